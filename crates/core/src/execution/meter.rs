//! Whether the memory a run left behind is its own.
//!
//! A pass can leave memory resident: ONNX Runtime's arena keeps the activations of the
//! largest shape it ran, which for a model with dynamic dimensions (an OCR detector fed
//! a larger image) is far more than its weights. What the process's *private* memory
//! grew across a run is that run's only when nothing else started or was in progress
//! meanwhile (another run, a load, a conversion); then it is added to the model's
//! learned footprint.
//!
//! What a run held at its peak and gave back before it ended (the activations ONNX
//! Runtime releases when a run ends, see `release_activations`) is read from the
//! process's peak RSS, reset when the run starts: it is the run's *transient*, which
//! the scheduler reserves while the model runs.
//!
//! Private, not all of RSS: a `mapped` model's first run faults in its weights' file
//! pages, which its load already accounted as the whole file; counting them again
//! doubled such a model's footprint (a 100 MB model learned 201 MiB and was refused
//! under a 300 MiB budget it fits in). Arenas and heaps are anonymous memory.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Work (runs, loads, conversions) in progress in the process.
pub struct WorkMeter {
    started: AtomicU64,
    active: AtomicUsize,
}

impl Default for WorkMeter {
    fn default() -> Self {
        WorkMeter::new()
    }
}

/// One-time preparations (conversions) in progress: a load measured while one runs
/// cannot tell its memory from the conversion's.
pub static PREPARING: WorkMeter = WorkMeter::new();

/// The process's meter.
pub static WORK: WorkMeter = WorkMeter::new();

impl WorkMeter {
    pub const fn new() -> WorkMeter {
        WorkMeter { started: AtomicU64::new(0), active: AtomicUsize::new(0) }
    }

    /// Watches the meter from now on (see [`Watch::undisturbed`]).
    pub fn watch(&self) -> Watch<'_> {
        let started = self.started.load(Ordering::SeqCst);
        Watch { meter: self, started, idle: self.active.load(Ordering::SeqCst) == 0 }
    }

    /// Starts a piece of work; it ends when the returned guard is dropped.
    pub fn begin(&self) -> Work<'_> {
        let ticket = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let alone = self.active.fetch_add(1, Ordering::SeqCst) == 0;
        // Work that did not start alone can never be measured: no reading for it.
        let before = alone.then(crate::memory::process_private_bytes);
        let peak_reset = alone && crate::memory::reset_peak_rss();
        Work { meter: self, ticket, before, peak_reset }
    }
}

/// A look at a meter from one moment on: did any of its work run since?
pub struct Watch<'a> {
    meter: &'a WorkMeter,
    started: u64,
    idle: bool,
}

impl Watch<'_> {
    /// No work of the meter was in progress at the start nor started since.
    pub fn undisturbed(&self) -> bool {
        self.idle
            && self.meter.started.load(Ordering::SeqCst) == self.started
            && self.meter.active.load(Ordering::SeqCst) == 0
    }
}

pub struct Work<'a> {
    meter: &'a WorkMeter,
    ticket: u64,
    /// Private memory at the start, read only when the work started alone.
    before: Option<u64>,
    /// The process's peak RSS was reset at the start (alone).
    peak_reset: bool,
}

/// What a piece of work did to memory, where it can be told (see [`Work::measure`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Growth {
    /// Private memory it left resident.
    pub kept: Option<u64>,
    /// Memory it held at its peak and gave back before it ended (a run's activations
    /// when the runtime releases them).
    pub transient: Option<u64>,
}

impl Work<'_> {
    /// What private memory grew since `begin`, less `held` bytes the work still holds (its
    /// outputs), if no other work was in progress or started meanwhile; `None` when
    /// the growth cannot be attributed.
    pub fn grew(&self, held: u64) -> Option<u64> {
        let before = self.before.filter(|_| self.still_alone())?;
        Some(crate::memory::process_private_bytes().saturating_sub(before).saturating_sub(held))
    }

    /// [`Work::grew`], and what the work held at its peak beyond what is resident now:
    /// the process's peak RSS since `begin` less its RSS now, if nothing else ran.
    pub fn measure(&self, held: u64) -> Growth {
        let Some(before) = self.before.filter(|_| self.still_alone()) else { return Growth::default() };
        // One reading of statm for both figures: this runs after every run that ran alone.
        let (resident, shared) = crate::memory::statm_resident_shared();
        let kept = Some(resident.saturating_sub(shared).saturating_sub(before).saturating_sub(held));
        let transient = self
            .peak_reset
            .then(crate::memory::peak_rss_bytes)
            .flatten()
            .filter(|_| self.still_alone())
            .map(|peak| peak.saturating_sub(resident));
        Growth { kept, transient }
    }

    /// No other work was in progress when this began, nor started since.
    pub fn alone(&self) -> bool {
        self.before.is_some() && self.still_alone()
    }

    fn still_alone(&self) -> bool {
        self.meter.started.load(Ordering::SeqCst) == self.ticket
            && self.meter.active.load(Ordering::SeqCst) == 1
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        self.meter.active.fetch_sub(1, Ordering::SeqCst);
    }
}
