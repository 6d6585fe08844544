//! rapidocr's `unclip`: a box grown by `area * unclip_ratio / perimeter` with
//! pyclipper's round-joined offset (Clipper 6.4, `JT_ROUND`, `ET_CLOSEDPOLYGON`).
//!
//! The detector's probability map marks a shrunk core of each text line; the offset
//! grows it back. Clipper works on integers: pyclipper truncates the box's float
//! corners toward zero, offsets each edge outward along its normal, fills each convex
//! corner with an arc of vertices `delta` away (as many as its arc tolerance of 0.25
//! asks for), and rounds every vertex half away from zero. rapidocr then takes the
//! minimum-area rectangle of that polygon: for a rectangle it is the rectangle grown
//! by `delta` on every side, give or take the rounding, which is why the exact
//! vertices are reproduced here rather than the closed form (the test measures both
//! against pyclipper numbers from the fixture).
//!
//! Only what a convex quadrilateral needs is here: its offset never self-intersects,
//! so Clipper's final union changes no vertex that matters to the hull.

use std::f64::consts::PI;

const ARC_TOLERANCE: f64 = 0.25;

/// Clipper's `Round`: half away from zero.
fn round(v: f64) -> i64 {
    if v < 0.0 {
        -((-v + 0.5).floor() as i64)
    } else {
        (v + 0.5).floor() as i64
    }
}

/// The distance rapidocr grows a box by: `area * ratio / perimeter` (shapely, f64).
pub fn unclip_distance(quad: &[[f32; 2]; 4], ratio: f64) -> f64 {
    let (area, perimeter) = crate::geometry::area_and_perimeter(quad);
    if perimeter == 0.0 {
        return 0.0;
    }
    area * ratio / perimeter
}

/// The vertices of `polygon` (float corners, truncated as pyclipper does) offset
/// outward by `delta` with round joins; empty when fewer than three distinct points
/// remain (Clipper drops such a path).
pub fn offset_polygon(polygon: &[[f32; 2]], delta: f64) -> Vec<[i64; 2]> {
    // AddPath: truncate, drop repeated points (and a closing repeat).
    let mut src: Vec<[i64; 2]> = Vec::with_capacity(polygon.len());
    for p in polygon {
        let q = [p[0] as i64, p[1] as i64];
        if src.last() != Some(&q) {
            src.push(q);
        }
    }
    while src.len() > 1 && src.first() == src.last() {
        src.pop();
    }
    if src.len() < 3 {
        return Vec::new();
    }
    // FixOrientations: Clipper wants a positive area (its sign convention).
    let mut area = 0f64;
    for i in 0..src.len() {
        let (p, q) = (src[(i + src.len() - 1) % src.len()], src[i]);
        area += (p[0] as f64 + q[0] as f64) * (p[1] as f64 - q[1] as f64);
    }
    if -area * 0.5 < 0.0 {
        src.reverse();
    }
    if delta.abs() < 1e-20 {
        return src;
    }

    let y =
        if ARC_TOLERANCE > delta.abs() * ARC_TOLERANCE { delta.abs() * ARC_TOLERANCE } else { ARC_TOLERANCE };
    let mut steps = PI / (1.0 - y / delta.abs()).acos();
    if steps > delta.abs() * PI {
        steps = delta.abs() * PI;
    }
    let (mut sin, cos) = ((2.0 * PI / steps).sin(), (2.0 * PI / steps).cos());
    let steps_per_rad = steps / (2.0 * PI);
    if delta < 0.0 {
        sin = -sin;
    }

    let n = src.len();
    let normals: Vec<[f64; 2]> = (0..n)
        .map(|j| {
            let (a, b) = (src[j], src[(j + 1) % n]);
            let (dx, dy) = ((b[0] - a[0]) as f64, (b[1] - a[1]) as f64);
            let f = 1.0 / dx.hypot(dy);
            [dy * f, -dx * f]
        })
        .collect();
    let at =
        |p: [i64; 2], n: [f64; 2]| [round(p[0] as f64 + n[0] * delta), round(p[1] as f64 + n[1] * delta)];

    let mut out = Vec::with_capacity(n * 8);
    let mut k = n - 1;
    for j in 0..n {
        let (nk, nj, p) = (normals[k], normals[j], src[j]);
        let mut sin_a = nk[0] * nj[1] - nj[0] * nk[1];
        let cos_a = nk[0] * nj[0] + nk[1] * nj[1];
        if (sin_a * delta).abs() < 1.0 {
            if cos_a > 0.0 {
                // Nearly straight: one vertex.
                out.push(at(p, nk));
                k = j;
                continue;
            }
        } else {
            sin_a = sin_a.clamp(-1.0, 1.0);
        }
        if sin_a * delta < 0.0 {
            // A concave corner: both edge ends and the corner itself.
            out.push(at(p, nk));
            out.push(p);
            out.push(at(p, nj));
        } else {
            // DoRound: an arc from one edge's normal to the next.
            let angle = sin_a.atan2(cos_a);
            let count = round(steps_per_rad * angle.abs()).max(1);
            let (mut x, mut y) = (nk[0], nk[1]);
            for _ in 0..count {
                out.push(at(p, [x, y]));
                let x2 = x;
                x = x * cos - sin * y;
                y = x2 * sin + y * cos;
            }
            out.push(at(p, nj));
        }
        k = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rectangle_grows_by_the_distance_on_every_side() {
        let quad = [[10.0, 10.0], [110.0, 10.0], [110.0, 30.0], [10.0, 30.0]];
        let d = unclip_distance(&quad, 1.6);
        // 100 x 20: area 2000, perimeter 240.
        assert!((d - 2000.0 * 1.6 / 240.0).abs() < 1e-12);
        let pts = offset_polygon(&quad, d);
        let (min_x, max_x) =
            (pts.iter().map(|p| p[0]).min().unwrap(), pts.iter().map(|p| p[0]).max().unwrap());
        let (min_y, max_y) =
            (pts.iter().map(|p| p[1]).min().unwrap(), pts.iter().map(|p| p[1]).max().unwrap());
        assert_eq!((min_x, max_x, min_y, max_y), (-3, 123, -3, 43), "13.33 rounded: 10 - 13 = -3");
        // Each corner's arc stays within the grown rectangle.
        assert!(pts.len() > 8);
    }

    #[test]
    fn floats_are_truncated_and_flat_paths_dropped() {
        let quad = [[0.7, 0.7], [10.6, 0.2], [10.5, 5.5], [0.4, 5.9]];
        let mut pts = offset_polygon(&quad, 1e-30);
        pts.sort();
        assert_eq!(pts, [[0, 0], [0, 5], [10, 0], [10, 5]], "pyclipper gives [[10,5],[0,5],[0,0],[10,0]]");
        assert!(offset_polygon(&[[1.0, 1.0], [1.5, 1.2], [4.0, 1.0], [4.0, 1.0]], 2.0).is_empty());
    }
}
