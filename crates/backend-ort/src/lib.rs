//! The ONNX Runtime backend: serves `.onnx` models on the CPU through the `ort` crate.
//!
//! ONNX Runtime is loaded at run time from a shared library (`ORT_DYLIB_PATH`, the
//! one `make prepare` installs), so the server builds and its other backends work
//! on a machine without it; a missing library is an error sentence, never a panic.
//! A model's signature and footprint come from its files alone (a hand-rolled,
//! zero-copy protobuf walk), because the scheduler decides *whether* to load
//! before loading. Runtime errors are classified here, once: only ONNX Runtime's
//! own allocation-failure texts count as out-of-memory.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use ort::{
    environment::{Environment, GlobalThreadPoolOptions},
    session::Session,
};
use snooze_core::{
    Backend, Device, FootprintEstimate, LoadError, LoadSpec, LoadedModel, ModelSignature, Task, Weights,
};
use snooze_text::{SentenceLayout, TextEncoder};

mod convert;
pub mod embed;
pub mod errors;
pub mod estimate;
mod external;
mod model;
mod onnx_file;
mod owners;
mod panel_gemm;
mod panel_op;
mod panels;
mod proto;
mod sessions;
mod threads;
mod weights;
mod whisper;

use crate::{model::OrtModel, onnx_file::ModelFile};

const HOW_TO_FIX: &str = "run `make prepare` (it installs onnxruntime into .venv) and set ORT_DYLIB_PATH to \
     .venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1.*";

/// The share of a model's weight bytes stored as panels from which it runs as fast from
/// its mapped copy as prepacked (`OrtBackend::prepacking_gains`): an MLP's are all
/// panels but its biases.
const PANELED_ENOUGH: f64 = 0.9;

/// ONNX Runtime can be loaded once per process: the library it was loaded from
/// and the environment every session shares, or why that failed.
static RUNTIME: OnceLock<Result<(PathBuf, Environment, ThreadPool), String>> = OnceLock::new();

/// The `onnx` backend. Cheap to clone; every clone shares the one runtime.
#[derive(Clone)]
pub struct OrtBackend {
    env: Environment,
    /// The shared pool's settings, which a low-priority model's own pool copies.
    pool: ThreadPool,
    /// The runtime library (part of the ORT-format cache key).
    library: PathBuf,
    /// Where ORT-format copies of models are kept; `None`: `compact` and `mapped` fall
    /// back to `prepacked`.
    cache_dir: Option<PathBuf>,
    /// Runs hand their activations back when they end (see [`OrtBackend::with_activations_released`]).
    release_activations: bool,
    /// Sessions plan each run's activations into one block (see [`OrtBackend::with_memory_pattern`]).
    memory_pattern: bool,
}

impl std::fmt::Debug for OrtBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrtBackend").finish_non_exhaustive()
    }
}

/// The one intra-op thread pool every session shares (ONNX Runtime's global thread
/// pool): N loaded models do not start N pools of spinning threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadPool {
    /// Threads one run may use; 0 = one per core.
    pub intra_op_threads: usize,
    /// Let idle pool threads spin for new work (off by default: measured no faster on
    /// 2 cores, and it takes CPU from everything else).
    pub spinning: bool,
}

impl OrtBackend {
    /// Loads ONNX Runtime from `dylib_path`, else from `ORT_DYLIB_PATH`, with the
    /// default thread pool.
    pub fn new(dylib_path: Option<&Path>) -> Result<OrtBackend, String> {
        OrtBackend::with_pool(dylib_path, ThreadPool::default())
    }

    /// Loads ONNX Runtime. The first successful call fixes the library and the thread
    /// pool for the process; a later call naming another existing file gets the loaded
    /// one (and a warning). A failed initialisation is remembered and its error
    /// returned again.
    pub fn with_pool(dylib_path: Option<&Path>, pool: ThreadPool) -> Result<OrtBackend, String> {
        let path = locate_library(dylib_path, std::env::var_os("ORT_DYLIB_PATH"))?;
        let (loaded, env, pool) =
            RUNTIME.get_or_init(|| init_runtime(&path, pool)).as_ref().map_err(Clone::clone)?;
        if *loaded != path {
            tracing::warn!(
                requested = %path.display(),
                loaded = %loaded.display(),
                "ONNX Runtime is already loaded from another file; using that one"
            );
        }
        Ok(OrtBackend {
            env: env.clone(),
            pool: *pool,
            library: loaded.clone(),
            cache_dir: None,
            release_activations: true,
            memory_pattern: false,
        })
    }

    /// Keeps ORT-format copies of the models in `dir` (needed by `compact` and `mapped`).
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> OrtBackend {
        self.cache_dir = Some(dir.into());
        self
    }

    /// Whether a run hands its activations back to the system when it ends (the
    /// default) or leaves them in its session's arena for the next run. ONNX Runtime's
    /// arena keeps the largest run's activations for as long as the session lives: an
    /// OCR detector with 10 MiB of weights held ~190 MiB after one 736x960 page, Whisper
    /// tiny's encoder ~240 MiB after one window. Released, they cost the runs that had
    /// them 6-15% (measured: detector page 327 -> 368 ms, encoder window 189 -> 221 ms,
    /// 32 embeddings 189 -> 202 ms; no difference on small runs).
    pub fn with_activations_released(mut self, release: bool) -> OrtBackend {
        self.release_activations = release;
        self
    }

    /// Whether sessions use ONNX Runtime's memory pattern (its default; off here by
    /// default). The pattern plans a run's activations into one block per input shape;
    /// for models fed many shapes (pages, crops, token batches, Whisper windows) it nearly
    /// doubled what a run holds, for no speed (ONNX Runtime 1.32, 2 cores, the same runs
    /// with the pattern on and off: the OCR detector on a 1120x928 page +309 vs +166 MiB,
    /// 0.65-0.80 s a run either way; Whisper tiny.en's encoder +250 vs +134 MiB; MiniLM on
    /// batches of 1-32 texts +169 vs +110 MiB, 112-131 vs 114-129 texts/s; the recogniser
    /// +95 vs +89 MiB). Without it the arena still keeps and reuses what runs free.
    pub fn with_memory_pattern(mut self, enable: bool) -> OrtBackend {
        self.memory_pattern = enable;
        self
    }

    /// Whether `file` has or can have a mapped copy (a cache directory and inline weights).
    fn mappable(&self, file: &Path) -> bool {
        self.cache_dir.as_deref().is_some_and(|dir| {
            weights::cached_mapped_copy(file, dir, &self.library).is_some() || external::possible(file)
        })
    }

    /// Whether the mapped copy of `file` in `dir` has (or, once made, will have) weights
    /// stored as panels (see `panels`).
    fn paneled(&self, file: &Path, dir: &Path) -> bool {
        match weights::cached_mapped_copy(file, dir, &self.library) {
            Some(copy) => external::has_panels(&copy),
            None => external::would_have_panels(file),
        }
    }

    /// The ORT-format copy of `file`, if it was made.
    fn cached_ort_format(&self, file: &Path) -> Option<PathBuf> {
        weights::cached_ort_file(file, self.cache_dir.as_deref()?, &self.library)
    }

    /// The ORT-format copy of `file`, converted now if needed.
    fn ort_format(&self, name: &str, file: &Path, weights: Weights) -> Result<PathBuf, LoadError> {
        let dir = self.cache_dir.as_deref().ok_or_else(|| {
            LoadError::Failed(format!(
                "model '{name}': weights = \"{}\" needs an ORT-format cache directory (state_dir)",
                weights.as_str()
            ))
        })?;
        weights::ort_format_file(&self.env, file, dir, &self.library).map_err(|e| {
            LoadError::Failed(format!("model '{name}' (weights = \"{}\"): {e}", weights.as_str()))
        })
    }
}

/// The library file to load: the argument, else the environment variable.
fn locate_library(arg: Option<&Path>, env_var: Option<std::ffi::OsString>) -> Result<PathBuf, String> {
    let (path, source) = match (arg, env_var) {
        (Some(p), _) => (p.to_path_buf(), "the configured path"),
        (None, Some(v)) if !v.is_empty() => (PathBuf::from(v), "ORT_DYLIB_PATH"),
        (None, _) => {
            return Err(format!(
                "the ONNX Runtime library was not found: ORT_DYLIB_PATH is not set; {HOW_TO_FIX}"
            ))
        }
    };
    if !path.is_file() {
        return Err(format!(
            "the ONNX Runtime library {} (from {source}) does not exist; {HOW_TO_FIX}",
            path.display()
        ));
    }
    // Absolute, because `ort` resolves a relative path against the executable's folder.
    std::fs::canonicalize(&path).map_err(|e| format!("cannot resolve {}: {e}", path.display()))
}

fn init_runtime(path: &Path, pool: ThreadPool) -> Result<(PathBuf, Environment, ThreadPool), String> {
    let failed = |e: &dyn std::fmt::Display| {
        format!("cannot initialise ONNX Runtime from {}: {e}; {HOW_TO_FIX}", path.display())
    };
    // `ort` asserts on a library that is not ONNX Runtime; that must not take the server down.
    let built = catch_unwind(AssertUnwindSafe(|| {
        let builder = ort::init_from(path).map_err(|e| failed(&e))?;
        let mut threads =
            GlobalThreadPoolOptions::default().with_spin_control(pool.spinning).map_err(|e| failed(&e))?;
        if pool.intra_op_threads > 0 {
            threads = threads.with_intra_threads(pool.intra_op_threads).map_err(|e| failed(&e))?;
        }
        builder
            .with_name("snooze")
            .with_telemetry(false)
            .with_global_thread_pool(threads)
            .build()
            .map_err(|e| failed(&e))
    }))
    .map_err(|_| failed(&"the library panicked while loading (is it really libonnxruntime?)"))?;
    let env = built?;
    warm_up(&env);
    tracing::info!(library = %path.display(), "ONNX Runtime loaded");
    Ok((path.to_path_buf(), env, pool))
}

/// Creates and drops one trivial session, so the runtime's one-time costs (kernel
/// registries, code pages: about 20 MiB) land in the server's baseline, measured
/// at start, instead of in the first model's measured footprint.
fn warm_up(env: &Environment) {
    let result = Session::builder(env).and_then(|mut b| b.commit_from_memory(&warm_up_model()));
    match result {
        Ok(session) => drop(session),
        Err(e) => tracing::warn!("ONNX Runtime warm-up session failed: {e}"),
    }
    snooze_core::memory::trim_heap();
}

/// `y = Identity(x)` over a float [1] tensor, as ONNX protobuf (IR 8, opset 17).
fn warm_up_model() -> Vec<u8> {
    use proto::{bytes_field as ld, varint_field as varint};
    let value_info = |name: &str| {
        let shape = ld(2, &ld(1, &varint(1, 1)));
        let tensor_type = [varint(1, 1), shape].concat();
        [ld(1, name.as_bytes()), ld(2, &ld(1, &tensor_type))].concat()
    };
    let node = [ld(1, b"x"), ld(2, b"y"), ld(4, b"Identity")].concat();
    let graph =
        [ld(1, &node), ld(2, b"warm_up"), ld(11, &value_info("x")), ld(12, &value_info("y"))].concat();
    let opset = [ld(1, b""), varint(2, 17)].concat();
    [varint(1, 8), ld(8, &opset), ld(7, &graph)].concat()
}

/// The `.onnx` file a model path designates: the file itself, the ONNX export of a
/// sentence-embedding folder (`onnx/model.onnx`), or `model.onnx` / `1/model.onnx`
/// (Triton's versioned layout) inside a folder.
pub fn resolve_model_file(path: &Path) -> Result<PathBuf, String> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if path.is_dir() {
        if let Some(export) = snooze_text::onnx_export(path) {
            return Ok(export);
        }
        for candidate in [path.join("model.onnx"), path.join("1").join("model.onnx")] {
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
        return Err(format!("{} holds neither model.onnx nor 1/model.onnx", path.display()));
    }
    Err(format!("model path {} does not exist", path.display()))
}

/// An entry of the `metadata_props` of the model at `path` (a PP-OCR recogniser keeps
/// its dictionary under `character`), read from the file without loading it.
pub fn model_metadata(path: &Path, key: &str) -> Result<Option<String>, String> {
    let file = resolve_model_file(path)?;
    ModelFile::metadata(&file, key).map_err(|e| format!("{}: {e}", file.display()))
}

fn read_signature(file: &Path) -> Result<ModelSignature, LoadError> {
    ModelFile::read(file)
        .and_then(|m| m.signature())
        .map_err(|e| LoadError::Failed(format!("{} is not a usable ONNX model: {e}", file.display())))
}

/// What a model folder is for: a sentence-embedding folder with an ONNX export is
/// served as texts in, vectors out; anything else as tensors.
fn task_of(path: &Path) -> Task {
    if whisper::is_whisper(path) {
        Task::Transcription
    } else if path.is_dir() && snooze_text::onnx_export(path).is_some() {
        Task::Embedding
    } else {
        Task::Tensor
    }
}

/// The sentence-embedding folder at `path` and how its export's graph fits it.
fn embedding_layout(path: &Path, file: &Path) -> Result<(SentenceLayout, embed::EncoderGraph), LoadError> {
    let layout = SentenceLayout::read(path).map_err(LoadError::Failed)?;
    let graph = embed::encoder_graph(&read_signature(file)?, layout.encoder.hidden_size)
        .map_err(|e| LoadError::Failed(format!("{} is not a text encoder export: {e}", file.display())))?;
    Ok((layout, graph))
}

impl Backend for OrtBackend {
    fn name(&self) -> &'static str {
        "onnx"
    }

    fn estimate(&self, path: &Path, weights: Weights) -> FootprintEstimate {
        if task_of(path) == Task::Transcription {
            return whisper::estimate(path, weights);
        }
        // Until its copy exists, a lean model loads its mapped copy, about its weights as
        // the converted one is; or, if it cannot have one, the .onnx, as `prepacked` does.
        let lean = matches!(weights, Weights::Compact | Weights::Mapped);
        let file = resolve_model_file(path).ok();
        let converted = || file.as_deref().and_then(|f| self.cached_ort_format(f)).is_some();
        let (form, meanwhile) = if !lean || converted() {
            (weights, None)
        } else if file.as_deref().is_some_and(|f| self.mappable(f)) {
            (weights, Some("; not converted yet: loads its mapped copy meanwhile"))
        } else {
            (Weights::Prepacked, Some("; not converted yet: loads from the .onnx meanwhile"))
        };
        let mut e = estimate::estimate(path, form);
        e.derivation += meanwhile.unwrap_or_default();
        if task_of(path) == Task::Embedding {
            estimate::add_embedding(&mut e, path);
        }
        e
    }

    /// The ORT-format copy (`compact`, `mapped`) or the prepacked copy (`prepacked`) that
    /// does not exist yet, as the peak its conversion holds: about 1.7x the model from
    /// its mapped copy, 2.7x from the `.onnx` (where a prepacked copy of a model whose
    /// mapped copy has weights stored as panels is made from).
    fn preparation(&self, path: &Path, weights: Weights) -> Option<u64> {
        let dir = self.cache_dir.as_deref()?;
        if task_of(path) == Task::Transcription {
            return whisper::preparation(path, dir, &self.library);
        }
        let file = resolve_model_file(path).ok()?;
        let made = match weights {
            Weights::Compact | Weights::Mapped => weights::cached_ort_file(&file, dir, &self.library),
            Weights::Prepacked | Weights::Auto => weights::cached_prepacked_file(&file, dir, &self.library),
        };
        let prepacking = matches!(weights, Weights::Prepacked | Weights::Auto);
        match made {
            Some(_) => None,
            None => estimate::conversion_peak(
                path,
                self.mappable(&file) && !(prepacking && self.paneled(&file, dir)),
            ),
        }
    }

    fn task(&self, path: &Path) -> Task {
        task_of(path)
    }

    fn batch_dependent(&self, path: &Path) -> bool {
        task_of(path) != Task::Transcription
            && resolve_model_file(path)
                .ok()
                .and_then(|f| ModelFile::read(&f).ok())
                .is_some_and(|m| m.batch_dependent)
    }

    /// Not for a model whose weights are nearly all panels in its mapped copy: that copy
    /// runs as fast as prepacked (`panels`, `panel_op`), and a promotion would only
    /// convert and load it again.
    fn prepacking_gains(&self, path: &Path) -> bool {
        if task_of(path) != Task::Tensor {
            return true;
        }
        let Ok(file) = resolve_model_file(path) else { return true };
        !(self.mappable(&file) && external::paneled_share(&file) >= PANELED_ENOUGH)
    }

    fn fixed_weights(&self, path: &Path) -> Option<Weights> {
        (task_of(path) == Task::Transcription).then_some(Weights::Prepacked)
    }

    /// A folder's every file, as the core counts them; a model named by its `.onnx` file
    /// counts the external data that file names as well.
    fn fingerprint(&self, path: &Path) -> String {
        if path.is_file() {
            weights::model_fingerprint(path)
        } else {
            snooze_core::learned::fingerprint(path)
        }
    }

    fn signature(&self, path: &Path) -> Result<ModelSignature, LoadError> {
        if task_of(path) == Task::Transcription {
            return whisper::signature(path);
        }
        let file = resolve_model_file(path).map_err(LoadError::Failed)?;
        if task_of(path) == Task::Embedding {
            let (layout, _) = embedding_layout(path, &file)?;
            return Ok(snooze_text::kserve::signature(embed::PLATFORM, layout.encoder.hidden_size));
        }
        read_signature(&file)
    }

    /// Makes the cached copy a load in `spec.weights` uses: the ORT-format file
    /// (`compact`, `mapped`) or the prepacked copy (`prepacked`). Its transient memory
    /// (about 2.6x a 100 MiB model) is the scheduler's to fit, never a load's.
    fn prepare(&self, spec: &LoadSpec) -> Result<(), LoadError> {
        if task_of(&spec.path) == Task::Transcription {
            let Some(dir) = &self.cache_dir else { return Ok(()) };
            return whisper::prepare(&self.env, spec, dir, &self.library);
        }
        let file = resolve_model_file(&spec.path)
            .map_err(|e| LoadError::Failed(format!("cannot prepare model '{}': {e}", spec.name)))?;
        read_signature(&file)?;
        match spec.weights {
            Weights::Compact | Weights::Mapped => self.ort_format(&spec.name, &file, spec.weights).map(drop),
            Weights::Prepacked | Weights::Auto => {
                let Some(dir) = &self.cache_dir else { return Ok(()) };
                weights::prepacked_file(&self.env, &file, dir, &self.library)
                    .map(drop)
                    .map_err(|e| LoadError::Failed(format!("model '{}': {e}", spec.name)))
            }
        }
    }

    fn load(&self, spec: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError> {
        if spec.device != Device::Cpu {
            return Err(LoadError::Failed(format!(
                "model '{}': the onnx backend runs on the CPU only, not on {}",
                spec.name, spec.device
            )));
        }
        if task_of(&spec.path) == Task::Transcription {
            return whisper::load(self, spec);
        }
        let file = resolve_model_file(&spec.path)
            .map_err(|e| LoadError::Failed(format!("cannot load model '{}': {e}", spec.name)))?;
        // A corrupt file fails here with a sentence instead of a protobuf error code.
        let signature = read_signature(&file)?;
        // An embedding folder's configuration and tokenizer are checked before any session exists.
        let embedding = match task_of(&spec.path) {
            Task::Embedding => {
                let (layout, graph) = embedding_layout(&spec.path, &file)?;
                let encoder = TextEncoder::load(&layout).map_err(LoadError::Failed)?;
                Some((layout, graph, encoder))
            }
            Task::Tensor | Task::Transcription => None,
        };
        let (sessions, bytes, runtime_mapped) = self.sessions(spec, &file)?;
        tracing::debug!(model = %spec.name, file = %file.display(), sessions = sessions.len(), weights = spec.weights.as_str(), "onnx sessions created");
        // SAFETY: `sessions` borrow only from `bytes` (see `sessions`).
        let model = unsafe {
            OrtModel::new(
                spec.name.clone(),
                signature,
                sessions,
                bytes,
                runtime_mapped,
                self.release_activations,
            )
        };
        Ok(match embedding {
            Some((layout, graph, encoder)) => {
                tracing::info!(pooling = ?layout.pooling, normalize = layout.normalize, max_seq_len = layout.max_seq_len, "sentence embeddings");
                Arc::new(embed::OrtEmbedder::new(model, graph, &layout, encoder))
            }
            None => Arc::new(model),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn library_location_errors_say_how_to_fix() {
        let err = locate_library(None, None).unwrap_err();
        assert!(err.contains("ORT_DYLIB_PATH is not set") && err.contains("make prepare"), "{err}");
        let err = locate_library(None, Some("".into())).unwrap_err();
        assert!(err.contains("not set"), "{err}");
        let err = locate_library(None, Some("/nonexistent/libonnxruntime.so".into())).unwrap_err();
        assert!(err.contains("/nonexistent/libonnxruntime.so") && err.contains("ORT_DYLIB_PATH"), "{err}");
        let err = locate_library(Some(Path::new("/nope.so")), Some("/also-nope.so".into())).unwrap_err();
        assert!(err.contains("/nope.so") && err.contains("make prepare"), "{err}");
    }

    #[test]
    fn the_warm_up_model_declares_x_and_y() {
        let sig = ModelFile::parse(&warm_up_model()).unwrap().signature().unwrap();
        assert_eq!(sig.inputs[0].name, "x");
        assert_eq!(sig.outputs[0].shape, vec![1]);
    }

    #[test]
    fn model_paths_resolve_to_files_or_layouts() {
        let dir = std::env::temp_dir().join(format!("snooze-ort-resolve-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("triton/1")).unwrap();
        std::fs::create_dir_all(dir.join("flat")).unwrap();
        std::fs::create_dir_all(dir.join("empty")).unwrap();
        std::fs::write(dir.join("triton/1/model.onnx"), b"x").unwrap();
        std::fs::write(dir.join("flat/model.onnx"), b"x").unwrap();
        assert_eq!(resolve_model_file(&dir.join("triton")).unwrap(), dir.join("triton/1/model.onnx"));
        assert_eq!(resolve_model_file(&dir.join("flat")).unwrap(), dir.join("flat/model.onnx"));
        let file = dir.join("flat/model.onnx");
        assert_eq!(resolve_model_file(&file).unwrap(), file);
        assert!(resolve_model_file(&dir.join("empty")).unwrap_err().contains("neither"));
        assert!(resolve_model_file(&dir.join("missing")).unwrap_err().contains("does not exist"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
