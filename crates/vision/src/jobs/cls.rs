//! The direction classifier as a job: a page's crops in, each crop's orientation out,
//! and the crops the classifier is sure are upside down turned, one of rapidocr's
//! batches (`cls_batch_num` crops) per slice.
//!
//! Every crop goes into the classifier alone in its 48 x 192 slot, so the batches of
//! all the jobs in a slice merge into one run whatever their pages: a crop's answer
//! does not depend on its neighbours. The job's `rows()` is the size of its next batch,
//! so the core's `max_batch_size` bounds the crops of one merged run.

use std::time::Instant;

use snooze_core::{InferError, LoadedModel, Progress, SliceRunner, TaskJob};

use super::{
    answer, batch_key, crops::CropBatches, downcast_jobs, rows_u32, run_model, unreadable, JobTimes, RunCost,
};
use crate::{
    bgr::BgrImage,
    cls::{apply_orientation, cls_decode, cls_input, Orientation},
    options::OcrOptions,
};

/// A page's crops for the classifier. Run its slices through [`TaskJob::runner`] until
/// it reports `Progress::Done`, then take [`ClsJob::into_crops`] for the recogniser.
#[derive(Debug)]
pub struct ClsJob {
    crops: CropBatches,
    orientations: Vec<Option<Orientation>>,
    cls_thresh: f32,
    times: JobTimes,
}

impl ClsJob {
    /// The crops in rapidocr's batches; with `use_cls` off the job has nothing to run
    /// and hands the crops on as they are.
    pub fn new(crops: Vec<BgrImage>, options: &OcrOptions) -> ClsJob {
        let orientations = vec![None; crops.len()];
        let crops = if options.use_cls {
            CropBatches::planned(crops, options.cls_batch_num)
        } else {
            CropBatches::unplanned(crops)
        };
        ClsJob { crops, orientations, cls_thresh: options.cls_thresh, times: JobTimes::default() }
    }

    pub fn is_done(&self) -> bool {
        self.crops.is_done()
    }

    /// Each crop's orientation, in the crops' order; `None` for a crop not classified
    /// (yet, or at all with `use_cls` off).
    pub fn orientations(&self) -> &[Option<Orientation>] {
        &self.orientations
    }

    /// The crops, those classified upside down with a score over `cls_thresh` turned.
    pub fn crops(&self) -> &[BgrImage] {
        self.crops.crops()
    }

    pub fn into_crops(self) -> Vec<BgrImage> {
        self.crops.into_crops()
    }

    pub fn times(&self) -> &JobTimes {
        &self.times
    }

    /// Keeps the classifier's answers for the current batch and moves to the next.
    fn keep(&mut self, answers: &[Orientation]) {
        let batch = self.crops.next_batch().to_vec();
        for (&i, &orientation) in batch.iter().zip(answers) {
            let cls_thresh = self.cls_thresh;
            self.crops.change(i, |crop| apply_orientation(crop, orientation, cls_thresh));
            if let Some(slot) = self.orientations.get_mut(i) {
                *slot = Some(orientation);
            }
        }
        self.crops.advance();
    }
}

impl TaskJob for ClsJob {
    /// Any classifier jobs may share a run.
    fn batch_key(&self) -> u64 {
        batch_key("ocr-cls")
    }

    /// The crops the next slice adds to the run.
    fn rows(&self) -> u32 {
        rows_u32(self.crops.next_batch().len())
    }

    fn byte_size(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.crops.byte_size()
            + self.orientations.len() * std::mem::size_of::<Option<Orientation>>()
    }

    fn runner(&self) -> SliceRunner {
        run_cls_slice
    }
}

/// Advances every [`ClsJob`] of a batch by one batch of its crops, all in one
/// classifier run.
pub fn run_cls_slice(
    model: &dyn LoadedModel,
    jobs: &mut [&mut dyn TaskJob],
) -> Vec<Result<Progress, InferError>> {
    let mut results = vec![Ok(Progress::Done); jobs.len()];
    let mut waiting: Vec<(usize, &mut ClsJob)> = downcast_jobs::<ClsJob>(jobs, "classifier", &mut results)
        .into_iter()
        .filter(|(_, j)| !j.is_done())
        .collect();
    if !waiting.is_empty() {
        let run = classify(model, &mut waiting);
        answer(&mut results, &waiting, run, ClsJob::is_done);
    }
    results
}

fn classify(model: &dyn LoadedModel, group: &mut [(usize, &mut ClsJob)]) -> Result<(), InferError> {
    let clock = Instant::now();
    let sizes: Vec<usize> = group.iter().map(|(_, job)| job.crops.next_batch().len()).collect();
    let total = sizes.iter().sum();
    let input = cls_input(&group.iter().flat_map(|(_, job)| job.crops.next_crops()).collect::<Vec<_>>());
    let mut cost = RunCost::start(clock.elapsed(), total, group.len());
    let clock = Instant::now();
    let output = run_model(model, input, "classifier")?;
    cost.model = clock.elapsed();
    let clock = Instant::now();
    let answers = cls_decode(&output, total).map_err(unreadable)?;
    cost.post = clock.elapsed();
    let mut rest = answers.as_slice();
    for ((_, job), &n) in group.iter_mut().zip(&sizes) {
        let clock = Instant::now();
        let (mine, tail) = rest.split_at(n.min(rest.len()));
        rest = tail;
        job.keep(mine);
        job.times.post += clock.elapsed();
        job.times.add_share(&cost, n);
    }
    Ok(())
}
