//! Work that advances in slices.
//!
//! A task job — a transcription, the crops of an OCR page — is many runs of one model:
//! an encoder pass, then decoder steps; a batch of crops, then the next. Run whole, a
//! two-second transcription would hold a core while a one-millisecond request waits
//! behind it. So the scheduler runs such a job one *slice* at a time and puts it back in
//! its model's queue between slices: other models' requests run in between, and jobs of
//! the same model that are queued together share the next slice (steps of different
//! transcriptions batched into one decoder run).
//!
//! The core knows nothing of what a slice does: a task crate implements [`TaskJob`] for
//! its job state and supplies the [`SliceRunner`] that advances a batch of them on a
//! loaded model (reaching its own model type through `Any` when it needs one).

use std::any::Any;

use crate::backend::{InferError, LoadedModel};

/// How far a slice took a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// More slices to run: the job goes back in its model's queue.
    Continue,
    /// Finished: the job is handed back to its caller, which reads its result.
    Done,
}

/// The size of a slice, as far as memory goes: what a run holds at its peak (its
/// working set) is about proportional to `units` within a `class` — pixels of a page
/// for a detector; a window for an encoder pass (class 1) and a live hypothesis for a
/// decoder step (class 0) of one Whisper model. The core learns the bytes per unit of
/// each class from measured runs and holds that for a run of such slices, instead of
/// the largest run the model ever made (a decoder step holds a sliver of what an
/// encoder pass does; a small page a fraction of an A4 one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkSize {
    pub class: u8,
    pub units: u64,
    /// Bytes per unit the work expects to hold until its class is measured (0: it has
    /// no idea, and the model's largest run is held). A detector's first page held
    /// nothing for its activations, ~200 MiB for a letter-size page, and a process
    /// under a byte budget went past it.
    pub prior_bytes_per_unit: u32,
}

impl WorkSize {
    pub fn new(class: u8, units: u64) -> WorkSize {
        WorkSize { class, units, prior_bytes_per_unit: 0 }
    }
}

/// Advances every job of a batch by one slice on `model`, in place, and returns one
/// result per job, in order. A job whose slice failed is left as it was before it, so
/// the slice can be run again (after an out-of-memory eviction, say).
pub type SliceRunner = fn(&dyn LoadedModel, &mut [&mut dyn TaskJob]) -> Vec<Result<Progress, InferError>>;

/// The state of a job that runs in slices.
pub trait TaskJob: Any + Send {
    /// Jobs with equal keys may share a slice; equal keys imply the same runner.
    fn batch_key(&self) -> u64;
    /// Rows the job adds to a slice, counted against the model's `max_batch_size`.
    fn rows(&self) -> u32 {
        1
    }
    /// What the memory its next slice holds at its peak grows with (see [`WorkSize`]):
    /// by default its rows. Work that says its size is a slice of long work to the
    /// scheduler (see `max_concurrent_slices`); a request that is not a task job says
    /// nothing, and the model's largest working set is held for it.
    fn work_size(&self) -> Option<WorkSize> {
        Some(WorkSize::new(0, u64::from(self.rows())))
    }
    /// Bytes of request data the job holds (charged to request memory).
    fn byte_size(&self) -> usize;
    /// The function that advances a batch of such jobs.
    fn runner(&self) -> SliceRunner;
}
