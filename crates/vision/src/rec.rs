//! The recogniser: crops in, text out, by greedy CTC decoding.
//!
//! A batch's crops are resized to 48 pixels high keeping their ratio and padded to the
//! batch's widest ratio (never under 320/48), as rapidocr's `resize_norm_img` does. The
//! output is `[n, T, C]`: for each of T positions, a probability per class, where
//! class 0 is the CTC blank, classes 1..=N the dictionary and class N+1 a space
//! (rapidocr appends it whatever the dictionary holds). Decoding takes each
//! position's most likely class, drops repeats and blanks, and scores the line with
//! the mean probability of the kept positions (each rounded to 5 decimals, then the
//! mean rounded again, as rapidocr reports it).

use snooze_core::{Tensor, TensorData};

use crate::{
    batch::{ratio, write_strip},
    bgr::BgrImage,
    error::VisionError,
    options::{REC_HEIGHT, REC_MIN_WIDTH},
};

/// The recogniser's classes: the CTC blank, the dictionary, a space.
#[derive(Debug, Clone, PartialEq)]
pub struct CtcDecoder {
    classes: Vec<String>,
}

/// The recogniser's input for one batch of crops: `[n, 3, 48, W]` f32 with
/// `W = int(48 * max(320/48, the widest crop's ratio))`.
pub fn rec_input(crops: &[&BgrImage]) -> Tensor {
    let width = rec_batch_width(crops.iter().copied());
    let per = 3 * REC_HEIGHT * width;
    let mut data = vec![0f32; per * crops.len()];
    for (i, crop) in crops.iter().enumerate() {
        write_strip(&mut data[i * per..(i + 1) * per], crop, REC_HEIGHT, width);
    }
    let shape = vec![crops.len() as i64, 3, REC_HEIGHT as i64, width as i64];
    Tensor::new("x", shape, TensorData::Fp32(data))
}

/// The width `W` a batch of these crops is padded to (see [`rec_input`]): crops whose
/// batches have equal widths see the same input whichever of them share a run.
pub(crate) fn rec_batch_width<'a>(crops: impl IntoIterator<Item = &'a BgrImage>) -> usize {
    let max_ratio = crops.into_iter().map(ratio).fold(REC_MIN_WIDTH as f64 / REC_HEIGHT as f64, f64::max);
    (REC_HEIGHT as f64 * max_ratio) as usize
}

/// Python's `round(v, 5)` for the probabilities rapidocr averages.
fn round5(v: f64) -> f64 {
    (v * 1e5).round_ties_even() / 1e5
}

impl CtcDecoder {
    /// From the dictionary, one character a line (`keys.txt`, or the rec model's
    /// `character` metadata): a final empty line and `\r` line ends are ignored.
    pub fn from_keys(text: &str) -> CtcDecoder {
        let mut lines: Vec<&str> = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).collect();
        if lines.last() == Some(&"") {
            lines.pop();
        }
        let mut classes = Vec::with_capacity(lines.len() + 2);
        classes.push(String::new());
        classes.extend(lines.iter().map(|l| (*l).to_owned()));
        classes.push(" ".to_owned());
        CtcDecoder { classes }
    }

    /// Classes the recogniser must output (dictionary + blank + space).
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// `(text, score)` per crop from an `[n, T, C]` output.
    pub fn decode(&self, output: &Tensor, expected: usize) -> Result<Vec<(String, f32)>, VisionError> {
        self.decode_rows(output, expected, 0..expected)
    }

    /// `(text, score)` for the crops at `rows` of the `[expected, T, C]` output of a
    /// batch shared with other jobs' crops.
    pub(crate) fn decode_rows(
        &self,
        output: &Tensor,
        expected: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<(String, f32)>, VisionError> {
        let TensorData::Fp32(values) = &output.data else {
            return Err(VisionError::model_output(
                "recogniser",
                format!("its output is {}, not FP32", output.datatype()),
            ));
        };
        let [n, steps, classes] = output.shape[..] else {
            return Err(VisionError::model_output(
                "recogniser",
                format!("its output has shape {:?}, not [n, T, C]", output.shape),
            ));
        };
        if n != expected as i64 || classes != self.classes.len() as i64 || steps < 0 {
            return Err(VisionError::model_output(
                "recogniser",
                format!(
                    "its output has shape {:?} for {expected} crops and a dictionary of {} classes (with blank and space)",
                    output.shape,
                    self.classes.len()
                ),
            ));
        }
        let (steps, classes) = (steps as usize, classes as usize);
        if values.len() != expected * steps * classes {
            return Err(VisionError::model_output(
                "recogniser",
                "its output holds fewer values than its shape",
            ));
        }
        if rows.end > expected {
            return Err(VisionError::model_output(
                "recogniser",
                format!("its output has {expected} rows where crops {rows:?} were asked for"),
            ));
        }
        let mut out = Vec::with_capacity(rows.len());
        for item in values.chunks_exact((steps * classes).max(1)).skip(rows.start).take(rows.len()) {
            let mut text = String::new();
            let mut kept = Vec::new();
            let mut previous = usize::MAX;
            for step in item.chunks_exact(classes) {
                // numpy's argmax: the first of equal maxima.
                let (best, p) = step
                    .iter()
                    .enumerate()
                    .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
                if best != previous && best != 0 {
                    text.push_str(&self.classes[best]);
                    kept.push(round5(f64::from(p)));
                }
                previous = best;
            }
            let mean = if kept.is_empty() { 0.0 } else { kept.iter().sum::<f64>() / kept.len() as f64 };
            out.push((text, round5(mean) as f32));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(steps: &[(usize, f32)], classes: usize) -> Tensor {
        let mut v = vec![0.0f32; steps.len() * classes];
        for (t, &(c, p)) in steps.iter().enumerate() {
            v[t * classes + c] = p;
        }
        Tensor::new("y", vec![1, steps.len() as i64, classes as i64], TensorData::Fp32(v))
    }

    #[test]
    fn repeats_collapse_blanks_split_and_space_is_last() {
        let dec = CtcDecoder::from_keys("a\nb\nc\n");
        assert_eq!(dec.class_count(), 5);
        // a a _ a b _ space c  ->  "aab c"
        let steps = [(1, 0.9), (1, 0.8), (0, 0.99), (1, 0.7), (2, 0.6), (0, 0.9), (4, 0.5), (3, 0.123456)];
        let (text, score) = &dec.decode(&output(&steps, 5), 1).unwrap()[0];
        assert_eq!(text, "aab c");
        // mean(0.9, 0.7, 0.6, 0.5, 0.12346) = 0.564692, rounded to 5 decimals.
        assert!((score - 0.56469).abs() < 1e-7, "{score}");
        let (empty, score) = &dec.decode(&output(&[(0, 0.9), (0, 0.9)], 5), 1).unwrap()[0];
        assert_eq!((empty.as_str(), *score), ("", 0.0));
    }

    #[test]
    fn a_dictionary_that_does_not_fit_the_model_is_an_error() {
        let dec = CtcDecoder::from_keys("a\r\nb");
        assert_eq!(dec.class_count(), 4);
        let err = dec.decode(&output(&[(1, 0.9)], 5), 1).unwrap_err();
        assert_eq!(err.http_status(), 500);
        assert!(err.to_string().contains("4 classes"), "{err}");
    }

    #[test]
    fn the_batch_width_follows_its_widest_crop() {
        let narrow = BgrImage::filled(20, 10, [0; 3]);
        let wide = BgrImage::filled(200, 20, [0; 3]);
        assert_eq!(rec_input(&[&narrow]).shape, [1, 3, 48, 320]);
        assert_eq!(rec_input(&[&narrow, &wide]).shape, [2, 3, 48, 480]);
    }
}
