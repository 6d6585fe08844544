//! One model's slot: its policy, where it is in its lifecycle, what waits for it, and
//! its history.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::{backend::Device, units::KeepAlive};

use super::{
    queue::{Priority, RequestQueue},
    RequestId, UnloadReason,
};

/// Per-model settings the scheduler obeys.
#[derive(Debug, Clone)]
pub struct ModelPolicy {
    pub name: String,
    /// Preference order; never empty.
    pub devices: Vec<Device>,
    /// Try the next device when one cannot take the model even after eviction.
    pub cpu_fallback: bool,
    /// The user's word on the footprint; wins over everything measured or estimated.
    pub memory: Option<u64>,
    /// The backend's figures from the files: steady and load-time peak.
    pub estimate_steady: Option<u64>,
    pub estimate_peak: Option<u64>,
    pub keep_alive: KeepAlive,
    /// Not evicted sooner than this after loading (its eviction waits, it is not refused).
    pub min_residency: Duration,
    /// Never evicted nor unloaded for idleness.
    pub pinned: bool,
    /// Most requests waiting for this model; more get 429.
    pub max_queue: usize,
    /// Most rows one run takes: queued requests are merged up to it, larger ones run in
    /// micro-batches of it. 1 = no batching.
    pub max_batch_size: u32,
    /// How long a batch that is not full may wait for more requests (0 = never wait).
    pub batch_delay: Duration,
    /// Runs of this model at once.
    pub max_concurrency: u32,
    /// The priority of requests that do not name one.
    pub priority: Priority,
    /// It loads lean (quick to swap, slower on batches) and may be reloaded, while it
    /// keeps serving, in a form that is slow to load but fast on batches once it shows
    /// it stays and batches (see `plan::promote`).
    pub promotable: bool,
    /// Its runs, and the runtime threads of its sessions, run in the idle scheduling
    /// class (at nice 10): while short requests of other models run, the cores are
    /// theirs, and the rest of the time its (long work: a transcription's slices, OCR
    /// stages); short runs that leave it nothing for a while give it turns (`turns`).
    pub low_cpu_priority: bool,
}

impl ModelPolicy {
    /// A CPU model with the server defaults; tests and the shell adjust fields.
    pub fn new(name: impl Into<String>) -> ModelPolicy {
        ModelPolicy {
            name: name.into(),
            devices: vec![Device::Cpu],
            cpu_fallback: true,
            memory: None,
            estimate_steady: None,
            estimate_peak: None,
            keep_alive: KeepAlive::For(Duration::from_secs(300)),
            min_residency: Duration::ZERO,
            pinned: false,
            max_queue: 256,
            max_batch_size: 32,
            batch_delay: Duration::ZERO,
            max_concurrency: 1,
            priority: Priority::Normal,
            promotable: false,
            low_cpu_priority: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum SlotState {
    Unloaded,
    /// `reserved`: bytes held against the budget while the load runs (its peak).
    Loading {
        device: Device,
        reserved: u64,
    },
    Ready {
        device: Device,
        last_used: Instant,
        loaded_at: Instant,
        footprint: u64,
    },
    Unloading {
        device: Device,
        footprint: u64,
        reason: UnloadReason,
    },
    /// The last load failed (not for memory), or the model panicked; refused until `until`.
    Failed {
        until: Instant,
        error: String,
    },
}

/// The state's name as the admin API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateName {
    Unloaded,
    Loading,
    Ready,
    Unloading,
    Failed,
}

#[derive(Debug)]
pub struct ModelSlot {
    pub policy: ModelPolicy,
    pub state: SlotState,
    /// Requests waiting to run.
    pub(super) queue: RequestQueue,
    /// Loads asked for without a request (repository API, preload), and since when.
    pub(super) load_waiters: Vec<(RequestId, Instant)>,
    pub(super) unload_waiters: Vec<RequestId>,
    /// An unload was asked for while requests ran: nothing more is dispatched to it
    /// until it is done (new requests wait, then reload it).
    pub(super) unload_requested: bool,
    /// The backend panicked during an inference: nothing more is dispatched, the model
    /// is unloaded once its runs end and then backs off like a failed load.
    pub(super) poisoned: Option<String>,
    /// Panics since the model last served and left memory normally; sets the backoff.
    pub(super) panics: u32,
    /// Batches running now.
    pub(super) running: u32,
    /// Chosen to make room for a model that waited past `max_swap_delay`: nothing more
    /// is dispatched, so its runs end and it can be evicted.
    pub(super) draining: bool,
    /// Requests that were waiting when it became ready: it serves them before it may be
    /// evicted.
    pub(super) owed: usize,
    /// Index in `policy.devices` of the device it loads to next.
    pub(super) device_index: usize,
    /// Bytes evicted to make room for this model's pending load.
    pub(super) evicted_for: u64,
    /// When it was last evicted (cleared when it loads again): a candidate to preload.
    pub(super) evicted_at: Option<Instant>,
    /// When a request for it last arrived.
    pub(super) last_request: Option<Instant>,
    /// When the request before that arrived (how often it is asked for).
    pub(super) previous_request: Option<Instant>,
    /// Measured on the last load of this process.
    pub measured_bytes: Option<u64>,
    pub measured_peak_bytes: Option<u64>,
    /// Measured on an earlier load (possibly an earlier run); preferred to the estimate.
    pub learned_bytes: Option<u64>,
    pub learned_peak_bytes: Option<u64>,
    /// What a run holds at its peak and gives back when it ends (activations): what the
    /// backend declared until a run that ran alone measured it, then the largest such
    /// run. Held against the budget while the model runs (see `held_on`).
    pub working_bytes: u64,
    /// `working_bytes` was measured (not the backend's word).
    pub(super) working_measured: bool,
    /// What runs held at their peak by the size of their work, by the size's class
    /// (see `working.rs`).
    pub(super) working_curves: Vec<(u8, super::working::SizeCurve)>,
    /// Its runs in flight, by their batch's first request: what each holds against the
    /// budget, and whether it is a slice of long work (see `max_concurrent_slices`).
    pub(super) reserved: Vec<super::working::RunHold>,
    /// The most a run left resident since the last load (already in its footprint).
    pub(super) kept_bytes: u64,
    pub loads: u64,
    pub evictions: u64,
    pub(super) failures: u32,
    pub last_load: Option<Duration>,
    pub last_error: Option<String>,
    /// Moving average of a request's share of its batch's run time.
    pub(super) per_request: Option<Duration>,
    /// Each unfinished task job's share of the slices it ran so far: a request's time is
    /// its whole job's, not one decoder step's (see `on_run_finished`).
    pub(super) job_time: HashMap<RequestId, Duration>,
    /// The first run after the last load (page faults, arenas: part of what a swap costs).
    pub(super) first_run: Option<Duration>,
    /// No run finished since the last load.
    pub(super) fresh: bool,
    /// Runs of more than one row since the last load.
    pub(super) batched_runs: u32,
    /// Being reloaded in its fast form: the bytes held for the second instance meanwhile.
    pub(super) promoting: Option<u64>,
    /// Serving from its fast form since the last load (or a promotion failed: not retried).
    pub(super) promoted: bool,
    /// Serving from the prepacked instance a promotion loaded (until the next load).
    pub(super) serving_promoted: bool,
    /// One-time preparations still to do (see `prepare`), next first.
    pub(super) preparations: Vec<super::Preparation>,
}

impl ModelSlot {
    pub(super) fn new(policy: ModelPolicy) -> ModelSlot {
        ModelSlot {
            policy,
            state: SlotState::Unloaded,
            queue: RequestQueue::default(),
            load_waiters: Vec::new(),
            unload_waiters: Vec::new(),
            unload_requested: false,
            poisoned: None,
            panics: 0,
            running: 0,
            draining: false,
            owed: 0,
            device_index: 0,
            evicted_for: 0,
            evicted_at: None,
            last_request: None,
            previous_request: None,
            measured_bytes: None,
            measured_peak_bytes: None,
            learned_bytes: None,
            learned_peak_bytes: None,
            working_bytes: 0,
            working_measured: false,
            working_curves: Vec::new(),
            reserved: Vec::new(),
            kept_bytes: 0,
            loads: 0,
            evictions: 0,
            failures: 0,
            last_load: None,
            last_error: None,
            per_request: None,
            job_time: HashMap::new(),
            first_run: None,
            fresh: false,
            batched_runs: 0,
            promoting: None,
            promoted: false,
            serving_promoted: false,
            preparations: Vec::new(),
        }
    }

    /// Bytes to find free before loading: the load-time peak when known.
    pub fn admission_bytes(&self) -> Option<u64> {
        // The user's word, else what was measured, else what the files suggest; of a
        // source, the larger of its load peak and its resident figure.
        let larger = |a: Option<u64>, b: Option<u64>| a.max(b);
        self.policy
            .memory
            .or(larger(self.learned_peak_bytes, self.learned_bytes))
            .or(larger(self.policy.estimate_peak, self.policy.estimate_steady))
    }

    /// Where [`Self::admission_bytes`] comes from.
    pub(super) fn admission_source(&self) -> super::refusal::FootprintSource {
        use super::refusal::FootprintSource;
        if self.policy.memory.is_some() {
            FootprintSource::Configured
        } else if self.learned_peak_bytes.or(self.learned_bytes).is_some() {
            FootprintSource::Measured
        } else {
            FootprintSource::Estimated
        }
    }

    /// Bytes the model holds once loaded.
    pub fn resident_bytes(&self) -> u64 {
        self.policy
            .memory
            .or(self.measured_bytes)
            .or(self.learned_bytes)
            .or(self.policy.estimate_steady)
            .unwrap_or(0)
    }

    pub fn name(&self) -> &str {
        &self.policy.name
    }

    pub fn state_name(&self) -> StateName {
        match self.state {
            SlotState::Unloaded if self.wants_load() => StateName::Loading,
            SlotState::Unloaded => StateName::Unloaded,
            SlotState::Loading { .. } => StateName::Loading,
            SlotState::Ready { .. } => StateName::Ready,
            SlotState::Unloading { .. } => StateName::Unloading,
            SlotState::Failed { .. } => StateName::Failed,
        }
    }

    /// Requests or load calls wait for it.
    pub(super) fn wants_load(&self) -> bool {
        !self.queue.is_empty() || !self.load_waiters.is_empty()
    }

    /// The device the model is on (or loading to, or waiting to load to).
    pub fn device(&self) -> Option<&Device> {
        match &self.state {
            SlotState::Loading { device, .. }
            | SlotState::Ready { device, .. }
            | SlotState::Unloading { device, .. } => Some(device),
            SlotState::Unloaded if self.wants_load() => self.policy.devices.get(self.device_index),
            SlotState::Unloaded | SlotState::Failed { .. } => None,
        }
    }

    /// Bytes held against `device`'s budget.
    pub(super) fn held_on(&self, on: &Device) -> Option<u64> {
        match &self.state {
            SlotState::Loading { device, reserved } if device == on => Some(*reserved),
            SlotState::Ready { device, footprint, .. } if device == on => {
                Some(footprint + self.promoting.unwrap_or(0) + self.working_reserved())
            }
            SlotState::Unloading { device, footprint, .. } if device == on => Some(*footprint),
            _ => None,
        }
    }

    /// The working sets of its runs in flight: between runs a model holds only its
    /// footprint.
    pub(super) fn working_reserved(&self) -> u64 {
        self.reserved.iter().map(|r| r.bytes).sum()
    }

    /// Its last load took at most `QUICK_LOAD` and its footprint is known: it may load
    /// beside a slow load.
    pub(super) fn quick_reload(&self) -> bool {
        self.last_load.is_some_and(|t| t <= super::plan::QUICK_LOAD) && self.admission_bytes().is_some()
    }

    /// Its last load took longer than `QUICK_LOAD`.
    pub(super) fn slow_reload(&self) -> bool {
        self.last_load.is_some_and(|t| t > super::plan::QUICK_LOAD)
    }

    /// Busy in a way that holds its device for every load: unloading, or loading
    /// quickly. A slow load or a promotion holds it for slow loads only.
    pub(super) fn holds_every_load(&self) -> bool {
        match self.state {
            SlotState::Unloading { .. } => true,
            SlotState::Loading { .. } => self.quick_reload(),
            _ => false,
        }
    }

    /// Loading or unloading on `device`: the device is not quiet.
    pub(super) fn busy_on(&self, on: &Device) -> bool {
        match &self.state {
            SlotState::Loading { device, .. } | SlotState::Unloading { device, .. } => device == on,
            SlotState::Ready { device, .. } => device == on && self.promoting.is_some(),
            _ => false,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(self.state, SlotState::Ready { .. })
    }

    /// Not in memory, nor on its way in or out (a failed load included).
    pub fn is_unloaded(&self) -> bool {
        matches!(self.state, SlotState::Unloaded | SlotState::Failed { .. })
    }

    /// Ready, but nothing more may be dispatched to it — except, before an asked-for
    /// unload, the slices of task jobs already started.
    pub(super) fn closed(&self) -> bool {
        (self.unload_requested && !self.queue.resumed_next()) || self.poisoned.is_some() || self.draining
    }

    /// `Some(last_used)` when ready with nothing running and nothing waiting.
    pub fn idle(&self) -> Option<Instant> {
        match self.state {
            SlotState::Ready { last_used, .. } if self.running == 0 && self.queue.is_empty() => {
                Some(last_used)
            }
            _ => None,
        }
    }

    /// Batches running now.
    pub fn leases(&self) -> u32 {
        self.running
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// When keep-alive will unload it, if it is idle, not pinned and keep-alive is finite.
    pub fn idle_deadline(&self) -> Option<Instant> {
        let last_used = self.idle()?;
        match self.policy.keep_alive {
            KeepAlive::For(d) if !self.policy.pinned => Some(last_used + d),
            _ => None,
        }
    }

    pub(super) fn status(&self, now: Instant) -> ModelStatus {
        let (last_used, loaded_at) = match self.state {
            SlotState::Ready { last_used, loaded_at, .. } => (Some(last_used), Some(loaded_at)),
            _ => (None, None),
        };
        let ago = |t: Instant| now.saturating_duration_since(t);
        let measured = match self.state {
            SlotState::Ready { footprint, .. } if self.policy.memory.is_none() => Some(footprint),
            _ => self.measured_bytes.or(self.learned_bytes),
        };
        ModelStatus {
            name: self.policy.name.clone(),
            state: self.state_name(),
            device: self.device().map(|d| d.to_string()),
            footprint_estimated_bytes: self.policy.memory.or(self.policy.estimate_steady),
            footprint_peak_estimated_bytes: self.policy.memory.or(self.policy.estimate_peak),
            footprint_measured_bytes: measured,
            // What runs left grows the footprint, not the load's peak: never shown less.
            footprint_peak_measured_bytes: self
                .measured_peak_bytes
                .or(self.learned_peak_bytes)
                .map(|p| p.max(measured.unwrap_or(0))),
            working_bytes: (self.working_bytes > 0).then_some(self.working_bytes),
            leases: self.running,
            queued: Priority::ALL.map(|p| self.queue.len_at(p)),
            last_used_ago: last_used.map(ago),
            loaded_ago: loaded_at.map(ago),
            unload_in: self.idle_deadline().map(|d| d.saturating_duration_since(now)),
            loads: self.loads,
            evictions: self.evictions,
            last_load: self.last_load,
            last_error: self.last_error.clone(),
            pinned: self.policy.pinned,
            promoted: self.serving_promoted && matches!(self.state, SlotState::Ready { .. }),
        }
    }
}

/// What the admin view shows of a model (times relative to `now`; the shell turns them
/// into wall-clock stamps).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelStatus {
    pub name: String,
    pub state: StateName,
    pub device: Option<String>,
    pub footprint_estimated_bytes: Option<u64>,
    pub footprint_peak_estimated_bytes: Option<u64>,
    pub footprint_measured_bytes: Option<u64>,
    pub footprint_peak_measured_bytes: Option<u64>,
    /// Held beside the footprint while it runs (see `ModelSlot::working_bytes`).
    pub working_bytes: Option<u64>,
    /// Batches running now.
    pub leases: u32,
    /// Requests waiting, by priority (low, normal, high).
    pub queued: [usize; 3],
    pub last_used_ago: Option<Duration>,
    pub loaded_ago: Option<Duration>,
    pub unload_in: Option<Duration>,
    pub loads: u64,
    pub evictions: u64,
    pub last_load: Option<Duration>,
    pub last_error: Option<String>,
    pub pinned: bool,
    /// Serving from the prepacked instance a promotion loaded, not the form it loaded in.
    pub promoted: bool,
}
