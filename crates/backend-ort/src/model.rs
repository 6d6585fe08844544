//! A loaded ONNX Runtime session behind the `LoadedModel` seam.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex, MutexGuard, PoisonError, TryLockError,
    },
};

use ort::session::{OutputSelector, RunOptions, Session, SessionInputValue, SessionOutputs};
use snooze_core::{InferError, LoadSpec, LoadedModel, ModelSignature, Tensor};

use crate::{convert, errors, threads, weights::ModelBytes, OrtBackend};

/// A session over the runtime's own copy of the model, or one that uses `bytes` in place.
pub(crate) enum Runner {
    Own(Session),
    /// Made with `session.use_ort_model_bytes_directly`: it reads the `OrtModel`'s
    /// `bytes` in place, so it must not outlive them (see `Drop`).
    InPlace(Session),
}

impl Runner {
    fn run<'r>(
        &'r mut self,
        feeds: Vec<(String, SessionInputValue<'_>)>,
        options: &'r RunOptions<ort::session::HasSelectedOutputs>,
    ) -> ort::Result<SessionOutputs<'r>> {
        match self {
            Runner::Own(s) => s.run_with_options(feeds, options),
            Runner::InPlace(s) => s.run_with_options(feeds, options),
        }
    }
}

pub(crate) struct OrtModel {
    name: String,
    signature: ModelSignature,
    /// The `ort` crate's `Session::run` takes `&mut self` although ONNX Runtime's `Run`
    /// is thread-safe, so concurrent runs of one model need one session each: the
    /// scheduler starts at most `max_concurrency` runs, and that many sessions are
    /// loaded (each counted in the measured footprint). `Option` so `Drop` can release
    /// the sessions before trimming the heap.
    sessions: Vec<Mutex<Option<Runner>>>,
    /// What `InPlace` sessions use; dropped after them.
    bytes: Option<ModelBytes>,
    /// Bytes of model files served from a mapping (`bytes`' or one the runtime made).
    mapped: u64,
    /// Runs shrink the arena when they end (see [`run_options`]).
    release: bool,
    /// A run succeeded: a shape error is then the request's (see `errors::infer_error`).
    served: AtomicBool,
}

impl OrtModel {
    /// `runtime_mapped`: bytes of data files the runtime maps for the sessions (the
    /// mapped copy's weights).
    ///
    /// # Safety
    /// Every `Runner::InPlace` in `sessions` must borrow from `bytes` (and nothing else
    /// with a shorter life): the model keeps `bytes` alive until its sessions are gone.
    pub(crate) unsafe fn new(
        name: String,
        signature: ModelSignature,
        sessions: Vec<Runner>,
        bytes: Option<ModelBytes>,
        runtime_mapped: u64,
        release: bool,
    ) -> OrtModel {
        OrtModel {
            name,
            signature,
            sessions: sessions.into_iter().map(|s| Mutex::new(Some(s))).collect(),
            mapped: bytes.as_ref().map_or(0, ModelBytes::mapped_len) + runtime_mapped,
            bytes,
            release,
            served: AtomicBool::new(false),
        }
    }

    /// A session no other run holds (the scheduler keeps runs <= sessions); the first
    /// one, waited for, if they are all busy anyway.
    fn free_session(&self) -> MutexGuard<'_, Option<Runner>> {
        for m in &self.sessions {
            match m.try_lock() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        self.sessions[0].lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn input_names(&self) -> String {
        self.signature.inputs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    fn output_names(&self) -> String {
        self.signature.outputs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// Refuses a request the model cannot take, naming the tensor, before the runtime sees it.
    fn check_inputs(&self, inputs: &[Tensor]) -> Result<(), InferError> {
        let invalid = |m: String| Err(InferError::InvalidInput(m));
        let mut seen = HashSet::new();
        for t in inputs {
            let Some(spec) = self.signature.inputs.iter().find(|s| s.name == t.name) else {
                return invalid(format!(
                    "model '{}' has no input '{}' (its inputs: {})",
                    self.name,
                    t.name,
                    self.input_names()
                ));
            };
            if !seen.insert(t.name.as_str()) {
                return invalid(format!("input '{}' is given more than once", t.name));
            }
            // An empty declared shape may mean "rank unknown": the runtime checks those shapes.
            let rank_unknown = spec.shape.is_empty() && !t.shape.is_empty();
            if t.datatype() != spec.datatype || !rank_unknown {
                spec.check(t).or_else(invalid)?;
            }
            if Tensor::shape_elements(&t.shape) != Some(t.data.len()) {
                return invalid(format!(
                    "input '{}' has shape {:?} but carries {} values",
                    t.name,
                    t.shape,
                    t.data.len()
                ));
            }
        }
        if let Some(missing) = self.signature.inputs.iter().find(|s| !seen.contains(s.name.as_str())) {
            return invalid(format!(
                "input '{}' is missing (model '{}' needs: {})",
                missing.name,
                self.name,
                self.input_names()
            ));
        }
        Ok(())
    }

    /// The outputs to return, in the order to return them.
    fn wanted_outputs<'a>(&'a self, requested: &'a [String]) -> Result<Vec<&'a str>, InferError> {
        if requested.is_empty() {
            return Ok(self.signature.outputs.iter().map(|s| s.name.as_str()).collect());
        }
        requested
            .iter()
            .map(|name| {
                if self.signature.outputs.iter().any(|s| &s.name == name) {
                    Ok(name.as_str())
                } else {
                    Err(InferError::InvalidInput(format!(
                        "model '{}' has no output '{name}' (its outputs: {})",
                        self.name,
                        self.output_names()
                    )))
                }
            })
            .collect()
    }
}

impl LoadedModel for OrtModel {
    fn signature(&self) -> &ModelSignature {
        &self.signature
    }

    fn mapped_bytes(&self) -> u64 {
        self.mapped
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        self.check_inputs(inputs)?;
        let wanted = self.wanted_outputs(outputs)?;
        let feeds = inputs.iter().map(|t| convert::to_input(&self.name, t)).collect::<Result<Vec<_>, _>>()?;
        // Naming only the wanted outputs lets the runtime skip nodes nobody reads.
        let mut unique = HashSet::new();
        let selector = wanted
            .iter()
            .filter(|n| unique.insert(**n))
            .fold(OutputSelector::no_default(), |s, n| s.with(*n));
        let served = self.served.load(Ordering::Relaxed);
        let run_failed = |e: ort::Error| errors::infer_error(&self.name, e.code(), e.message(), served);
        let options = run_options(self.release).map_err(run_failed)?.with_outputs(selector);

        let mut guard = self.free_session();
        let session = guard
            .as_mut()
            .ok_or_else(|| InferError::Failed(format!("model '{}' has been unloaded", self.name)))?;
        let results = session.run(feeds, &options).map_err(run_failed)?;
        self.served.store(true, Ordering::Relaxed);
        wanted
            .iter()
            .map(|name| {
                let value = results.get(*name).ok_or_else(|| {
                    InferError::Failed(format!("model '{}' returned no output '{name}'", self.name))
                })?;
                convert::to_tensor(name, value)
                    .map_err(|e| InferError::Failed(format!("model '{}': {e}", self.name)))
            })
            .collect()
    }
}

/// A session builder for serving `spec` on `backend`: every graph optimisation,
/// prepacking as asked, ONNX Runtime's memory pattern as the backend says (see
/// [`OrtBackend::with_memory_pattern`]), and the threads the spec's CPU priority gets
/// (see `threads`). The error is the runtime's message.
pub(crate) fn serving_builder(
    backend: &OrtBackend,
    spec: &LoadSpec,
    prepack: bool,
) -> Result<ort::session::builder::SessionBuilder, String> {
    let builder = (|| -> ort::Result<ort::session::builder::SessionBuilder> {
        Ok(Session::builder(&backend.env)?
            .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)?
            .with_prepacking(prepack)?
            .with_memory_pattern(backend.memory_pattern)?
            .with_operators(crate::panel_op::domain()?)?)
    })()
    .map_err(|e| e.message().to_string())?;
    threads::with_threads(builder, spec, backend.pool)
}

/// Options of a run; `release`: the session's arena frees what the run allocated and no
/// longer uses when it ends, instead of keeping it for the next run (see
/// `OrtBackend::with_activations_released`).
pub(crate) fn run_options(release: bool) -> ort::Result<RunOptions> {
    let mut options = RunOptions::new()?;
    if release {
        options.set("memory.enable_memory_arena_shrinkage", "cpu:0")?;
    }
    Ok(options)
}

impl Drop for OrtModel {
    fn drop(&mut self) {
        // Sessions before the bytes they may borrow.
        for m in &mut self.sessions {
            drop(m.get_mut().unwrap_or_else(PoisonError::into_inner).take());
        }
        drop(self.bytes.take());
        // ONNX Runtime frees through glibc, which keeps the freed arenas mapped:
        // without a trim an unloaded model still counts against RSS and the cgroup.
        snooze_core::memory::trim_heap();
    }
}
