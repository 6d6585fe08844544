//! The async shell around the [`Scheduler`]: one actor task owns it, feeds it events
//! from a channel and from its next deadline (`actor`), and carries out its actions —
//! loads, unloads and batches on blocking threads (`effects`), answers to waiting
//! callers.
//!
//! [`ModelManager`] (this file) is the cheap-to-clone handle the transports share. A request is a
//! [`Payload`] submitted with [`ModelManager::infer`] or [`ModelManager::embed`]; its
//! data stays here, in the actor, while the scheduler decides when it runs. A caller
//! that goes away (a client disconnects) cancels its request on the way out.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, oneshot, watch};

mod actor;
mod effects;
mod info;

pub use info::ModelInfo;

use actor::Actor;

use crate::{
    backend::{Backend, Device, EmbedInput, Embeddings, LoadError, LoadedModel, Weights},
    error::{ErrorKind, SnoozeError},
    events::{EventLog, LifecycleEvent},
    execution::{BatchEnd, Job, Output, Payload},
    learned::FootprintStore,
    lifecycle::{
        LoadMeasurement, ModelId, ModelPolicy, ModelStatus, Preparation, Prepared, Priority, RequestId,
        Scheduler, SchedulerConfig, Submit,
    },
    memory::{self, MemoryProbe},
    pressure::{PressureLevel, PressureState, Thresholds},
    task::TaskJob,
    tensor::{ModelSignature, Tensor},
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
    /// Its answers depend on the batch (see `Backend::batch_dependent`): requests run
    /// apart, each as one batch of its own rows.
    pub batch_dependent: bool,
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
    /// Who does the models' one-time preparations (in the background, one at a time).
    pub preparer: Arc<dyn crate::backend::Preparer>,
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
    /// What the budget accounts on the host now (not at the last memory check).
    Accounted {
        reply: oneshot::Sender<u64>,
    },
    /// Reads a model's files again if they changed and it is not in memory; whether
    /// they had.
    Refresh {
        model: ModelId,
        reply: oneshot::Sender<bool>,
    },
    Cancel {
        req: RequestId,
    },
    /// `grew`: what the run left resident and held at its peak, where that could be
    /// measured (see `WorkMeter`).
    RunDone {
        model: ModelId,
        reqs: Vec<RequestId>,
        end: BatchEnd,
        took: Duration,
        grew: crate::execution::Growth,
    },
    /// `form`: how the weights were held (`mapped`, ..., or `onnx`: straight from the
    /// file while the form's preparation is pending).
    LoadDone {
        model: ModelId,
        result: Result<(Loaded, LoadMeasurement), LoadError>,
        took: Duration,
        form: &'static str,
    },
    UnloadDone {
        model: ModelId,
    },
    PromoteDone {
        model: ModelId,
        result: Result<(Loaded, LoadMeasurement), LoadError>,
    },
    PrepareDone {
        model: ModelId,
        weights: Weights,
        result: Prepared,
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
        let mut signatures = Vec::new();
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
            scheduler.set_preparations(
                id,
                preparations(&*entry.backend, &entry.path, entry.weights, entry.policy.promotable),
            );
            fingerprints.push(entry.fingerprint.clone());
            if entry.preload {
                preload.push(id);
            }
            let info = ModelInfo::new(
                entry.policy.name.clone(),
                entry.backend.name(),
                entry.backend.task(&entry.path),
                entry.path.clone(),
                entry.signature,
                batchable && !entry.batch_dependent,
                entry.weights,
            );
            signatures.push(info.signature.clone());
            infos.push(info);
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
            signatures,
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
            preparer: config.preparer,
            stop_asked: None,
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
    pub fn events(&self, since_ms: u64, after_seq: u64) -> Vec<LifecycleEvent> {
        self.events.since(since_ms, after_seq)
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
            _ => Err(SnoozeError::new(ErrorKind::Internal, "a tensor request got another kind of answer")),
        }
    }

    /// Runs a task job (a transcription, an OCR stage) slice by slice on the model — back
    /// in its queue between slices, sharing slices with the model's other jobs — and
    /// hands it back finished, its result inside.
    pub async fn run_task(
        &self,
        name: &str,
        priority: Option<Priority>,
        job: Box<dyn TaskJob>,
    ) -> Result<Box<dyn TaskJob>, SnoozeError> {
        match self.submit(name, priority, Payload::Task(job)).await? {
            Output::Task(job) => Ok(job),
            _ => Err(SnoozeError::new(ErrorKind::Internal, "a task job got another kind of answer")),
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
            _ => {
                Err(SnoozeError::new(ErrorKind::Internal, "an embedding request got another kind of answer"))
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
        let size = payload.work_size();
        let req = self.next_request_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::Submit {
            sub: Submit { req, model, priority, rows, key, size },
            job: Job { payload, reply, submitted: Some(Instant::now()), model },
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

    /// The host memory the budget accounts now: the baseline, what every model holds
    /// (working sets in flight included) and preparations running. The pressure history's
    /// readings are up to `memory_check_interval` old: right after an unload they still
    /// count the model.
    pub async fn accounted(&self) -> Option<u64> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Accounted { reply });
        rx.await.ok()
    }

    /// Whether `name`'s files were replaced since they were read (then read again, its
    /// signature included) — asked before what a request is checked against is trusted
    /// to refuse it, and before metadata is shown: a model not in memory serves its
    /// files as they are now.
    pub async fn refresh_files(&self, name: &str) -> bool {
        let Ok(model) = self.id(name) else { return false };
        let (reply, rx) = oneshot::channel();
        self.send(Command::Refresh { model, reply });
        rx.await.unwrap_or(false)
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

/// The one-time preparations a model's loads would gain from: its own form's, and the
/// prepacked copy a promotion loads.
pub(super) fn preparations(
    backend: &dyn Backend,
    path: &Path,
    loads_in: Weights,
    promotable: bool,
) -> Vec<Preparation> {
    let mut forms = vec![loads_in];
    if promotable && loads_in != Weights::Prepacked {
        forms.push(Weights::Prepacked);
    }
    forms
        .into_iter()
        .filter_map(|weights| {
            backend.preparation(path, weights).map(|peak| Preparation {
                weights,
                peak,
                loads_in: weights == loads_in,
            })
        })
        .collect()
}

/// Every input and output of the signature has a dynamic first dimension: requests can
/// be stacked along it.
fn dynamic_batch(sig: &ModelSignature) -> bool {
    let dynamic = |s: &crate::tensor::TensorSpec| s.shape.first().is_some_and(|d| *d < 0);
    !sig.inputs.is_empty() && sig.inputs.iter().all(dynamic) && sig.outputs.iter().all(dynamic)
}

#[cfg(test)]
mod tests;
