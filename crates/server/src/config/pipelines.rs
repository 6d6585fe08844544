//! The `[pipelines.NAME]` tables: OCR pipelines made of models of `[models]` — a
//! detector, an optional direction classifier, a recogniser — with their options.
//! Several pipelines may share a detector and differ in their recogniser (one per
//! language); each stage stays a model to the core (its own footprint, queue, batching
//! and eviction).

use std::collections::BTreeMap;

use serde::Deserialize;
use snooze_vision::{LimitType, OcrOptions};

use super::{
    err,
    models::{Backend, ModelSettings},
    settings::Scalar,
    ConfigError,
};

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPipeline {
    pub det: Option<String>,
    pub cls: Option<String>,
    pub rec: Option<String>,
    pub use_cls: Option<bool>,
    pub limit_side_len: Option<Scalar>,
    pub limit_type: Option<String>,
    pub det_thresh: Option<Scalar>,
    pub box_thresh: Option<Scalar>,
    pub unclip_ratio: Option<Scalar>,
    pub min_score: Option<Scalar>,
    pub dpi: Option<Scalar>,
    pub page_batch: Option<Scalar>,
}

/// A validated pipeline.
#[derive(Debug, Clone)]
pub struct PipelineSettings {
    pub name: String,
    pub det: String,
    /// `None`: no direction classifier (no line is turned).
    pub cls: Option<String>,
    pub rec: String,
    /// rapidocr 3.10's defaults but where the table says otherwise.
    pub options: OcrOptions,
    /// PDF pages are rendered at this resolution unless the request names one.
    pub dpi: f32,
    /// Pages of a document read at once: the bitmaps a request holds is bounded by it.
    pub page_batch: usize,
}

/// Default DPI of PDF pages: rapidocr's detector resizes a page's long side to at most
/// 2,000 px (~171 DPI on A4) anyway, and below ~120 DPI 10-point text falls under the
/// recogniser's 48-px lines. Measured with hayro: an A4 text page in 67 ms and 14.5 MiB
/// at 150 DPI, 166 ms and 58 MiB at 300.
pub const DEFAULT_DPI: f32 = 150.0;
/// The resolutions PDF pages may be rendered at, in a pipeline or a request: below 36
/// DPI body text is a few pixels high and reads as nothing; at 600 an A4 page is 35
/// megapixels, most of `max_image_pixels`' default.
pub const DPI_RANGE: std::ops::RangeInclusive<f32> = 36.0..=600.0;
/// Pages in flight per request: they share detector and recogniser runs, and a
/// 500-page PDF holds at most this many page bitmaps at a time.
pub const DEFAULT_PAGE_BATCH: usize = 4;

pub(super) fn pipelines(
    raw: &BTreeMap<String, RawPipeline>,
    models: &[ModelSettings],
) -> Result<Vec<PipelineSettings>, ConfigError> {
    raw.iter().map(|(name, p)| pipeline(name, p, models)).collect()
}

fn pipeline(
    name: &str,
    raw: &RawPipeline,
    models: &[ModelSettings],
) -> Result<PipelineSettings, ConfigError> {
    let key = |k: &str| format!("[pipelines.{name}] {k}");
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(err(
            &format!("[pipelines.{name}]"),
            "a pipeline name may hold only letters, digits, '-', '_' and '.'",
        ));
    }
    if models.iter().any(|m| m.name == name) {
        return Err(err(
            &format!("[pipelines.{name}]"),
            "a model has this name too: metrics and `x-snooze-model` would not tell them apart; rename one",
        ));
    }
    let model = |k: &str, v: &Option<String>| -> Result<Option<String>, ConfigError> {
        match v {
            None => Ok(None),
            Some(m) => match models.iter().find(|s| &s.name == m) {
                None => Err(err(&key(k), format!("'{m}' is not a model of [models] (or model_dir)"))),
                Some(s) => match stage_misfit(s) {
                    Some(what) => Err(err(&key(k), format!("'{m}' is {what}, not an OCR model (ONNX)"))),
                    None => Ok(Some(m.clone())),
                },
            },
        }
    };
    let det =
        model("det", &raw.det)?.ok_or_else(|| err(&key("det"), "missing: which model detects text?"))?;
    let rec =
        model("rec", &raw.rec)?.ok_or_else(|| err(&key("rec"), "missing: which model recognises it?"))?;
    let cls = model("cls", &raw.cls)?;
    let num = |k: &str, v: &Option<Scalar>| -> Result<Option<f64>, ConfigError> {
        v.as_ref()
            .map(|s| {
                s.to_string()
                    .trim()
                    .parse::<f64>()
                    .map_err(|_| err(&key(k), format!("'{s}' is not a number")))
            })
            .transpose()
    };
    let mut o = OcrOptions {
        use_cls: raw.use_cls.unwrap_or(cls.is_some()) && cls.is_some(),
        ..OcrOptions::default()
    };
    if raw.use_cls == Some(true) && cls.is_none() {
        return Err(err(&key("use_cls"), "true, but the pipeline names no `cls` model"));
    }
    if let Some(v) = num("limit_side_len", &raw.limit_side_len)? {
        if !(32.0..=10_000.0).contains(&v) || v.fract() != 0.0 {
            return Err(err(&key("limit_side_len"), format!("{v} is not a whole number from 32 to 10000")));
        }
        o.limit_side_len = v as usize;
    }
    if let Some(t) = &raw.limit_type {
        o.limit_type = match t.as_str() {
            "min" => LimitType::Min,
            "max" => LimitType::Max,
            other => return Err(err(&key("limit_type"), format!("'{other}' is not \"min\" or \"max\""))),
        };
    }
    if let Some(v) = num("det_thresh", &raw.det_thresh)? {
        o.det_thresh = v as f32;
    }
    if let Some(v) = num("box_thresh", &raw.box_thresh)? {
        o.box_thresh = v as f32;
    }
    if let Some(v) = num("unclip_ratio", &raw.unclip_ratio)? {
        o.unclip_ratio = v as f32;
    }
    if let Some(v) = num("min_score", &raw.min_score)? {
        // Checked here: the vision crate names it by rapidocr's `text_score`.
        if !(0.0..=1.0).contains(&v) {
            return Err(err(&key("min_score"), format!("{v} is not between 0 and 1")));
        }
        o.text_score = v as f32;
    }
    o.validate().map_err(|e| err(&format!("[pipelines.{name}]"), e))?;
    let dpi = num("dpi", &raw.dpi)?.unwrap_or(f64::from(DEFAULT_DPI)) as f32;
    if !DPI_RANGE.contains(&dpi) {
        let (low, high) = (DPI_RANGE.start(), DPI_RANGE.end());
        return Err(err(&key("dpi"), format!("{dpi} is not between {low} and {high}")));
    }
    let page_batch = num("page_batch", &raw.page_batch)?.unwrap_or(DEFAULT_PAGE_BATCH as f64);
    if !(1.0..=64.0).contains(&page_batch) || page_batch.fract() != 0.0 {
        return Err(err(&key("page_batch"), format!("{page_batch} is not a whole number from 1 to 64")));
    }
    // Each page of a batch queues at every stage: a stage that cannot queue a batch
    // refused every document of more pages, by its own pages.
    for stage in [Some(&det), cls.as_ref(), Some(&rec)].into_iter().flatten() {
        let queue = models.iter().find(|m| &m.name == stage).map_or(usize::MAX, |m| m.max_queue);
        if (queue as f64) < page_batch {
            return Err(err(
                &key("page_batch"),
                format!(
                    "{page_batch} pages at once, but '{stage}' queues at most {queue} (its max_queue): \
                     a document of {page_batch} pages would be refused by its own pages"
                ),
            ));
        }
    }
    Ok(PipelineSettings {
        name: name.to_string(),
        det,
        cls,
        rec,
        options: o,
        dpi,
        page_batch: page_batch as usize,
    })
}

/// What a model is when it cannot be a pipeline stage: stages run images through ONNX
/// Runtime, so a Candle model, a Whisper folder or an embedding model would only fail
/// at the first page.
fn stage_misfit(model: &ModelSettings) -> Option<&'static str> {
    if model.backend != Backend::Onnx {
        Some("a Candle model")
    } else if snooze_speech::whisper::is_whisper_folder(&model.path) {
        Some("a Whisper model")
    } else if snooze_text::is_sentence_model(&model.path) {
        Some("an embedding model")
    } else {
        None
    }
}
