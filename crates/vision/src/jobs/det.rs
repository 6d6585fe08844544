//! The detector stage as a job: one page in, its text boxes and their crops out, in a
//! single slice.
//!
//! The job holds the page as the detector sees it (bounded and padded by
//! [`prepare_page`], when the job is made) and builds the detector's input only in its
//! slice, so a queued page costs its 8-bit pixels, not four times as much in floats.
//! Small pages whose inputs have the same size share one `[B, 3, H, W]` run (the size
//! is in the batch key); each page's probability map is then read on its own, with its
//! own options. A page of [`SOLO_PIXELS`] or more runs alone: a shared run of such
//! pages is no faster per page and holds every page's activations at once — four A4
//! pages at 150 DPI took 1.7 GiB where one takes 0.4. The slice also cuts the crops:
//! they come from the padded page, which the job can drop right after, and the boxes
//! stay in that page's pixels, where the crops were cut — [`DetectedPage::assemble`]
//! maps them back to the uploaded image.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Instant,
};

use snooze_core::{InferError, LoadedModel, Progress, SliceRunner, TaskJob, Tensor, TensorData, WorkSize};

use super::{answer, batch_key, downcast_jobs, group_by, run_model, unreadable, JobTimes, RunCost};
use crate::{
    bgr::BgrImage,
    crop::crop_box,
    db::{boxes_from_map, filter_boxes, sort_boxes, TextBox},
    det::{det_input_size, prepare_page, write_det_input, PageGeometry, PreparedPage},
    error::VisionError,
    options::OcrOptions,
    page::{assemble_page, Page},
};

/// Pages whose detector input has at least this many pixels (1 Mi: 1024 x 1024; an A4
/// page at 150 DPI has 2.2 Mi) never share a run.
pub const SOLO_PIXELS: usize = 1 << 20;

/// What the detector holds per pixel of its input before a run of it was measured
/// (PP-OCR's detector on ONNX Runtime: ~160 MiB for a 736 x 960 input, ~430 MiB for
/// 1248 x 1760; rounded up). The scheduler holds it for a first page until it has
/// learned its own rate, and the server predicts a page's memory by it until then.
pub const PRIOR_BYTES_PER_PIXEL: u32 = 240;

/// Tells apart the batch keys of pages that run alone.
static SOLO: AtomicU64 = AtomicU64::new(0);

/// What the detector found on a page.
#[derive(Debug, Clone)]
pub struct DetectedPage {
    pub geometry: PageGeometry,
    /// Text lines in reading order, in the pixels of the page the detector saw.
    pub boxes: Vec<TextBox>,
    /// One crop per box, in the same order, turned upright when taller than wide.
    pub crops: Vec<BgrImage>,
}

impl DetectedPage {
    /// The page read: the boxes mapped back to the uploaded image, with the texts the
    /// recogniser gave for the crops (in the same order); blank or unsure lines dropped.
    pub fn assemble(&self, texts: &[(String, f32)], text_score: f32) -> Page {
        assemble_page(&self.geometry, &self.boxes, texts, text_score)
    }

    pub fn byte_size(&self) -> usize {
        let crops: usize = self.crops.iter().map(|c| c.data().len() + std::mem::size_of::<BgrImage>()).sum();
        crops + self.boxes.len() * std::mem::size_of::<TextBox>()
    }
}

#[derive(Debug)]
enum DetState {
    /// The page the detector will see, and the `(width, height)` of its input.
    Waiting {
        page: PreparedPage,
        input: (usize, usize),
    },
    Done(DetectedPage),
}

/// One page for the detector. Run its slice through [`TaskJob::runner`] until it
/// reports `Progress::Done`, then take [`DetJob::into_result`].
#[derive(Debug)]
pub struct DetJob {
    options: OcrOptions,
    state: DetState,
    times: JobTimes,
    /// Set for a page that runs alone (see [`SOLO_PIXELS`]): a key no other job has.
    solo: Option<u64>,
}

impl DetJob {
    /// Bounds and pads `image` as rapidocr does. A page too small to leave the
    /// detector any pixel is done at once, with no boxes.
    pub fn new(image: &BgrImage, options: &OcrOptions) -> Result<DetJob, VisionError> {
        options.validate()?;
        let clock = Instant::now();
        let page = prepare_page(image, options);
        let state = match det_input_size(&page.image, options) {
            Some(input) => DetState::Waiting { page, input },
            None => {
                DetState::Done(DetectedPage { geometry: page.geometry, boxes: Vec::new(), crops: Vec::new() })
            }
        };
        let times = JobTimes { pre: clock.elapsed(), ..JobTimes::default() };
        let solo = match &state {
            DetState::Waiting { input: (w, h), .. } if w * h >= SOLO_PIXELS => {
                Some(SOLO.fetch_add(1, Ordering::Relaxed))
            }
            _ => None,
        };
        Ok(DetJob { options: options.clone(), state, times, solo })
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, DetState::Done(_))
    }

    /// `(width, height)` of the detector's input while the page waits for it.
    pub fn input_size(&self) -> Option<(usize, usize)> {
        match &self.state {
            DetState::Waiting { input, .. } => Some(*input),
            DetState::Done(_) => None,
        }
    }

    /// What was found, once done.
    pub fn result(&self) -> Option<&DetectedPage> {
        match &self.state {
            DetState::Done(found) => Some(found),
            DetState::Waiting { .. } => None,
        }
    }

    /// What was found; `None` while the page still waits for the detector.
    pub fn into_result(self) -> Option<DetectedPage> {
        match self.state {
            DetState::Done(found) => Some(found),
            DetState::Waiting { .. } => None,
        }
    }

    pub fn times(&self) -> &JobTimes {
        &self.times
    }

    /// Boxes and crops from this page's probability map (`width` x `height`).
    fn finish(&mut self, map: &[f32], width: usize, height: usize) {
        let DetState::Waiting { page, .. } = &self.state else { return };
        let (page_w, page_h) = (page.image.width(), page.image.height());
        let boxes = boxes_from_map(map, width, height, page_w, page_h, &self.options);
        let boxes = sort_boxes(filter_boxes(boxes, page_w, page_h));
        let crops = boxes.iter().map(|b| crop_box(&page.image, &b.quad)).collect();
        self.state = DetState::Done(DetectedPage { geometry: page.geometry, boxes, crops });
    }
}

impl TaskJob for DetJob {
    /// Small pages share a detector run when their inputs have the same size.
    fn batch_key(&self) -> u64 {
        batch_key(("ocr-det", self.input_size(), self.solo))
    }

    /// The detector's activations grow with the pixels of its input.
    fn work_size(&self) -> Option<WorkSize> {
        self.input_size().map(|(w, h)| WorkSize {
            prior_bytes_per_unit: PRIOR_BYTES_PER_PIXEL,
            ..WorkSize::new(0, (w * h) as u64)
        })
    }

    fn byte_size(&self) -> usize {
        std::mem::size_of::<Self>()
            + match &self.state {
                DetState::Waiting { page, .. } => page.image.data().len(),
                DetState::Done(found) => found.byte_size(),
            }
    }

    fn runner(&self) -> SliceRunner {
        run_det_slice
    }
}

/// Advances every [`DetJob`] of a batch: one detector run per input size among them.
pub fn run_det_slice(
    model: &dyn LoadedModel,
    jobs: &mut [&mut dyn TaskJob],
) -> Vec<Result<Progress, InferError>> {
    let mut results = vec![Ok(Progress::Done); jobs.len()];
    let waiting: Vec<(usize, &mut DetJob)> = downcast_jobs::<DetJob>(jobs, "detector", &mut results)
        .into_iter()
        .filter(|(_, j)| !j.is_done())
        .collect();
    for mut group in group_by(waiting, DetJob::input_size) {
        let run = detect(model, &mut group);
        answer(&mut results, &group, run, DetJob::is_done);
    }
    results
}

/// One detector run over pages whose inputs have the same size.
fn detect(model: &dyn LoadedModel, group: &mut [(usize, &mut DetJob)]) -> Result<(), InferError> {
    let Some((width, height)) = group.first().and_then(|(_, job)| job.input_size()) else { return Ok(()) };
    let clock = Instant::now();
    let per_page = 3 * width * height;
    let mut data = vec![0f32; per_page * group.len()];
    for ((_, job), out) in group.iter().zip(data.chunks_exact_mut(per_page)) {
        if let DetState::Waiting { page, .. } = &job.state {
            write_det_input(out, &page.image, width, height);
        }
    }
    let shape = vec![group.len() as i64, 3, height as i64, width as i64];
    let input = Tensor::new("x", shape, TensorData::Fp32(data));
    let mut cost = RunCost::start(clock.elapsed(), group.len(), group.len());
    let clock = Instant::now();
    let output = run_model(model, input, "detector")?;
    cost.model = clock.elapsed();
    let (maps, map_w, map_h) = split_maps(&output, group.len()).map_err(unreadable)?;
    for ((_, job), map) in group.iter_mut().zip(maps) {
        let clock = Instant::now();
        job.finish(map, map_w, map_h);
        job.times.post += clock.elapsed();
        job.times.add_share(&cost, 1);
    }
    Ok(())
}

/// The `pages` probability maps of a `[B, 1, H, W]` (or `[B, H, W]`) detector output.
fn split_maps(output: &Tensor, pages: usize) -> Result<(Vec<&[f32]>, usize, usize), VisionError> {
    let TensorData::Fp32(values) = &output.data else {
        return Err(VisionError::model_output(
            "detector",
            format!("its output is {}, not FP32", output.datatype()),
        ));
    };
    let (b, h, w) = match output.shape[..] {
        [b, 1, h, w] | [b, h, w] => (b, h, w),
        _ => {
            return Err(VisionError::model_output(
                "detector",
                format!("its output has shape {:?}, not [{pages}, 1, H, W]", output.shape),
            ))
        }
    };
    let size = |v: i64| usize::try_from(v).unwrap_or(0);
    let (b, h, w) = (size(b), size(h), size(w));
    let expected = pages.checked_mul(h).and_then(|n| n.checked_mul(w));
    if b != pages || h == 0 || w == 0 || expected != Some(values.len()) {
        return Err(VisionError::model_output(
            "detector",
            format!("its output holds {} values, shape {:?}, for {pages} pages", values.len(), output.shape),
        ));
    }
    Ok((values.chunks_exact(h * w).collect(), w, h))
}
