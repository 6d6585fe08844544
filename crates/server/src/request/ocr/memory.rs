//! Memory by the page: the detector's working set grows with the pixels it is fed
//! (a 736 x 960 page's activations take ~160 MiB for 10 MB of weights, given back when
//! the run ends or kept in ONNX Runtime's arena, see `release_activations`), so a page's
//! is predicted from its size before it runs — bytes per pixel, learned from what the
//! detector's runs took (its measured footprint and working set over its estimate, per
//! pixel of the largest page it read).
//! A page whose prediction could never fit the budget — with nothing else loaded but
//! pinned models — is read at the scale that fits, and the answer says so, instead of
//! running into an out-of-memory error.

use std::sync::Mutex;

use snooze_core::{units::format_bytes, SnoozeError};
use snooze_vision::{jobs::DetJob, BgrImage, LimitType, OcrOptions};

use super::{vision_error, Pipeline};
use crate::request::AppState;

/// Before anything was learned: 160 MiB for a 736 x 960 input, rounded up.
const PRIOR_BYTES_PER_PIXEL: f64 = snooze_vision::jobs::PRIOR_BYTES_PER_PIXEL as f64;
/// The least a page is read at: below, text is not worth reading.
const MIN_LONG_SIDE: usize = 320;

/// What a pipeline's detector takes per pixel of its input.
#[derive(Debug)]
pub struct PixelMemory(Mutex<Learned>);

#[derive(Debug, Clone, Copy)]
struct Learned {
    bytes_per_pixel: f64,
    /// The largest input the detector read since the server started.
    max_pixels: u64,
}

impl Default for PixelMemory {
    fn default() -> Self {
        PixelMemory(Mutex::new(Learned { bytes_per_pixel: PRIOR_BYTES_PER_PIXEL, max_pixels: 0 }))
    }
}

impl PixelMemory {
    fn get(&self) -> Learned {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn saw(&self, pixels: u64) {
        let mut l = self.0.lock().unwrap_or_else(|p| p.into_inner());
        l.max_pixels = l.max_pixels.max(pixels);
    }

    /// Bytes per pixel the detector is predicted to hold.
    pub fn bytes_per_pixel(&self) -> f64 {
        self.get().bytes_per_pixel
    }
}

/// The most a detector run may hold beside the detector's weights: the budget, less the
/// server's baseline, headroom and pinned models — what it could have with every other
/// model evicted.
async fn room(state: &AppState, det: &str) -> (u64, u64) {
    let status = state.manager.status().await;
    let pinned: u64 = status
        .iter()
        .filter(|s| s.pinned && s.name != det)
        .filter_map(|s| s.footprint_measured_bytes.or(s.footprint_estimated_bytes))
        .sum();
    let weights =
        status.iter().find(|s| s.name == det).and_then(|s| s.footprint_estimated_bytes).unwrap_or(0);
    let m = &state.memory;
    let room = m
        .budget_bytes
        .saturating_sub(m.baseline_bytes)
        .saturating_sub(state.settings.headroom)
        .saturating_sub(pinned)
        .saturating_sub(weights);
    (room, weights)
}

/// The detector's job for `image`, at a scale its run can take; the note says why the
/// page was read smaller, when it was.
pub(super) async fn det_job(
    state: &AppState,
    pipeline: &Pipeline,
    image: &BgrImage,
    options: &OcrOptions,
) -> Result<(DetJob, Option<String>), SnoozeError> {
    let job = DetJob::new(image, options).map_err(vision_error)?;
    let Some((w, h)) = job.input_size() else { return Ok((job, None)) };
    let pixels = (w * h) as u64;
    let bpp = pipeline.memory.bytes_per_pixel();
    let need = pixels as f64 * bpp;
    let (room, _) = room(state, &pipeline.settings.det).await;
    if need <= room as f64 {
        pipeline.memory.saw(pixels);
        return Ok((job, None));
    }
    let scale = (room as f64 / need).sqrt();
    let long = ((w.max(h) as f64 * scale) as usize / 32 * 32).max(MIN_LONG_SIDE);
    let smaller = OcrOptions {
        limit_type: LimitType::Max,
        limit_side_len: long,
        max_side_len: long,
        ..options.clone()
    };
    let job = DetJob::new(image, &smaller).map_err(vision_error)?;
    let (sw, sh) = job.input_size().unwrap_or((0, 0));
    pipeline.memory.saw((sw * sh) as u64);
    let note = format!(
        "read at {sw}x{sh} instead of {w}x{h}: the detector's run was predicted to hold {} ({bpp:.0} bytes a \
         pixel), more than the memory budget can ever give it ({} beside the model)",
        format_bytes(need as u64),
        format_bytes(room)
    );
    Ok((job, Some(note)))
}

/// Learns bytes per pixel from what the detector's runs left in its footprint and held
/// at their peak (its working set).
pub(super) async fn learn(state: &AppState, pipeline: &Pipeline) {
    let det = &pipeline.settings.det;
    let status = state.manager.status().await;
    let Some(s) = status.iter().find(|s| &s.name == det) else { return };
    let (Some(measured), Some(estimated)) = (s.footprint_measured_bytes, s.footprint_estimated_bytes) else {
        return;
    };
    let measured = measured + s.working_bytes.unwrap_or(0);
    let seen = pipeline.memory.get();
    if measured <= estimated || seen.max_pixels == 0 {
        return;
    }
    let bpp = (measured - estimated) as f64 / seen.max_pixels as f64;
    let mut l = pipeline.memory.0.lock().unwrap_or_else(|p| p.into_inner());
    // A run that left less than the prior says only that this page needed less: keep the
    // larger figure of a page as large, the learned one once pages that large ran.
    l.bytes_per_pixel = bpp.max(1.0);
}
