//! What the actor starts on blocking threads: a batch run, a load (measured), an
//! unload (audited: it must give back what its load took). Each reports back to the
//! actor with a [`Command`] when it ends.

use std::time::{Duration, Instant};

use super::{actor::Actor, Command, Loaded};
use crate::{
    backend::{Device, LoadError, LoadSpec, Weights},
    events::{metric, EventKind},
    execution::{self, BatchEnd, Job},
    lifecycle::{LoadMeasurement, ModelId, Prepared, RequestId, UnloadReason},
    memory::{self, MemoryProbe},
    units::format_bytes,
};

/// Runs `run` on a blocking thread: for a model of low CPU priority, a kept thread at
/// low priority (a thread cannot raise its priority back without privileges, so the
/// shared blocking pool's threads never lower theirs).
fn spawn_run(low_priority: bool, run: impl FnOnce() + Send + 'static) {
    if low_priority {
        execution::low_priority::spawn(run);
    } else {
        tokio::task::spawn_blocking(run);
    }
}

/// Held while an unload drops its model and measures what came back (see `start_unload`).
pub(super) static UNLOADING: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Actor {
    pub(super) fn start_run(&mut self, model: ModelId, reqs: Vec<RequestId>, max_rows: u32) {
        let mut jobs: Vec<(RequestId, Job)> =
            reqs.iter().filter_map(|r| self.jobs.remove(r).map(|j| (*r, j))).collect();
        let name = self.scheduler.slot(model).policy.name.clone();
        for (_, job) in &mut jobs {
            if let Some(submitted) = job.submitted.take() {
                metrics::histogram!(metric::QUEUE_WAIT, "model" => name.clone())
                    .record(submitted.elapsed().as_secs_f64());
            }
        }
        let tx = self.tx.clone();
        let Some(instance) = self.loaded.get(&model).map(|l| l.instance.clone()) else {
            tracing::error!(model, "dispatched to a model that is not loaded");
            let _ = tx.send(Command::RunDone {
                model,
                reqs,
                end: BatchEnd::done(),
                took: Duration::ZERO,
                grew: execution::Growth::default(),
            });
            return;
        };
        let policy = &self.scheduler.slot(model).policy;
        let (name, low_priority) = (policy.name.clone(), policy.low_cpu_priority);
        spawn_run(low_priority, move || {
            let started = Instant::now();
            let work = execution::WORK.begin();
            let (end, grew) = if jobs.is_empty() {
                (BatchEnd::done(), execution::Growth::default())
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

    pub(super) fn start_unload(&mut self, model: ModelId, device: Device, reason: UnloadReason, bytes: u64) {
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
            // Work like a run's: memory given back meanwhile (the model's, and what the
            // heap trim returns) is not a run's to count.
            let work = execution::WORK.begin();
            let started = Instant::now();
            let gpu_before = gpu.as_ref().map(|p| p.snapshot().process_bytes);
            let took = loaded.as_ref().and_then(|l| l.grew);
            // One unload measured at a time: the process's RSS is shared, so unloads side
            // by side (a gc, a shutdown, an emergency) each counted all of theirs as its
            // own ("368 MiB returned" twice), and the check below was masked or tripped
            // by a neighbour. A drop and a trim take milliseconds.
            let one_at_a_time = UNLOADING.lock().unwrap_or_else(|p| p.into_inner());
            let before = memory::process_rss_bytes();
            drop(loaded);
            memory::trim_heap();
            let mut freed = before.saturating_sub(memory::process_rss_bytes());
            // The memory a load took must come back: if not, trim once more, then say so.
            let short = |freed: u64| took.is_some_and(|t| freed.saturating_add((16 << 20).max(t / 10)) < t);
            if short(freed) {
                memory::trim_heap();
                freed = before.saturating_sub(memory::process_rss_bytes());
            }
            drop(one_at_a_time);
            if let (Some(probe), Some(held)) = (&gpu, gpu_before) {
                wait_for_gpu_release(probe.as_ref(), held, bytes);
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
            // Ended before the actor hears of it: the load it starts next must find the
            // meter idle, or it would never be measured.
            drop(work);
            let _ = tx.send(Command::UnloadDone { model });
        });
    }

    /// Loads the model on a blocking thread, measured; `promote`: a second instance in its
    /// prepacked form, for a model that keeps serving meanwhile.
    pub(super) fn start_load(&mut self, model: ModelId, device: Device, promote: bool) {
        let (backend, path, weights) = self.backends[model].clone();
        let weights = if promote { Weights::Prepacked } else { weights };
        let form = match self.scheduler.is_prepared(model, weights) {
            true => weights.as_str(),
            false => "onnx",
        };
        let policy = &self.scheduler.slot(model).policy;
        let spec = LoadSpec {
            name: policy.name.clone(),
            path,
            device,
            intra_op_threads: self.intra_op_threads,
            instances: policy.max_concurrency.max(1) as usize,
            weights,
            low_cpu_priority: policy.low_cpu_priority,
        };
        tracing::debug!(model = %spec.name, device = %spec.device, "loading");
        let tx = self.tx.clone();
        let probe = self.probe.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            // A run meanwhile must not take the load's memory for its own, nor the load a
            // run's: a load that did not run alone is not measured (its model keeps the
            // figure measured before, learned or estimated).
            let work = execution::WORK.begin();
            let panicked = || LoadError::Failed(format!("the backend panicked loading '{}'", spec.name));
            // A preparation running beside the load moves RSS by hundreds of MB: what the
            // load took is then not measurable.
            let preparations = execution::PREPARING.watch();
            memory::trim_heap();
            let before = probe.process_bytes().filter(|_| preparations.undisturbed());
            probe.reset_peak();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.load(&spec)))
                .unwrap_or_else(|_| Err(panicked()));
            let (after, peak) = (probe.process_bytes(), probe.peak_process_bytes());
            let before = before.filter(|_| preparations.undisturbed() && work.alone());
            let grew =
                |to: Option<u64>| to.zip(before).and_then(|(t, b)| t.checked_sub(b)).filter(|d| *d > 0);
            let result = result.map(|m| {
                let steady = grew(after).map(|s| s + m.mapped_bytes());
                let measured = LoadMeasurement {
                    steady,
                    // The mapped weights count once their pages are touched, after the
                    // load: the peak is never less than what stays.
                    peak: grew(peak).max(steady),
                    working: m.working_bytes(),
                };
                (Loaded { instance: m, grew: grew(after) }, measured)
            });
            let took = started.elapsed();
            // Ended before the actor hears of it, for the run it dispatches next.
            drop(work);
            let _ = tx.send(if promote {
                Command::PromoteDone { model, result }
            } else {
                Command::LoadDone { model, result, took, form }
            });
        });
    }
}

impl Actor {
    /// Does a model's one-time preparation through the preparer (in a child process, or on
    /// a thread of its own at low CPU priority), so requests keep the cores; reports what
    /// the model's loads cost from now on.
    pub(super) fn start_prepare(&mut self, model: ModelId, weights: Weights) {
        let (backend, path, load_weights) = self.backends[model].clone();
        let policy = &self.scheduler.slot(model).policy;
        let spec = LoadSpec {
            name: policy.name.clone(),
            path,
            device: Device::Cpu,
            intra_op_threads: self.intra_op_threads,
            instances: 1,
            weights,
            // The preparer lowers its own priority (a child process, or its thread).
            low_cpu_priority: false,
        };
        let tx = self.tx.clone();
        let preparer = self.preparer.clone();
        let spawned = std::thread::Builder::new().name("snooze-prepare".into()).spawn(move || {
            let started = Instant::now();
            // Beside the process's own loads and runs only when it runs in this process.
            let in_process = preparer.in_process();
            let _work = in_process.then(|| execution::WORK.begin());
            let _preparing = in_process.then(|| execution::PREPARING.begin());
            if in_process {
                memory::lower_thread_priority();
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                preparer.prepare(backend.as_ref(), &spec)
            }))
            .unwrap_or_else(|_| Err(LoadError::Failed(format!("the backend panicked preparing '{}'", spec.name))));
            if in_process {
                memory::trim_heap();
            }
            let result = match result {
                Ok(()) => {
                    tracing::info!(model = %spec.name, weights = weights.as_str(), duration_ms = started.elapsed().as_millis() as u64, "prepared in the background");
                    let e = (weights == load_weights).then(|| backend.estimate(&spec.path, weights));
                    Prepared::Done {
                        steady: e.as_ref().and_then(|e| e.steady_bytes),
                        peak: e.and_then(|e| e.peak_bytes),
                    }
                }
                Err(e) => Prepared::Failed(e.to_string()),
            };
            let _ = tx.send(Command::PrepareDone { model, weights, result });
        });
        if let Err(e) = spawned {
            let result = Prepared::Failed(format!("cannot start a thread: {e}"));
            let _ = self.tx.send(Command::PrepareDone { model, weights, result });
        }
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

pub(super) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
