//! The recogniser as a job: a page's crops in, each crop's text and score out, one of
//! rapidocr's batches (`rec_batch_num` crops) per slice.
//!
//! A recogniser batch is padded to its widest crop's ratio, and the padding is not
//! neutral: padded to a wider neighbour's width, a crop reads the same text on the
//! fixture pages but often with another score (37 of 65, by up to 0.027, enough to
//! cross `text_score`). So a batch only shares a run with batches of the same padded
//! width `W`: `W` is in the job's batch key, and each crop sees exactly the input
//! rapidocr's per-page batch gave it. A crop's pixels are freed once it is read.

use std::{sync::Arc, time::Instant};

use snooze_core::{InferError, LoadedModel, Progress, SliceRunner, TaskJob, WorkSize};

use super::{
    answer, batch_key, crops::CropBatches, downcast_jobs, group_by, rows_u32, run_model, unreadable,
    JobTimes, RunCost,
};
use crate::{
    bgr::BgrImage,
    error::VisionError,
    options::OcrOptions,
    rec::{rec_batch_width, rec_input, CtcDecoder},
};

/// A page's crops for the recogniser. Run its slices through [`TaskJob::runner`]
/// until it reports `Progress::Done`, then read [`RecJob::texts`].
pub struct RecJob {
    crops: CropBatches,
    texts: Vec<(String, f32)>,
    /// The recogniser's dictionary: one per model, shared by its jobs.
    decoder: Arc<CtcDecoder>,
    times: JobTimes,
}

impl std::fmt::Debug for RecJob {
    // Not the decoder: its dictionary holds thousands of entries.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecJob")
            .field("crops", &self.crops.len())
            .field("done", &self.is_done())
            .field("times", &self.times)
            .finish_non_exhaustive()
    }
}

impl RecJob {
    /// The crops (upright, as the classifier left them) in rapidocr's batches.
    pub fn new(crops: Vec<BgrImage>, options: &OcrOptions, decoder: Arc<CtcDecoder>) -> RecJob {
        let texts = vec![(String::new(), 0.0); crops.len()];
        let crops = CropBatches::planned(crops, options.rec_batch_num);
        RecJob { crops, texts, decoder, times: JobTimes::default() }
    }

    pub fn is_done(&self) -> bool {
        self.crops.is_done()
    }

    /// `(text, score)` per crop, in the crops' order (empty with score 0 until read).
    pub fn texts(&self) -> &[(String, f32)] {
        &self.texts
    }

    pub fn into_texts(self) -> Vec<(String, f32)> {
        self.texts
    }

    pub fn times(&self) -> &JobTimes {
        &self.times
    }

    /// The width the next batch is padded to (0 once done).
    pub fn next_width(&self) -> usize {
        if self.is_done() {
            0
        } else {
            rec_batch_width(self.crops.next_crops())
        }
    }

    /// Keeps the texts of the current batch, frees its crops, moves to the next.
    fn keep(&mut self, texts: Vec<(String, f32)>) {
        let batch = self.crops.next_batch().to_vec();
        for (&i, text) in batch.iter().zip(texts) {
            if let Some(slot) = self.texts.get_mut(i) {
                *slot = text;
            }
            self.crops.release(i);
        }
        self.crops.advance();
    }
}

impl TaskJob for RecJob {
    /// Jobs share a run when their next batches are padded to the same width.
    fn batch_key(&self) -> u64 {
        batch_key(("ocr-rec", self.next_width()))
    }

    /// The crops the next slice adds to the run.
    fn rows(&self) -> u32 {
        rows_u32(self.crops.next_batch().len())
    }

    /// The recogniser's activations grow with its input: rows x padded width.
    fn work_size(&self) -> Option<WorkSize> {
        let units = self.crops.next_batch().len() * self.next_width();
        Some(WorkSize::new(0, units as u64))
    }

    fn byte_size(&self) -> usize {
        let texts: usize =
            self.texts.iter().map(|(t, _)| t.len() + std::mem::size_of::<(String, f32)>()).sum();
        std::mem::size_of::<Self>() + self.crops.byte_size() + texts
    }

    fn runner(&self) -> SliceRunner {
        run_rec_slice
    }
}

/// Advances every [`RecJob`] of a batch by one batch of its crops: one recogniser run
/// per padded width among them (one run when the batch keys agree).
pub fn run_rec_slice(
    model: &dyn LoadedModel,
    jobs: &mut [&mut dyn TaskJob],
) -> Vec<Result<Progress, InferError>> {
    let mut results = vec![Ok(Progress::Done); jobs.len()];
    let waiting: Vec<(usize, &mut RecJob)> = downcast_jobs::<RecJob>(jobs, "recogniser", &mut results)
        .into_iter()
        .filter(|(_, j)| !j.is_done())
        .collect();
    for mut group in group_by(waiting, RecJob::next_width) {
        let run = recognize(model, &mut group);
        answer(&mut results, &group, run, RecJob::is_done);
    }
    results
}

/// One recogniser run over batches padded to the same width. Every job's rows are
/// decoded before any job keeps them, so a failure leaves all of them as they were.
fn recognize(model: &dyn LoadedModel, group: &mut [(usize, &mut RecJob)]) -> Result<(), InferError> {
    let clock = Instant::now();
    let sizes: Vec<usize> = group.iter().map(|(_, job)| job.crops.next_batch().len()).collect();
    let total = sizes.iter().sum();
    let input = rec_input(&group.iter().flat_map(|(_, job)| job.crops.next_crops()).collect::<Vec<_>>());
    let cost = RunCost::start(clock.elapsed(), total, group.len());
    let clock = Instant::now();
    let output = run_model(model, input, "recogniser")?;
    let cost = RunCost { model: clock.elapsed(), ..cost };
    let mut decoded = Vec::with_capacity(group.len());
    let mut first = 0;
    for ((_, job), &n) in group.iter().zip(&sizes) {
        let clock = Instant::now();
        let texts = job.decoder.decode_rows(&output, total, first..first + n).map_err(unreadable)?;
        if texts.len() != n {
            let reason = format!("it read {} of {n} crops", texts.len());
            return Err(unreadable(VisionError::model_output("recogniser", reason)));
        }
        decoded.push((texts, clock.elapsed()));
        first += n;
    }
    for (((_, job), &n), (texts, decoding)) in group.iter_mut().zip(&sizes).zip(decoded) {
        let clock = Instant::now();
        job.keep(texts);
        job.times.post += decoding + clock.elapsed();
        job.times.add_share(&cost, n);
    }
    Ok(())
}
