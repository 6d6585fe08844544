//! Boxes as rapidocr shapes them: convex hulls, minimum-area rectangles
//! (`cv2.minAreaRect` + `get_mini_boxes`), and the clockwise point order.
//!
//! A box is four `[x, y]` points. The minimum-area rectangle of a point set has one
//! side on an edge of the set's convex hull (Freeman & Shapira); OpenCV finds it with
//! rotating calipers in f32, and rapidocr truncates the corners it gives (pyclipper
//! takes integers), so a corner OpenCV puts at 583.99994 instead of 584 moves a box
//! by a pixel. The calipers are therefore OpenCV's, operation for operation, on the
//! hull in OpenCV's order.

/// Four corners, clockwise from the top-left in image coordinates (y down).
pub type Quad = [[f32; 2]; 4];

/// The convex hull, counter-clockwise in a y-up frame (Andrew's monotone chain);
/// collinear points dropped, duplicates merged.
pub fn convex_hull(points: &[[f64; 2]]) -> Vec<[f64; 2]> {
    let mut pts: Vec<[f64; 2]> = points.to_vec();
    pts.sort_by(|a, b| a[0].total_cmp(&b[0]).then(a[1].total_cmp(&b[1])));
    pts.dedup();
    if pts.len() < 3 {
        return pts;
    }
    let cross =
        |o: [f64; 2], a: [f64; 2], b: [f64; 2]| (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0]);
    let mut hull: Vec<[f64; 2]> = Vec::with_capacity(pts.len() * 2);
    for pass in 0..2 {
        let start = hull.len();
        let iter: Box<dyn Iterator<Item = &[f64; 2]>> =
            if pass == 0 { Box::new(pts.iter()) } else { Box::new(pts.iter().rev()) };
        for &p in iter {
            while hull.len() >= start + 2 && cross(hull[hull.len() - 2], hull[hull.len() - 1], p) <= 0.0 {
                hull.pop();
            }
            hull.push(p);
        }
        hull.pop();
    }
    hull
}

/// Where OpenCV's hull of a point sequence starts. `convexHull` lists the hull
/// counter-clockwise on screen (clockwise with y up) and rotates the list to follow
/// the input's order; the calipers below then break ties and accumulate float error
/// from that start, so it changes the last bits of the rectangle, which matter when
/// rapidocr truncates its corners.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HullStart {
    /// An outer contour: traced counter-clockwise from this pixel, a hull vertex.
    At([f64; 2]),
    /// A hole's contour: traced clockwise from this pixel; the hull starts at the
    /// vertex that follows it counter-clockwise.
    After([f64; 2]),
    /// Any other sequence: the leftmost (then topmost) vertex, Sklansky's own start.
    Leftmost,
}

/// OpenCV's `RotatedRect`, as `cv2.minAreaRect` computes it (f32 throughout).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RotatedRect {
    pub center: [f32; 2],
    pub size: [f32; 2],
    /// Degrees.
    pub angle: f32,
}

/// The hull in OpenCV's order: counter-clockwise on screen from `start`.
fn opencv_hull(points: &[[f64; 2]], start: HullStart) -> Vec<[f32; 2]> {
    // convex_hull is counter-clockwise with y up, i.e. clockwise on screen.
    let mut hull: Vec<[f64; 2]> = convex_hull(points);
    hull.reverse();
    let first = match start {
        HullStart::At(p) => hull.iter().position(|&v| v == p).unwrap_or_else(|| next_after(&hull, p)),
        HullStart::After(p) => match hull.iter().position(|&v| v == p) {
            Some(i) => (i + 1) % hull.len().max(1),
            None => next_after(&hull, p),
        },
        HullStart::Leftmost => hull
            .iter()
            .enumerate()
            .min_by(|a, b| a.1[0].total_cmp(&b.1[0]).then(a.1[1].total_cmp(&b.1[1])))
            .map_or(0, |(i, _)| i),
    };
    let first = first.min(hull.len().saturating_sub(1));
    hull.rotate_left(first);
    hull.iter().map(|p| [p[0] as f32, p[1] as f32]).collect()
}

/// The first hull vertex counter-clockwise (on screen) after the direction of `p`
/// seen from the hull's centre.
fn next_after(hull: &[[f64; 2]], p: [f64; 2]) -> usize {
    if hull.is_empty() {
        return 0;
    }
    let n = hull.len() as f64;
    let c = [hull.iter().map(|v| v[0]).sum::<f64>() / n, hull.iter().map(|v| v[1]).sum::<f64>() / n];
    // On screen, counter-clockwise is decreasing atan2 with y down.
    let angle = |v: [f64; 2]| (v[1] - c[1]).atan2(v[0] - c[0]);
    let from = angle(p);
    let behind = |v: [f64; 2]| (from - angle(v)).rem_euclid(std::f64::consts::TAU);
    (0..hull.len())
        .filter(|&i| behind(hull[i]) > 0.0)
        .min_by(|&a, &b| behind(hull[a]).total_cmp(&behind(hull[b])))
        .unwrap_or(0)
}

/// OpenCV's `rotatingCalipers` (minimum-area mode) on a hull of more than two points,
/// operation for operation in f32: a corner and the two side vectors.
fn rotating_calipers(points: &[[f32; 2]]) -> Option<[f32; 6]> {
    let n = points.len();
    let mut vect = vec![[0f32; 2]; n];
    let mut inv_len = vec![0f32; n];
    let (mut left, mut bottom, mut right, mut top) = (0, 0, 0, 0);
    let mut pt0 = points[0];
    let (mut left_x, mut right_x, mut top_y, mut bottom_y) = (pt0[0], pt0[0], pt0[1], pt0[1]);
    for i in 0..n {
        if pt0[0] < left_x {
            (left_x, left) = (pt0[0], i);
        }
        if pt0[0] > right_x {
            (right_x, right) = (pt0[0], i);
        }
        if pt0[1] > top_y {
            (top_y, top) = (pt0[1], i);
        }
        if pt0[1] < bottom_y {
            (bottom_y, bottom) = (pt0[1], i);
        }
        let pt = points[(i + 1) % n];
        let (dx, dy) = (f64::from(pt[0] - pt0[0]), f64::from(pt[1] - pt0[1]));
        vect[i] = [dx as f32, dy as f32];
        inv_len[i] = (1.0 / (dx * dx + dy * dy).sqrt()) as f32;
        pt0 = pt;
    }
    let mut orientation = 0f32;
    let (mut ax, mut ay) = (f64::from(vect[n - 1][0]), f64::from(vect[n - 1][1]));
    for v in &vect {
        let (bx, by) = (f64::from(v[0]), f64::from(v[1]));
        let convexity = ax * by - ay * bx;
        if convexity != 0.0 {
            orientation = if convexity > 0.0 { 1.0 } else { -1.0 };
            break;
        }
        (ax, ay) = (bx, by);
    }
    if orientation == 0.0 {
        return None;
    }
    let (mut base_a, mut base_b) = (orientation, 0f32);
    let mut seq = [bottom, right, top, left];
    let mut min_area = f32::MAX;
    let mut best = (0usize, 0f32, 0f32, 0f32, 0f32, 0usize);
    for _ in 0..n {
        let dp = [
            base_a * vect[seq[0]][0] + base_b * vect[seq[0]][1],
            -base_b * vect[seq[1]][0] + base_a * vect[seq[1]][1],
            -base_a * vect[seq[2]][0] - base_b * vect[seq[2]][1],
            base_b * vect[seq[3]][0] - base_a * vect[seq[3]][1],
        ];
        let mut main = 0;
        let mut max_cos = dp[0] * inv_len[seq[0]];
        for k in 1..4 {
            let cos = dp[k] * inv_len[seq[k]];
            if cos > max_cos {
                (main, max_cos) = (k, cos);
            }
        }
        let p = seq[main];
        let (lead_x, lead_y) = (vect[p][0] * inv_len[p], vect[p][1] * inv_len[p]);
        (base_a, base_b) = match main {
            0 => (lead_x, lead_y),
            1 => (lead_y, -lead_x),
            2 => (-lead_x, -lead_y),
            _ => (-lead_y, lead_x),
        };
        seq[main] = (seq[main] + 1) % n;
        let (dx, dy) = (points[seq[1]][0] - points[seq[3]][0], points[seq[1]][1] - points[seq[3]][1]);
        let width = dx * base_a + dy * base_b;
        let (dx, dy) = (points[seq[2]][0] - points[seq[0]][0], points[seq[2]][1] - points[seq[0]][1]);
        let height = -dx * base_b + dy * base_a;
        let area = width * height;
        if area <= min_area {
            min_area = area;
            best = (seq[3], base_a, width, base_b, height, seq[0]);
        }
    }
    let (i0, a1, width, b1, height, i5) = best;
    let (a2, b2) = (-b1, a1);
    let c1 = a1 * points[i0][0] + points[i0][1] * b1;
    let c2 = a2 * points[i5][0] + points[i5][1] * b2;
    let idet = 1.0f32 / (a1 * b2 - a2 * b1);
    let px = (c1 * b2 - c2 * b1) * idet;
    let py = (a1 * c2 - a2 * c1) * idet;
    Some([px, py, a1 * width, b1 * width, a2 * height, b2 * height])
}

/// `cv2.minAreaRect` of `points`, its hull ordered as OpenCV orders it (see
/// [`HullStart`]).
pub fn min_area_rect(points: &[[f64; 2]], start: HullStart) -> Option<RotatedRect> {
    let hull = opencv_hull(points, start);
    let to_degrees = |radians: f32| (f64::from(radians * 180.0) / std::f64::consts::PI) as f32;
    match hull.len() {
        0 => None,
        1 => Some(RotatedRect { center: hull[0], size: [0.0, 0.0], angle: 0.0 }),
        2 => {
            let (p, q) = (hull[0], hull[1]);
            let (dx, dy) = (f64::from(q[0] - p[0]), f64::from(q[1] - p[1]));
            Some(RotatedRect {
                center: [(p[0] + q[0]) * 0.5, (p[1] + q[1]) * 0.5],
                size: [(dx * dx + dy * dy).sqrt() as f32, 0.0],
                angle: to_degrees(dy.atan2(dx) as f32),
            })
        }
        _ => {
            let Some([px, py, v1x, v1y, v2x, v2y]) = rotating_calipers(&hull) else {
                // All points on one line: the two farthest apart.
                return min_area_rect(&[points[0], points[points.len() - 1]], HullStart::Leftmost);
            };
            let len =
                |x: f32, y: f32| (f64::from(x) * f64::from(x) + f64::from(y) * f64::from(y)).sqrt() as f32;
            Some(RotatedRect {
                center: [px + (v1x + v2x) * 0.5, py + (v1y + v2y) * 0.5],
                size: [len(v1x, v1y), len(v2x, v2y)],
                angle: to_degrees(f64::from(v1y).atan2(f64::from(v1x)) as f32),
            })
        }
    }
}

/// `cv2.boxPoints`: the rectangle's corners, in f32 as OpenCV computes them.
pub fn box_points(r: &RotatedRect) -> Quad {
    let radians = f64::from(r.angle) * std::f64::consts::PI / 180.0;
    let b = radians.cos() as f32 * 0.5;
    let a = radians.sin() as f32 * 0.5;
    let ([cx, cy], [w, h]) = (r.center, r.size);
    let p0 = [cx - a * h - b * w, cy + b * h - a * w];
    let p1 = [cx + a * h - b * w, cy - b * h - a * w];
    [p0, p1, [2.0 * cx - p0[0], 2.0 * cy - p0[1]], [2.0 * cx - p1[0], 2.0 * cy - p1[1]]]
}

/// rapidocr's `get_mini_boxes`: the minimum-area rectangle's corners ordered top-left,
/// top-right, bottom-right, bottom-left by sorting on x and then y within the left
/// and right pairs; and its shorter side.
pub fn mini_box(points: &[[f64; 2]], start: HullStart) -> Option<(Quad, f32)> {
    let rect = min_area_rect(points, start)?;
    let mut pts = box_points(&rect);
    pts.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let (i1, i4) = if pts[1][1] > pts[0][1] { (0, 1) } else { (1, 0) };
    let (i2, i3) = if pts[3][1] > pts[2][1] { (2, 3) } else { (3, 2) };
    Some(([pts[i1], pts[i2], pts[i3], pts[i4]], rect.size[0].min(rect.size[1])))
}

/// rapidocr's `order_points_clockwise`: the two leftmost points (by x) are the left
/// side, top one first; the two others the right side.
pub fn order_clockwise(quad: Quad) -> Quad {
    let mut by_x = quad;
    by_x.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let mut left = [by_x[0], by_x[1]];
    let mut right = [by_x[2], by_x[3]];
    left.sort_by(|a, b| a[1].total_cmp(&b[1]));
    right.sort_by(|a, b| a[1].total_cmp(&b[1]));
    [left[0], right[0], right[1], left[1]]
}

/// Area (shoelace, absolute) and perimeter of a polygon, in f64 as shapely computes them.
pub fn area_and_perimeter(polygon: &[[f32; 2]]) -> (f64, f64) {
    let n = polygon.len();
    let (mut twice_area, mut perimeter) = (0f64, 0f64);
    for i in 0..n {
        let (a, b) = (polygon[i], polygon[(i + 1) % n]);
        let (ax, ay, bx, by) = (f64::from(a[0]), f64::from(a[1]), f64::from(b[0]), f64::from(b[1]));
        twice_area += ax * by - bx * ay;
        perimeter += (bx - ax).hypot(by - ay);
    }
    (twice_area.abs() / 2.0, perimeter)
}

/// Euclidean distance between two points, in f32 as numpy's `linalg.norm` on f32 arrays.
pub fn distance(a: [f32; 2], b: [f32; 2]) -> f32 {
    let (dx, dy) = (a[0] - b[0], a[1] - b[1]);
    (dx * dx + dy * dy).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: [f32; 2], b: [f32; 2]) -> bool {
        (a[0] - b[0]).abs() < 1e-3 && (a[1] - b[1]).abs() < 1e-3
    }

    #[test]
    fn hull_drops_inner_and_collinear_points() {
        let pts = [[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [2.0, 2.0], [0.0, 2.0], [1.0, 1.0], [2.0, 2.0]];
        let mut hull = convex_hull(&pts);
        hull.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(hull, [[0.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 2.0]]);
    }

    #[test]
    fn min_area_rect_of_an_axis_aligned_block() {
        // Pixels x 2..=9, y 3..=5: the rectangle through their centres is 7 x 2.
        let pts: Vec<[f64; 2]> =
            (2..=9).flat_map(|x| (3..=5).map(move |y| [f64::from(x), f64::from(y)])).collect();
        let (quad, short) = mini_box(&pts, HullStart::At([2.0, 3.0])).unwrap();
        assert_eq!(short, 2.0);
        assert_eq!(quad, [[2.0, 3.0], [9.0, 3.0], [9.0, 5.0], [2.0, 5.0]]);
    }

    #[test]
    fn float_error_is_opencvs() {
        // A contour of the fixture's columns page: cv2.minAreaRect gives
        // ((707.99994, 484.5), (10.999998, 247.99997), -90.0), so the left corners sit at
        // x = 583.99994, which rapidocr then truncates to 583. (OpenCV 5 picks the other
        // of two equal sides as the width: the same rectangle, the same corners.)
        let hull = [
            [700.0, 479.0],
            [831.0, 480.0],
            [832.0, 481.0],
            [832.0, 489.0],
            [831.0, 490.0],
            [586.0, 490.0],
            [584.0, 489.0],
            [584.0, 480.0],
            [585.0, 479.0],
        ];
        let r = min_area_rect(&hull, HullStart::At([585.0, 479.0])).unwrap();
        assert_eq!(r.center, [707.999_94, 484.5]);
        let (quad, short) = mini_box(&hull, HullStart::At([585.0, 479.0])).unwrap();
        assert_eq!((quad[0], short), ([583.999_94, 479.0], 10.999_998));
    }

    #[test]
    fn min_area_rect_of_a_rotated_rectangle_is_itself() {
        // A 10 x 4 rectangle turned 30 degrees around (20, 20), plus inner points.
        let (c, s) = (30f64.to_radians().cos(), 30f64.to_radians().sin());
        let corner = |u: f64, v: f64| [20.0 + u * c - v * s, 20.0 + u * s + v * c];
        let mut pts = vec![corner(-5.0, -2.0), corner(5.0, -2.0), corner(5.0, 2.0), corner(-5.0, 2.0)];
        pts.push(corner(0.0, 0.0));
        pts.push(corner(3.0, -1.0));
        let r = min_area_rect(&pts, HullStart::Leftmost).unwrap();
        assert!((r.size[0] * r.size[1] - 40.0).abs() < 1e-3, "{r:?}");
        let (quad, short) = mini_box(&pts, HullStart::Leftmost).unwrap();
        assert!((short - 4.0).abs() < 1e-5);
        let (tl, bl) = (corner(-5.0, -2.0), corner(-5.0, 2.0));
        assert!(close(quad[0], [tl[0] as f32, tl[1] as f32]), "{quad:?}");
        assert!(close(quad[3], [bl[0] as f32, bl[1] as f32]), "{quad:?}");
    }

    #[test]
    fn degenerate_sets_give_flat_rectangles() {
        assert!(min_area_rect(&[], HullStart::Leftmost).is_none());
        let r = min_area_rect(&[[3.0, 4.0]], HullStart::Leftmost).unwrap();
        assert_eq!(r.size, [0.0, 0.0]);
        let r = min_area_rect(&[[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]], HullStart::Leftmost).unwrap();
        assert_eq!(r.size, [10.0, 0.0]);
    }

    #[test]
    fn clockwise_order_and_measures() {
        let q = order_clockwise([[10.0, 10.0], [0.0, 0.0], [0.0, 10.0], [10.0, 0.0]]);
        assert_eq!(q, [[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]]);
        assert_eq!(area_and_perimeter(&q), (100.0, 40.0));
        assert_eq!(distance([0.0, 0.0], [3.0, 4.0]), 5.0);
    }
}
