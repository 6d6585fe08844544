//! The lifecycle state machine: which model is loaded where, which request runs when,
//! and when that changes.
//!
//! Sans-IO, in the quinn-proto shape: the shell calls [`Scheduler::handle`] with the
//! current instant and an [`Event`], carries out the [`Action`]s it gets back, and
//! calls [`Scheduler::handle_timeout`] at [`Scheduler::next_deadline`]. Nothing here
//! reads a clock, sleeps or touches a backend, so every rule is tested with
//! hand-built instants (see `tests*.rs`).
//!
//! A request is *submitted* and waits in its model's queue (a lane per priority)
//! until the model is resident and has a free run slot; then it is *dispatched*,
//! merged with the queued requests of the same shape into one batch. A model that is
//! not resident is loaded when its device is quiet (one load or unload at a time per
//! device, so the memory check before a load and the measurement after it see a quiet
//! device), evicting idle models least-recently-used first. What blocks a load but
//! will pass by itself — runs in flight, a queue being served, a young model, a load
//! or unload in progress — makes it *wait*, never refuse; requests are refused only
//! when waiting cannot help (the model can never fit), when their queue is full, or
//! when they waited `queue_timeout`.

mod dispatch;
mod loads;
mod order;
mod plan;
mod prepare;
mod queue;
mod refusal;
mod requests;
mod slot;
#[cfg(test)]
mod tests;
mod turns;
mod unloads;
mod working;

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

pub use prepare::{Preparation, Prepared};
pub use queue::{Priority, Queued, Retry};
pub use slot::{ModelPolicy, ModelSlot, ModelStatus, SlotState, StateName};
pub use turns::{LONG_TURN, SHORT_STREAK};

use crate::{
    backend::{Device, LoadError, Weights},
    error::{ErrorKind, SnoozeError},
    pressure::PressureLevel,
    task::WorkSize,
    units::KeepAlive,
};

/// Index of a model, fixed at registration.
pub type ModelId = usize;
/// Identifies one waiting caller; chosen by the shell, unique while in flight.
pub type RequestId = u64;

/// A load waiter whose caller stopped waiting: the load goes on, its answer goes nowhere.
const NOBODY: RequestId = RequestId::MAX;

/// Server-wide knobs of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Bytes each device may hold in all, the process baseline included.
    pub budgets: BTreeMap<Device, u64>,
    /// What the process holds on each device before any model (measured at start).
    pub baselines: BTreeMap<Device, u64>,
    /// Slack kept free on top of each model's estimate.
    pub headroom: u64,
    /// Most models resident at once across devices; 0 = no cap.
    pub max_loaded_models: usize,
    /// Retry-After for memory refusals, which have no better-known time.
    pub retry_after: Duration,
    /// First backoff after a failed load; doubles per failure up to `backoff_max`.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Longest a request waits in its queue before it is refused (503).
    pub queue_timeout: Duration,
    /// Longest a model waiting to load lets resident models serve their queues before
    /// it evicts one of them anyway: the bound that keeps a cold model from starving.
    pub max_swap_delay: Duration,
    /// Batches running at once across all models; 0 = no cap.
    pub max_concurrent_inferences: u32,
    /// Slices of long work (task jobs: transcriptions, OCR stages) running at once
    /// across all models; 0 = no cap. Requests that are not task jobs are not counted.
    pub max_concurrent_slices: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            budgets: BTreeMap::from([(Device::Cpu, u64::MAX)]),
            baselines: BTreeMap::new(),
            headroom: 0,
            max_loaded_models: 0,
            retry_after: Duration::from_secs(5),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            queue_timeout: Duration::from_secs(30),
            max_swap_delay: Duration::from_millis(200),
            max_concurrent_inferences: 0,
            max_concurrent_slices: 0,
        }
    }
}

/// Why a model leaves memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnloadReason {
    /// Made room for another model.
    Evicted,
    /// Keep-alive ran out.
    Idle,
    /// Asked for through the API (a repository unload, `POST /admin/memory/gc`).
    Requested,
    /// The memory pressure's emergency unload.
    Pressure,
    Shutdown,
    /// The backend panicked during inference: the instance cannot be trusted.
    Failed,
}

/// A request that wants to run on a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Submit {
    pub req: RequestId,
    pub model: ModelId,
    /// `None`: the model's default.
    pub priority: Option<Priority>,
    /// Rows along the batch dimension.
    pub rows: u32,
    /// Requests with the same key may run as one batch; `None` runs alone.
    pub key: Option<u64>,
    /// What its run's memory grows with, when it says (see [`WorkSize`]).
    pub size: Option<WorkSize>,
}

/// A task job that ran a slice and queues again for the next: its rows and batch key
/// may have changed with its state.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    pub req: RequestId,
    pub rows: u32,
    pub key: Option<u64>,
    pub size: Option<WorkSize>,
}

/// How a dispatched batch ended, as far as the scheduler cares (the shell answered
/// the requests of a finished batch itself).
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutcome {
    Done,
    /// The backend verified an allocation failure: nobody was answered (but the jobs that
    /// continue); retry or refuse.
    OutOfMemory(String),
    /// The backend panicked: the requests were answered 500; the model is not trusted.
    Panicked(String),
}

/// What happened, as the shell tells it.
#[derive(Debug)]
pub enum Event {
    /// A request wants to run.
    Submit(Submit),
    /// Load without running anything (repository API, preload); replied when ready.
    Load { req: RequestId, model: ModelId },
    /// Unload once nothing runs on it; replied when unloaded.
    Unload { req: RequestId, model: ModelId },
    /// A waiting caller went away (timeout, disconnect): it leaves its queue at once.
    Cancel { req: RequestId },
    /// A dispatched batch ended. `continuing`: task jobs of the batch that ran a slice
    /// and have more to run; they queue again (see [`crate::task`]).
    RunFinished {
        model: ModelId,
        reqs: Vec<RequestId>,
        outcome: RunOutcome,
        took: Duration,
        continuing: Vec<Resume>,
    },
    /// A load ended. `measured`: bytes the load took, when the shell could measure it.
    LoadFinished { model: ModelId, result: Result<LoadMeasurement, LoadError>, took: Duration },
    /// An unload ended and its memory was given back.
    UnloadFinished { model: ModelId },
    /// A promotion ended: the model now serves from its fast form (or stays as it was).
    PromoteFinished { model: ModelId, result: Result<LoadMeasurement, LoadError> },
    /// A preparation (see `prepare`) ended.
    PrepareFinished { model: ModelId, weights: Weights, result: Prepared },
    /// Unload every idle model but `except` (pinned ones too when `include_pinned`);
    /// answered with [`Action::Collected`] once they are all gone.
    Collect { req: RequestId, except: Option<ModelId>, include_pinned: bool, reason: UnloadReason },
    /// Refuse new work from now on; waiting callers are refused.
    Shutdown,
    /// The memory pressure level (rule 8): critical makes loads pay for themselves with
    /// evictions and refuses low-priority requests; emergency also unloads idle, unpinned
    /// models, the least worth first, until they cover `excess` — the bytes the process
    /// holds over the critical threshold (ignored below emergency).
    Pressure { level: PressureLevel, excess: u64 },
}

/// What a load took, as the shell measured it (`None` where it could not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadMeasurement {
    /// Resident bytes the model added (RSS delta for the host, NVML delta for a GPU).
    pub steady: Option<u64>,
    /// The most the load held at once.
    pub peak: Option<u64>,
    /// What the backend says a run may hold beyond the loaded footprint (see
    /// `LoadedModel::working_bytes`): the model's reservation while it runs until a
    /// run measures it.
    pub working: u64,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start loading the model on the device (on a blocking thread).
    StartLoad { model: ModelId, device: Device },
    /// Load a second instance of a resident model in its fast form while the first keeps
    /// serving; swap them, then send `PromoteFinished`.
    StartPromote { model: ModelId, device: Device },
    /// Do the model's one-time preparation for `weights` in the background (lowest
    /// priority), then send `PrepareFinished`.
    StartPrepare { model: ModelId, weights: Weights },
    /// Stop the model's preparation in progress, if the preparer can (a load or a run
    /// needs the memory it holds); its `PrepareFinished` follows either way.
    StopPrepare { model: ModelId },
    /// Drop the model, trim the heap, then send `UnloadFinished`.
    StartUnload { model: ModelId, device: Device, reason: UnloadReason, bytes: u64 },
    /// Run these requests as one batch, in micro-batches of at most `max_rows` rows,
    /// answer them, then send `RunFinished`.
    Dispatch { model: ModelId, reqs: Vec<RequestId>, max_rows: u32 },
    /// Answer a `Load` / `Unload`, or refuse a `Submit`.
    Reply { req: RequestId, result: Result<(), SnoozeError> },
    /// Answer a `Collect`: these models were unloaded.
    Collected { req: RequestId, models: Vec<ModelId> },
}

/// A garbage collection waiting for its unloads.
#[derive(Debug)]
struct Collection {
    req: RequestId,
    models: Vec<ModelId>,
    pending: Vec<ModelId>,
}

/// The state machine. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    slots: Vec<ModelSlot>,
    /// The last probe reading per device, with the bytes accounted when it was taken.
    available: BTreeMap<Device, (u64, u64)>,
    /// Why a model's files cannot be read, when they cannot.
    unreadable: Vec<Option<String>>,
    /// Dispatched requests: what they were, in case an out-of-memory retry requeues them.
    in_flight: HashMap<RequestId, (ModelId, Priority, Queued)>,
    running: u32,
    /// Turns for the cores between short runs and long work (see `turns`).
    turns: turns::Turns,
    /// The preparation in progress.
    preparing: Option<prepare::Preparing>,
    /// Background preparations stopped for requests in a row, and the instant before which
    /// a quiet host starts none (see `prepare`).
    prepare_stops: (u32, Option<Instant>),
    collections: Vec<Collection>,
    shutting_down: bool,
    pressure: PressureLevel,
    /// The earliest instant a waiting plan or batch may change by itself.
    wake: Option<Instant>,
    /// The instant of the event being handled.
    now: Instant,
    actions: Vec<Action>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config,
            slots: Vec::new(),
            available: BTreeMap::new(),
            unreadable: Vec::new(),
            in_flight: HashMap::new(),
            running: 0,
            turns: turns::Turns::default(),
            preparing: None,
            prepare_stops: (0, None),
            collections: Vec::new(),
            shutting_down: false,
            pressure: PressureLevel::Normal,
            wake: None,
            now: Instant::now(),
            actions: Vec::new(),
        }
    }

    /// Adds a model; returns its id.
    pub fn register(&mut self, policy: ModelPolicy) -> ModelId {
        self.slots.push(ModelSlot::new(policy));
        self.unreadable.push(None);
        self.slots.len() - 1
    }

    pub fn find(&self, name: &str) -> Option<ModelId> {
        self.slots.iter().position(|s| s.policy.name == name)
    }

    pub fn slot(&self, model: ModelId) -> &ModelSlot {
        &self.slots[model]
    }

    pub fn slots(&self) -> &[ModelSlot] {
        &self.slots
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Records a footprint learned on an earlier run (preferred to the file estimate).
    pub fn set_learned(&mut self, model: ModelId, steady: Option<u64>, peak: Option<u64>) {
        self.slots[model].learned_bytes = steady;
        self.slots[model].learned_peak_bytes = peak;
    }

    /// A run of a resident model left `grew` bytes resident (measured by the manager
    /// when nothing else ran): its footprint is its load's plus the most one run left
    /// since, unless the config fixes its memory. Returns the new footprint.
    pub fn learn_pass(&mut self, model: ModelId, grew: u64) -> Option<u64> {
        let s = &mut self.slots[model];
        if s.policy.memory.is_some() || grew <= s.kept_bytes {
            return None;
        }
        let SlotState::Ready { footprint, .. } = &mut s.state else { return None };
        // The most one run left, not the sum: a run reuses what the one before it left
        // (an arena, the allocator's free lists); a sum counted the allocator's noise
        // again at every run (an OCR recogniser "grew" to 201 MiB in a minute).
        *footprint = footprint.saturating_add(grew - s.kept_bytes);
        s.kept_bytes = grew;
        // The next load is admitted for it; `measured_bytes` stays the load's alone, so
        // a reload starts from that (its own runs add theirs again).
        s.learned_bytes = Some(*footprint);
        Some(*footprint)
    }

    /// Memory given back on purpose (an unload or gc asked for, an emergency) stays
    /// given back: no model evicted earlier is preloaded into it, until a load evicts
    /// again.
    pub(super) fn forget_evictions(&mut self) {
        for s in &mut self.slots {
            s.evicted_at = None;
        }
    }

    /// Records a fresh probe reading of what `device` can still allocate. Not an event:
    /// a reading decides nothing by itself, it is consulted by the next admission.
    pub fn observe_memory(&mut self, device: Device, bytes: u64) {
        let accounted = self.accounted(&device);
        self.available.insert(device, (bytes, accounted));
    }

    /// What `device` can allocate now by the last reading, corrected by what was
    /// accounted since: a model that finished unloading after the reading gave its bytes
    /// back (without this, a reading taken while an evicted model was still leaving
    /// makes the next load evict a second model it does not need to), and one that
    /// began loading has taken its bytes.
    /// A waiting plan or batch may change by itself at `t`: the scheduler looks again by then.
    pub(super) fn wake_by(&mut self, t: Instant) {
        self.wake = Some(self.wake.map_or(t, |w| w.min(t)));
    }

    pub(crate) fn probe_free(&self, device: &Device) -> u64 {
        match self.available.get(device) {
            None => u64::MAX,
            Some(&(bytes, then)) => {
                let now = self.accounted(device);
                if now <= then {
                    bytes.saturating_add(then - now)
                } else {
                    bytes.saturating_sub(now - then)
                }
            }
        }
    }

    /// Records whether the model's files can be read (`Some(why)` when not): a model
    /// that cannot is refused before anything is evicted for it.
    pub fn observe_files(&mut self, model: ModelId, unreadable: Option<String>) {
        self.unreadable[model] = unreadable;
    }

    pub fn is_unreadable(&self, model: ModelId) -> bool {
        self.unreadable[model].is_some()
    }

    /// Bytes accounted on a device: baseline + every resident, loading or unloading model
    /// + a preparation in progress.
    pub fn accounted(&self, device: &Device) -> u64 {
        let models: u64 = self.slots.iter().filter_map(|s| s.held_on(device)).sum();
        self.config.baselines.get(device).copied().unwrap_or(0) + models + self.preparing_bytes(device)
    }

    /// Bytes accounted to each model holding memory on `device`.
    pub fn holding(&self, device: &Device) -> Vec<(String, u64)> {
        self.slots.iter().filter_map(|s| Some((s.policy.name.clone(), s.held_on(device)?))).collect()
    }

    pub fn budget(&self, device: &Device) -> u64 {
        self.config.budgets.get(device).copied().unwrap_or(0)
    }

    pub fn pressure(&self) -> PressureLevel {
        self.pressure
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Models holding memory or running (for shutdown: are we done?).
    pub fn busy(&self) -> bool {
        self.running > 0
            || self.slots.iter().any(|s| !matches!(s.state, SlotState::Unloaded | SlotState::Failed { .. }))
    }

    /// Feeds one event; returns what to do.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        self.now = now;
        match event {
            Event::Submit(s) => self.on_submit(now, s),
            Event::Load { req, model } => self.on_load(now, req, model),
            Event::Unload { req, model } => {
                self.forget_evictions();
                self.on_unload(req, model)
            }
            Event::Cancel { req } => self.on_cancel(req),
            Event::RunFinished { model, reqs, outcome, took, continuing } => {
                self.on_run_finished(now, model, reqs, outcome, took, continuing)
            }
            Event::LoadFinished { model, result, took } => self.on_load_finished(now, model, result, took),
            Event::UnloadFinished { model } => self.on_unload_finished(now, model),
            Event::PromoteFinished { model, result } => self.on_promote_finished(model, result),
            Event::PrepareFinished { model, weights, result } => {
                self.on_prepare_finished(model, weights, result)
            }
            Event::Collect { req, except, include_pinned, reason } => {
                self.forget_evictions();
                self.on_collect(req, except, include_pinned, reason)
            }
            Event::Shutdown => self.on_shutdown(),
            Event::Pressure { level, excess } => {
                self.pressure = level;
                if level == PressureLevel::Emergency {
                    self.forget_evictions();
                    self.on_emergency(now, excess);
                }
            }
        }
        self.pump(now);
        std::mem::take(&mut self.actions)
    }

    /// The earliest instant at which `handle_timeout` has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let timeout = self.config.queue_timeout;
        let keep_alive = self.slots.iter().filter_map(|s| s.idle_deadline());
        let queued = self.slots.iter().filter_map(|s| s.queue.oldest()).map(|t| t + timeout);
        keep_alive.chain(queued).chain(self.wake).min()
    }

    /// Refuses requests that waited `queue_timeout`, unloads models whose keep-alive
    /// ran out, and starts what the passing of time allows.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Action> {
        self.now = now;
        let timeout = self.config.queue_timeout;
        for id in 0..self.slots.len() {
            let Some(cutoff) = now.checked_sub(timeout) else { continue };
            let expired = self.slots[id].queue.expire(cutoff);
            if !expired.is_empty() {
                let err = self.queue_timeout_error(id);
                for q in expired {
                    self.push(Action::Reply { req: q.req, result: Err(err.clone()) });
                }
            }
            if self.slots[id].idle_deadline().is_some_and(|d| d <= now) {
                self.begin_unload(id, UnloadReason::Idle);
            }
        }
        self.pump(now);
        std::mem::take(&mut self.actions)
    }

    pub(super) fn push(&mut self, action: Action) {
        self.actions.push(action);
    }

    pub(super) fn refuse(&mut self, req: RequestId, err: SnoozeError) {
        self.push(Action::Reply { req, result: Err(err) });
    }

    pub(super) fn device_index(&self, model: ModelId, device: &Device) -> usize {
        self.slots[model].policy.devices.iter().position(|d| d == device).unwrap_or(0)
    }

    /// Starts what can start: the copy of a model that churns (before the loads, which
    /// would otherwise take every gap it could use), loads (and the evictions they need),
    /// batches, then any other background preparation if the host is quiet.
    pub(super) fn pump(&mut self, now: Instant) {
        self.wake = None;
        self.plan_preparation();
        self.plan_loads(now);
        self.dispatch(now);
        self.hold_budgets(now);
        self.plan_preparation();
    }

    /// What a model's next request can expect to wait: the requests ahead of it times
    /// the measured time per request, plus the last load time if it must load. Before
    /// any request of it has finished, `retry_after` (the estimate of last resort), or
    /// the load if that is longer.
    pub fn expected_wait(&self, model: ModelId) -> Duration {
        let s = &self.slots[model];
        let load = if s.is_ready() { Duration::ZERO } else { s.last_load.unwrap_or(Duration::from_secs(1)) };
        let Some(per) = s.per_request else {
            // The first requests still running: a guess of the model's speed said
            // "retry in about 0.0s" ahead of two 37 s transcriptions.
            return self.config.retry_after.max(load);
        };
        let ahead = u32::try_from(s.queue.len()).unwrap_or(u32::MAX).saturating_add(1);
        per.saturating_mul(ahead) / s.policy.max_concurrency.max(1) + load
    }

    pub(super) fn queue_full_error(&self, model: ModelId) -> SnoozeError {
        let s = &self.slots[model];
        refusal::queue_full(s.name(), s.policy.max_queue, self.expected_wait(model))
    }

    pub(super) fn queue_timeout_error(&self, model: ModelId) -> SnoozeError {
        refusal::queue_timeout(self.slots[model].name(), self.config.queue_timeout, self.expected_wait(model))
    }

    pub(super) fn shutting_down_error(&self) -> SnoozeError {
        SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
            .retry_after(self.config.retry_after)
    }

    /// The admin view of every model. One whose files cannot be read is `failed` with
    /// the reason, as a failed load is: every request to it is refused until the files
    /// are fixed, so neither readiness nor the admin view may call it loadable.
    pub fn status(&self, now: Instant) -> Vec<ModelStatus> {
        let views = self.slots.iter().zip(&self.unreadable).map(|(s, unreadable)| {
            let mut view = s.status(now);
            if let Some(why) = unreadable {
                view.state = StateName::Failed;
                view.last_error = Some(why.clone());
            }
            view
        });
        views.collect()
    }
}
