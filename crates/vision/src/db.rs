//! The detector's probability map to text boxes: rapidocr's `DBPostProcess`,
//! `filter_det_res` and `sorted_boxes`.
//!
//! Pixels over `det_thresh` (dilated 2 x 2) form regions; each region's contour gives
//! a minimum-area rectangle, kept when its short side is at least 3 map pixels and
//! the mean probability inside it (`box_score_fast`) at least `box_thresh`; it is
//! grown back by the unclip offset, its rectangle taken again (short side at least 5),
//! and scaled from map to page pixels. Boxes are then put in clockwise order, clipped
//! to the page, dropped when a side is 3 pixels or less, and sorted into reading order.

use snooze_core::{Tensor, TensorData};

use crate::{
    contour::find_contours,
    error::VisionError,
    geometry::{distance, mini_box, order_clockwise, HullStart, Quad},
    options::{OcrOptions, LINE_Y_TOLERANCE, MIN_BOX_SIDE},
    raster::{box_score_fast, dilate_2x2},
    unclip::{offset_polygon, unclip_distance},
};

/// A detected text line on the page the detector saw.
#[derive(Debug, Clone, PartialEq)]
pub struct TextBox {
    /// Corners clockwise from the top-left, in page pixels.
    pub quad: Quad,
    /// Mean probability inside the box before it was grown.
    pub score: f32,
}

/// The probability map inside a detector output: `[1, 1, H, W]` (or `[1, H, W]`) f32.
pub fn probability_map(output: &Tensor) -> Result<(&[f32], usize, usize), VisionError> {
    let TensorData::Fp32(values) = &output.data else {
        return Err(VisionError::model_output(
            "detector",
            format!("its output is {}, not FP32", output.datatype()),
        ));
    };
    let dims: Vec<i64> = output.shape.clone();
    let (h, w) = match dims.as_slice() {
        [1, 1, h, w] | [1, h, w] => (*h, *w),
        other => {
            return Err(VisionError::model_output(
                "detector",
                format!("its output has shape {other:?}, not [1, 1, H, W]"),
            ))
        }
    };
    let (h, w) = (usize::try_from(h).unwrap_or(0), usize::try_from(w).unwrap_or(0));
    if h == 0 || w == 0 || values.len() != h * w {
        return Err(VisionError::model_output(
            "detector",
            format!("its output holds {} values for a {h} x {w} map", values.len()),
        ));
    }
    Ok((values, w, h))
}

/// Text boxes in reading order, in the pixels of the `page_width` x `page_height`
/// image whose detector input gave `output`.
pub fn text_boxes(
    output: &Tensor,
    page_width: usize,
    page_height: usize,
    options: &OcrOptions,
) -> Result<Vec<TextBox>, VisionError> {
    let (map, w, h) = probability_map(output)?;
    let mut boxes = boxes_from_map(map, w, h, page_width, page_height, options);
    boxes = filter_boxes(boxes, page_width, page_height);
    Ok(sort_boxes(boxes))
}

/// `boxes_from_bitmap`: boxes scaled to the page, before `filter_det_res`.
pub fn boxes_from_map(
    map: &[f32],
    w: usize,
    h: usize,
    page_width: usize,
    page_height: usize,
    options: &OcrOptions,
) -> Vec<TextBox> {
    let mut mask: Vec<u8> = map.iter().map(|&p| u8::from(p > options.det_thresh)).collect();
    if options.use_dilation {
        mask = dilate_2x2(&mask, w, h);
    }
    let mut boxes = Vec::new();
    for contour in find_contours(&mask, w, h).into_iter().take(options.max_candidates) {
        let points: Vec<[f64; 2]> =
            contour.points.iter().map(|p| [f64::from(p[0]), f64::from(p[1])]).collect();
        let Some((quad, short)) = mini_box(&points, contour.hull_start()) else { continue };
        if short < MIN_BOX_SIDE {
            continue;
        }
        let score = box_score_fast(map, w, h, &quad);
        if options.box_thresh > score {
            continue;
        }
        let grown = offset_polygon(&quad, unclip_distance(&quad, f64::from(options.unclip_ratio)));
        let grown: Vec<[f64; 2]> = grown.iter().map(|p| [p[0] as f64, p[1] as f64]).collect();
        let Some((quad, short)) = mini_box(&grown, HullStart::Leftmost) else { continue };
        if short < MIN_BOX_SIDE + 2.0 {
            continue;
        }
        // numpy: f32 box / int width * int page width, rounded half to even, clipped.
        let scale = |v: f32, from: usize, to: usize| {
            ((v / from as f32) * to as f32).round_ties_even().clamp(0.0, to as f32) as i32 as f32
        };
        let quad = quad.map(|[x, y]| [scale(x, w, page_width), scale(y, h, page_height)]);
        boxes.push(TextBox { quad, score });
    }
    boxes
}

/// `filter_det_res`: clockwise order, corners clipped to the last pixel, boxes with a
/// side of 3 pixels or less dropped.
pub fn filter_boxes(boxes: Vec<TextBox>, page_width: usize, page_height: usize) -> Vec<TextBox> {
    boxes
        .into_iter()
        .filter_map(|b| {
            let quad = order_clockwise(b.quad).map(|[x, y]| {
                [
                    x.max(0.0).min(page_width as f32 - 1.0).trunc(),
                    y.max(0.0).min(page_height as f32 - 1.0).trunc(),
                ]
            });
            let width = distance(quad[0], quad[1]) as i32;
            let height = distance(quad[0], quad[3]) as i32;
            (width > 3 && height > 3).then_some(TextBox { quad, score: b.score })
        })
        .collect()
}

/// `sorted_boxes`: by the top-left corner's y (stable); a box whose y is within 10
/// pixels of the previous one's joins its line; each line by the top-left x.
pub fn sort_boxes(mut boxes: Vec<TextBox>) -> Vec<TextBox> {
    boxes.sort_by(|a, b| a.quad[0][1].total_cmp(&b.quad[0][1]));
    let mut line = 0usize;
    let mut keyed: Vec<(usize, f32, TextBox)> = Vec::with_capacity(boxes.len());
    let mut previous_y: Option<f32> = None;
    for b in boxes {
        let y = b.quad[0][1];
        if previous_y.is_some_and(|p| y - p >= LINE_Y_TOLERANCE) {
            line += 1;
        }
        previous_y = Some(y);
        keyed.push((line, b.quad[0][0], b));
    }
    keyed.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    keyed.into_iter().map(|(_, _, b)| b).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quad(x0: f32, y0: f32, x1: f32, y1: f32) -> Quad {
        [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]
    }

    #[test]
    fn a_block_of_probability_becomes_one_grown_box() {
        // A 40 x 10 map with a 20 x 4 block of 0.9 at x 10..=29, y 3..=6.
        let (w, h) = (40, 10);
        let mut map = vec![0.05f32; w * h];
        for y in 3..=6 {
            for x in 10..=29 {
                map[y * w + x] = 0.9;
            }
        }
        let t = Tensor::new("y", vec![1, 1, h as i64, w as i64], TensorData::Fp32(map));
        // The page is twice the map's size.
        let boxes = text_boxes(&t, 80, 20, &OcrOptions::default()).unwrap();
        assert_eq!(boxes.len(), 1);
        // Dilation adds a row and a column (x 10..=30, y 3..=7): rectangle 20 x 4 through
        // centres, area 80, perimeter 48, grown by 80 * 1.6 / 48 = 2.67 -> 7..=33, 0..=10 after
        // rounding, then x2 and clipped to the page.
        assert_eq!(boxes[0].quad, quad(14.0, 0.0, 66.0, 19.0));
        // rapidocr's DBPostProcess on the same map: [[14,0],[66,0],[66,19],[14,19]], 0.69762.
        assert!((boxes[0].score - 0.697_619).abs() < 1e-5, "{}", boxes[0].score);
    }

    #[test]
    fn faint_and_tiny_regions_are_dropped() {
        let (w, h) = (30, 10);
        let mut map = vec![0.0f32; w * h];
        for x in 2..=20 {
            map[3 * w + x] = 0.9; // one row: short side 1 after dilation
        }
        for y in 5..=8 {
            for x in 2..=20 {
                map[y * w + x] = 0.35; // over thresh, under box_thresh
            }
        }
        let t = Tensor::new("y", vec![1, 1, h as i64, w as i64], TensorData::Fp32(map));
        assert!(text_boxes(&t, w, h, &OcrOptions::default()).unwrap().is_empty());
    }

    #[test]
    fn boxes_sort_by_line_then_left_to_right() {
        let b = |x: f32, y: f32| TextBox { quad: quad(x, y, x + 5.0, y + 5.0), score: 1.0 };
        let sorted = sort_boxes(vec![b(50.0, 12.0), b(10.0, 30.0), b(5.0, 15.0), b(90.0, 10.0)]);
        let order: Vec<(f32, f32)> = sorted.iter().map(|b| (b.quad[0][0], b.quad[0][1])).collect();
        // 10, 12, 15 are one line (each step < 10); 30 the next.
        assert_eq!(order, [(5.0, 15.0), (50.0, 12.0), (90.0, 10.0), (10.0, 30.0)]);
    }

    #[test]
    fn a_wrong_output_is_the_servers_error() {
        let t = Tensor::new("y", vec![2, 5], TensorData::Fp32(vec![0.0; 10]));
        assert_eq!(text_boxes(&t, 5, 2, &OcrOptions::default()).unwrap_err().http_status(), 500);
        let t = Tensor::new("y", vec![1, 1, 2, 5], TensorData::Fp32(vec![0.0; 9]));
        assert_eq!(text_boxes(&t, 5, 2, &OcrOptions::default()).unwrap_err().http_status(), 500);
    }
}
