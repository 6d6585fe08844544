//! The actor: the one task that owns the [`Scheduler`]. It waits on three things —
//! a command from a handle or a finished effect, the scheduler's next deadline, the
//! pressure monitor's tick — turns each into an event, and hands the scheduler's
//! actions to `effects`. Everything it learns on the way (a load's measured
//! footprint, a run that left memory behind) is recorded here.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::{mpsc, oneshot, watch};

use super::{effects::sleep_until, Command, Loaded, UnitReply, UnloadAudit, PASS_GROWTH_FLOOR};
use crate::{
    backend::{Backend, Device, LoadError, Weights},
    error::{ErrorKind, SnoozeError},
    events::{metric, EventKind, EventLog},
    execution::{BatchEnd, Job},
    learned::{FootprintStore, LearnedFootprint},
    lifecycle::{
        Action, Event, LoadMeasurement, ModelId, Prepared, RequestId, Resume, RunOutcome, Scheduler,
        UnloadReason,
    },
    memory::{MemoryProbe, MemorySnapshot},
    pressure::{MemoryReading, PressureLevel, PressureState, Thresholds},
    tensor::ModelSignature,
    units::format_bytes,
};

pub(super) struct Actor {
    pub(super) scheduler: Scheduler,
    pub(super) backends: Vec<(Arc<dyn Backend>, PathBuf, Weights)>,
    pub(super) fingerprints: Vec<String>,
    /// What the transports see of each model's signature (see `refresh_files`).
    pub(super) signatures: Vec<Arc<RwLock<Result<ModelSignature, String>>>>,
    pub(super) store: Option<Arc<FootprintStore>>,
    pub(super) loaded: HashMap<ModelId, Loaded>,
    pub(super) audit: Arc<Mutex<UnloadAudit>>,
    pub(super) events: Arc<EventLog>,
    /// Submitted requests not yet answered, with their data.
    pub(super) jobs: HashMap<RequestId, Job>,
    pub(super) replies: HashMap<RequestId, UnitReply>,
    pub(super) collections: HashMap<RequestId, oneshot::Sender<Vec<ModelId>>>,
    pub(super) tx: mpsc::UnboundedSender<Command>,
    pub(super) rx: mpsc::UnboundedReceiver<Command>,
    pub(super) drained: watch::Sender<bool>,
    pub(super) probe: Arc<dyn MemoryProbe>,
    pub(super) gpu_probes: Vec<(Device, Arc<dyn MemoryProbe>)>,
    pub(super) intra_op_threads: usize,
    pub(super) pressure: Arc<Mutex<PressureState>>,
    pub(super) level: watch::Sender<PressureLevel>,
    pub(super) thresholds: Thresholds,
    pub(super) check_interval: Duration,
    pub(super) preparer: Arc<dyn crate::backend::Preparer>,
    /// The model whose preparation the preparer was asked to stop, until it ends.
    pub(super) stop_asked: Option<ModelId>,
}

enum Wake {
    Command(Command),
    Deadline,
    Tick,
}

pub(super) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Actor {
    pub(super) async fn run(mut self) {
        self.refresh_probe();
        let mut ticker = tokio::time::interval(self.check_interval.max(Duration::from_millis(10)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = self.scheduler.next_deadline();
            let wake = tokio::select! {
                cmd = self.rx.recv() => match cmd {
                    Some(cmd) => Wake::Command(cmd),
                    None => return,
                },
                _ = sleep_until(deadline) => Wake::Deadline,
                _ = ticker.tick() => Wake::Tick,
            };
            let actions = match wake {
                Wake::Command(cmd) => self.command(cmd),
                Wake::Deadline => self.scheduler.handle_timeout(now()),
                Wake::Tick => {
                    // A load waiting for memory the probe did not show may fit now.
                    let mut actions = self.check_pressure();
                    actions.extend(self.scheduler.handle_timeout(now()));
                    actions
                }
            };
            self.execute(actions);
            self.drained.send_replace(self.scheduler.is_shutting_down() && !self.scheduler.busy());
        }
    }

    /// Reads the probe, records the reading and tells the scheduler if the level moved.
    fn check_pressure(&mut self) -> Vec<Action> {
        let snap = self.refresh_probe();
        let budget = self.scheduler.budget(&Device::Cpu);
        let reading = MemoryReading {
            unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            process_bytes: snap.process_bytes,
            available_bytes: snap.available_bytes,
            accounted_bytes: self.scheduler.accounted(&Device::Cpu),
            budget_bytes: budget,
            level: self.thresholds.level(snap.process_bytes, budget),
            models: self.scheduler.holding(&Device::Cpu),
        };
        let level = self.pressure.lock().unwrap_or_else(|p| p.into_inner()).record(reading);
        let mut actions = Vec::new();
        // Emergency is re-applied at every reading: models that became idle since the
        // last one are unloaded too.
        if level != self.scheduler.pressure() || level == PressureLevel::Emergency {
            self.level.send_replace(level);
            // A load must now be paid for by evictions: what was kept goes first.
            if level >= PressureLevel::Critical {
                let dropped = crate::kept::drop_all();
                if dropped > 0 {
                    tracing::info!(
                        dropped,
                        ?level,
                        "memory pressure: parsed files kept between loads dropped"
                    );
                }
            }
            // What brings the process back under the critical threshold.
            let critical = (budget as f64 * self.thresholds.critical) as u64;
            let excess = snap.process_bytes.saturating_sub(critical).saturating_add(1);
            if level == PressureLevel::Emergency {
                tracing::warn!(
                    process_bytes = snap.process_bytes,
                    excess,
                    "memory pressure emergency: unloading idle, unpinned models until the excess is covered"
                );
            }
            actions.extend(self.scheduler.handle(now(), Event::Pressure { level, excess }));
        }
        actions
    }

    /// Gives the scheduler fresh readings of every device; returns the host's.
    fn refresh_probe(&mut self) -> MemorySnapshot {
        let snap = self.probe.snapshot();
        self.scheduler.observe_memory(Device::Cpu, snap.available_bytes);
        for (device, probe) in &self.gpu_probes {
            self.scheduler.observe_memory(device.clone(), probe.snapshot().available_bytes);
        }
        snap
    }

    pub(super) fn device_probe(&self, device: &Device) -> Option<Arc<dyn MemoryProbe>> {
        self.gpu_probes.iter().find(|(d, _)| d == device).map(|(_, p)| p.clone())
    }

    /// A model not in memory whose files were replaced since they were read (a new
    /// version copied over the old, then an unload) is read again before it loads: its
    /// signature (what requests are checked against), its estimate, its preparations;
    /// what was measured on the old files is dropped. Costs a few `stat` calls.
    fn refresh_files(&mut self, model: ModelId) -> bool {
        if self.loaded.contains_key(&model) || !self.scheduler.slot(model).is_unloaded() {
            return false;
        }
        let (backend, path, weights) = &self.backends[model];
        let now = crate::learned::model_fingerprint(&**backend, path, *weights);
        if now == self.fingerprints[model] {
            return false;
        }
        let slot = self.scheduler.slot(model);
        let name = slot.policy.name.clone();
        let signature = backend.signature(path).map_err(|e| e.to_string());
        let estimate = backend.estimate(path, *weights);
        let learned = self
            .store
            .as_ref()
            .and_then(|s| s.get(&name, &now))
            .map_or((None, None), |l| (l.steady_bytes, l.peak_bytes));
        let preparations = super::preparations(&**backend, path, *weights, slot.policy.promotable);
        tracing::info!(
            model = %name,
            estimate = ?estimate.steady_bytes,
            readable = signature.is_ok(),
            "the model's files changed since they were read: their signature and estimate are read again"
        );
        self.scheduler.files_replaced(
            model,
            (estimate.steady_bytes, estimate.peak_bytes),
            learned,
            preparations,
        );
        self.scheduler.observe_files(model, signature.as_ref().err().cloned());
        *self.signatures[model].write().unwrap_or_else(|p| p.into_inner()) = signature;
        self.fingerprints[model] = now;
        true
    }

    /// A model whose files were unreadable is checked again on each request (cheap:
    /// only the header is parsed), so a fixed file is picked up without a restart.
    fn recheck_files(&mut self, model: ModelId) {
        if !self.scheduler.is_unreadable(model) {
            return;
        }
        let (backend, path, _) = &self.backends[model];
        let now_readable = backend.signature(path).err().map(|e| e.to_string());
        if let Some(e) = &now_readable {
            let name = &self.scheduler.slot(model).policy.name;
            tracing::warn!(model = %name, error = %e, "refused: the model's files cannot be read");
        }
        self.scheduler.observe_files(model, now_readable);
    }

    /// Takes jobs back from a run (to retry or to continue), dropping those whose
    /// callers went away; returns how each remaining one queues again.
    fn keep_jobs(&mut self, jobs: Vec<(RequestId, Job)>) -> Vec<Resume> {
        let mut kept = Vec::with_capacity(jobs.len());
        for (req, job) in jobs {
            if job.reply.is_closed() {
                continue;
            }
            let (rows, key) = job.payload.rows_and_key(true);
            kept.push(Resume { req, rows, key, size: job.payload.work_size() });
            self.jobs.insert(req, job);
        }
        kept
    }

    fn command(&mut self, cmd: Command) -> Vec<Action> {
        let event = match cmd {
            Command::Submit { sub, job } => {
                let _ = self.refresh_files(sub.model);
                self.recheck_files(sub.model);
                if !self.scheduler.slot(sub.model).is_ready() {
                    self.refresh_probe();
                }
                self.jobs.insert(sub.req, job);
                Event::Submit(sub)
            }
            Command::Load { req, model, reply } => {
                let _ = self.refresh_files(model);
                self.recheck_files(model);
                self.refresh_probe();
                self.replies.insert(req, reply);
                Event::Load { req, model }
            }
            Command::Unload { req, model, reply } => {
                self.replies.insert(req, reply);
                Event::Unload { req, model }
            }
            Command::Collect { req, except, reply } => {
                self.collections.insert(req, reply);
                // `POST /admin/memory/gc`: asked for, not the memory pressure's emergency unload.
                Event::Collect { req, except, include_pinned: false, reason: UnloadReason::Requested }
            }
            Command::Status { reply } => {
                let _ = reply.send(self.scheduler.status(now()));
                return Vec::new();
            }
            Command::Accounted { reply } => {
                let _ = reply.send(self.scheduler.accounted(&Device::Cpu));
                return Vec::new();
            }
            Command::Refresh { model, reply } => {
                let _ = reply.send(self.refresh_files(model));
                return Vec::new();
            }
            Command::Cancel { req } => {
                self.jobs.remove(&req);
                self.replies.remove(&req);
                Event::Cancel { req }
            }
            Command::RunDone { model, reqs, end, took, grew } => {
                if let Some(kept) = grew.kept.filter(|g| *g >= PASS_GROWTH_FLOOR) {
                    self.learn_pass(model, kept);
                }
                if let Some(transient) = grew.transient {
                    self.learn_sized(model, transient, &reqs);
                }
                if let Some(transient) = grew.transient.filter(|g| *g >= PASS_GROWTH_FLOOR) {
                    self.learn_transient(model, transient);
                }
                // Back in the queue (task jobs with more slices) or for a retry (out of
                // memory), unless their callers went away meanwhile.
                let (outcome, continuing) = match end {
                    BatchEnd::Done { continuing } => (RunOutcome::Done, continuing),
                    BatchEnd::Panicked(why) => (RunOutcome::Panicked(why), Vec::new()),
                    BatchEnd::OutOfMemory { message, jobs, continuing } => {
                        self.keep_jobs(jobs);
                        (RunOutcome::OutOfMemory(message), continuing)
                    }
                };
                let continuing = self.keep_jobs(continuing);
                Event::RunFinished { model, reqs, outcome, took, continuing }
            }
            Command::LoadDone { model, result, took, form } => {
                let result = self.record_load(model, result, took, form);
                let mut actions = self.check_pressure();
                actions.extend(self.scheduler.handle(now(), Event::LoadFinished { model, result, took }));
                return actions;
            }
            Command::UnloadDone { model } => {
                // Under critical pressure a load must pay for itself with evictions; once an
                // emergency has unloaded the idle models nothing may be left to evict, so the
                // level the unloads may have ended is read now, not at the next reading
                // (the mix benchmark's light tasks all stalled for those 5 s).
                let mut actions = if self.scheduler.pressure() >= PressureLevel::Critical {
                    self.check_pressure()
                } else {
                    self.refresh_probe();
                    Vec::new()
                };
                actions.extend(self.scheduler.handle(now(), Event::UnloadFinished { model }));
                return actions;
            }
            Command::PromoteDone { model, result } => {
                let name = self.scheduler.slot(model).policy.name.clone();
                let result = result.map(|(loaded, measured)| {
                    tracing::info!(model = %name, bytes = measured.steady, "promoted: now serving from its prepacked copy");
                    self.events.record(&name, EventKind::Promoted, "prepacked", measured.steady);
                    // The old instance goes when its runs in flight end.
                    self.loaded.insert(model, loaded);
                    measured
                });
                Event::PromoteFinished { model, result }
            }
            Command::PrepareDone { model, weights, mut result } => {
                let name = self.scheduler.slot(model).policy.name.clone();
                if self.stop_asked.take() == Some(model) && matches!(result, Prepared::Failed(_)) {
                    result = Prepared::Stopped;
                }
                match &result {
                    Prepared::Done { .. } => {
                        self.events.record(&name, EventKind::Prepared, weights.as_str(), None)
                    }
                    Prepared::Stopped => {
                        self.events.record(&name, EventKind::PrepareStopped, weights.as_str(), None)
                    }
                    Prepared::Failed(_) => {}
                }
                self.refresh_probe();
                Event::PrepareFinished { model, weights, result }
            }
            Command::Shutdown => Event::Shutdown,
        };
        self.scheduler.handle(now(), event)
    }

    /// A run left `grew` bytes resident: the model's working set is larger than its
    /// load measured. Its footprint grows by that (now and in the store, for the next
    /// load's admission), unless the config fixed its memory.
    fn learn_pass(&mut self, model: ModelId, grew: u64) {
        let Some(footprint) = self.scheduler.learn_pass(model, grew) else { return };
        let name = self.scheduler.slot(model).policy.name.clone();
        tracing::info!(
            model = %name,
            grew_bytes = grew,
            bytes = footprint,
            "a run left {} resident: footprint now {}",
            format_bytes(grew),
            format_bytes(footprint)
        );
        let peak = self.scheduler.slot(model).measured_peak_bytes.map(|p| p.max(footprint));
        self.remember(model, &name, footprint, peak);
    }

    /// A run held `transient` bytes at its peak and gave them back: the model's working
    /// set, held against the budget while it runs from now on (see `Scheduler::learn_transient`).
    fn learn_transient(&mut self, model: ModelId, transient: u64) {
        let Some(working) = self.scheduler.learn_transient(model, transient) else { return };
        tracing::info!(
            model = %self.scheduler.slot(model).policy.name,
            transient_bytes = transient,
            working_bytes = working,
            "a run held {} at its peak: {} held against the budget while the model runs",
            format_bytes(transient),
            format_bytes(working)
        );
    }

    /// A run of work that said its size held `transient` bytes at its peak: what its
    /// class is held at by size (see `Scheduler::learn_sized`).
    fn learn_sized(&mut self, model: ModelId, transient: u64, reqs: &[RequestId]) {
        let Some((class, rate)) = self.scheduler.learn_sized(model, transient, reqs) else { return };
        tracing::debug!(
            model = %self.scheduler.slot(model).policy.name,
            class,
            bytes_per_unit = rate,
            "a run held {} at its peak ({rate:.1} bytes a unit): what its kind of work is held at changed",
            format_bytes(transient)
        );
    }

    /// Keeps a measured footprint in the store, for the next load's admission.
    fn remember(&self, model: ModelId, name: &str, steady: u64, peak: Option<u64>) {
        let Some(store) = &self.store else { return };
        let device = self.scheduler.slot(model).device().map(|d| d.to_string()).unwrap_or_default();
        store.record(
            name,
            LearnedFootprint {
                fingerprint: self.fingerprints[model].clone(),
                device,
                steady_bytes: Some(steady),
                peak_bytes: peak,
                measured_at: crate::learned::unix_now(),
            },
        );
    }

    /// Logs a load, keeps its instance and learns its footprint.
    fn record_load(
        &mut self,
        model: ModelId,
        result: Result<(Loaded, LoadMeasurement), LoadError>,
        took: Duration,
        form: &'static str,
    ) -> Result<LoadMeasurement, LoadError> {
        let name = self.scheduler.slot(model).policy.name.clone();
        let outcome = match &result {
            Ok(_) => "ok",
            Err(LoadError::OutOfMemory(_)) => "out_of_memory",
            Err(LoadError::Failed(_)) => "failed",
        };
        metrics::counter!(metric::LOADS, "model" => name.clone(), "outcome" => outcome).increment(1);
        match result {
            Ok((instance, measured)) => {
                metrics::histogram!(metric::LOAD_DURATION, "model" => name.clone())
                    .record(took.as_secs_f64());
                self.events.record(&name, EventKind::Loaded, form, measured.steady);
                tracing::info!(
                    model = %name,
                    bytes = measured.steady,
                    peak_bytes = measured.peak,
                    duration_ms = took.as_millis() as u64,
                    "model loaded ({})",
                    measured.steady.map_or("footprint not measured".into(), format_bytes)
                );
                self.loaded.insert(model, instance);
                if let Some(steady) = measured.steady {
                    self.remember(model, &name, steady, measured.peak);
                }
                Ok(measured)
            }
            Err(e) => {
                self.events.record(&name, EventKind::LoadFailed, e.to_string(), None);
                tracing::error!(model = %name, error = %e, duration_ms = took.as_millis() as u64, "model load failed");
                Err(e)
            }
        }
    }

    fn execute(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::StartLoad { model, device } => self.start_load(model, device, false),
                Action::StartPromote { model, device } => self.start_load(model, device, true),
                Action::StartPrepare { model, weights } => self.start_prepare(model, weights),
                Action::StopPrepare { model } => {
                    if self.preparer.stop() {
                        self.stop_asked = Some(model);
                    }
                }
                Action::StartUnload { model, device, reason, bytes } => {
                    self.start_unload(model, device, reason, bytes)
                }
                Action::Dispatch { model, reqs, max_rows } => self.start_run(model, reqs, max_rows),
                Action::Reply { req, result } => self.reply(req, result),
                Action::Collected { req, models } => {
                    if let Some(reply) = self.collections.remove(&req) {
                        let _ = reply.send(models);
                    }
                }
            }
        }
    }

    fn reply(&mut self, req: RequestId, result: Result<(), SnoozeError>) {
        if let Some(job) = self.jobs.remove(&req) {
            if let Err(e) = result {
                let name = self.scheduler.slot(job.model).policy.name.clone();
                metrics::counter!(metric::REFUSALS, "model" => name.clone(), "reason" => e.kind.code())
                    .increment(1);
                self.events.record(&name, EventKind::Refused, e.kind.code(), None);
                if matches!(
                    e.kind,
                    ErrorKind::InsufficientMemory | ErrorKind::QueueFull | ErrorKind::Overloaded
                ) {
                    tracing::warn!(
                        model = %name,
                        retry_after_ms = e.retry_after.map(|d| d.as_millis() as u64),
                        code = e.kind.code(),
                        reason = %e,
                        "request refused"
                    );
                }
                let _ = job.reply.send(Err(e));
            }
        } else if let Some(reply) = self.replies.remove(&req) {
            let _ = reply.send(result);
        }
    }
}
