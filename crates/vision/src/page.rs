//! What a page read returns: its lines in reading order, each with its text, score
//! and four-point box in the uploaded image's pixels.
//!
//! rapidocr's final filter is applied here: a line whose text is blank is dropped,
//! and so is one whose recognition score is under `text_score`.

use serde::{Deserialize, Serialize};

use crate::{db::TextBox, det::PageGeometry, geometry::Quad};

/// One line of text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub text: String,
    /// The recogniser's mean probability over the line's characters.
    pub score: f32,
    /// Corners clockwise from the top-left, `[x, y]` in the uploaded image's pixels.
    #[serde(rename = "box")]
    pub quad: Quad,
}

/// One page read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page {
    pub width: usize,
    pub height: usize,
    pub lines: Vec<Line>,
    /// The lines' texts joined by newlines.
    pub text: String,
}

impl Page {
    pub fn new(width: usize, height: usize, lines: Vec<Line>) -> Page {
        let text = lines.iter().map(|l| l.text.as_str()).collect::<Vec<_>>().join("\n");
        Page { width, height, lines, text }
    }
}

/// The page from its boxes (on the detector's image) and their recognised texts, in
/// the same order.
pub fn assemble_page(
    geometry: &PageGeometry,
    boxes: &[TextBox],
    texts: &[(String, f32)],
    text_score: f32,
) -> Page {
    let lines = boxes
        .iter()
        .zip(texts)
        .filter(|(_, (text, score))| !text.trim().is_empty() && *score >= text_score)
        .map(|(b, (text, score))| Line {
            text: text.clone(),
            score: *score,
            quad: geometry.to_original(&b.quad),
        })
        .collect();
    Page::new(geometry.original_width, geometry.original_height, lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blank_and_unsure_lines_are_dropped_and_boxes_mapped_back() {
        let g =
            PageGeometry { original_width: 100, original_height: 50, ratio_w: 2.0, ratio_h: 2.0, pad_top: 0 };
        let b = |y: f32| TextBox { quad: [[1.0, y], [40.0, y], [40.0, y + 5.0], [1.0, y + 5.0]], score: 0.9 };
        let texts = [
            ("first".to_owned(), 0.9),
            ("  ".to_owned(), 0.99),
            ("faint".to_owned(), 0.4),
            ("last".to_owned(), 0.5),
        ];
        let page = assemble_page(&g, &[b(0.0), b(8.0), b(16.0), b(24.0)], &texts, 0.5);
        assert_eq!(page.text, "first\nlast");
        assert_eq!(page.lines[1].quad, [[2.0, 48.0], [80.0, 48.0], [80.0, 50.0], [2.0, 50.0]]);
        let json = serde_json::to_value(&page.lines[0]).unwrap();
        assert_eq!(json["box"][1], serde_json::json!([80.0, 0.0]));
    }
}
