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
mod plan;
mod queue;
mod refusal;
mod slot;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_queueing;

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

pub use queue::{Priority, Queued, Retry};
pub use slot::{ModelPolicy, ModelSlot, ModelStatus, SlotState, StateName};

use crate::{
    backend::{Device, LoadError},
    error::{ErrorKind, SnoozeError},
    pressure::PressureLevel,
    units::KeepAlive,
};

/// Index of a model, fixed at registration.
pub type ModelId = usize;
/// Identifies one waiting caller; chosen by the shell, unique while in flight.
pub type RequestId = u64;

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
    /// Asked for through the API.
    Requested,
    /// Emergency pressure or an explicit GC.
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
}

/// How a dispatched batch ended, as far as the scheduler cares (the shell answered
/// the requests of a finished batch itself).
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutcome {
    Done,
    /// The backend verified an allocation failure: nobody was answered; retry or refuse.
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
    /// A dispatched batch ended.
    RunFinished { model: ModelId, reqs: Vec<RequestId>, outcome: RunOutcome, took: Duration },
    /// A load ended. `measured`: bytes the load took, when the shell could measure it.
    LoadFinished { model: ModelId, result: Result<LoadMeasurement, LoadError>, took: Duration },
    /// An unload ended and its memory was given back.
    UnloadFinished { model: ModelId },
    /// A promotion ended: the model now serves from its fast form (or stays as it was).
    PromoteFinished { model: ModelId, result: Result<LoadMeasurement, LoadError> },
    /// Unload every idle model but `except` (pinned ones too when `include_pinned`);
    /// answered with [`Action::Collected`] once they are all gone.
    Collect { req: RequestId, except: Option<ModelId>, include_pinned: bool, reason: UnloadReason },
    /// Refuse new work from now on; waiting callers are refused.
    Shutdown,
    /// The memory pressure level (rule 8). Emergency unloads every idle, unpinned
    /// model; critical makes loads pay for themselves with evictions and refuses
    /// low-priority requests.
    Pressure(PressureLevel),
}

/// What a load took, as the shell measured it (`None` where it could not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadMeasurement {
    /// Resident bytes the model added (RSS delta for the host, NVML delta for a GPU).
    pub steady: Option<u64>,
    /// The most the load held at once.
    pub peak: Option<u64>,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start loading the model on the device (on a blocking thread).
    StartLoad { model: ModelId, device: Device },
    /// Load a second instance of a resident model in its fast form while the first keeps
    /// serving; swap them, then send `PromoteFinished`.
    StartPromote { model: ModelId, device: Device },
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
    /// when nothing else ran): its footprint grows by that, unless the config fixes
    /// its memory. Returns the new footprint.
    pub fn learn_pass(&mut self, model: ModelId, grew: u64) -> Option<u64> {
        let s = &mut self.slots[model];
        if s.policy.memory.is_some() {
            return None;
        }
        let SlotState::Ready { footprint, .. } = &mut s.state else { return None };
        *footprint = footprint.saturating_add(grew);
        s.measured_bytes = Some(*footprint);
        s.learned_bytes = Some(*footprint);
        Some(*footprint)
    }

    /// Memory given back on purpose (an unload or gc asked for, an emergency) stays
    /// given back: no model evicted earlier is preloaded into it, until a load evicts
    /// again.
    fn forget_evictions(&mut self) {
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

    /// Bytes accounted on a device: baseline + every resident, loading or unloading model.
    pub fn accounted(&self, device: &Device) -> u64 {
        let models: u64 = self.slots.iter().filter_map(|s| s.held_on(device)).sum();
        self.config.baselines.get(device).copied().unwrap_or(0) + models
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
            Event::RunFinished { model, reqs, outcome, took } => {
                self.on_run_finished(now, model, reqs, outcome, took)
            }
            Event::LoadFinished { model, result, took } => self.on_load_finished(now, model, result, took),
            Event::UnloadFinished { model } => self.on_unload_finished(now, model),
            Event::PromoteFinished { model, result } => self.on_promote_finished(model, result),
            Event::Collect { req, except, include_pinned, reason } => {
                self.forget_evictions();
                self.on_collect(req, except, include_pinned, reason)
            }
            Event::Shutdown => self.on_shutdown(),
            Event::Pressure(level) => {
                self.pressure = level;
                if level == PressureLevel::Emergency {
                    self.forget_evictions();
                    for id in 0..self.slots.len() {
                        if self.slots[id].idle().is_some() && !self.slots[id].policy.pinned {
                            self.begin_unload(id, UnloadReason::Pressure);
                        }
                    }
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

    fn push(&mut self, action: Action) {
        self.actions.push(action);
    }

    fn refuse(&mut self, req: RequestId, err: SnoozeError) {
        self.push(Action::Reply { req, result: Err(err) });
    }

    /// Why a model cannot be used right now, if it cannot.
    fn unavailable(&self, now: Instant, model: ModelId) -> Option<SnoozeError> {
        if self.shutting_down {
            return Some(self.shutting_down_error());
        }
        let s = &self.slots[model];
        if let Some(why) = &self.unreadable[model] {
            return Some(SnoozeError::new(
                ErrorKind::ModelFailed,
                format!("model '{}' cannot be loaded: {why}", s.policy.name),
            ));
        }
        match &s.state {
            SlotState::Failed { until, error } if *until > now => {
                let wait = *until - now;
                Some(
                    SnoozeError::new(
                        ErrorKind::ModelFailed,
                        format!(
                            "model '{}' failed and is backing off for {:.1}s more: {error}",
                            s.policy.name,
                            wait.as_secs_f64()
                        ),
                    )
                    .retry_after(wait),
                )
            }
            _ => None,
        }
    }

    fn on_submit(&mut self, now: Instant, sub: Submit) {
        let model = sub.model;
        if let Some(err) = self.unavailable(now, model) {
            return self.refuse(sub.req, err);
        }
        let s = &self.slots[model];
        let priority = sub.priority.unwrap_or(s.policy.priority);
        if priority == Priority::Low && self.pressure >= PressureLevel::Critical {
            return self.refuse(sub.req, refusal::low_priority_under_pressure(self.config.retry_after));
        }
        if s.queue.len() >= s.policy.max_queue {
            let err = self.queue_full_error(model);
            match self.slots[model].queue.pop_least_urgent_below(priority) {
                // A full queue makes room for a more urgent request by dropping the
                // newest of its least urgent ones.
                Some(dropped) => self.refuse(dropped.req, err),
                None => return self.refuse(sub.req, err),
            }
        }
        self.slots[model].last_request = Some(now);
        self.enqueue(
            model,
            priority,
            Queued { req: sub.req, rows: sub.rows, key: sub.key, since: now, retry: Retry::First },
        );
    }

    fn enqueue(&mut self, model: ModelId, priority: Priority, q: Queued) {
        let s = &mut self.slots[model];
        if matches!(s.state, SlotState::Failed { .. }) {
            s.state = SlotState::Unloaded;
        }
        if matches!(s.state, SlotState::Unloaded) && !s.wants_load() {
            s.device_index = 0;
        }
        s.queue.push(priority, q);
    }

    fn on_load(&mut self, now: Instant, req: RequestId, model: ModelId) {
        self.supersede_unload(model);
        if let Some(err) = self.unavailable(now, model) {
            return self.refuse(req, err);
        }
        let s = &mut self.slots[model];
        match s.state {
            SlotState::Ready { .. } => self.push(Action::Reply { req, result: Ok(()) }),
            _ => {
                if matches!(s.state, SlotState::Failed { .. }) {
                    s.state = SlotState::Unloaded;
                }
                if matches!(s.state, SlotState::Unloaded) && !s.wants_load() {
                    s.device_index = 0;
                }
                s.load_waiters.push((req, now));
            }
        }
    }

    fn on_unload(&mut self, req: RequestId, model: ModelId) {
        let s = &mut self.slots[model];
        match &s.state {
            SlotState::Unloaded | SlotState::Failed { .. } => {
                self.push(Action::Reply { req, result: Ok(()) })
            }
            SlotState::Ready { .. } if s.running == 0 => {
                s.unload_waiters.push(req);
                self.begin_unload(model, UnloadReason::Requested);
            }
            SlotState::Unloading { .. } => s.unload_waiters.push(req),
            // Runs in flight (or a load) end first; meanwhile nothing more is dispatched.
            _ => {
                s.unload_requested = true;
                s.unload_waiters.push(req);
            }
        }
    }

    fn on_cancel(&mut self, req: RequestId) {
        self.in_flight.remove(&req);
        for s in &mut self.slots {
            s.queue.remove(req);
            s.load_waiters.retain(|(r, _)| *r != req);
            s.unload_waiters.retain(|r| *r != req);
        }
    }

    fn on_collect(
        &mut self,
        req: RequestId,
        except: Option<ModelId>,
        include_pinned: bool,
        reason: UnloadReason,
    ) {
        let victims: Vec<ModelId> = (0..self.slots.len())
            .filter(|&id| Some(id) != except)
            .filter(|&id| {
                self.slots[id].idle().is_some() && (include_pinned || !self.slots[id].policy.pinned)
            })
            .collect();
        for &v in &victims {
            self.begin_unload(v, reason);
        }
        if victims.is_empty() {
            self.push(Action::Collected { req, models: Vec::new() });
        } else {
            self.collections.push(Collection { req, pending: victims.clone(), models: victims });
        }
    }

    fn on_load_finished(
        &mut self,
        now: Instant,
        model: ModelId,
        result: Result<LoadMeasurement, LoadError>,
        took: Duration,
    ) {
        let SlotState::Loading { device, .. } = self.slots[model].state.clone() else {
            debug_assert!(false, "load finished for a model that was not loading");
            return;
        };
        match result {
            Ok(measured) => self.became_ready(now, model, device, measured, took),
            Err(LoadError::OutOfMemory(msg)) => {
                // Verified OOM: make room by evicting one more idle model and retry.
                self.slots[model].state = SlotState::Unloaded;
                if !self.slots[model].wants_load() {
                    // A preload: nobody waits for it, and nothing is evicted for it.
                    return;
                }
                if let Some(victim) = self.lru_idle(&device, model, now).first().copied() {
                    self.slots[model].evicted_for += self.slots[victim].resident_bytes();
                    self.begin_unload(victim, UnloadReason::Evicted);
                } else {
                    let text = format!(
                        "model '{}' ran out of memory while loading on {device} and no idle model is left to evict: {msg}",
                        self.slots[model].policy.name
                    );
                    self.slots[model].last_error = Some(text.clone());
                    let err = SnoozeError::new(ErrorKind::InsufficientMemory, text)
                        .retry_after(self.config.retry_after);
                    self.fail_all(model, err);
                }
            }
            Err(LoadError::Failed(msg)) => {
                let s = &mut self.slots[model];
                s.failures += 1;
                s.last_error = Some(msg.clone());
                s.last_load = Some(took);
                let backoff = self.backoff(self.slots[model].failures);
                let s = &mut self.slots[model];
                s.state = SlotState::Failed { until: now + backoff, error: msg.clone() };
                let err = SnoozeError::new(
                    ErrorKind::ModelFailed,
                    format!("model '{}' failed to load: {msg}", s.policy.name),
                );
                self.fail_all(model, err);
            }
        }
    }

    fn became_ready(
        &mut self,
        now: Instant,
        model: ModelId,
        device: Device,
        measured: LoadMeasurement,
        took: Duration,
    ) {
        let s = &mut self.slots[model];
        s.loads += 1;
        s.failures = 0;
        s.evicted_for = 0;
        s.last_load = Some(took);
        s.last_error = None;
        if let Some(m) = measured.steady {
            s.measured_bytes = Some(m);
            s.learned_bytes = Some(m);
        }
        if let Some(p) = measured.peak {
            s.measured_peak_bytes = Some(p);
            s.learned_peak_bytes = Some(p);
        }
        let footprint = s.resident_bytes();
        s.evicted_at = None;
        s.fresh = true;
        s.batched_runs = 0;
        s.promoted = false;
        s.state = SlotState::Ready { device, last_used: now, loaded_at: now, footprint };
        // It serves what waited for it before anything may evict it.
        s.owed = s.queue.len();
        for (req, _) in std::mem::take(&mut s.load_waiters) {
            self.actions.push(Action::Reply { req, result: Ok(()) });
        }
        self.maybe_unload_after_work(model);
    }

    fn on_promote_finished(&mut self, model: ModelId, result: Result<LoadMeasurement, LoadError>) {
        let s = &mut self.slots[model];
        s.promoting = None;
        // Failed or not, not tried again until the next load.
        s.promoted = true;
        match result {
            Ok(measured) => {
                if let (Some(bytes), SlotState::Ready { footprint, .. }) = (measured.steady, &mut s.state) {
                    if s.policy.memory.is_none() {
                        *footprint = bytes;
                        s.measured_bytes = Some(bytes);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(model = %s.policy.name, error = %e, "promotion failed: the model keeps serving as it was")
            }
        }
        self.maybe_unload_after_work(model);
    }

    fn on_unload_finished(&mut self, now: Instant, model: ModelId) {
        let s = &mut self.slots[model];
        let reason = match &s.state {
            SlotState::Unloading { reason, .. } => Some(*reason),
            _ => None,
        };
        debug_assert!(reason.is_some(), "unload finished for a model that was not unloading");
        s.state = SlotState::Unloaded;
        s.draining = false;
        s.owed = 0;
        s.device_index = 0;
        self.answer_unload_waiters(model);
        for c in &mut self.collections {
            c.pending.retain(|m| *m != model);
        }
        let (done, open): (Vec<Collection>, Vec<Collection>) =
            std::mem::take(&mut self.collections).into_iter().partition(|c| c.pending.is_empty());
        self.collections = open;
        for c in done {
            self.push(Action::Collected { req: c.req, models: c.models });
        }
        if let Some(why) = self.slots[model].poisoned.take() {
            // Like a failed load: back off, so a model that panics on every request is
            // not reloaded for every request.
            let backoff = self.backoff(self.slots[model].panics);
            let s = &mut self.slots[model];
            s.state = SlotState::Failed { until: now + backoff, error: why.clone() };
            let err = SnoozeError::new(
                ErrorKind::ModelFailed,
                format!(
                    "model '{}' was unloaded after it failed ({why}); it reloads in {:.1}s",
                    s.policy.name,
                    backoff.as_secs_f64()
                ),
            )
            .retry_after(backoff);
            self.fail_all(model, err);
            return;
        }
        if reason != Some(UnloadReason::Failed) {
            // Left memory normally: earlier panics no longer count toward the backoff.
            self.slots[model].panics = 0;
        }
        if self.shutting_down {
            let err = self.shutting_down_error();
            self.fail_all(model, err);
        }
    }

    fn on_shutdown(&mut self) {
        self.shutting_down = true;
        let err = self.shutting_down_error();
        for id in 0..self.slots.len() {
            if !self.slots[id].is_ready() {
                self.fail_all(id, err.clone());
            } else {
                let waiting: Vec<Queued> = self.slots[id].queue.drain();
                for q in waiting {
                    self.refuse(q.req, err.clone());
                }
            }
            if self.slots[id].idle().is_some() {
                self.begin_unload(id, UnloadReason::Shutdown);
            }
        }
    }

    /// Refuses everything waiting for the model (requests and loads) and answers its
    /// pending unloads: the model is not going to be in memory for them.
    fn fail_all(&mut self, model: ModelId, err: SnoozeError) {
        let s = &mut self.slots[model];
        let waiting: Vec<RequestId> = s
            .queue
            .drain()
            .into_iter()
            .map(|q| q.req)
            .chain(std::mem::take(&mut s.load_waiters).into_iter().map(|(r, _)| r))
            .collect();
        for req in waiting {
            self.actions.push(Action::Reply { req, result: Err(err.clone()) });
        }
        self.answer_unload_waiters(model);
    }

    /// First backoff, doubled per consecutive failure, capped.
    fn backoff(&self, failures: u32) -> Duration {
        self.config
            .backoff_base
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(self.config.backoff_max)
    }

    /// The model is not in memory any more (or never got there): every pending unload
    /// is done, and the request for one does not outlive this load.
    fn answer_unload_waiters(&mut self, model: ModelId) {
        let s = &mut self.slots[model];
        s.unload_requested = false;
        for req in std::mem::take(&mut s.unload_waiters) {
            self.actions.push(Action::Reply { req, result: Ok(()) });
        }
    }

    /// A load asked for after an unload wins: the unload is called off and its callers
    /// are told so rather than left waiting for an unload that will not come.
    fn supersede_unload(&mut self, model: ModelId) {
        let s = &mut self.slots[model];
        if !s.unload_requested {
            return;
        }
        s.unload_requested = false;
        let err = SnoozeError::new(
            ErrorKind::Conflict,
            format!("the unload of model '{}' was called off by a later load request", s.policy.name),
        );
        for req in std::mem::take(&mut s.unload_waiters) {
            self.actions.push(Action::Reply { req, result: Err(err.clone()) });
        }
    }

    /// Once nothing runs and nothing waits, a pending unload, a panic, shutdown or a
    /// zero keep-alive takes the model out of memory.
    fn maybe_unload_after_work(&mut self, model: ModelId) {
        let s = &self.slots[model];
        if !s.is_ready() || s.running > 0 {
            return;
        }
        if s.poisoned.is_some() {
            return self.begin_unload(model, UnloadReason::Failed);
        }
        if s.unload_requested {
            return self.begin_unload(model, UnloadReason::Requested);
        }
        if !s.queue.is_empty() {
            return;
        }
        if self.shutting_down {
            self.begin_unload(model, UnloadReason::Shutdown);
        } else if s.policy.keep_alive == KeepAlive::For(Duration::ZERO) && !s.policy.pinned {
            self.begin_unload(model, UnloadReason::Idle);
        }
    }

    /// Moves a Ready model with nothing running to Unloading.
    fn begin_unload(&mut self, model: ModelId, reason: UnloadReason) {
        let s = &mut self.slots[model];
        let SlotState::Ready { device, footprint, .. } = &s.state else { return };
        // A promotion in flight ends first (then `on_promote_finished` looks again).
        if s.running > 0 || s.promoting.is_some() {
            return;
        }
        let (device, bytes) = (device.clone(), *footprint);
        if reason == UnloadReason::Evicted {
            s.evictions += 1;
        }
        s.state = SlotState::Unloading { device: device.clone(), footprint: bytes, reason };
        self.actions.push(Action::StartUnload { model, device, reason, bytes });
    }

    fn device_index(&self, model: ModelId, device: &Device) -> usize {
        self.slots[model].policy.devices.iter().position(|d| d == device).unwrap_or(0)
    }

    /// Starts what can start: loads (and the evictions they need), then batches.
    fn pump(&mut self, now: Instant) {
        self.wake = None;
        self.plan_loads(now);
        self.dispatch(now);
    }

    /// What a model's next request can expect to wait: the requests ahead of it times
    /// the measured time per request, plus the last load time if it must load.
    pub fn expected_wait(&self, model: ModelId) -> Duration {
        let s = &self.slots[model];
        let per = s.per_request.unwrap_or(Duration::from_millis(10));
        let ahead = u32::try_from(s.queue.len()).unwrap_or(u32::MAX).saturating_add(1);
        let mut wait = per.saturating_mul(ahead) / s.policy.max_concurrency.max(1);
        if !s.is_ready() {
            wait += s.last_load.unwrap_or(Duration::from_secs(1));
        }
        wait
    }

    fn queue_full_error(&self, model: ModelId) -> SnoozeError {
        let s = &self.slots[model];
        refusal::queue_full(s.name(), s.policy.max_queue, self.expected_wait(model))
    }

    fn queue_timeout_error(&self, model: ModelId) -> SnoozeError {
        refusal::queue_timeout(self.slots[model].name(), self.config.queue_timeout, self.expected_wait(model))
    }

    fn shutting_down_error(&self) -> SnoozeError {
        SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
            .retry_after(self.config.retry_after)
    }

    /// The admin view of every model.
    pub fn status(&self, now: Instant) -> Vec<ModelStatus> {
        self.slots.iter().map(|s| s.status(now)).collect()
    }
}
