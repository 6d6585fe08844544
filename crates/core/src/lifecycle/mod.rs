//! The lifecycle state machine: which model is loaded where, and when that changes.
//!
//! Sans-IO, in the quinn-proto shape: the shell calls [`Scheduler::handle`] with the
//! current instant and an [`Event`], carries out the [`Action`]s it gets back, and
//! calls [`Scheduler::handle_timeout`] at [`Scheduler::next_deadline`]. Nothing here
//! reads a clock, sleeps or touches a backend, so every rule is tested with
//! hand-built instants (see `tests.rs`).
//!
//! Per model a [`ModelSlot`]; per device a FIFO of models waiting to load. Only one
//! load runs per device, and none starts while an unload on that device is still
//! giving memory back, so the memory check before a load and the measurement after
//! it see a quiet device.

mod plan;
mod slot;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, Instant},
};

pub use slot::{ModelPolicy, ModelSlot, ModelStatus, SlotState, StateName};

use crate::{
    backend::{Device, LoadError},
    error::{ErrorKind, SnoozeError},
    pressure::PressureLevel,
    units::KeepAlive,
};
use plan::Plan;

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
    /// Retry-After for refusals with no better-known time.
    pub retry_after: Duration,
    /// First backoff after a failed load; doubles per failure up to `backoff_max`.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
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

/// What happened, as the shell tells it.
#[derive(Debug)]
pub enum Event {
    /// A request wants a lease on the model (granted when it is ready).
    Acquire { req: RequestId, model: ModelId },
    /// Load without taking a lease (repository API, preload); replied when ready.
    Load { req: RequestId, model: ModelId },
    /// Unload as soon as no request holds it; replied when unloaded.
    Unload { req: RequestId, model: ModelId },
    /// A lease ended (the request completed).
    Release { model: ModelId },
    /// A waiting caller went away (timeout, disconnect).
    Cancel { req: RequestId },
    /// The backend panicked while running the model: stop granting leases, unload it
    /// once they end, then back off before the next load.
    Poisoned { model: ModelId, reason: String },
    /// A load ended. `measured`: bytes the load took, when the shell could measure it.
    LoadFinished { model: ModelId, result: Result<LoadMeasurement, LoadError>, took: Duration },
    /// An unload ended and its memory was given back.
    UnloadFinished { model: ModelId },
    /// Unload every idle model (pinned ones too when `include_pinned`); replied at once.
    UnloadIdle { req: RequestId, include_pinned: bool, reason: UnloadReason },
    /// Refuse new work from now on; waiting callers are refused.
    Shutdown,
    /// The memory pressure level changed (rule 8). Emergency unloads every idle,
    /// unpinned model; critical makes loads pay for themselves with evictions.
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
    /// Drop the model, trim the heap, then send `UnloadFinished`.
    StartUnload { model: ModelId, device: Device, reason: UnloadReason, bytes: u64 },
    /// The caller now holds a lease (already counted).
    Grant { req: RequestId, model: ModelId },
    /// Answer a `Load` / `Unload` / `UnloadIdle`, or refuse an `Acquire`.
    Reply { req: RequestId, result: Result<(), SnoozeError> },
}

/// The state machine. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    slots: Vec<ModelSlot>,
    queues: BTreeMap<Device, VecDeque<ModelId>>,
    available: BTreeMap<Device, u64>,
    shutting_down: bool,
    pressure: PressureLevel,
    actions: Vec<Action>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config,
            slots: Vec::new(),
            queues: BTreeMap::new(),
            available: BTreeMap::new(),
            shutting_down: false,
            pressure: PressureLevel::Normal,
            actions: Vec::new(),
        }
    }

    /// Adds a model; returns its id.
    pub fn register(&mut self, policy: ModelPolicy) -> ModelId {
        self.slots.push(ModelSlot::new(policy));
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

    /// Records a fresh probe reading of what `device` can still allocate. Not an event:
    /// a reading decides nothing by itself, it is consulted by the next admission.
    pub fn observe_memory(&mut self, device: Device, bytes: u64) {
        self.available.insert(device, bytes);
    }

    /// Bytes accounted on a device: baseline + every resident, loading or unloading model.
    pub fn accounted(&self, device: &Device) -> u64 {
        let models: u64 = self.slots.iter().filter_map(|s| s.held_on(device)).sum();
        self.config.baselines.get(device).copied().unwrap_or(0) + models
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

    /// Models holding memory or leases (for shutdown: are we done?).
    pub fn busy(&self) -> bool {
        self.slots.iter().any(|s| !matches!(s.state, SlotState::Unloaded | SlotState::Failed { .. }))
    }

    /// Feeds one event; returns what to do.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        match event {
            Event::Acquire { req, model } => self.on_want(now, model, slot::Waiter::Lease(req)),
            Event::Load { req, model } => {
                self.supersede_unload(model);
                self.on_want(now, model, slot::Waiter::Load(req))
            }
            Event::Unload { req, model } => self.on_unload(now, req, model),
            Event::Release { model } => self.on_release(now, model),
            Event::Cancel { req } => {
                for s in &mut self.slots {
                    s.waiters.retain(|w| w.req() != req);
                    s.unload_waiters.retain(|w| *w != req);
                }
            }
            Event::Poisoned { model, reason } => {
                let s = &mut self.slots[model];
                if matches!(s.state, SlotState::Ready { .. }) && s.poisoned.is_none() {
                    s.panics += 1;
                    s.last_error = Some(reason.clone());
                    s.poisoned = Some(reason);
                    self.begin_unload(model, UnloadReason::Failed);
                }
            }
            Event::LoadFinished { model, result, took } => self.on_load_finished(now, model, result, took),
            Event::UnloadFinished { model } => self.on_unload_finished(now, model),
            Event::UnloadIdle { req, include_pinned, reason } => {
                for id in 0..self.slots.len() {
                    let s = &self.slots[id];
                    if s.idle().is_some() && (include_pinned || !s.policy.pinned) {
                        self.begin_unload(id, reason);
                    }
                }
                self.push(Action::Reply { req, result: Ok(()) });
            }
            Event::Shutdown => self.on_shutdown(),
            Event::Pressure(level) => {
                self.pressure = level;
                if level == PressureLevel::Emergency {
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
        self.slots.iter().filter_map(|s| s.idle_deadline()).min()
    }

    /// Unloads every model whose keep-alive ran out by `now`.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Action> {
        for id in 0..self.slots.len() {
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

    fn on_want(&mut self, now: Instant, model: ModelId, waiter: slot::Waiter) {
        if self.shutting_down {
            let err = SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
                .retry_after(self.config.retry_after);
            return self.push(Action::Reply { req: waiter.req(), result: Err(err) });
        }
        let s = &mut self.slots[model];
        let closed = s.closed_to_new_leases();
        match &mut s.state {
            // Waits for the pending unload, then reloads (see `on_unload_finished`).
            SlotState::Ready { .. } if closed => s.waiters.push(waiter),
            SlotState::Ready { leases, .. } => {
                if let slot::Waiter::Lease(req) = waiter {
                    *leases += 1;
                    self.push(Action::Grant { req, model });
                } else {
                    self.push(Action::Reply { req: waiter.req(), result: Ok(()) });
                }
            }
            SlotState::Queued { .. } | SlotState::Loading { .. } | SlotState::Unloading { .. } => {
                s.waiters.push(waiter);
            }
            SlotState::Failed { until, error, .. } if *until > now => {
                let wait = *until - now;
                let err = SnoozeError::new(
                    ErrorKind::ModelFailed,
                    format!(
                        "model '{}' failed to load and is backing off for {:.1}s more: {error}",
                        s.policy.name,
                        wait.as_secs_f64()
                    ),
                )
                .retry_after(wait);
                self.push(Action::Reply { req: waiter.req(), result: Err(err) });
            }
            SlotState::Unloaded | SlotState::Failed { .. } => {
                s.waiters.push(waiter);
                self.enqueue(model, 0);
            }
        }
    }

    fn enqueue(&mut self, model: ModelId, device_index: usize) {
        let device = self.slots[model].policy.devices[device_index].clone();
        self.slots[model].state = SlotState::Queued { device_index };
        self.queues.entry(device).or_default().push_back(model);
    }

    fn on_unload(&mut self, now: Instant, req: RequestId, model: ModelId) {
        let s = &mut self.slots[model];
        match &s.state {
            SlotState::Unloaded | SlotState::Failed { .. } => {
                self.push(Action::Reply { req, result: Ok(()) });
            }
            SlotState::Ready { leases: 0, .. } => {
                s.unload_waiters.push(req);
                self.begin_unload(model, UnloadReason::Requested);
            }
            _ => {
                s.unload_requested = true;
                s.unload_waiters.push(req);
            }
        }
        let _ = now;
    }

    fn on_release(&mut self, now: Instant, model: ModelId) {
        let s = &mut self.slots[model];
        let SlotState::Ready { leases, last_used, .. } = &mut s.state else {
            debug_assert!(false, "release of a model that is not ready");
            return;
        };
        *leases = leases.saturating_sub(1);
        *last_used = now;
        if *leases > 0 {
            return;
        }
        if s.poisoned.is_some() {
            self.begin_unload(model, UnloadReason::Failed);
        } else if s.unload_requested {
            self.begin_unload(model, UnloadReason::Requested);
        } else if self.shutting_down {
            self.begin_unload(model, UnloadReason::Shutdown);
        } else if s.policy.keep_alive == KeepAlive::For(Duration::ZERO) && !s.policy.pinned {
            self.begin_unload(model, UnloadReason::Idle);
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
            Ok(measured) => {
                let s = &mut self.slots[model];
                s.loads += 1;
                s.failures = 0;
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
                let mut leases = 0;
                for w in std::mem::take(&mut s.waiters) {
                    match w {
                        slot::Waiter::Lease(req) => {
                            leases += 1;
                            self.actions.push(Action::Grant { req, model });
                        }
                        slot::Waiter::Load(req) => self.actions.push(Action::Reply { req, result: Ok(()) }),
                    }
                }
                let s = &mut self.slots[model];
                s.state = SlotState::Ready { device, leases, last_used: now, loaded_at: now, footprint };
                if leases == 0 && (s.unload_requested || self.shutting_down) {
                    let reason =
                        if self.shutting_down { UnloadReason::Shutdown } else { UnloadReason::Requested };
                    self.begin_unload(model, reason);
                }
            }
            Err(LoadError::OutOfMemory(msg)) => {
                // Verified OOM: make room by evicting one more idle model and retry.
                if let Some(victim) = self.lru_idle(&device, model, now, true).first().copied() {
                    self.begin_unload(victim, UnloadReason::Evicted);
                    let index = self.device_index(model, &device);
                    self.slots[model].state = SlotState::Queued { device_index: index };
                    self.queues.entry(device).or_default().push_front(model);
                } else {
                    let s = &mut self.slots[model];
                    let text = format!(
                        "model '{}' ran out of memory while loading on {device} and no idle model is left to evict: {msg}",
                        s.policy.name
                    );
                    s.last_error = Some(text.clone());
                    s.state = SlotState::Unloaded;
                    let err = SnoozeError::new(ErrorKind::InsufficientMemory, text)
                        .retry_after(self.config.retry_after);
                    self.fail_waiters(model, err);
                    self.answer_unload_waiters(model);
                }
            }
            Err(LoadError::Failed(msg)) => {
                self.slots[model].failures += 1;
                let backoff = self.backoff(self.slots[model].failures);
                let s = &mut self.slots[model];
                s.last_error = Some(msg.clone());
                s.last_load = Some(took);
                s.state = SlotState::Failed { until: now + backoff, error: msg.clone() };
                let err = SnoozeError::new(
                    ErrorKind::ModelFailed,
                    format!("model '{}' failed to load: {msg}", s.policy.name),
                );
                self.fail_waiters(model, err);
                self.answer_unload_waiters(model);
            }
        }
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
        // Requests that queued behind the unload can be served now.
        if let SlotState::Ready { leases, .. } = &mut s.state {
            let mut granted = 0;
            for w in std::mem::take(&mut s.waiters) {
                match w {
                    slot::Waiter::Lease(req) => {
                        granted += 1;
                        self.actions.push(Action::Grant { req, model });
                    }
                    slot::Waiter::Load(req) => self.actions.push(Action::Reply { req, result: Ok(()) }),
                }
            }
            *leases += granted;
        }
    }

    fn on_unload_finished(&mut self, now: Instant, model: ModelId) {
        let s = &mut self.slots[model];
        let reason = match &s.state {
            SlotState::Unloading { reason, .. } => Some(*reason),
            _ => None,
        };
        debug_assert!(reason.is_some(), "unload finished for a model that was not unloading");
        s.state = SlotState::Unloaded;
        self.answer_unload_waiters(model);
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
            self.fail_waiters(model, err);
            return;
        }
        if reason != Some(UnloadReason::Failed) {
            // Left memory normally: earlier panics no longer count toward the backoff.
            self.slots[model].panics = 0;
        }
        if !self.slots[model].waiters.is_empty() {
            if self.shutting_down {
                let err = SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
                    .retry_after(self.config.retry_after);
                self.fail_waiters(model, err);
            } else {
                self.enqueue(model, 0);
            }
        }
    }

    fn on_shutdown(&mut self) {
        self.shutting_down = true;
        let err = SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
            .retry_after(self.config.retry_after);
        for queue in std::mem::take(&mut self.queues).into_values() {
            for model in queue {
                self.slots[model].state = SlotState::Unloaded;
                self.fail_waiters(model, err.clone());
                self.answer_unload_waiters(model);
            }
        }
        for id in 0..self.slots.len() {
            if self.slots[id].idle().is_some() {
                self.begin_unload(id, UnloadReason::Shutdown);
            }
        }
    }

    fn fail_waiters(&mut self, model: ModelId, err: SnoozeError) {
        for w in std::mem::take(&mut self.slots[model].waiters) {
            self.actions.push(Action::Reply { req: w.req(), result: Err(err.clone()) });
        }
    }

    /// Moves a Ready model with no leases to Unloading.
    fn begin_unload(&mut self, model: ModelId, reason: UnloadReason) {
        let s = &mut self.slots[model];
        let SlotState::Ready { device, leases: 0, footprint, .. } = &s.state else {
            return;
        };
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

    /// Starts what can start: per device, the head of the queue loads, evicts or is refused.
    fn pump(&mut self, now: Instant) {
        // A refusal may move a model to another device's queue: go round until quiet.
        while self.pump_once(now) {}
    }

    /// Returns true if a model moved to another device's queue.
    fn pump_once(&mut self, now: Instant) -> bool {
        let mut moved = false;
        let devices: Vec<Device> = self.queues.keys().cloned().collect();
        for device in devices {
            loop {
                let busy = self.slots.iter().any(|s| s.busy_on(&device));
                let Some(&model) = self.queues.get(&device).and_then(|q| q.front()) else { break };
                if busy {
                    break;
                }
                match self.plan(model, &device, now) {
                    Plan::Load => {
                        self.pop(&device);
                        self.slots[model].evicted_for = 0;
                        let reserved = self.slots[model].admission_bytes().unwrap_or(0);
                        self.slots[model].state = SlotState::Loading { device: device.clone(), reserved };
                        self.push(Action::StartLoad { model, device: device.clone() });
                        break;
                    }
                    Plan::Evict(victims) => {
                        for v in victims {
                            self.slots[model].evicted_for += self.slots[v].resident_bytes();
                            self.begin_unload(v, UnloadReason::Evicted);
                        }
                        break;
                    }
                    Plan::Refuse(err) => {
                        self.pop(&device);
                        self.slots[model].evicted_for = 0;
                        let next = self.device_index(model, &device) + 1;
                        let s = &mut self.slots[model];
                        if next < s.policy.devices.len() && s.policy.cpu_fallback {
                            tracing::info!(model = %s.policy.name, from = %device, to = %s.policy.devices[next], reason = %err, "falling back to the next device");
                            self.enqueue(model, next);
                            moved = true;
                        } else {
                            s.state = SlotState::Unloaded;
                            s.last_error = Some(err.message.clone());
                            self.fail_waiters(model, err);
                            self.answer_unload_waiters(model);
                        }
                    }
                }
            }
        }
        moved
    }

    fn pop(&mut self, device: &Device) {
        if let Some(q) = self.queues.get_mut(device) {
            q.pop_front();
        }
    }

    /// The admin view of every model.
    pub fn status(&self, now: Instant) -> Vec<ModelStatus> {
        self.slots.iter().map(|s| s.status(now)).collect()
    }
}
