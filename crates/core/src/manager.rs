//! The async shell around the [`Scheduler`]: one actor task owns it, feeds it events
//! from a channel and from its next deadline, and carries out its actions — loads,
//! unloads and batches on blocking threads, answers to waiting callers.
//!
//! [`ModelManager`] is the cheap-to-clone handle the transports share. A request is a
//! [`Payload`] submitted with [`ModelManager::infer`] or [`ModelManager::embed`]; its
//! data stays here, in the actor, while the scheduler decides when it runs. A caller
//! that goes away (a client disconnects) cancels its request on the way out.

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
    backend::{Backend, Device, EmbedInput, Embeddings, LoadError, LoadSpec, LoadedModel, Task, Weights},
    error::{ErrorKind, SnoozeError},
    events::{metric, EventKind, EventLog, LifecycleEvent},
    execution::{self, BatchEnd, Job, Output, Payload},
    learned::{FootprintStore, LearnedFootprint},
    lifecycle::{
        Action, Event, LoadMeasurement, ModelId, ModelPolicy, ModelStatus, Priority, RequestId, RunOutcome,
        Scheduler, SchedulerConfig, Submit, UnloadReason,
    },
    memory::{self, MemoryProbe, MemorySnapshot},
    pressure::{MemoryReading, PressureLevel, PressureState, Thresholds},
    tensor::{ModelSignature, Tensor},
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
    /// How its weights are held (resolved: not `Auto`).
    pub weights: Weights,
}

pub struct ManagerConfig {
    pub scheduler: SchedulerConfig,
    pub models: Vec<ModelEntry>,
    /// Longest a repository load or unload waits before it is answered 503.
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
    pub task: Task,
    pub path: PathBuf,
    pub signature: Result<ModelSignature, String>,
    /// Requests may share a run (the batch dimension is dynamic and `max_batch_size > 1`).
    pub batchable: bool,
    /// How its weights are held.
    pub weights: Weights,
}

/// What a garbage collection did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    pub models_unloaded: Vec<String>,
    /// RSS before minus RSS after (the heap trimmed included).
    pub freed_bytes: u64,
}

type UnitReply = oneshot::Sender<Result<(), SnoozeError>>;

pub(crate) enum Command {
    Submit {
        sub: Submit,
        job: Job,
    },
    Load {
        req: RequestId,
        model: ModelId,
        reply: UnitReply,
    },
    Unload {
        req: RequestId,
        model: ModelId,
        reply: UnitReply,
    },
    Collect {
        req: RequestId,
        except: Option<ModelId>,
        reply: oneshot::Sender<Vec<ModelId>>,
    },
    Status {
        reply: oneshot::Sender<Vec<ModelStatus>>,
    },
    Cancel {
        req: RequestId,
    },
    /// `grew`: what the run left resident, when that could be measured (see `WorkMeter`).
    RunDone {
        model: ModelId,
        reqs: Vec<RequestId>,
        end: BatchEnd,
        took: Duration,
        grew: Option<u64>,
    },
    LoadDone {
        model: ModelId,
        result: Result<(Loaded, LoadMeasurement), LoadError>,
        took: Duration,
    },
    UnloadDone {
        model: ModelId,
    },
    PromoteDone {
        model: ModelId,
        result: Result<(Loaded, LoadMeasurement), LoadError>,
    },
    Shutdown,
}

/// Growth a run must leave for its model's footprint to grow: below it, allocator
/// noise (a response's buffers, a thread's stack) is not the model's working set.
const PASS_GROWTH_FLOOR: u64 = 4 << 20;

/// A resident instance and what its load added to RSS: an unload should give that back.
pub(crate) struct Loaded {
    instance: Arc<dyn LoadedModel>,
    grew: Option<u64>,
}

/// Unloads that gave back less memory than their load took (after a second trim).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct UnloadAudit {
    pub unloads: u64,
    pub short: u64,
    /// The latest shortfall: model, bytes its load took, bytes its unload gave back.
    pub last_short: Option<(String, u64, u64)>,
}

/// The handle every transport shares.
#[derive(Clone)]
pub struct ModelManager {
    tx: mpsc::UnboundedSender<Command>,
    infos: Arc<Vec<ModelInfo>>,
    names: Arc<HashMap<String, ModelId>>,
    /// True once shutting down and nothing is loaded or running any more.
    drained: watch::Receiver<bool>,
    /// Ids of waiting callers are chosen here, so a caller that gives up can cancel its own.
    next_req: Arc<AtomicU64>,
    acquire_timeout: Duration,
    retry_after: Duration,
    pub(crate) pressure: Arc<Mutex<PressureState>>,
    level: watch::Receiver<PressureLevel>,
    audit: Arc<Mutex<UnloadAudit>>,
    events: Arc<EventLog>,
}

/// Cancels a submitted request if its caller stops waiting before the answer.
struct CancelOnDrop<'a> {
    manager: &'a ModelManager,
    req: RequestId,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.manager.send(Command::Cancel { req: self.req });
        }
    }
}

impl ModelManager {
    /// Starts the actor on the current runtime and preloads what is marked so.
    pub fn start(config: ManagerConfig) -> ModelManager {
        let mut scheduler = Scheduler::new(config.scheduler);
        let retry_after = scheduler.config().retry_after;
        let mut infos = Vec::new();
        let mut backends = Vec::new();
        let mut fingerprints = Vec::new();
        let mut preload = Vec::new();
        for entry in config.models {
            let batchable =
                entry.policy.max_batch_size > 1 && entry.signature.as_ref().is_ok_and(dynamic_batch);
            let mut policy = entry.policy.clone();
            if !batchable {
                policy.max_batch_size = 1;
            }
            let id = scheduler.register(policy);
            if let Some(l) = config.store.as_ref().and_then(|s| s.get(&entry.policy.name, &entry.fingerprint))
            {
                tracing::info!(model = %entry.policy.name, steady_bytes = l.steady_bytes, peak_bytes = l.peak_bytes, "using the footprint measured on an earlier load");
                scheduler.set_learned(id, l.steady_bytes, l.peak_bytes);
            }
            scheduler.observe_files(id, entry.signature.as_ref().err().cloned());
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
                batchable,
                weights: entry.weights,
            });
            backends.push((entry.backend, entry.path, entry.weights));
        }
        let names = infos.iter().enumerate().map(|(i, m)| (m.name.clone(), i)).collect();
        let (tx, rx) = mpsc::unbounded_channel();
        let (drained_tx, drained) = watch::channel(false);
        let (level_tx, level) = watch::channel(PressureLevel::Normal);
        let pressure = Arc::new(Mutex::new(PressureState::default()));
        let audit = Arc::new(Mutex::new(UnloadAudit::default()));
        let events = Arc::new(EventLog::default());
        let actor = Actor {
            audit: audit.clone(),
            events: events.clone(),
            scheduler,
            backends,
            fingerprints,
            store: config.store,
            loaded: HashMap::new(),
            jobs: HashMap::new(),
            replies: HashMap::new(),
            collections: HashMap::new(),
            tx: tx.clone(),
            rx,
            drained: drained_tx,
            probe: config.probe,
            gpu_probes: config.gpu_probes,
            intra_op_threads: config.intra_op_threads,
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
            next_req: Arc::new(AtomicU64::new(1)),
            acquire_timeout: config.acquire_timeout,
            retry_after,
            pressure,
            level,
            audit,
            events,
        };
        for id in preload {
            let m = manager.clone();
            tokio::spawn(async move {
                let name = m.infos[id].name.clone();
                if let Err(e) = m.load(&name).await {
                    tracing::error!(model = %name, error = %e, "preload failed");
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

    fn next_request_id(&self) -> RequestId {
        self.next_req.fetch_add(1, Ordering::Relaxed)
    }

    fn send(&self, cmd: Command) {
        // The actor lives as long as any handle; a failed send means the runtime is gone.
        let _ = self.tx.send(cmd);
    }

    fn gone(&self) -> SnoozeError {
        SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down").retry_after(self.retry_after)
    }

    /// The memory pressure level now.
    pub fn pressure_level(&self) -> PressureLevel {
        *self.level.borrow()
    }

    /// Loads, evictions, unloads and refusals after `since_ms` (Unix milliseconds).
    pub fn events(&self, since_ms: u64) -> Vec<LifecycleEvent> {
        self.events.since(since_ms)
    }

    /// How much memory unloads gave back, against what their loads took.
    pub fn unload_audit(&self) -> UnloadAudit {
        self.audit.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A copy of the monitor's readings and alerts.
    pub fn pressure_state(&self) -> PressureState {
        self.pressure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Runs a KServe request: waits in the model's queue, possibly sharing a run with
    /// other requests, and returns its outputs. `priority: None` = the model's default.
    pub async fn infer(
        &self,
        name: &str,
        priority: Option<Priority>,
        inputs: Vec<Tensor>,
        outputs: Vec<String>,
    ) -> Result<Vec<Tensor>, SnoozeError> {
        match self.submit(name, priority, Payload::Tensors { inputs, outputs }).await? {
            Output::Tensors(t) => Ok(t),
            Output::Embeddings { .. } => {
                Err(SnoozeError::new(ErrorKind::Internal, "a tensor request got embeddings"))
            }
        }
    }

    /// Embeds texts (or token ids); also says whether the vectors are normalized.
    pub async fn embed(
        &self,
        name: &str,
        priority: Option<Priority>,
        input: EmbedInput,
    ) -> Result<(Embeddings, bool), SnoozeError> {
        match self.submit(name, priority, Payload::Embed(input)).await? {
            Output::Embeddings { embeddings, normalized } => Ok((embeddings, normalized)),
            Output::Tensors(_) => {
                Err(SnoozeError::new(ErrorKind::Internal, "an embedding request got tensors"))
            }
        }
    }

    async fn submit(
        &self,
        name: &str,
        priority: Option<Priority>,
        payload: Payload,
    ) -> Result<Output, SnoozeError> {
        let model = self.id(name)?;
        let (rows, key) = payload.rows_and_key(self.infos[model].batchable);
        let req = self.next_request_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::Submit {
            sub: Submit { req, model, priority, rows, key },
            job: Job { payload, reply, submitted: Instant::now(), model },
        });
        let mut guard = CancelOnDrop { manager: self, req, armed: true };
        let answer = rx.await;
        guard.armed = false;
        answer.unwrap_or_else(|_| Err(self.gone()))
    }

    /// Loads the model; returns when it is ready, or 503 after `acquire_timeout` (the
    /// load itself goes on).
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

    /// Unloads the model once the runs holding it end (requests arriving meanwhile
    /// wait, then reload it); returns when it is gone, or 503 after `acquire_timeout`
    /// (the unload stays pending until those runs end).
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
        cmd: impl FnOnce(UnitReply) -> Command,
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

    /// Unloads every idle, unpinned model (but `except`), waits until they are gone and
    /// trims the heap.
    pub async fn gc(&self, except: Option<&str>) -> GcReport {
        let before = memory::process_rss_bytes();
        let except = except.and_then(|n| self.id(n).ok());
        let (reply, rx) = oneshot::channel();
        self.send(Command::Collect { req: self.next_request_id(), except, reply });
        let unloaded = tokio::time::timeout(self.acquire_timeout, rx)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let _ = tokio::task::spawn_blocking(memory::trim_heap).await;
        let freed = before.saturating_sub(memory::process_rss_bytes());
        let models_unloaded: Vec<String> =
            unloaded.into_iter().map(|id| self.infos[id].name.clone()).collect();
        tracing::info!(models = ?models_unloaded, freed_bytes = freed, "garbage collection");
        GcReport { models_unloaded, freed_bytes: freed }
    }

    pub async fn status(&self) -> Vec<ModelStatus> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Status { reply });
        rx.await.unwrap_or_default()
    }

    /// Refuses new work, lets runs finish (up to `timeout`), unloads everything.
    /// Returns false if requests were still running at the timeout.
    pub async fn shutdown(&self, timeout: Duration) -> bool {
        self.send(Command::Shutdown);
        let mut drained = self.drained.clone();
        let done = tokio::time::timeout(timeout, drained.wait_for(|d| *d)).await.is_ok();
        done
    }
}

/// Every input and output of the signature has a dynamic first dimension: requests can
/// be stacked along it.
fn dynamic_batch(sig: &ModelSignature) -> bool {
    let dynamic = |s: &crate::tensor::TensorSpec| s.shape.first().is_some_and(|d| *d < 0);
    !sig.inputs.is_empty() && sig.inputs.iter().all(dynamic) && sig.outputs.iter().all(dynamic)
}

struct Actor {
    scheduler: Scheduler,
    backends: Vec<(Arc<dyn Backend>, PathBuf, Weights)>,
    fingerprints: Vec<String>,
    store: Option<Arc<FootprintStore>>,
    loaded: HashMap<ModelId, Loaded>,
    audit: Arc<Mutex<UnloadAudit>>,
    events: Arc<EventLog>,
    /// Submitted requests not yet answered, with their data.
    jobs: HashMap<RequestId, Job>,
    replies: HashMap<RequestId, UnitReply>,
    collections: HashMap<RequestId, oneshot::Sender<Vec<ModelId>>>,
    tx: mpsc::UnboundedSender<Command>,
    rx: mpsc::UnboundedReceiver<Command>,
    drained: watch::Sender<bool>,
    probe: Arc<dyn MemoryProbe>,
    gpu_probes: Vec<(Device, Arc<dyn MemoryProbe>)>,
    intra_op_threads: usize,
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

    fn command(&mut self, cmd: Command) -> Vec<Action> {
        let event = match cmd {
            Command::Submit { sub, job } => {
                self.recheck_files(sub.model);
                if !self.scheduler.slot(sub.model).is_ready() {
                    self.refresh_probe();
                }
                self.jobs.insert(sub.req, job);
                Event::Submit(sub)
            }
            Command::Load { req, model, reply } => {
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
                Event::Collect { req, except, include_pinned: false, reason: UnloadReason::Pressure }
            }
            Command::Status { reply } => {
                let _ = reply.send(self.scheduler.status(now()));
                return Vec::new();
            }
            Command::Cancel { req } => {
                self.jobs.remove(&req);
                self.replies.remove(&req);
                Event::Cancel { req }
            }
            Command::RunDone { model, reqs, end, took, grew } => {
                if let Some(grew) = grew.filter(|g| *g >= PASS_GROWTH_FLOOR) {
                    self.learn_pass(model, grew);
                }
                let outcome = match end {
                    BatchEnd::Done => RunOutcome::Done,
                    BatchEnd::Panicked(why) => RunOutcome::Panicked(why),
                    BatchEnd::OutOfMemory { message, jobs } => {
                        // Back for a retry, unless their callers went away meanwhile.
                        for (req, job) in jobs {
                            if !job.reply.is_closed() {
                                self.jobs.insert(req, job);
                            }
                        }
                        RunOutcome::OutOfMemory(message)
                    }
                };
                Event::RunFinished { model, reqs, outcome, took }
            }
            Command::LoadDone { model, result, took } => {
                let result = self.record_load(model, result, took);
                let mut actions = self.check_pressure();
                actions.extend(self.scheduler.handle(now(), Event::LoadFinished { model, result, took }));
                return actions;
            }
            Command::UnloadDone { model } => {
                self.refresh_probe();
                Event::UnloadFinished { model }
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
                self.events.record(
                    &name,
                    EventKind::Loaded,
                    self.backends[model].2.as_str(),
                    measured.steady,
                );
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

    fn start_run(&mut self, model: ModelId, reqs: Vec<RequestId>, max_rows: u32) {
        let jobs: Vec<(RequestId, Job)> =
            reqs.iter().filter_map(|r| self.jobs.remove(r).map(|j| (*r, j))).collect();
        let name = self.scheduler.slot(model).policy.name.clone();
        for (_, job) in &jobs {
            metrics::histogram!(metric::QUEUE_WAIT, "model" => name.clone())
                .record(job.submitted.elapsed().as_secs_f64());
        }
        let tx = self.tx.clone();
        let Some(instance) = self.loaded.get(&model).map(|l| l.instance.clone()) else {
            tracing::error!(model, "dispatched to a model that is not loaded");
            let _ = tx.send(Command::RunDone {
                model,
                reqs,
                end: BatchEnd::Done,
                took: Duration::ZERO,
                grew: None,
            });
            return;
        };
        let name = self.scheduler.slot(model).policy.name.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let work = execution::WORK.begin();
            let (end, grew) = if jobs.is_empty() {
                (BatchEnd::Done, None)
            } else {
                execution::run_batch(instance.as_ref(), &name, jobs, max_rows, &work)
            };
            drop(work);
            // Our reference goes before the actor hears of the end, so an unload that
            // follows holds the last one and really frees the model.
            drop(instance);
            let _ = tx.send(Command::RunDone { model, reqs, end, took: started.elapsed(), grew });
        });
    }

    fn start_unload(&mut self, model: ModelId, device: Device, reason: UnloadReason, bytes: u64) {
        let loaded = self.loaded.remove(&model);
        let name = self.scheduler.slot(model).policy.name.clone();
        let tx = self.tx.clone();
        let gpu = self.device_probe(&device);
        let audit = self.audit.clone();
        let reason_name = match reason {
            UnloadReason::Evicted => "evicted",
            UnloadReason::Idle => "idle",
            UnloadReason::Requested => "requested",
            UnloadReason::Pressure => "pressure",
            UnloadReason::Shutdown => "shutdown",
            UnloadReason::Failed => "failed",
        };
        metrics::counter!(metric::UNLOADS, "model" => name.clone(), "reason" => reason_name).increment(1);
        self.events.record(&name, EventKind::Unloaded, reason_name, Some(bytes));
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let before = memory::process_rss_bytes();
            let gpu_before = gpu.as_ref().map(|p| p.snapshot().process_bytes);
            let took = loaded.as_ref().and_then(|l| l.grew);
            drop(loaded);
            memory::trim_heap();
            if let (Some(probe), Some(held)) = (&gpu, gpu_before) {
                wait_for_gpu_release(probe.as_ref(), held, bytes);
            }
            let mut freed = before.saturating_sub(memory::process_rss_bytes());
            // The memory a load took must come back: if not, trim once more, then say so.
            let short = |freed: u64| took.is_some_and(|t| freed.saturating_add((16 << 20).max(t / 10)) < t);
            if short(freed) {
                memory::trim_heap();
                freed = before.saturating_sub(memory::process_rss_bytes());
            }
            let mut a = audit.lock().unwrap_or_else(|p| p.into_inner());
            a.unloads += 1;
            if let (true, Some(t)) = (short(freed), took) {
                a.short += 1;
                a.last_short = Some((name.clone(), t, freed));
                tracing::warn!(model = %name, load_took_bytes = t, freed_bytes = freed, "the unload gave back less memory than the load took");
            }
            drop(a);
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

    /// Loads the model on a blocking thread, measured; `promote`: a second instance in its
    /// prepacked form, for a model that keeps serving meanwhile.
    fn start_load(&mut self, model: ModelId, device: Device, promote: bool) {
        let (backend, path, weights) = self.backends[model].clone();
        let weights = if promote { Weights::Prepacked } else { weights };
        let policy = &self.scheduler.slot(model).policy;
        let spec = LoadSpec {
            name: policy.name.clone(),
            path,
            device,
            intra_op_threads: self.intra_op_threads,
            instances: policy.max_concurrency.max(1) as usize,
            weights,
        };
        tracing::debug!(model = %spec.name, device = %spec.device, "loading");
        let tx = self.tx.clone();
        let probe = self.probe.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            // A run meanwhile must not take the load's memory for its own.
            let _work = execution::WORK.begin();
            let panicked = || LoadError::Failed(format!("the backend panicked loading '{}'", spec.name));
            // One-time preparation (a format conversion) is not what the model costs to load.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.prepare(&spec)))
                .unwrap_or_else(|_| Err(panicked()));
            memory::trim_heap();
            let before = probe.process_bytes();
            probe.reset_peak();
            let result = prepared.and_then(|()| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.load(&spec)))
                    .unwrap_or_else(|_| Err(panicked()))
            });
            let (after, peak) = (probe.process_bytes(), probe.peak_process_bytes());
            let grew =
                |to: Option<u64>| to.zip(before).and_then(|(t, b)| t.checked_sub(b)).filter(|d| *d > 0);
            let result = result.map(|m| {
                let measured = LoadMeasurement {
                    steady: grew(after).map(|s| s + m.working_bytes() + m.mapped_bytes()),
                    peak: grew(peak),
                };
                (Loaded { instance: m, grew: grew(after) }, measured)
            });
            let took = started.elapsed();
            let _ = tx.send(if promote {
                Command::PromoteDone { model, result }
            } else {
                Command::LoadDone { model, result, took }
            });
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
