//! The async shell around the [`Scheduler`]: one actor task owns it, feeds it events
//! from a channel and from its next deadline, and carries out its actions — loads and
//! unloads on blocking threads, leases handed to waiting requests.
//!
//! [`ModelManager`] is the cheap-to-clone handle the transports share. A [`Lease`]
//! keeps its model resident; dropping it tells the actor the request completed.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::{mpsc, oneshot, watch};

use crate::{
    backend::{Backend, Device, LoadError, LoadSpec, LoadedModel},
    error::{ErrorKind, SnoozeError},
    learned::{FootprintStore, LearnedFootprint},
    lifecycle::{
        Action, Event, LoadMeasurement, ModelId, ModelPolicy, ModelStatus, RequestId, Scheduler,
        SchedulerConfig, UnloadReason,
    },
    memory::{self, MemoryProbe, MemorySnapshot},
    pressure::{MemoryReading, PressureLevel, PressureState, Thresholds},
    tensor::ModelSignature,
    units::format_bytes,
};

/// A model as the manager serves it.
pub struct ModelEntry {
    pub policy: ModelPolicy,
    pub backend: Arc<dyn Backend>,
    pub path: PathBuf,
    /// Read from the files at start, so metadata never needs a load; `Err` when the
    /// files could not be read (the load will then fail with the same reason).
    pub signature: Result<ModelSignature, String>,
    pub preload: bool,
    /// Identifies the model's files for the learned-footprint store.
    pub fingerprint: String,
}

pub struct ManagerConfig {
    pub scheduler: SchedulerConfig,
    pub models: Vec<ModelEntry>,
    /// Longest a request waits for its model to load before it gets 503.
    pub acquire_timeout: Duration,
    pub intra_op_threads: usize,
    pub probe: Arc<dyn MemoryProbe>,
    /// One probe per GPU (NVML); empty on a machine without one.
    pub gpu_probes: Vec<(Device, Arc<dyn MemoryProbe>)>,
    /// Where measured footprints are kept across runs; `None` = not kept.
    pub store: Option<Arc<FootprintStore>>,
    pub thresholds: Thresholds,
    /// How often the pressure monitor reads the probe (also after every load).
    pub check_interval: Duration,
}

/// What the transports know of a model without asking the actor.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub backend: &'static str,
    pub task: crate::backend::Task,
    pub path: PathBuf,
    pub signature: Result<ModelSignature, String>,
}

pub(crate) enum Command {
    Acquire {
        req: RequestId,
        model: ModelId,
        reply: oneshot::Sender<Result<Lease, SnoozeError>>,
    },
    Load {
        req: RequestId,
        model: ModelId,
        reply: oneshot::Sender<Result<(), SnoozeError>>,
    },
    Unload {
        req: RequestId,
        model: ModelId,
        reply: oneshot::Sender<Result<(), SnoozeError>>,
    },
    Poisoned {
        model: ModelId,
        reason: String,
    },
    UnloadIdle {
        include_pinned: bool,
        reason: UnloadReason,
        reply: oneshot::Sender<Result<(), SnoozeError>>,
    },
    Status {
        reply: oneshot::Sender<Vec<ModelStatus>>,
    },
    Release {
        model: ModelId,
    },
    Cancel {
        req: RequestId,
    },
    LoadDone {
        model: ModelId,
        result: Result<(Arc<dyn LoadedModel>, LoadMeasurement), LoadError>,
        took: Duration,
    },
    UnloadDone {
        model: ModelId,
    },
    Shutdown,
}

/// Keeps a model resident while a request uses it.
pub struct Lease {
    model: Option<Arc<dyn LoadedModel>>,
    id: ModelId,
    tx: mpsc::UnboundedSender<Command>,
}

impl Lease {
    pub fn model(&self) -> &dyn LoadedModel {
        self.model.as_deref().expect("a lease holds its model until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Drop our reference before the actor learns the lease ended, so an unload that
        // follows is the model's last owner and really frees it.
        drop(self.model.take());
        let _ = self.tx.send(Command::Release { model: self.id });
    }
}

/// The handle every transport shares.
#[derive(Clone)]
pub struct ModelManager {
    tx: mpsc::UnboundedSender<Command>,
    infos: Arc<Vec<ModelInfo>>,
    names: Arc<HashMap<String, ModelId>>,
    /// True once shutting down and nothing is loaded or leased any more.
    drained: watch::Receiver<bool>,
    /// Acquire ids are chosen here so a caller that times out can cancel its own.
    next_acquire: Arc<AtomicU64>,
    acquire_timeout: Duration,
    retry_after: Duration,
    pub(crate) pressure: Arc<Mutex<PressureState>>,
    level: watch::Receiver<PressureLevel>,
}

/// How much a request may be refused under memory pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    /// Refused with 503 while memory pressure is critical.
    Low,
    #[default]
    Normal,
}

impl ModelManager {
    /// Starts the actor on the current runtime and preloads what is marked so.
    pub fn start(config: ManagerConfig) -> ModelManager {
        let mut scheduler = Scheduler::new(config.scheduler);
        let retry_after = scheduler.config().retry_after;
        let mut infos = Vec::new();
        let mut backends = Vec::new();
        let mut broken = Vec::new();
        let mut fingerprints = Vec::new();
        let mut preload = Vec::new();
        for entry in config.models {
            let id = scheduler.register(entry.policy.clone());
            if let Some(l) = config.store.as_ref().and_then(|s| s.get(&entry.policy.name, &entry.fingerprint))
            {
                tracing::info!(model = %entry.policy.name, steady_bytes = l.steady_bytes, peak_bytes = l.peak_bytes, "using the footprint measured on an earlier load");
                scheduler.set_learned(id, l.steady_bytes, l.peak_bytes);
            }
            fingerprints.push(entry.fingerprint.clone());
            if entry.preload {
                preload.push(id);
            }
            infos.push(ModelInfo {
                name: entry.policy.name.clone(),
                backend: entry.backend.name(),
                task: entry.backend.task(&entry.path),
                path: entry.path.clone(),
                signature: entry.signature,
            });
            broken.push(infos.last().and_then(|i| i.signature.as_ref().err().cloned()));
            backends.push((entry.backend, entry.path));
        }
        let names = infos.iter().enumerate().map(|(i, m)| (m.name.clone(), i)).collect();
        let (tx, rx) = mpsc::unbounded_channel();
        let (drained_tx, drained) = watch::channel(false);
        let (level_tx, level) = watch::channel(PressureLevel::Normal);
        let pressure = Arc::new(Mutex::new(PressureState::default()));
        let actor = Actor {
            scheduler,
            backends,
            broken,
            fingerprints,
            store: config.store,
            loaded: HashMap::new(),
            replies: HashMap::new(),
            wanted: HashMap::new(),
            next_req: 1,
            tx: tx.clone(),
            rx,
            drained: drained_tx,
            probe: config.probe,
            gpu_probes: config.gpu_probes,
            intra_op_threads: config.intra_op_threads,
            load_started: HashMap::new(),
            pressure: pressure.clone(),
            level: level_tx,
            thresholds: config.thresholds,
            check_interval: config.check_interval,
        };
        tokio::spawn(actor.run());
        let manager = ModelManager {
            tx,
            infos: Arc::new(infos),
            names: Arc::new(names),
            drained,
            next_acquire: Arc::new(AtomicU64::new(1 << 62)),
            acquire_timeout: config.acquire_timeout,
            retry_after,
            pressure,
            level,
        };
        for id in preload {
            let m = manager.clone();
            tokio::spawn(async move {
                let (reply, rx) = oneshot::channel();
                let req = m.next_request_id();
                m.send(Command::Load { req, model: id, reply });
                if let Ok(Err(e)) = rx.await {
                    tracing::error!(model = %m.infos[id].name, error = %e, "preload failed");
                }
            });
        }
        manager
    }

    pub fn models(&self) -> &[ModelInfo] {
        &self.infos
    }

    pub fn info(&self, name: &str) -> Result<&ModelInfo, SnoozeError> {
        self.id(name).map(|id| &self.infos[id])
    }

    fn id(&self, name: &str) -> Result<ModelId, SnoozeError> {
        self.names.get(name).copied().ok_or_else(|| SnoozeError::not_found(name))
    }

    pub(crate) fn model_id(&self, name: &str) -> Result<ModelId, SnoozeError> {
        self.id(name)
    }

    pub(crate) fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// Ids of waiting callers are chosen here, so a caller that gives up can cancel its own.
    fn next_request_id(&self) -> RequestId {
        self.next_acquire.fetch_add(1, Ordering::Relaxed)
    }

    /// The backend panicked running `model`: it is unloaded once its requests end and
    /// reloaded after a backoff.
    pub(crate) fn report_panic(&self, model: ModelId, reason: String) {
        self.send(Command::Poisoned { model, reason });
    }

    fn send(&self, cmd: Command) {
        // The actor lives as long as any handle; a failed send means the runtime is gone.
        let _ = self.tx.send(cmd);
    }

    fn gone(&self) -> SnoozeError {
        SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down").retry_after(self.retry_after)
    }

    /// Waits (bounded) until the model is ready and returns a lease on it.
    pub async fn acquire(&self, name: &str) -> Result<Lease, SnoozeError> {
        self.acquire_with(name, Priority::Normal).await
    }

    /// The memory pressure level now.
    pub fn pressure_level(&self) -> PressureLevel {
        *self.level.borrow()
    }

    #[cfg(test)]
    pub(crate) fn pressure_level_for_test(&mut self, level: PressureLevel) {
        let (tx, rx) = watch::channel(level);
        self.level = rx;
        std::mem::forget(tx);
    }

    /// A copy of the monitor's readings and alerts.
    pub fn pressure_state(&self) -> PressureState {
        self.pressure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Like [`acquire`](Self::acquire); low-priority work is refused under critical pressure.
    pub async fn acquire_with(&self, name: &str, priority: Priority) -> Result<Lease, SnoozeError> {
        let model = self.id(name)?;
        if priority == Priority::Low && self.pressure_level() >= PressureLevel::Critical {
            return Err(SnoozeError::new(
                ErrorKind::InsufficientMemory,
                "memory pressure is critical: low-priority requests are refused until it eases",
            )
            .retry_after(self.retry_after));
        }
        let (reply, rx) = oneshot::channel();
        let req = self.next_request_id();
        self.send(Command::Acquire { req, model, reply });
        match tokio::time::timeout(self.acquire_timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(self.gone()),
            Err(_) => Err({
                self.send(Command::Cancel { req });
                SnoozeError::new(
                    ErrorKind::Overloaded,
                    format!(
                        "model '{name}' was not ready within {:.0}s (still loading or waiting for memory)",
                        self.acquire_timeout.as_secs_f64()
                    ),
                )
                .retry_after(self.retry_after)
            }),
        }
    }

    /// Loads the model (no lease); returns when it is ready, or 503 after
    /// `acquire_timeout` (the load itself goes on).
    pub async fn load(&self, name: &str) -> Result<(), SnoozeError> {
        let model = self.id(name)?;
        let req = self.next_request_id();
        let late = || {
            SnoozeError::new(
                ErrorKind::Overloaded,
                format!(
                    "model '{name}' was not loaded within {:.0}s (still loading or waiting for memory); \
                     the load goes on",
                    self.acquire_timeout.as_secs_f64()
                ),
            )
        };
        self.ask_within(req, |reply| Command::Load { req, model, reply }, late).await
    }

    /// Unloads the model once the requests holding it end (new ones wait, then reload
    /// it); returns when it is gone, or 503 after `acquire_timeout` (the unload stays
    /// pending until those requests end).
    pub async fn unload(&self, name: &str) -> Result<(), SnoozeError> {
        let model = self.id(name)?;
        let req = self.next_request_id();
        let late = || {
            SnoozeError::new(
                ErrorKind::Overloaded,
                format!(
                    "model '{name}' is still serving requests after {:.0}s; it unloads as soon as they end",
                    self.acquire_timeout.as_secs_f64()
                ),
            )
        };
        self.ask_within(req, |reply| Command::Unload { req, model, reply }, late).await
    }

    /// Sends a command and waits for its reply at most `acquire_timeout`; on timeout the
    /// caller's wait is cancelled (what it asked for goes on) and `late()` is returned.
    async fn ask_within(
        &self,
        req: RequestId,
        cmd: impl FnOnce(oneshot::Sender<Result<(), SnoozeError>>) -> Command,
        late: impl FnOnce() -> SnoozeError,
    ) -> Result<(), SnoozeError> {
        let (reply, rx) = oneshot::channel();
        self.send(cmd(reply));
        match tokio::time::timeout(self.acquire_timeout, rx).await {
            Ok(result) => result.unwrap_or_else(|_| Err(self.gone())),
            Err(_) => {
                self.send(Command::Cancel { req });
                Err(late().retry_after(self.retry_after))
            }
        }
    }

    /// Unloads every idle model (pinned too if asked); returns at once.
    pub async fn unload_idle(&self, include_pinned: bool, reason: UnloadReason) -> Result<(), SnoozeError> {
        self.ask(|reply| Command::UnloadIdle { include_pinned, reason, reply }).await
    }

    async fn ask(
        &self,
        cmd: impl FnOnce(oneshot::Sender<Result<(), SnoozeError>>) -> Command,
    ) -> Result<(), SnoozeError> {
        let (reply, rx) = oneshot::channel();
        self.send(cmd(reply));
        rx.await.unwrap_or_else(|_| Err(self.gone()))
    }

    pub async fn status(&self) -> Vec<ModelStatus> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Status { reply });
        rx.await.unwrap_or_default()
    }

    /// Refuses new work, lets leases finish (up to `timeout`), unloads everything.
    /// Returns false if requests were still running at the timeout.
    pub async fn shutdown(&self, timeout: Duration) -> bool {
        self.send(Command::Shutdown);
        let mut drained = self.drained.clone();
        let done = tokio::time::timeout(timeout, drained.wait_for(|d| *d)).await.is_ok();
        done
    }
}

struct Actor {
    scheduler: Scheduler,
    backends: Vec<(Arc<dyn Backend>, PathBuf)>,
    /// Why a model's files could not be read at start (or at its last request).
    broken: Vec<Option<String>>,
    fingerprints: Vec<String>,
    store: Option<Arc<FootprintStore>>,
    loaded: HashMap<ModelId, Arc<dyn LoadedModel>>,
    replies: HashMap<RequestId, Reply>,
    /// The model each waiting acquire/load is for, to name it in refusal logs.
    wanted: HashMap<RequestId, ModelId>,
    next_req: RequestId,
    tx: mpsc::UnboundedSender<Command>,
    rx: mpsc::UnboundedReceiver<Command>,
    drained: watch::Sender<bool>,
    probe: Arc<dyn MemoryProbe>,
    gpu_probes: Vec<(Device, Arc<dyn MemoryProbe>)>,
    intra_op_threads: usize,
    load_started: HashMap<ModelId, Instant>,
    pressure: Arc<Mutex<PressureState>>,
    level: watch::Sender<PressureLevel>,
    thresholds: Thresholds,
    check_interval: Duration,
}

enum Wake {
    Command(Command),
    Deadline,
    Tick,
}

enum Reply {
    Lease(oneshot::Sender<Result<Lease, SnoozeError>>),
    Unit(oneshot::Sender<Result<(), SnoozeError>>),
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Actor {
    async fn run(mut self) {
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
                Wake::Tick => self.check_pressure(),
            };
            self.execute(actions);
            self.drained.send_replace(self.scheduler.is_shutting_down() && !self.scheduler.busy());
        }
    }

    fn register(&mut self, reply: Reply) -> RequestId {
        let req = self.next_req;
        self.next_req += 1;
        self.replies.insert(req, reply);
        req
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
        };
        let level = self.pressure.lock().unwrap_or_else(|p| p.into_inner()).record(reading);
        let mut actions = Vec::new();
        // Emergency is re-applied at every reading: models that became idle since the
        // last one are unloaded too.
        if level != self.scheduler.pressure() || level == PressureLevel::Emergency {
            self.level.send_replace(level);
            if level == PressureLevel::Emergency {
                tracing::warn!("memory pressure emergency: unloading every idle, unpinned model");
            }
            actions.extend(self.scheduler.handle(now(), Event::Pressure(level)));
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

    fn device_probe(&self, device: &Device) -> Option<Arc<dyn MemoryProbe>> {
        self.gpu_probes.iter().find(|(d, _)| d == device).map(|(_, p)| p.clone())
    }

    /// A model whose files were unreadable fails fast — before anything is evicted for
    /// it — for as long as they stay unreadable (re-read on each request: cheap, since
    /// only the header is parsed, and a fixed file is picked up without a restart).
    fn still_broken(&mut self, model: ModelId) -> Option<SnoozeError> {
        self.broken[model].as_ref()?;
        let (backend, path) = &self.backends[model];
        match backend.signature(path) {
            Ok(_) => {
                self.broken[model] = None;
                None
            }
            Err(e) => {
                let name = &self.scheduler.slot(model).policy.name;
                tracing::warn!(model = %name, error = %e, "refused: the model's files cannot be read");
                self.broken[model] = Some(e.to_string());
                Some(SnoozeError::new(
                    ErrorKind::ModelFailed,
                    format!("model '{name}' cannot be loaded: {e}"),
                ))
            }
        }
    }

    fn command(&mut self, cmd: Command) -> Vec<Action> {
        let event = match cmd {
            Command::Acquire { req, model, reply } => {
                if let Some(e) = self.still_broken(model) {
                    let _ = reply.send(Err(e));
                    return Vec::new();
                }
                if self.scheduler.slot(model).idle().is_none() && self.scheduler.slot(model).leases() == 0 {
                    self.refresh_probe();
                }
                self.replies.insert(req, Reply::Lease(reply));
                self.wanted.insert(req, model);
                Event::Acquire { req, model }
            }
            Command::Load { req, model, reply } => {
                if let Some(e) = self.still_broken(model) {
                    let _ = reply.send(Err(e));
                    return Vec::new();
                }
                self.refresh_probe();
                self.replies.insert(req, Reply::Unit(reply));
                self.wanted.insert(req, model);
                Event::Load { req, model }
            }
            Command::Unload { req, model, reply } => {
                self.replies.insert(req, Reply::Unit(reply));
                Event::Unload { req, model }
            }
            Command::Poisoned { model, reason } => Event::Poisoned { model, reason },
            Command::UnloadIdle { include_pinned, reason, reply } => {
                Event::UnloadIdle { req: self.register(Reply::Unit(reply)), include_pinned, reason }
            }
            Command::Status { reply } => {
                let _ = reply.send(self.scheduler.status(now()));
                return Vec::new();
            }
            Command::Release { model } => Event::Release { model },
            Command::Cancel { req } => {
                self.replies.remove(&req);
                self.wanted.remove(&req);
                Event::Cancel { req }
            }
            Command::LoadDone { model, result, took } => {
                self.load_started.remove(&model);
                let name = &self.scheduler.slot(model).policy.name;
                let result = match result {
                    Ok((instance, measured)) => {
                        tracing::info!(
                            model = %name,
                            bytes = measured.steady,
                            peak_bytes = measured.peak,
                            duration_ms = took.as_millis() as u64,
                            "model loaded ({})",
                            measured.steady.map_or("footprint not measured".into(), format_bytes)
                        );
                        self.loaded.insert(model, instance);
                        if let (Some(store), Some(_)) = (&self.store, measured.steady) {
                            let device = self
                                .scheduler
                                .slot(model)
                                .device()
                                .map(|d| d.to_string())
                                .unwrap_or_default();
                            store.record(
                                name,
                                LearnedFootprint {
                                    fingerprint: self.fingerprints[model].clone(),
                                    device,
                                    steady_bytes: measured.steady,
                                    peak_bytes: measured.peak,
                                    measured_at: crate::learned::unix_now(),
                                },
                            );
                        }
                        Ok(measured)
                    }
                    Err(e) => {
                        tracing::error!(model = %name, error = %e, duration_ms = took.as_millis() as u64, "model load failed");
                        Err(e)
                    }
                };
                let mut actions = self.check_pressure();
                actions.extend(self.scheduler.handle(now(), Event::LoadFinished { model, result, took }));
                return actions;
            }
            Command::UnloadDone { model } => {
                self.refresh_probe();
                Event::UnloadFinished { model }
            }
            Command::Shutdown => Event::Shutdown,
        };
        self.scheduler.handle(now(), event)
    }

    fn execute(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::StartLoad { model, device } => self.start_load(model, device),
                Action::StartUnload { model, device, reason, bytes } => {
                    let instance = self.loaded.remove(&model);
                    let name = self.scheduler.slot(model).policy.name.clone();
                    let tx = self.tx.clone();
                    let gpu = self.device_probe(&device);
                    tokio::task::spawn_blocking(move || {
                        let started = Instant::now();
                        let before = memory::process_rss_bytes();
                        let gpu_before = gpu.as_ref().map(|p| p.snapshot().process_bytes);
                        drop(instance);
                        memory::trim_heap();
                        if let (Some(probe), Some(held)) = (&gpu, gpu_before) {
                            wait_for_gpu_release(probe.as_ref(), held, bytes);
                        }
                        let freed = before.saturating_sub(memory::process_rss_bytes());
                        tracing::info!(
                            model = %name,
                            %device,
                            reason = ?reason,
                            bytes,
                            freed_bytes = freed,
                            duration_ms = started.elapsed().as_millis() as u64,
                            "model unloaded ({:?}, {} accounted, {} returned to the OS)",
                            reason,
                            format_bytes(bytes),
                            format_bytes(freed)
                        );
                        let _ = tx.send(Command::UnloadDone { model });
                    });
                }
                Action::Grant { req, model } => {
                    self.wanted.remove(&req);
                    let Some(Reply::Lease(reply)) = self.replies.remove(&req) else { continue };
                    let Some(instance) = self.loaded.get(&model).cloned() else {
                        tracing::error!(model, "granted a lease on a model that is not loaded");
                        continue;
                    };
                    let lease = Lease { model: Some(instance), id: model, tx: self.tx.clone() };
                    // A caller that gave up drops the lease here, which releases it.
                    let _ = reply.send(Ok(lease));
                }
                Action::Reply { req, result } => {
                    let model = self.wanted.remove(&req);
                    if let (Err(e), Some(model)) = (&result, model) {
                        if e.kind == ErrorKind::InsufficientMemory {
                            let slot = self.scheduler.slot(model);
                            tracing::warn!(
                                model = %slot.policy.name,
                                bytes = slot.admission_bytes(),
                                retry_after_ms = e.retry_after.map(|d| d.as_millis() as u64),
                                reason = %e,
                                "request refused: not enough memory"
                            );
                        }
                    }
                    match self.replies.remove(&req) {
                        Some(Reply::Lease(reply)) => match result {
                            Err(e) => {
                                let _ = reply.send(Err(e));
                            }
                            // Leases come through Action::Grant; an Ok reply to an acquire is a bug.
                            Ok(()) => tracing::error!(req, "an acquire was answered without a lease"),
                        },
                        Some(Reply::Unit(reply)) => {
                            let _ = reply.send(result);
                        }
                        None => {}
                    }
                }
            }
        }
    }

    fn start_load(&mut self, model: ModelId, device: Device) {
        let (backend, path) = self.backends[model].clone();
        let spec = LoadSpec {
            name: self.scheduler.slot(model).policy.name.clone(),
            path,
            device,
            intra_op_threads: self.intra_op_threads,
        };
        self.load_started.insert(model, Instant::now());
        tracing::debug!(model = %spec.name, device = %spec.device, "loading");
        let tx = self.tx.clone();
        let probe = self.probe.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let before = probe.process_bytes();
            probe.reset_peak();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.load(&spec)))
                .unwrap_or_else(|_| {
                    Err(LoadError::Failed(format!("the backend panicked loading '{}'", spec.name)))
                });
            let (after, peak) = (probe.process_bytes(), probe.peak_process_bytes());
            let grew =
                |to: Option<u64>| to.zip(before).and_then(|(t, b)| t.checked_sub(b)).filter(|d| *d > 0);
            let result = result.map(|m| {
                let measured =
                    LoadMeasurement { steady: grew(after).map(|s| s + m.working_bytes()), peak: grew(peak) };
                (m, measured)
            });
            let _ = tx.send(Command::LoadDone { model, result, took: started.elapsed() });
        });
    }
}

/// GPU drivers free asynchronously: wait (bounded) until NVML shows most of the model's
/// memory gone, so the next load's admission sees the truth.
fn wait_for_gpu_release(probe: &dyn MemoryProbe, held_before: u64, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let released = held_before.saturating_sub(probe.snapshot().process_bytes);
        if released >= bytes / 10 * 9 {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    tracing::warn!(bytes, "the GPU driver did not report the model's memory free within 5s");
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
