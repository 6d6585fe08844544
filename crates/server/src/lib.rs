//! The SnoozeML server: configuration (file + env + flags), the request layer every
//! transport shares (`request`), the transports over it — REST (`rest`: KServe v2,
//! OpenAI, admin) and gRPC (`grpc`) — and the glue that builds a [`ModelManager`] from
//! a [`Config`]. The `snooze` binary is a thin CLI over this.

pub mod client;
pub mod config;
pub mod dump;
pub mod gpu;
pub mod grpc;
pub mod listener;
pub mod prepare;
pub mod request;
pub mod rest;

use std::{future::Future, sync::Arc, time::Duration};

use anyhow::Context;
use snooze_backend_candle::CandleBackend;
use snooze_backend_ort::{OrtBackend, ThreadPool};
use snooze_core::{
    lifecycle::SchedulerConfig,
    memory::{LimitSource, MemoryProbe},
    units::format_bytes,
    Backend, Device, HostProbe, ManagerConfig, ModelEntry, ModelManager, ModelPolicy, Weights,
};

use crate::config::{Backend as BackendKind, Config, MemoryLimit};
pub use request::AppState;
pub use rest::router;

/// The memory picture fixed at start.
#[derive(Clone)]
pub struct ServerMemory {
    pub budget_bytes: u64,
    pub baseline_bytes: u64,
    pub limit_source: LimitSource,
    /// Whether ONNX runs hand their activations back when they end (`release_activations`).
    pub releases_activations: bool,
    /// Each GPU NVML found, with its budget and probe.
    pub gpus: Vec<(Device, u64, Arc<dyn MemoryProbe>)>,
}

/// The backends a config needs, created once. ONNX Runtime is only required when an
/// ONNX model is configured, so a candle-only server runs without the library.
pub struct Backends {
    pub onnx: Option<Arc<dyn Backend>>,
    pub candle: Arc<dyn Backend>,
}

impl Backends {
    /// `release_activations`: whether ONNX runs hand their activations back (see
    /// [`releases_activations`]).
    pub fn for_config(config: &Config, release_activations: bool) -> anyhow::Result<Backends> {
        let pool = ThreadPool {
            intra_op_threads: config.server.intra_op_threads,
            spinning: config.server.intra_op_spinning,
        };
        let onnx = if config.models.iter().any(|m| m.backend == BackendKind::Onnx) {
            let ort = OrtBackend::with_pool(None, pool)
                .map_err(anyhow::Error::msg)?
                .with_cache_dir(config.server.state_dir.join("ort-cache"))
                .with_activations_released(release_activations);
            Some(Arc::new(ort) as Arc<dyn Backend>)
        } else {
            None
        };
        Ok(Backends { onnx, candle: Arc::new(CandleBackend::new()) })
    }

    pub fn get(&self, kind: BackendKind) -> anyhow::Result<Arc<dyn Backend>> {
        match kind {
            BackendKind::Onnx => self.onnx.clone().context("ONNX Runtime is not initialised"),
            BackendKind::Candle => Ok(self.candle.clone()),
        }
    }
}

/// `weights = "auto"` decided per model: `prepacked` (the fastest batches) when every
/// configured model fits the budget at once and `max_loaded_models` does not cap them —
/// nothing will be evicted, so its slower loads are rare — and the model batches
/// (`max_batch_size > 1`: prepacking only pays on batches); otherwise `mapped`, whose
/// swaps cost milliseconds, promoted in place to `prepacked` once it stays and batches
/// (see the scheduler's `promote`). Neither for a model that runs as fast `mapped`
/// (`Backend::prepacking_gains`, asked once per model). Measured: see bench/README.md.
/// Per model: the form, and whether it may be promoted.
fn resolve_weights(
    config: &Config,
    backends: &Backends,
    budget: u64,
    baseline: u64,
) -> anyhow::Result<Vec<(Weights, bool)>> {
    let s = &config.server;
    let mut all = baseline;
    for m in &config.models {
        let need = match m.memory {
            Some(b) => Some(b),
            None => backends.get(m.backend)?.estimate(&m.path, Weights::Prepacked).steady_bytes,
        };
        all = all.saturating_add(need.unwrap_or(u64::MAX / 4)).saturating_add(s.headroom);
    }
    let uncapped = s.max_loaded_models == 0 || s.max_loaded_models >= config.models.len();
    let roomy = all <= budget && uncapped;
    config
        .models
        .iter()
        .map(|m| {
            // A form the engine always uses (Whisper: prepacked) is what the model is said
            // to be held in, and the only copy prepared for it.
            if let Some(fixed) = backends.get(m.backend)?.fixed_weights(&m.path) {
                if !matches!(m.weights, Weights::Auto) && m.weights != fixed {
                    tracing::warn!(
                        model = %m.name,
                        asked = m.weights.as_str(),
                        "this model's weights are always {}: `weights` is ignored",
                        fixed.as_str()
                    );
                }
                return Ok((fixed, false));
            }
            if m.weights != Weights::Auto {
                return Ok((m.weights, false));
            }
            let gains = m.max_batch_size > 1 && backends.get(m.backend)?.prepacking_gains(&m.path);
            Ok(if roomy && gains { (Weights::Prepacked, false) } else { (Weights::Mapped, gains) })
        })
        .collect()
}

/// `release_activations`, or by default whether memory is bounded: a byte budget, or
/// `auto` under a memory cgroup's limit. Kept arenas there got the server OOM-killed: a
/// model's arena, once grown by a run, hides what a larger run needs from the working
/// set the scheduler learns, and the kernel, not the budget, then stops the process.
fn releases_activations(config: &Config, source: LimitSource) -> bool {
    let s = &config.server;
    s.release_activations.unwrap_or(match s.host_memory_limit {
        MemoryLimit::Size(_) => true,
        MemoryLimit::Auto => source != LimitSource::Machine,
    })
}

/// The budget a config gives, and what the server holds before any model.
fn budget_of(config: &Config, probe: &HostProbe) -> anyhow::Result<(u64, u64)> {
    let snap = probe.snapshot();
    let s = &config.server;
    let budget = match s.host_memory_limit {
        MemoryLimit::Auto => snap.total_bytes.saturating_sub(s.headroom),
        MemoryLimit::Size(size) => size.resolve(snap.total_bytes).min(snap.total_bytes),
    };
    // Measured after the backends are initialised: the runtime libraries are part of
    // what the server holds before any model.
    let baseline = snooze_core::memory::process_rss_bytes();
    if budget <= baseline + s.headroom {
        anyhow::bail!(
            "host_memory_limit leaves no room for models: budget {} <= server baseline {} + headroom {}",
            format_bytes(budget),
            format_bytes(baseline),
            format_bytes(s.headroom)
        );
    }
    Ok((budget, baseline))
}

/// `snooze prepare`: makes every one-time copy the config's models may load from (ORT
/// format, prepacked), as a server would in the background, but now and in the
/// foreground — for an image build, an init container or a deploy. Reports each model
/// through `report`. A model whose files cannot be read (corrupt, truncated, not a model
/// of its backend) is reported as such: an init container that said "nothing to
/// prepare" for it, and exited 0, left a server failing its every request.
pub fn prepare(config: &Config, mut report: impl FnMut(&str)) -> anyhow::Result<Prepared> {
    let backends =
        Backends::for_config(config, releases_activations(config, HostProbe::new().snapshot().source))?;
    let mut done = Prepared::default();
    for m in &config.models {
        let backend = backends.get(m.backend)?;
        if let Err(e) = backend.signature(&m.path) {
            report(&format!("{}: FAILED: the model cannot be read: {e}", m.name));
            done.unreadable.push(m.name.clone());
            continue;
        }
        // `auto` is decided by the budget at each start (an image is built on another
        // machine than it runs on): both forms it may choose, or only the quick-to-swap
        // one for a model that runs as fast in it (see `resolve_weights`).
        let forms = match (backend.fixed_weights(&m.path), m.weights) {
            // One form whatever `weights` says (Whisper's graphs: prepacked).
            (Some(fixed), _) => vec![fixed],
            (None, Weights::Auto) if backend.prepacking_gains(&m.path) => {
                vec![Weights::Mapped, Weights::Prepacked]
            }
            (None, Weights::Auto) => vec![Weights::Mapped],
            (None, chosen) => vec![chosen],
        };
        let mut any = false;
        for form in forms {
            if backend.preparation(&m.path, form).is_none() {
                continue;
            }
            any = true;
            let spec = snooze_core::LoadSpec {
                name: m.name.clone(),
                path: m.path.clone(),
                device: Device::Cpu,
                intra_op_threads: config.server.intra_op_threads,
                instances: 1,
                weights: form,
                low_cpu_priority: false,
            };
            let started = std::time::Instant::now();
            match backend.prepare(&spec) {
                Ok(()) => report(&format!(
                    "{}: prepared ({}) in {:.1} s",
                    m.name,
                    form.as_str(),
                    started.elapsed().as_secs_f64()
                )),
                Err(e) => {
                    done.failed += 1;
                    report(&format!("{}: FAILED ({}): {e}", m.name, form.as_str()));
                }
            }
            snooze_core::memory::trim_heap();
        }
        if !any {
            report(&format!("{}: nothing to prepare", m.name));
        }
    }
    Ok(done)
}

/// What [`prepare`] could not do.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Preparations that failed: their models still load, from their own files.
    pub failed: usize,
    /// Models whose files cannot be read at all.
    pub unreadable: Vec<String>,
}

/// Builds the model manager and the HTTP state from a validated config. Must run
/// inside a tokio runtime.
pub fn build(config: &Config) -> anyhow::Result<AppState> {
    let probe = Arc::new(HostProbe::new());
    let releases = releases_activations(config, probe.snapshot().source);
    if config.server.low_ram_mode {
        let tuned = snooze_core::memory::tune_allocator_for_low_ram();
        tracing::info!(tuned, "low-RAM mode: one malloc arena, 64 KiB mmap threshold");
    } else if releases && !snooze_core::memory::return_large_blocks() {
        tracing::warn!("the allocator keeps freed blocks: released activations stay resident until a trim");
    }
    // Installed before anything is recorded: the counters start at the first event.
    request::metrics::handle();
    let backends = Backends::for_config(config, releases)?;
    let snap = probe.snapshot();
    let s = &config.server;
    let (budget, baseline) = budget_of(config, &probe)?;
    let weights = resolve_weights(config, &backends, budget, baseline)?;
    let mut models = Vec::new();
    for (m, (weights, promotable)) in config.models.iter().zip(weights) {
        let backend = backends.get(m.backend)?;
        let estimate = backend.estimate(&m.path, weights);
        if estimate.steady_bytes.is_none() && m.memory.is_none() {
            tracing::warn!(model = %m.name, reason = %estimate.derivation, "footprint indeterminate: this model loads without the memory guard");
        }
        let signature = backend.signature(&m.path).map_err(|e| e.to_string());
        if let Err(e) = &signature {
            tracing::warn!(model = %m.name, error = %e, "cannot read the model's signature; its loads will fail");
        }
        let policy = ModelPolicy {
            name: m.name.clone(),
            devices: m.devices.clone(),
            cpu_fallback: m.cpu_fallback,
            memory: m.memory,
            estimate_steady: estimate.steady_bytes,
            estimate_peak: estimate.peak_bytes,
            keep_alive: m.keep_alive,
            min_residency: m.min_residency,
            pinned: m.pinned,
            max_queue: m.max_queue,
            max_batch_size: m.max_batch_size,
            batch_delay: m.batch_delay,
            max_concurrency: m.max_concurrency,
            priority: m.priority,
            promotable,
            low_cpu_priority: m.low_cpu_priority,
        };
        let batch_dependent = backend.batch_dependent(&m.path);
        let fingerprint = snooze_core::learned::model_fingerprint(&*backend, &m.path, weights);
        models.push(ModelEntry {
            policy,
            backend,
            path: m.path.clone(),
            signature,
            preload: m.preload,
            fingerprint,
            weights,
            batch_dependent,
        });
    }
    let gpus = gpu::detect();
    let mut budgets: std::collections::BTreeMap<Device, u64> = [(Device::Cpu, budget)].into();
    let mut baselines: std::collections::BTreeMap<Device, u64> = [(Device::Cpu, baseline)].into();
    for (device, probe) in &gpus {
        let snap = probe.snapshot();
        budgets.insert(device.clone(), snap.total_bytes.saturating_sub(s.headroom));
        baselines.insert(device.clone(), snap.process_bytes);
    }
    let gpu_list: Vec<(Device, u64, Arc<dyn MemoryProbe>)> =
        gpus.iter().map(|(d, p)| (d.clone(), budgets.get(d).copied().unwrap_or(0), p.clone())).collect();
    let scheduler = SchedulerConfig {
        budgets,
        baselines,
        headroom: s.headroom,
        max_loaded_models: s.max_loaded_models,
        retry_after: s.retry_after,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(60),
        queue_timeout: s.queue_timeout,
        max_swap_delay: s.max_swap_delay,
        max_concurrent_inferences: s.max_concurrent_inferences,
        max_concurrent_slices: s.max_concurrent_slices,
    };
    tracing::info!(
        budget_bytes = budget,
        baseline_bytes = baseline,
        headroom_bytes = s.headroom,
        limit_source = ?snap.source,
        release_activations = releases,
        models = models.len(),
        "memory budget {} ({:?} total {}, headroom {}), server baseline {}, activations {}",
        format_bytes(budget),
        snap.source,
        format_bytes(snap.total_bytes),
        format_bytes(s.headroom),
        format_bytes(baseline),
        if releases { "released after each run" } else { "kept in each model's arena" }
    );
    let manager = ModelManager::start(ManagerConfig {
        scheduler,
        models,
        acquire_timeout: s.acquire_timeout,
        intra_op_threads: s.intra_op_threads,
        probe,
        gpu_probes: gpus.clone(),
        store: Some(Arc::new(snooze_core::learned::FootprintStore::open(&s.state_dir))),
        thresholds: s.thresholds(),
        check_interval: s.memory_check_interval,
        preparer: Arc::new(
            prepare::ChildPreparer::new(&s.state_dir, s.intra_op_threads).map_err(anyhow::Error::msg)?,
        ),
    });
    let memory = ServerMemory {
        budget_bytes: budget,
        baseline_bytes: baseline,
        limit_source: snap.source,
        releases_activations: releases,
        gpus: gpu_list,
    };
    request::metrics::register_models(config.models.iter().map(|m| m.name.as_str()));
    request::metrics::register_pipelines(config.pipelines.iter().map(|p| p.name.as_str()));
    let state = AppState::new(manager, s.clone(), memory, &config.pipelines);
    if state.keys.enabled() {
        match state.keys.reload() {
            Ok(n) => tracing::info!(keys = n, "inference endpoints need an API key"),
            Err(e) => anyhow::bail!("{e}"),
        }
    }
    Ok(state)
}

/// Serves until `shutdown` resolves, then stops admitting (503 + Retry-After), lets
/// in-flight requests finish within `shutdown_timeout`, unloads every model and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    grpc: Option<tokio::net::TcpListener>,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let s = &state.settings;
    let exposure = request::auth::exposure_warnings(
        &s.http_address,
        &s.grpc_address,
        s.admin_token.is_some(),
        state.keys.enabled(),
    );
    for warning in exposure {
        tracing::warn!("{warning}");
    }
    raise_open_file_limit(s.max_connections);
    // Caught whether or not there is a key file: SIGHUP's default action ends the process.
    tokio::spawn(reload_keys_on_sighup(state.clone()));
    let limits = listener::ConnectionLimits {
        header_read_timeout: s.header_read_timeout,
        idle_timeout: s.idle_timeout,
        max_connections: s.max_connections,
    };
    let drain = state.clone();
    // gRPC stops once the drain is over; until then its calls are refused like REST's.
    // Set once the drain is over, to the grace connections then get.
    let (drained, drained_rx) = tokio::sync::watch::channel(None::<std::time::Duration>);
    let grpc = grpc.map(|l| {
        let mut drained_rx = drained_rx.clone();
        tokio::spawn(grpc::serve(l, state.clone(), async move {
            let _ = drained_rx.wait_for(Option::is_some).await;
        }))
    });
    let stop = async move {
        shutdown.await;
        tracing::info!("shutting down: refusing new work, waiting for requests in flight");
        drain.begin_shutdown();
        let timeout = drain.settings.shutdown_timeout;
        // A document's stages are separate requests to the core, which refuses new ones
        // once it shuts down: the documents being read finish first, in the same time.
        let waited = drain.documents_finished(timeout).await;
        if drain.manager.shutdown(timeout.saturating_sub(waited)).await {
            tracing::info!("all models unloaded");
            // Every answer is made; a slow reader gets this long to take it.
            CLOSE_GRACE
        } else {
            tracing::warn!(
                timeout_s = timeout.as_secs_f64(),
                "requests still running at shutdown_timeout; closing their connections and exiting"
            );
            std::time::Duration::ZERO
        }
    };
    let stop = async move {
        let grace = stop.await;
        let _ = drained.send(Some(grace));
        grace
    };
    listener::serve(listener, router(state.clone()), limits, stop).await;
    if let Some(task) = grpc {
        // gRPC calls still running get the same grace as REST's connections.
        let grace = (*drained_rx.borrow()).unwrap_or_default();
        match tokio::time::timeout(grace, task).await {
            Ok(served) => served??,
            Err(_) => tracing::warn!(
                grace_s = grace.as_secs_f64(),
                "gRPC calls still open after shutdown; closing them"
            ),
        }
    }
    Ok(())
}

/// After a clean drain, how long connections get to take the answers already made.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Re-reads `api_keys_file` on every SIGHUP: keys rotate without a restart (a file that
/// cannot be read, or names no key, leaves the keys in force as they were).
async fn reload_keys_on_sighup(state: AppState) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else { return };
    while hup.recv().await.is_some() {
        if state.settings.api_keys_file.is_none() {
            tracing::info!("SIGHUP: nothing to re-read (no api_keys_file); still serving");
            continue;
        }
        match state.keys.reload() {
            Ok(n) => tracing::info!(keys = n, "API keys reloaded (SIGHUP)"),
            Err(e) => tracing::error!("API keys not reloaded, the old ones stay in force: {e}"),
        }
    }
}

/// Lifts the soft open-file limit toward the hard one, so `max_connections` sockets
/// plus model files fit (many systems start processes at 1024).
fn raise_open_file_limit(connections: usize) {
    let want = (connections as u64).saturating_add(256);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 || lim.rlim_cur >= want {
            return;
        }
        let raised = libc::rlimit { rlim_cur: want.min(lim.rlim_max), rlim_max: lim.rlim_max };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 || raised.rlim_cur < want {
            tracing::warn!(
                limit = raised.rlim_cur,
                max_connections = connections,
                "the open-file limit is below max_connections + 256; accepts may fail under load"
            );
        }
    }
}
