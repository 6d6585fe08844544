//! The OCR path, `/v1/ocr`'s once its request is parsed: a document (an image, a
//! multi-page TIFF, a PDF) read page by page through a pipeline's three models, each a
//! model to the core — loaded, batched, evicted on its own.
//!
//! Pages go in bounded batches (`page_batch`), so a 500-page PDF holds a few page
//! bitmaps at a time; within a batch every page goes through the detector, then every
//! page's crops through the classifier, then the recogniser: a request holds at most
//! one stage's model at a time (a budget that fits one stage still serves, and no two
//! requests can wait on each other's models), and the pages of a batch — and of other
//! requests queued at the same time — share the stage's runs.
//!
//! Memory by the page (`memory`): the detector's working set grows with the pixels it
//! is fed, so a page's is predicted from its size before it runs; a page that could
//! never fit is read at a smaller scale, and under critical memory pressure the
//! optional classifier is skipped — both said in `usage`.

mod memory;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::future::try_join_all;
use serde::Serialize;
use snooze_core::{
    execution::WORK, pressure::PressureLevel, ErrorKind, ModelInfo, Priority, SnoozeError, TaskJob,
};
use snooze_vision::{
    jobs::{ClsJob, DetectedPage, JobTimes, RecJob},
    CtcDecoder, Document, InputLimits, OcrOptions, Page, PageSelection, VisionError,
};

use super::AppState;
use crate::config::{PipelineSettings, DPI_RANGE};
pub use memory::PixelMemory;

/// A configured pipeline, ready to read.
pub struct Pipeline {
    pub settings: PipelineSettings,
    /// The recogniser's dictionary, or why it could not be read.
    decoder: Result<Arc<CtcDecoder>, String>,
    /// What the detector's runs take per pixel, learned.
    pub memory: PixelMemory,
}

/// The pipelines of the config, by name.
pub struct Pipelines(Vec<Pipeline>);

impl Pipelines {
    /// Checks each stage's model is one (by its output's rank) and reads the pipeline's
    /// dictionary: `keys.txt` beside the recogniser (one character a line, as PaddleOCR
    /// ships it), else its ONNX `character` metadata (rapidocr's).
    pub fn load(settings: &[PipelineSettings], models: &[ModelInfo]) -> Pipelines {
        Pipelines(
            settings
                .iter()
                .map(|s| {
                    let decoder = stages_fit(s, models)
                        .and_then(|()| {
                            models
                                .iter()
                                .find(|m| m.name == s.rec)
                                .ok_or_else(|| format!("no model '{}'", s.rec))
                        })
                        .and_then(|m| dictionary(&m.path))
                        .map(|keys| Arc::new(CtcDecoder::from_keys(&keys)));
                    if let Err(e) = &decoder {
                        tracing::warn!(pipeline = %s.name, error = %e, "the pipeline will refuse requests");
                    }
                    Pipeline { settings: s.clone(), decoder, memory: PixelMemory::default() }
                })
                .collect(),
        )
    }

    pub fn all(&self) -> &[Pipeline] {
        &self.0
    }

    pub fn get(&self, name: &str) -> Result<&Pipeline, SnoozeError> {
        self.0.iter().find(|p| p.settings.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.0.iter().map(|p| p.settings.name.as_str()).collect();
            SnoozeError::new(
                ErrorKind::ModelNotFound,
                format!(
                    "no OCR pipeline '{name}' ({})",
                    if names.is_empty() {
                        "none is configured".to_string()
                    } else {
                        format!("pipelines: {}", names.join(", "))
                    }
                ),
            )
        })
    }
}

impl Pipeline {
    /// Why the pipeline refuses every request (a stage that is no such model, no
    /// dictionary), if it does.
    pub fn problem(&self) -> Option<&str> {
        self.decoder.as_ref().err().map(String::as_str)
    }
}

/// Each stage's model by the rank of its first output: the detector's probability map
/// `[N, 1, H, W]`, the classifier's `[N, 2]`, the recogniser's `[N, T, classes]` — so a
/// pipeline with two stages swapped says so instead of failing inside ONNX Runtime.
fn stages_fit(s: &PipelineSettings, models: &[ModelInfo]) -> Result<(), String> {
    let stages = [
        ("det", Some(&s.det), 4, "detector"),
        ("cls", s.cls.as_ref(), 2, "direction classifier"),
        ("rec", Some(&s.rec), 3, "recogniser"),
    ];
    for (key, name, rank, role) in stages {
        let Some(name) = name else { continue };
        let Some(Ok(signature)) = models.iter().find(|m| &m.name == name).map(|m| m.signature()) else {
            continue;
        };
        if let Some(out) = signature.outputs.first().filter(|o| o.shape.len() != rank) {
            return Err(format!(
                "'{name}' ({key}) is not a {role}: its output '{}' has shape {:?}, a {role}'s has {rank} dimensions",
                out.name, out.shape
            ));
        }
    }
    Ok(())
}

fn dictionary(path: &std::path::Path) -> Result<String, String> {
    let keys = if path.is_dir() { path.join("keys.txt") } else { path.with_file_name("keys.txt") };
    if let Ok(text) = std::fs::read_to_string(&keys) {
        return Ok(text);
    }
    snooze_backend_ort::model_metadata(path, "character")?
        .ok_or_else(|| format!("{} has no keys.txt and its model no `character` metadata", path.display()))
}

/// What a request asks beyond the document.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Run the direction classifier (default: the pipeline's).
    pub use_cls: Option<bool>,
    /// Lines scoring below are dropped (default: the pipeline's, 0.5).
    pub min_score: Option<f32>,
    /// Pages of a PDF or TIFF to read ("1-3,7"); all when `None`.
    pub pages: Option<String>,
    /// Resolution of PDF pages (default: the pipeline's, 150).
    pub dpi: Option<f32>,
}

impl Request {
    /// Checks the options against `pipeline`; the error names the option (`use_cls`,
    /// `min_score`, `dpi`, `pages`) and what is wrong with it.
    pub fn check(&self, pipeline: &PipelineSettings) -> Result<(), (&'static str, SnoozeError)> {
        if self.use_cls == Some(true) && pipeline.cls.is_none() {
            let why = format!("pipeline '{}' has no direction classifier (use_cls)", pipeline.name);
            return Err(("use_cls", SnoozeError::invalid(why)));
        }
        if let Some(min) = self.min_score.filter(|m| !(0.0..=1.0).contains(m)) {
            return Err((
                "min_score",
                SnoozeError::invalid(format!("min_score {min} is not between 0 and 1")),
            ));
        }
        if let Some(dpi) = self.dpi.filter(|d| !DPI_RANGE.contains(d)) {
            let (low, high) = (DPI_RANGE.start(), DPI_RANGE.end());
            return Err(("dpi", SnoozeError::invalid(format!("dpi {dpi} is not between {low} and {high}"))));
        }
        if let Some(pages) = &self.pages {
            PageSelection::parse(pages).map_err(|e| ("pages", vision_error(e)))?;
        }
        Ok(())
    }
}

/// One page of the answer.
#[derive(Debug, Serialize)]
pub struct PageResult {
    /// 1-based, in the document.
    pub page: usize,
    #[serde(flatten)]
    pub read: Page,
}

/// How a page was read at another scale than asked, and why.
#[derive(Debug, Serialize)]
pub struct Downscaled {
    pub page: usize,
    pub reason: String,
}

/// `usage`: what the request cost.
#[derive(Debug, Default, Serialize)]
pub struct Usage {
    pub pages: usize,
    /// Pixels the detector read, over all pages.
    pub pixels: u64,
    #[serde(serialize_with = "to_microseconds")]
    pub decode_ms: f64,
    #[serde(serialize_with = "to_microseconds")]
    pub det_ms: f64,
    #[serde(serialize_with = "to_microseconds")]
    pub cls_ms: f64,
    #[serde(serialize_with = "to_microseconds")]
    pub rec_ms: f64,
    /// Model runs per stage this request took part in, each once however many of its
    /// pages shared it.
    pub runs: [u32; 3],
    #[serde(skip)]
    run_ids: [std::collections::BTreeSet<u64>; 3],
    pub downscaled: Vec<Downscaled>,
    /// Stages skipped (`cls` under critical memory pressure) and why.
    pub degraded: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct OcrResult {
    pub model: String,
    pub pages: Vec<PageResult>,
    pub usage: Usage,
}

/// Why a read failed, and the request option it is about (`pages` past the document's
/// end), if any.
#[derive(Debug)]
pub struct ReadError(pub SnoozeError, pub Option<&'static str>);

impl From<SnoozeError> for ReadError {
    fn from(e: SnoozeError) -> Self {
        ReadError(e, None)
    }
}

/// A failure of the vision crate as a user sees it.
pub fn vision_error(e: VisionError) -> SnoozeError {
    let kind = match e.http_status() {
        413 => ErrorKind::PayloadTooLarge,
        500 => ErrorKind::Inference,
        _ => ErrorKind::InvalidInput,
    };
    SnoozeError::new(kind, e.to_string())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Milliseconds written to the microsecond: sums of `f64` read `2.7120519999999996`.
fn to_microseconds<S: serde::Serializer>(ms: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64((ms * 1e3).round() / 1e3)
}

fn add(usage: &mut Usage, stage: usize, t: &JobTimes) {
    let spent = ms(t.pre + t.model + t.post);
    match stage {
        0 => usage.det_ms += spent,
        1 => usage.cls_ms += spent,
        _ => usage.rec_ms += spent,
    }
    usage.run_ids[stage].extend(&t.run_ids);
    usage.runs[stage] = usage.run_ids[stage].len() as u32;
}

/// Runs `job` on `model` unless it has nothing to do, and hands it back typed.
async fn run<J: TaskJob>(
    state: &AppState,
    model: &str,
    priority: Option<Priority>,
    job: J,
    done: bool,
) -> Result<J, SnoozeError> {
    if done {
        return Ok(job);
    }
    let back = state.manager.run_task(model, priority, Box::new(job)).await?;
    let any: Box<dyn std::any::Any> = back;
    any.downcast::<J>().map(|b| *b).map_err(|_| {
        SnoozeError::new(ErrorKind::Internal, format!("model '{model}' answered another kind of job"))
    })
}

/// Reads `bytes` (an image or a PDF) through `pipeline`.
pub async fn read(
    state: &AppState,
    pipeline: &Pipeline,
    bytes: Vec<u8>,
    request: Request,
    priority: Option<Priority>,
) -> Result<OcrResult, ReadError> {
    let s = &pipeline.settings;
    let decoder = pipeline.decoder.clone().map_err(|e| {
        SnoozeError::new(ErrorKind::ModelFailed, format!("OCR pipeline '{}' cannot read text: {e}", s.name))
    })?;
    request.check(s).map_err(|(_, e)| e)?;
    let mut options = OcrOptions { ..s.options.clone() };
    if let Some(use_cls) = request.use_cls {
        options.use_cls = use_cls;
    }
    if let Some(min) = request.min_score {
        options.text_score = min;
    }
    options.validate().map_err(vision_error)?;
    let limits = InputLimits {
        max_image_pixels: state.settings.max_image_pixels as u64,
        max_pages: state.settings.max_pages,
        pdf_dpi: request.dpi.unwrap_or(s.dpi),
    };
    limits.validate().map_err(vision_error)?;
    let selection = request.pages.as_deref().map(PageSelection::parse).transpose().map_err(vision_error)?;
    let mut usage = Usage::default();
    let clock = Instant::now();
    let open_limits = limits.clone();
    let opened = tokio::task::spawn_blocking(move || {
        // Decoding allocates what no model's run should count as its own.
        let _work = WORK.begin();
        let limits = open_limits;
        // What cannot be opened (corrupt, of an unknown format, too many pixels) is the
        // uploaded file's fault, and so is a document over `max_pages` read whole; a
        // selection past the end or over `max_pages` is the option's.
        let doc = Document::open(bytes, &limits).map_err(|e| ReadError(vision_error(e), Some("file")))?;
        let about = Some(if selection.is_some() { "pages" } else { "file" });
        let pages = doc.select(selection.as_ref(), &limits).map_err(|e| ReadError(vision_error(e), about))?;
        Ok::<_, ReadError>((Arc::new(doc), pages))
    })
    .await
    .map_err(|e| SnoozeError::new(ErrorKind::Internal, format!("the document decoder stopped: {e}")))??;
    let (doc, selected) = opened;
    usage.decode_ms += ms(clock.elapsed());
    let mut pages = Vec::with_capacity(selected.len());
    for batch in selected.chunks(s.page_batch) {
        let clock = Instant::now();
        let (doc, indexes, limits) = (doc.clone(), batch.to_vec(), limits.clone());
        let images = tokio::task::spawn_blocking(move || {
            let _work = WORK.begin();
            indexes.iter().map(|&i| doc.render_page(i, &limits)).collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| SnoozeError::new(ErrorKind::Internal, format!("the page renderer stopped: {e}")))?
        .map_err(|e| ReadError(vision_error(e), Some("file")))?;
        usage.decode_ms += ms(clock.elapsed());
        // The detector: every page of the batch, each at a scale its run can take.
        let mut dets = Vec::with_capacity(images.len());
        for image in &images {
            let work = WORK.begin();
            let (job, note) = memory::det_job(state, pipeline, &image.image, &options).await?;
            drop(work);
            if let Some(reason) = note.or(image.note.clone()) {
                usage.downscaled.push(Downscaled { page: image.index + 1, reason });
            }
            if let Some((w, h)) = job.input_size() {
                usage.pixels += (w * h) as u64;
            }
            dets.push(job);
        }
        drop(images);
        // A page refused (its detector's queue full) or failed fails the request at once:
        // its other pages are dropped, leaving their queues, rather than run for nothing.
        let dets = try_join_all(dets.into_iter().map(|j| {
            let done = j.is_done();
            run(state, &s.det, priority, j, done)
        }))
        .await?;
        let mut found: Vec<(DetectedPage, JobTimes)> = Vec::with_capacity(dets.len());
        for d in dets {
            add(&mut usage, 0, d.times());
            let times = d.times().clone();
            let page = d
                .into_result()
                .ok_or_else(|| SnoozeError::new(ErrorKind::Internal, "the detector left a page unread"))?;
            found.push((page, times));
        }
        memory::learn(state, pipeline).await;
        // The classifier, unless skipped.
        let mut use_cls = options.use_cls;
        if use_cls && state.manager.pressure_level() >= PressureLevel::Critical {
            use_cls = false;
            if usage.degraded.is_empty() {
                usage.degraded.push("cls skipped: memory pressure is critical".into());
            }
        }
        let cls_options = OcrOptions { use_cls, ..options.clone() };
        let cls_model = s.cls.clone().unwrap_or_default();
        let turned = try_join_all(found.iter_mut().map(|(page, _)| {
            let job = ClsJob::new(std::mem::take(&mut page.crops), &cls_options);
            let done = job.is_done();
            run(state, &cls_model, priority, job, done)
        }))
        .await?;
        // The recogniser.
        let mut recs = Vec::with_capacity(turned.len());
        for c in turned {
            add(&mut usage, 1, c.times());
            recs.push(RecJob::new(c.into_crops(), &options, decoder.clone()));
        }
        let read = try_join_all(recs.into_iter().map(|j| {
            let done = j.is_done();
            run(state, &s.rec, priority, j, done)
        }))
        .await?;
        for ((index, (page, _)), r) in batch.iter().zip(found).zip(read) {
            add(&mut usage, 2, r.times());
            pages.push(PageResult { page: index + 1, read: page.assemble(r.texts(), options.text_score) });
        }
    }
    usage.pages = pages.len();
    Ok(OcrResult { model: s.name.clone(), pages, usage })
}

#[cfg(test)]
mod tests {
    use snooze_core::{DataType, ModelSignature, TensorSpec, Weights};

    use super::*;

    fn info(name: &str, output: &[i64]) -> ModelInfo {
        let spec = |n: &str, shape: &[i64]| TensorSpec {
            name: n.into(),
            datatype: DataType::Fp32,
            shape: shape.to_vec(),
        };
        ModelInfo::new(
            name.into(),
            "onnx",
            snooze_core::Task::Tensor,
            "/nowhere".into(),
            Ok(ModelSignature {
                platform: "onnxruntime_onnx".into(),
                inputs: vec![spec("x", &[-1, 3, -1, -1])],
                outputs: vec![spec("y", output)],
            }),
            true,
            Weights::Prepacked,
        )
    }

    #[test]
    fn a_stage_whose_model_does_another_job_is_named() {
        let models = [info("det", &[-1, 1, -1, -1]), info("cls", &[-1, 2]), info("rec", &[-1, -1, 6625])];
        let settings = |det: &str, cls: &str, rec: &str| PipelineSettings {
            name: "p".into(),
            det: det.into(),
            cls: Some(cls.into()),
            rec: rec.into(),
            options: OcrOptions::default(),
            dpi: 150.0,
            page_batch: 2,
        };
        assert_eq!(stages_fit(&settings("det", "cls", "rec"), &models), Ok(()));
        let swapped = stages_fit(&settings("rec", "cls", "det"), &models).unwrap_err();
        assert!(swapped.starts_with("'rec' (det) is not a detector"), "{swapped}");
        let cls = stages_fit(&settings("det", "det", "rec"), &models).unwrap_err();
        assert!(cls.contains("is not a direction classifier"), "{cls}");
    }

    #[test]
    fn usage_times_are_written_to_the_microsecond() {
        let usage = Usage { decode_ms: 2.7120519999999996, det_ms: 0.0004, ..Usage::default() };
        let json = serde_json::to_value(&usage).unwrap_or_default();
        assert_eq!(json["decode_ms"], 2.712);
        assert_eq!(json["det_ms"], 0.0);
    }
}
