//! The OCR stages as task jobs the core's scheduler runs in slices (see
//! `snooze_core::task`): a page is a [`DetJob`] on the detector, then a [`ClsJob`] on
//! the classifier, then a [`RecJob`] on the recogniser, each model loaded, batched and
//! evicted on its own, and a page holding at most one stage's model at a time.
//!
//! A detector slice reads whole pages: small pages whose detector inputs have the same
//! size share one `[B, 3, H, W]` run; a large one runs alone ([`SOLO_PIXELS`]). A
//! classifier or recogniser slice advances each of its jobs by one of rapidocr's
//! batches of crops (`plan_batches`), the batches of all the jobs sharing the slice
//! merged into one model run, so small pages queued together cost one run instead of
//! one each. Every merge gives each crop the very input it
//! would have had alone, so the answers are rapidocr's: the classifier's input is a
//! fixed 48 x 192, and a recogniser batch is padded to its widest crop, so only
//! batches of equal padded width merge (the width is in the job's batch key). Padding a
//! batch to a wider neighbour's width kept every text on the fixture pages but moved
//! 37 of 65 scores, by up to 0.027.
//!
//! On the CPU (one thread per run) a shared run saves little model time: the detector
//! took the same time per page in batches of 1, 2 and 4, the recogniser its least per
//! crop at 6. What sharing buys is fewer slices and queue turns per page; a detector
//! batch also holds B pages' activations at once, so pages of a megapixel or more never
//! share one.
//!
//! The server's order for one page: [`DetJob::new`] → slices → [`DetJob::into_result`]
//! gives a [`DetectedPage`]; its crops → [`ClsJob::new`] → slices →
//! [`ClsJob::into_crops`]; those → [`RecJob::new`] → slices → [`RecJob::texts`];
//! [`DetectedPage::assemble`] gives the page. A job with nothing to do (no crops, a
//! page with no pixel for the detector) is done from the start — the server may skip
//! the queue — and done at its first slice without a model run; a slice whose model
//! run fails leaves its jobs as they were, so the core may run it again.

mod cls;
mod crops;
mod det;
mod rec;

use std::{
    any::Any,
    hash::{DefaultHasher, Hash, Hasher},
    time::Duration,
};

use snooze_core::{InferError, LoadedModel, Progress, TaskJob, Tensor};

use crate::{error::VisionError, pipeline::StageTimes};

pub use cls::{run_cls_slice, ClsJob};
pub use det::{run_det_slice, DetJob, DetectedPage, PRIOR_BYTES_PER_PIXEL, SOLO_PIXELS};
pub use rec::{run_rec_slice, RecJob};

/// Time one job spent in its stage. Work done for a whole shared run (building its
/// input, the model) is shared out over the jobs by the crops (or pages) each put in.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobTimes {
    /// Before the model: the page's bounds and padding, resizing and normalising inputs.
    pub pre: Duration,
    pub model: Duration,
    /// After the model: boxes and crops, turning crops, CTC decoding.
    pub post: Duration,
    /// Model runs the job took part in.
    pub runs: u32,
    /// Which: each run's number (see `RunCost::id`), so a request whose pages shared a
    /// run counts it once.
    pub run_ids: Vec<u64>,
    /// Of those, runs shared with other jobs.
    pub shared_runs: u32,
}

/// What one model run cost as a whole (its input, the model, reading its output),
/// before it is shared out over the jobs in it.
#[derive(Debug, Clone, Copy, Default)]
struct RunCost {
    /// The run's number, unique in the process.
    id: u64,
    pre: Duration,
    model: Duration,
    post: Duration,
    /// Crops (or pages) in the run, and the jobs they came from.
    rows: usize,
    jobs: usize,
}

impl JobTimes {
    /// Adds this job's share of `run`, to which it brought `rows`.
    fn add_share(&mut self, run: &RunCost, rows: usize) {
        let share = if run.rows == 0 { 0.0 } else { rows as f64 / run.rows as f64 };
        self.pre += run.pre.mul_f64(share);
        self.model += run.model.mul_f64(share);
        self.post += run.post.mul_f64(share);
        self.runs += 1;
        self.run_ids.push(run.id);
        self.shared_runs += u32::from(run.jobs > 1);
    }
}

impl RunCost {
    /// A new run's cost, numbered.
    fn start(pre: Duration, rows: usize, jobs: usize) -> RunCost {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RunCost { id, pre, rows, jobs, ..RunCost::default() }
    }
}

/// A page's [`StageTimes`] (the shape [`crate::read_page`] reports) from its three jobs'.
pub fn page_times(det: &JobTimes, cls: &JobTimes, rec: &JobTimes) -> StageTimes {
    StageTimes {
        det_pre: det.pre,
        det_model: det.model,
        det_post: det.post,
        cls_pre_post: cls.pre + cls.post,
        cls_model: cls.model,
        rec_pre_post: rec.pre + rec.post,
        rec_model: rec.model,
        runs: [det.runs, cls.runs, rec.runs].map(|r| r as usize),
    }
}

/// A batch key: the stage's name and what must be equal for jobs to share a run.
fn batch_key(parts: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// `rows` as the core counts them: at least 1, so a job with nothing left still counts
/// as one request in its queue.
fn rows_u32(rows: usize) -> u32 {
    u32::try_from(rows.max(1)).unwrap_or(u32::MAX)
}

/// The slice's jobs as `T`. One of another type is answered with an error at once
/// (a job given to the wrong stage's model is the server's bug, not the sender's).
fn downcast_jobs<'a, T: TaskJob>(
    jobs: &'a mut [&mut dyn TaskJob],
    stage: &str,
    results: &mut [Result<Progress, InferError>],
) -> Vec<(usize, &'a mut T)> {
    let mut live = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter_mut().enumerate() {
        let any: &mut dyn Any = &mut **job;
        match any.downcast_mut::<T>() {
            Some(job) => live.push((i, job)),
            None => {
                results[i] = Err(InferError::Failed(format!(
                    "the OCR {stage} was given a job of another stage; this is a bug in the server"
                )))
            }
        }
    }
    live
}

/// The jobs cut into groups of equal `key`, each group in the slice's order.
fn group_by<'a, T, K: PartialEq>(
    jobs: Vec<(usize, &'a mut T)>,
    key: impl Fn(&T) -> K,
) -> Vec<Vec<(usize, &'a mut T)>> {
    let mut groups: Vec<(K, Vec<(usize, &'a mut T)>)> = Vec::new();
    for (i, job) in jobs {
        let k = key(job);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, group)) => group.push((i, job)),
            None => groups.push((k, vec![(i, job)])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// Runs `model` on `input` and returns its first output.
fn run_model(model: &dyn LoadedModel, input: Tensor, stage: &str) -> Result<Tensor, InferError> {
    model
        .infer(&[input], &[])?
        .into_iter()
        .next()
        .ok_or_else(|| InferError::Failed(format!("the OCR {stage} model gave no output")))
}

/// A model output this crate cannot read fails the run (the server's model, not the
/// sender's fault).
fn unreadable(e: VisionError) -> InferError {
    InferError::Failed(e.to_string())
}

/// Sets each group member's result from its group's run.
fn answer<T>(
    results: &mut [Result<Progress, InferError>],
    group: &[(usize, &mut T)],
    run: Result<(), InferError>,
    done: impl Fn(&T) -> bool,
) {
    for (i, job) in group {
        results[*i] = match &run {
            Ok(()) if done(job) => Ok(Progress::Done),
            Ok(()) => Ok(Progress::Continue),
            Err(e) => Err(e.clone()),
        };
    }
}
