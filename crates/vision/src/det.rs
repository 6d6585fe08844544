//! The page before the detector: rapidocr's size bounds and padding, and the
//! detector's input tensor.
//!
//! rapidocr first resizes the page into [`min_side_len`, `max_side_len`] (both
//! rounded to multiples of 32), then pads a very flat or very short page with black
//! bands above and below; that image is what the detector sees (resized again to its
//! own multiple-of-32 input) and what the crops are cut from. Boxes found on it are
//! mapped back to the uploaded image at the end ([`PageGeometry::to_original`]).
//!
//! The input tensor is `[1, 3, H, W]` f32 in BGR channel order, each value
//! `(v / 255 - 0.5) / 0.5` computed the way numpy does it in rapidocr (the division by
//! 255 in f32, the rest in f64).
//!
//! [`min_side_len`]: crate::OcrOptions::min_side_len
//! [`max_side_len`]: crate::OcrOptions::max_side_len

use snooze_core::{Tensor, TensorData};

use crate::{
    bgr::BgrImage,
    geometry::Quad,
    options::{LimitType, OcrOptions},
    resize::resize_linear,
};

/// Python's `int(round(n / 32) * 32)`: round half to even.
fn round_to_32(n: usize) -> usize {
    ((n as f64 / 32.0).round_ties_even() * 32.0) as usize
}

/// How the image the detector sees relates to the uploaded one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PageGeometry {
    pub original_width: usize,
    pub original_height: usize,
    /// Original size over resized size (1 when not resized).
    pub ratio_w: f64,
    pub ratio_h: f64,
    /// Black rows added above (and below) the resized page.
    pub pad_top: usize,
}

/// The image the detector sees and the crops come from.
#[derive(Debug, Clone)]
pub struct PreparedPage {
    pub image: BgrImage,
    pub geometry: PageGeometry,
}

/// rapidocr's `resize_image_within_bounds` and `apply_vertical_padding`.
///
/// Two departures, both where rapidocr fails or misplaces boxes: a side that would
/// round to 0 pixels is kept at 32 (rapidocr raises), and when the page is both
/// shrunk and then enlarged (an aspect ratio over ~66) the two ratios are composed
/// (rapidocr keeps the second only).
pub fn prepare_page(original: &BgrImage, options: &OcrOptions) -> PreparedPage {
    let (ow, oh) = (original.width(), original.height());
    let mut image = original.clone();
    let (mut ratio_w, mut ratio_h) = (1.0f64, 1.0f64);
    let scaled = |img: &BgrImage, ratio: f64| -> BgrImage {
        let w = round_to_32((img.width() as f64 * ratio) as usize).max(32);
        let h = round_to_32((img.height() as f64 * ratio) as usize).max(32);
        resize_linear(img, w, h)
    };
    if image.width().max(image.height()) > options.max_side_len {
        let ratio = options.max_side_len as f64 / image.width().max(image.height()) as f64;
        let resized = scaled(&image, ratio);
        ratio_w *= image.width() as f64 / resized.width() as f64;
        ratio_h *= image.height() as f64 / resized.height() as f64;
        image = resized;
    }
    if image.width().min(image.height()) < options.min_side_len {
        let ratio = options.min_side_len as f64 / image.width().min(image.height()) as f64;
        let resized = scaled(&image, ratio);
        ratio_w *= image.width() as f64 / resized.width() as f64;
        ratio_h *= image.height() as f64 / resized.height() as f64;
        image = resized;
    }
    let (w, h) = (image.width(), image.height());
    let mut pad_top = 0;
    if h <= options.min_height || w as f64 / h as f64 > f64::from(options.width_height_ratio) {
        let new_h = ((w as f64 / f64::from(options.width_height_ratio)) as usize).max(options.min_height) * 2;
        pad_top = new_h.abs_diff(h) / 2;
        image = image.pad_vertical(pad_top, pad_top);
    }
    PreparedPage {
        image,
        geometry: PageGeometry { original_width: ow, original_height: oh, ratio_w, ratio_h, pad_top },
    }
}

impl PageGeometry {
    /// rapidocr's `map_boxes_to_original`: remove the padding, undo the resize (in
    /// f32, as numpy does on the f32 boxes), clamp to `[0, width] x [0, height]`.
    pub fn to_original(&self, quad: &Quad) -> Quad {
        let (rw, rh) = (self.ratio_w as f32, self.ratio_h as f32);
        quad.map(|[x, y]| {
            let y = y - self.pad_top as f32;
            let (x, y) = (x * rw, y * rh);
            [x.max(0.0).min(self.original_width as f32), y.max(0.0).min(self.original_height as f32)]
        })
    }
}

/// The detector's input for `image`; `None` when the limit resize leaves no pixels
/// (rapidocr then finds nothing).
pub fn det_input(image: &BgrImage, options: &OcrOptions) -> Option<Tensor> {
    let (rw, rh) = det_input_size(image, options)?;
    let mut data = vec![0f32; 3 * rw * rh];
    write_det_input(&mut data, image, rw, rh);
    Some(Tensor::new("x", vec![1, 3, rh as i64, rw as i64], TensorData::Fp32(data)))
}

/// The `(width, height)` of the detector's input for `image`: `limit_side_len`
/// applied, rounded to multiples of 32; `None` when that leaves no pixels.
pub(crate) fn det_input_size(image: &BgrImage, options: &OcrOptions) -> Option<(usize, usize)> {
    let (w, h) = (image.width(), image.height());
    let limit = options.limit_side_len as f64;
    let ratio = match options.limit_type {
        LimitType::Max if w.max(h) as f64 > limit => limit / w.max(h) as f64,
        LimitType::Min if (w.min(h) as f64) < limit => limit / w.min(h) as f64,
        _ => 1.0,
    };
    let rw = round_to_32((w as f64 * ratio) as usize);
    let rh = round_to_32((h as f64 * ratio) as usize);
    (rw != 0 && rh != 0).then_some((rw, rh))
}

/// One page of a detector batch: `image` resized to `width` x `height` and normalised
/// into `out` (`3 * width * height` values, three planes B, G, R).
pub(crate) fn write_det_input(out: &mut [f32], image: &BgrImage, width: usize, height: usize) {
    let resized = resize_linear(image, width, height);
    let plane = width * height;
    let table: Vec<f32> = (0..=255u8).map(normalize).collect();
    for (i, px) in resized.data().chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * plane + i] = table[usize::from(px[c])];
        }
    }
}

/// rapidocr's detector normalisation of one 8-bit value.
fn normalize(v: u8) -> f32 {
    let scaled = f32::from(v) * (1.0f64 / 255.0) as f32;
    ((f64::from(scaled) - 0.5) / 0.5) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_to_32_rounds_half_to_even() {
        assert_eq!([round_to_32(16), round_to_32(48), round_to_32(47), round_to_32(15)], [0, 64, 32, 0]);
    }

    #[test]
    fn detector_input_is_a_multiple_of_32_with_the_short_side_near_736() {
        let img = BgrImage::filled(1000, 500, [255, 0, 128]);
        let t = det_input(&img, &OcrOptions::default()).unwrap();
        // 736 / 500 = 1.472: 1472 x 736.
        assert_eq!(t.shape, [1, 3, 736, 1472]);
        let TensorData::Fp32(v) = &t.data else { panic!() };
        let plane = 736 * 1472;
        assert_eq!((v[0], v[plane], v[2 * plane]), (1.0, -1.0, normalize(128)), "B, G, R planes");
    }

    #[test]
    fn pages_are_bounded_then_padded() {
        let opts = OcrOptions::default();
        let big = prepare_page(&BgrImage::filled(4000, 3000, [0; 3]), &opts);
        // 2000 x 1500: 62.5 x 32 rounds to 62 x 32 (half to even), 46.875 x 32 to 47 x 32.
        assert_eq!((big.image.width(), big.image.height()), (1984, 1504));
        assert!((big.geometry.ratio_w - 4000.0 / 1984.0).abs() < 1e-12);
        // A 600 x 40 strip: 600 / 40 = 15 > 8, so padded to 2 * max(600 / 8, 30) = 150 rows.
        let strip = prepare_page(&BgrImage::filled(600, 40, [255; 3]), &opts);
        assert_eq!((strip.image.height(), strip.geometry.pad_top), (150, 55));
        assert_eq!(strip.image.pixel(0, 0), [0, 0, 0]);
        let back = strip.geometry.to_original(&[[10.0, 60.0], [590.0, 60.0], [590.0, 200.0], [10.0, 50.0]]);
        assert_eq!(back, [[10.0, 5.0], [590.0, 5.0], [590.0, 40.0], [10.0, 0.0]]);
    }
}
