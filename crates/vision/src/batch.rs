//! What the classifier and the recogniser share: the order crops are batched in, and
//! how one crop becomes a fixed-height, zero-padded slice of a batch tensor.
//!
//! rapidocr sorts a page's crops by width/height ratio and cuts the sorted list into
//! batches of `cls_batch_num` / `rec_batch_num`, so each batch pads its crops to
//! similar widths. The order is planned here and the batches are left to the caller
//! (the server may merge crops of several pages, or split a batch under memory
//! pressure); rapidocr's numpy sort is not stable, this one is, which only matters
//! for crops of equal ratio.

use crate::{bgr::BgrImage, resize::resize_linear};

/// Crop indices in rapidocr's order (ascending width/height ratio), cut into batches
/// of at most `batch_size`.
pub fn plan_batches(crops: &[BgrImage], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..crops.len()).collect();
    order.sort_by(|&a, &b| ratio(&crops[a]).total_cmp(&ratio(&crops[b])));
    order.chunks(batch_size.max(1)).map(<[usize]>::to_vec).collect()
}

/// Width over height, as rapidocr computes it (f64).
pub fn ratio(img: &BgrImage) -> f64 {
    img.width() as f64 / img.height() as f64
}

/// Width a crop is resized to at `height`, at most `max_width`: rapidocr's
/// `ceil(height * w / h)`.
pub fn strip_width(img: &BgrImage, height: usize, max_width: usize) -> usize {
    let w = (height as f64 * ratio(img)).ceil();
    if w > max_width as f64 {
        max_width
    } else {
        (w as usize).max(1)
    }
}

/// `resize_norm_img`: the crop resized to `height` keeping its ratio (at most `width`
/// wide), scaled to [-1, 1] in f32 as numpy does, as three planes (B, G, R) of
/// `height x width` with zeros right of the image, written into `out`.
pub fn write_strip(out: &mut [f32], img: &BgrImage, height: usize, width: usize) {
    let resized_w = strip_width(img, height, width);
    let resized = resize_linear(img, resized_w, height);
    let plane = height * width;
    out[..plane * 3].fill(0.0);
    for y in 0..height {
        let row = resized.row(y);
        for x in 0..resized_w {
            for c in 0..3 {
                let v = f32::from(row[x * 3 + c]) / 255.0;
                out[c * plane + y * width + x] = (v - 0.5) / 0.5;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_follow_the_ratio_order() {
        let crops: Vec<BgrImage> = [(100, 10), (20, 10), (50, 10), (30, 10)]
            .iter()
            .map(|&(w, h)| BgrImage::filled(w, h, [0; 3]))
            .collect();
        assert_eq!(plan_batches(&crops, 3), [vec![1, 3, 2], vec![0]]);
        assert_eq!(plan_batches(&crops, 0).len(), 4, "a batch size of 0 is taken as 1");
        assert!(plan_batches(&[], 6).is_empty());
    }

    #[test]
    fn strips_keep_the_ratio_and_pad_with_zeros() {
        let img = BgrImage::filled(30, 12, [255, 0, 128]);
        assert_eq!(strip_width(&img, 48, 192), 120);
        assert_eq!(strip_width(&BgrImage::filled(1000, 10, [0; 3]), 48, 192), 192);
        let mut out = vec![7.0f32; 3 * 48 * 192];
        write_strip(&mut out, &img, 48, 192);
        let plane = 48 * 192;
        assert_eq!((out[0], out[plane], out[2 * plane + 119]), (1.0, -1.0, (128.0 / 255.0 - 0.5) / 0.5));
        assert_eq!(out[120], 0.0, "padding");
    }
}
