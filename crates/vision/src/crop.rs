//! A text box cut out of the page and straightened: rapidocr's
//! `get_rotate_crop_image`.
//!
//! The crop is `int(max(top, bottom edge))` wide and `int(max(left, right edge))`
//! tall; each of its pixels is sampled from the page through the perspective
//! transform that maps the crop's corners onto the box's (OpenCV's
//! `getPerspectiveTransform` + `warpPerspective`, bicubic with a = -0.75, edge pixels
//! repeated outside the page), and a crop at least 1.5 times taller than wide is
//! turned 90 degrees counter-clockwise, since text lines are read horizontally.
//!
//! OpenCV 5's bicubic warp samples at the exact source position (no 1/32-pixel grid)
//! and rounds the weighted sum to the nearest integer: computed the same way here,
//! the crops match cv2's pixel for pixel on the fixture's boxes.

use crate::{
    bgr::BgrImage,
    geometry::{distance, Quad},
};

/// Solves the 8 x 8 system of `getPerspectiveTransform` from `from` to `to` by
/// Gaussian elimination with partial pivoting; `None` when the corners are degenerate.
pub fn perspective_transform(from: &[[f64; 2]; 4], to: &[[f64; 2]; 4]) -> Option<[f64; 9]> {
    let mut a = [[0f64; 9]; 8];
    for i in 0..4 {
        let ([x, y], [u, v]) = (from[i], to[i]);
        a[i] = [x, y, 1.0, 0.0, 0.0, 0.0, -x * u, -y * u, u];
        a[i + 4] = [0.0, 0.0, 0.0, x, y, 1.0, -x * v, -y * v, v];
    }
    for col in 0..8 {
        let pivot = (col..8).max_by(|&r, &s| a[r][col].abs().total_cmp(&a[s][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col];
        for (row, r) in a.iter_mut().enumerate() {
            let f = r[col] / pivot_row[col];
            if row != col && f != 0.0 {
                for (x, p) in r.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut m = [0f64; 9];
    for i in 0..8 {
        m[i] = a[i][8] / a[i][i];
    }
    m[8] = 1.0;
    Some(m)
}

/// Keys' cubic convolution weights (a = -0.75) for a fractional offset `t`.
fn cubic_weights(t: f64) -> [f64; 4] {
    const A: f64 = -0.75;
    let w0 = ((A * (t + 1.0) - 5.0 * A) * (t + 1.0) + 8.0 * A) * (t + 1.0) - 4.0 * A;
    let w1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
    let w2 = ((A + 2.0) * (1.0 - t) - (A + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0;
    [w0, w1, w2, 1.0 - w0 - w1 - w2]
}

/// `warpPerspective(page, M, (width, height), INTER_CUBIC, BORDER_REPLICATE)` given
/// `to_source`, the transform from output to page pixels.
pub fn warp_cubic(page: &BgrImage, to_source: &[f64; 9], width: usize, height: usize) -> BgrImage {
    let m = to_source;
    let (last_x, last_y) = (page.width() as i64 - 1, page.height() as i64 - 1);
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            let (xf, yf) = (x as f64, y as f64);
            let w = m[6] * xf + m[7] * yf + m[8];
            let w = if w != 0.0 { 1.0 / w } else { 0.0 };
            let sx = (m[0] * xf + m[1] * yf + m[2]) * w;
            let sy = (m[3] * xf + m[4] * yf + m[5]) * w;
            if !(sx.is_finite() && sy.is_finite()) {
                data.extend([0, 0, 0]);
                continue;
            }
            let (ix, iy) = (sx.floor(), sy.floor());
            let (wx, wy) = (cubic_weights(sx - ix), cubic_weights(sy - iy));
            let (ix, iy) = (ix as i64, iy as i64);
            let mut acc = [0f64; 3];
            for (ky, wyk) in wy.iter().enumerate() {
                let py = (iy - 1 + ky as i64).clamp(0, last_y) as usize;
                let row = page.row(py);
                for (kx, wxk) in wx.iter().enumerate() {
                    let px = (ix - 1 + kx as i64).clamp(0, last_x) as usize;
                    let weight = wxk * wyk;
                    for c in 0..3 {
                        acc[c] += f64::from(row[px * 3 + c]) * weight;
                    }
                }
            }
            data.extend(acc.map(|v| v.round_ties_even().clamp(0.0, 255.0) as u8));
        }
    }
    BgrImage::from_bgr(width, height, data).unwrap_or_else(|| BgrImage::filled(width, height, [0; 3]))
}

/// The box's pixels as an upright strip (see the module notes).
pub fn crop_box(page: &BgrImage, quad: &Quad) -> BgrImage {
    let width = distance(quad[0], quad[1]).max(distance(quad[2], quad[3])) as usize;
    let height = distance(quad[0], quad[3]).max(distance(quad[1], quad[2])) as usize;
    let (width, height) = (width.max(1), height.max(1));
    let (w, h) = (width as f64, height as f64);
    let target = [[0.0, 0.0], [w, 0.0], [w, h], [0.0, h]];
    let corners = quad.map(|[x, y]| [f64::from(x), f64::from(y)]);
    let crop = match perspective_transform(&target, &corners) {
        Some(to_source) => warp_cubic(page, &to_source, width, height),
        None => BgrImage::filled(width, height, [255; 3]),
    };
    if crop.height() as f64 / crop.width() as f64 >= 1.5 {
        crop.rotate90_ccw()
    } else {
        crop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: usize, h: usize) -> BgrImage {
        let data = (0..w * h).flat_map(|i| [((i % w) * 3) as u8, ((i / w) * 5) as u8, 77]).collect();
        BgrImage::from_bgr(w, h, data).unwrap()
    }

    #[test]
    fn an_axis_aligned_box_is_a_plain_copy() {
        let page = gradient(60, 40);
        let crop = crop_box(&page, &[[10.0, 5.0], [40.0, 5.0], [40.0, 20.0], [10.0, 20.0]]);
        assert_eq!((crop.width(), crop.height()), (30, 15));
        for (x, y) in [(0, 0), (29, 14), (7, 3)] {
            assert_eq!(crop.pixel(x, y), page.pixel(10 + x, 5 + y), "({x}, {y})");
        }
    }

    #[test]
    fn tall_crops_turn_and_transforms_map_corners() {
        let page = gradient(60, 60);
        let crop = crop_box(&page, &[[10.0, 5.0], [20.0, 5.0], [20.0, 35.0], [10.0, 35.0]]);
        assert_eq!((crop.width(), crop.height()), (30, 10));
        let quad = [[3.0, 4.0], [50.0, 10.0], [48.0, 30.0], [1.0, 25.0]];
        let m = perspective_transform(&[[0.0, 0.0], [40.0, 0.0], [40.0, 20.0], [0.0, 20.0]], &quad).unwrap();
        for (i, (x, y)) in [(0.0, 0.0), (40.0, 0.0), (40.0, 20.0), (0.0, 20.0)].into_iter().enumerate() {
            let w = m[6] * x + m[7] * y + m[8];
            let (u, v) = ((m[0] * x + m[1] * y + m[2]) / w, (m[3] * x + m[4] * y + m[5]) / w);
            assert!((u - quad[i][0]).abs() < 1e-9 && (v - quad[i][1]).abs() < 1e-9, "corner {i}");
        }
        assert!(perspective_transform(&[[0.0, 0.0]; 4], &quad).is_none());
    }

    #[test]
    fn cubic_weights_sum_to_one_and_interpolate() {
        for t in [0.0, 0.25, 0.5, 0.9] {
            let w = cubic_weights(t);
            assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
        assert_eq!(cubic_weights(0.0), [0.0, 1.0, 0.0, 0.0]);
    }
}
