//! The contours `cv2.findContours(mask, RETR_LIST, CHAIN_APPROX_SIMPLE)` returns, as
//! far as the detector's boxes depend on them.
//!
//! rapidocr only takes each contour's minimum-area rectangle, and that rectangle
//! depends only on the convex hull of the contour's points. So a contour is given
//! here as a few points with the same hull, not as a traced chain:
//! - the outer border of an 8-connected region of set pixels: the hull of its border
//!   pixels is the hull of all its pixels, whose extreme points are each row's
//!   leftmost and rightmost pixels;
//! - a hole (a 4-connected region of unset pixels that does not reach the image's
//!   edge): OpenCV traces the set pixels 4-adjacent to it, whose hull is the hull of
//!   the hole grown by one pixel left, right, up and down.
//!
//! Regions are found from runs of set pixels joined row to row (union-find), which
//! touches each pixel once. The order is OpenCV's: contours in reverse order of the
//! raster position where the border following starts (a region's first pixel; the
//! pixel left of a hole's first pixel), which matters only for `max_candidates` and
//! for ties when boxes are sorted.

/// One contour: points whose convex hull is the contour's.
#[derive(Debug, Clone, PartialEq)]
pub struct Contour {
    pub points: Vec<[i32; 2]>,
    /// Raster position `(y, x)` where OpenCV starts tracing it.
    start: (usize, usize),
    /// A hole's border, traced the other way round.
    hole: bool,
}

impl Contour {
    /// Where OpenCV's hull of the traced contour starts (see `geometry::HullStart`).
    pub fn hull_start(&self) -> crate::geometry::HullStart {
        let p = [self.start.1 as f64, self.start.0 as f64];
        if self.hole {
            crate::geometry::HullStart::After(p)
        } else {
            crate::geometry::HullStart::At(p)
        }
    }
}

/// A run of equal pixels in one row: `[start, end]`, inclusive.
#[derive(Clone, Copy)]
struct Run {
    y: usize,
    start: usize,
    end: usize,
}

fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

/// Runs of pixels equal to `value`, row by row, with the index of each row's first run.
fn runs(mask: &[u8], width: usize, height: usize, value: bool) -> (Vec<Run>, Vec<usize>) {
    let mut runs = Vec::new();
    let mut row_start = Vec::with_capacity(height + 1);
    for y in 0..height {
        row_start.push(runs.len());
        let row = &mask[y * width..(y + 1) * width];
        let mut x = 0;
        while x < width {
            if (row[x] != 0) == value {
                let start = x;
                while x < width && (row[x] != 0) == value {
                    x += 1;
                }
                runs.push(Run { y, start, end: x - 1 });
            } else {
                x += 1;
            }
        }
    }
    row_start.push(runs.len());
    (runs, row_start)
}

/// Labels connected runs: `diagonal` joins runs that touch at a corner (8-connectivity).
fn label(runs: &[Run], row_start: &[usize], diagonal: bool) -> Vec<usize> {
    let mut parent: Vec<usize> = (0..runs.len()).collect();
    let reach = usize::from(diagonal);
    for y in 1..row_start.len().saturating_sub(1) {
        let (above, here) = (row_start[y - 1]..row_start[y], row_start[y]..row_start[y + 1]);
        let mut j = above.start;
        for i in here {
            let r = runs[i];
            // Runs above are sorted: skip those that end left of this one's reach.
            while j < above.end && runs[j].end + reach < r.start {
                j += 1;
            }
            let mut k = j;
            while k < above.end && runs[k].start <= r.end + reach {
                let (a, b) = (find(&mut parent, i), find(&mut parent, k));
                if a != b {
                    parent[a.max(b)] = a.min(b);
                }
                k += 1;
            }
        }
    }
    (0..runs.len()).map(|i| find(&mut parent, i)).collect()
}

/// Each row's leftmost and rightmost pixel, per region, as hull candidates.
fn extremes(runs: &[Run], roots: &[usize]) -> std::collections::BTreeMap<usize, Vec<(usize, usize, usize)>> {
    // root -> [(y, min_x, max_x)] in row order.
    let mut rows: std::collections::BTreeMap<usize, Vec<(usize, usize, usize)>> = Default::default();
    for (run, &root) in runs.iter().zip(roots) {
        let list = rows.entry(root).or_default();
        match list.last_mut() {
            Some(last) if last.0 == run.y => {
                last.1 = last.1.min(run.start);
                last.2 = last.2.max(run.end);
            }
            _ => list.push((run.y, run.start, run.end)),
        }
    }
    rows
}

/// The contours of the set pixels of a `width` x `height` mask (row-major, non-zero
/// = set), in OpenCV's order.
pub fn find_contours(mask: &[u8], width: usize, height: usize) -> Vec<Contour> {
    let mut contours = Vec::new();
    if mask.len() != width * height || width == 0 || height == 0 {
        return contours;
    }
    let (fg, fg_rows) = runs(mask, width, height, true);
    let fg_roots = label(&fg, &fg_rows, true);
    for (_, rows) in extremes(&fg, &fg_roots) {
        let (y0, x0, _) = rows[0];
        let mut points = Vec::with_capacity(rows.len() * 2);
        for &(y, a, b) in &rows {
            points.push([a as i32, y as i32]);
            if b != a {
                points.push([b as i32, y as i32]);
            }
        }
        contours.push(Contour { points, start: (y0, x0), hole: false });
    }

    let (bg, bg_rows) = runs(mask, width, height, false);
    let bg_roots = label(&bg, &bg_rows, false);
    let mut open = vec![false; bg.len()];
    for (run, &root) in bg.iter().zip(&bg_roots) {
        if run.y == 0 || run.y == height - 1 || run.start == 0 || run.end == width - 1 {
            open[root] = true;
        }
    }
    for (root, rows) in extremes(&bg, &bg_roots) {
        if open[root] {
            continue;
        }
        let (y0, x0, _) = rows[0];
        contours.push(Contour { points: grown_hole(&rows), start: (y0, x0 - 1), hole: true });
    }
    contours.sort_by_key(|c| std::cmp::Reverse(c.start));
    contours
}

/// Hull candidates of a hole grown by its 4-neighbours: each row's extremes widened by
/// one, and the first and last rows' extremes moved one row out.
fn grown_hole(rows: &[(usize, usize, usize)]) -> Vec<[i32; 2]> {
    let mut points = Vec::with_capacity(rows.len() * 2 + 4);
    for &(y, a, b) in rows {
        points.push([a as i32 - 1, y as i32]);
        points.push([b as i32 + 1, y as i32]);
        // Rows of a 4-connected region are contiguous, but a row's extremes can reach past
        // its neighbours': their vertical neighbours are contour pixels too.
        points.push([a as i32, y as i32 - 1]);
        points.push([b as i32, y as i32 - 1]);
        points.push([a as i32, y as i32 + 1]);
        points.push([b as i32, y as i32 + 1]);
    }
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(rows: &[&str]) -> (Vec<u8>, usize, usize) {
        let w = rows[0].len();
        let data = rows.iter().flat_map(|r| r.bytes().map(|b| u8::from(b == b'#'))).collect();
        (data, w, rows.len())
    }

    #[test]
    fn regions_and_holes_come_in_opencv_order() {
        // The shapes of the OpenCV check in scripts/ocr_fixture.py's notes: cv2 returns
        // D, the hole, C, B, A.
        let (m, w, h) = mask(&[
            "..............................",
            "..............................",
            "..####..............#####.....",
            "..####..............#####.....",
            "..####..............#####.....",
            "..............................",
            "..............................",
            "..............................",
            "..............................",
            "..............................",
            ".....#######..................",
            ".....#######..................",
            ".....###.###..................",
            ".....#######..................",
            ".....#######..................",
            "..............................",
            ".##...........................",
            ".##...........................",
            ".##...........................",
            "..............................",
        ]);
        let c = find_contours(&m, w, h);
        let starts: Vec<(usize, usize)> = c.iter().map(|c| c.start).collect();
        assert_eq!(starts, [(16, 1), (12, 7), (10, 5), (2, 20), (2, 2)]);
        let mut hole = c[1].points.clone();
        hole.sort();
        hole.dedup();
        // The hole's 4-neighbours (7,12) (9,12) (8,11) (8,13) are among the points.
        for p in [[7, 12], [9, 12], [8, 11], [8, 13]] {
            assert!(hole.contains(&p), "{p:?} in {hole:?}");
        }
    }

    #[test]
    fn diagonal_pixels_join_and_edge_background_is_no_hole() {
        let (m, w, h) = mask(&["#..", ".#.", "..#"]);
        let c = find_contours(&m, w, h);
        assert_eq!(c.len(), 1, "8-connected");
        let (m, w, h) = mask(&["###", "#.#", "###"]);
        assert_eq!(find_contours(&m, w, h).len(), 2, "a closed ring has a hole");
        let (m, w, h) = mask(&["###", "#..", "###"]);
        assert_eq!(find_contours(&m, w, h).len(), 1, "open to the edge");
        assert!(find_contours(&[], 0, 0).is_empty());
    }
}
