//! The pipeline's settings, defaulting to rapidocr 3.10's `config.yaml` (its
//! `Global`, `Det`, `Cls` and `Rec` sections and the constants in its sources), which
//! are the reference outputs this crate is compared with.

use serde::{Deserialize, Serialize};

/// How the detector's input side is bounded (`Det.limit_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitType {
    /// Scale up so the short side is at least `limit_side_len` (rapidocr's default).
    Min,
    /// Scale down so the long side is at most `limit_side_len`.
    Max,
}

/// Settings of every stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OcrOptions {
    /// `Global.text_score`: recognised lines scoring below are dropped.
    pub text_score: f32,
    /// `Global.min_side_len` / `max_side_len`: the page is resized into these bounds first.
    pub min_side_len: usize,
    pub max_side_len: usize,
    /// `Global.min_height` / `width_height_ratio`: flat or short pages get black bands.
    pub min_height: usize,
    pub width_height_ratio: f32,
    /// `Det.limit_side_len` / `limit_type`.
    pub limit_side_len: usize,
    pub limit_type: LimitType,
    /// `Det.thresh`: map pixels above are text.
    pub det_thresh: f32,
    /// `Det.box_thresh`: boxes whose mean probability is below are dropped.
    pub box_thresh: f32,
    /// `Det.max_candidates`: contours looked at.
    pub max_candidates: usize,
    /// `Det.unclip_ratio`: how far boxes grow back.
    pub unclip_ratio: f32,
    /// `Det.use_dilation`: a 2 x 2 dilation of the text mask.
    pub use_dilation: bool,
    /// `Global.use_cls`: run the direction classifier.
    pub use_cls: bool,
    /// `Cls.cls_thresh`: a crop turns when "180" scores above.
    pub cls_thresh: f32,
    /// `Cls.cls_batch_num` / `Rec.rec_batch_num`: crops per model run.
    pub cls_batch_num: usize,
    pub rec_batch_num: usize,
}

impl Default for OcrOptions {
    fn default() -> Self {
        OcrOptions {
            text_score: 0.5,
            min_side_len: 30,
            max_side_len: 2000,
            min_height: 30,
            width_height_ratio: 8.0,
            limit_side_len: 736,
            limit_type: LimitType::Min,
            det_thresh: 0.3,
            box_thresh: 0.5,
            max_candidates: 1000,
            unclip_ratio: 1.6,
            use_dilation: true,
            use_cls: true,
            cls_thresh: 0.9,
            cls_batch_num: 6,
            rec_batch_num: 6,
        }
    }
}

/// Classifier input: `Cls.cls_image_shape` for the PP-OCRv4 mobile classifier.
pub const CLS_HEIGHT: usize = 48;
pub const CLS_WIDTH: usize = 192;
/// Recogniser input: `Rec.rec_img_shape` (the width is a minimum).
pub const REC_HEIGHT: usize = 48;
pub const REC_MIN_WIDTH: usize = 320;
/// `DBPostProcess.min_size`: boxes with a shorter side are dropped.
pub const MIN_BOX_SIDE: f32 = 3.0;
/// `_BOX_SORT_Y_THRESHOLD`: boxes whose tops are closer are on one line.
pub const LINE_Y_TOLERANCE: f32 = 10.0;

impl OcrOptions {
    /// Refuses settings no page could be read with; names the setting.
    pub fn validate(&self) -> Result<(), crate::VisionError> {
        let bad = |name: &'static str, value: String, reason: &str| {
            Err(crate::VisionError::BadOption { name, value, reason: reason.into() })
        };
        let unit = |v: f32| v.is_finite() && (0.0..=1.0).contains(&v);
        for (name, v) in [
            ("text_score", self.text_score),
            ("det_thresh", self.det_thresh),
            ("box_thresh", self.box_thresh),
            ("cls_thresh", self.cls_thresh),
        ] {
            if !unit(v) {
                return bad(name, v.to_string(), "it must be between 0 and 1");
            }
        }
        if !(self.unclip_ratio.is_finite() && self.unclip_ratio > 0.0 && self.unclip_ratio <= 10.0) {
            return bad("unclip_ratio", self.unclip_ratio.to_string(), "it must be above 0 and at most 10");
        }
        if !(self.width_height_ratio.is_finite() && self.width_height_ratio > 0.0) {
            return bad("width_height_ratio", self.width_height_ratio.to_string(), "it must be above 0");
        }
        for (name, v, lo, hi) in [
            ("min_side_len", self.min_side_len, 1, 10_000),
            ("max_side_len", self.max_side_len, 32, 10_000),
            ("limit_side_len", self.limit_side_len, 32, 10_000),
            ("max_candidates", self.max_candidates, 1, 100_000),
            ("cls_batch_num", self.cls_batch_num, 1, 1024),
            ("rec_batch_num", self.rec_batch_num, 1, 1024),
            ("min_height", self.min_height, 0, 10_000),
        ] {
            if !(lo..=hi).contains(&v) {
                return bad(name, v.to_string(), &format!("it must be between {lo} and {hi}"));
            }
        }
        if self.min_side_len > self.max_side_len {
            return bad("min_side_len", self.min_side_len.to_string(), "it must not exceed max_side_len");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_named() {
        assert!(OcrOptions::default().validate().is_ok());
        let err = OcrOptions { box_thresh: 1.5, ..Default::default() }.validate().unwrap_err();
        assert!(err.to_string().contains("box_thresh"), "{err}");
        let err = OcrOptions { rec_batch_num: 0, ..Default::default() }.validate().unwrap_err();
        assert!(err.to_string().contains("rec_batch_num"), "{err}");
        let parsed: OcrOptions = serde_json::from_str(r#"{"limit_type": "max", "box_thresh": 0.6}"#).unwrap();
        assert_eq!((parsed.limit_type, parsed.box_thresh, parsed.unclip_ratio), (LimitType::Max, 0.6, 1.6));
    }
}
