//! The direction classifier: is a crop upside down?
//!
//! Its input is a batch of crops, each resized to 48 pixels high keeping its ratio
//! (at most 192 wide) and zero-padded to 48 x 192; its output one pair of
//! probabilities per crop for the labels "0" and "180". A crop whose "180" score is
//! over `cls_thresh` is turned half a turn before recognition.

use snooze_core::{Tensor, TensorData};

use crate::{
    batch::write_strip,
    bgr::BgrImage,
    error::VisionError,
    options::{CLS_HEIGHT, CLS_WIDTH},
};

/// A crop's reading direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Direction {
    Upright,
    UpsideDown,
}

/// The classifier's answer for one crop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Orientation {
    pub direction: Direction,
    pub score: f32,
}

/// The classifier's input for `crops` (one batch): `[n, 3, 48, 192]` f32.
pub fn cls_input(crops: &[&BgrImage]) -> Tensor {
    let per = 3 * CLS_HEIGHT * CLS_WIDTH;
    let mut data = vec![0f32; per * crops.len()];
    for (i, crop) in crops.iter().enumerate() {
        write_strip(&mut data[i * per..(i + 1) * per], crop, CLS_HEIGHT, CLS_WIDTH);
    }
    let shape = vec![crops.len() as i64, 3, CLS_HEIGHT as i64, CLS_WIDTH as i64];
    Tensor::new("x", shape, TensorData::Fp32(data))
}

/// One answer per crop from an `[n, 2]` output: the first highest label and its score.
pub fn cls_decode(output: &Tensor, expected: usize) -> Result<Vec<Orientation>, VisionError> {
    let TensorData::Fp32(values) = &output.data else {
        return Err(VisionError::model_output(
            "classifier",
            format!("its output is {}, not FP32", output.datatype()),
        ));
    };
    if output.shape != [expected as i64, 2] || values.len() != expected * 2 {
        return Err(VisionError::model_output(
            "classifier",
            format!("its output has shape {:?} for {expected} crops, not [{expected}, 2]", output.shape),
        ));
    }
    Ok(values
        .chunks_exact(2)
        .map(|p| {
            // numpy's argmax: the first of equal maxima.
            let upside_down = p[1] > p[0];
            Orientation {
                direction: if upside_down { Direction::UpsideDown } else { Direction::Upright },
                score: if upside_down { p[1] } else { p[0] },
            }
        })
        .collect())
}

/// The crop as the recogniser should see it: turned when the classifier is sure.
pub fn apply_orientation(crop: BgrImage, orientation: Orientation, cls_thresh: f32) -> BgrImage {
    if orientation.direction == Direction::UpsideDown && orientation.score > cls_thresh {
        crop.rotate180()
    } else {
        crop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_fixed_size_and_decoded_per_crop() {
        let a = BgrImage::filled(100, 20, [0; 3]);
        let b = BgrImage::filled(10, 40, [255; 3]);
        let t = cls_input(&[&a, &b]);
        assert_eq!(t.shape, [2, 3, 48, 192]);
        let out = Tensor::new("y", vec![2, 2], TensorData::Fp32(vec![0.2, 0.8, 0.6, 0.4]));
        let o = cls_decode(&out, 2).unwrap();
        assert_eq!(o[0], Orientation { direction: Direction::UpsideDown, score: 0.8 });
        assert_eq!(o[1].direction, Direction::Upright);
        assert!(cls_decode(&out, 3).is_err());
    }

    #[test]
    fn only_a_sure_180_turns_the_crop() {
        let data = (0..6).map(|i| i as u8).collect();
        let crop = BgrImage::from_bgr(2, 1, data).unwrap();
        let unsure = Orientation { direction: Direction::UpsideDown, score: 0.9 };
        assert_eq!(apply_orientation(crop.clone(), unsure, 0.9), crop, "0.9 is not over 0.9");
        let sure = Orientation { direction: Direction::UpsideDown, score: 0.95 };
        assert_eq!(apply_orientation(crop.clone(), sure, 0.9).pixel(0, 0), [3, 4, 5]);
    }
}
