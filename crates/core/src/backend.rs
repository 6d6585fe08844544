//! The engine seam: a small *synchronous* trait a backend crate implements.
//!
//! Backends never see the scheduler; the async shell (`manager`) calls `load` on a
//! blocking thread, keeps the `LoadedModel` while it is resident and drops it to
//! unload. Errors are classified once, here at the boundary: only a failure the
//! backend *verified* as out-of-memory may trigger eviction-and-retry.

use std::{path::PathBuf, sync::Arc};

use crate::tensor::{ModelSignature, Tensor};

/// A placement target: `cpu` or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Device {
    Cpu,
    Cuda(u32),
}

impl Device {
    pub fn parse(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device '{s}' (expected \"cpu\" or \"cuda:N\")")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl From<Device> for String {
    fn from(d: Device) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Device::parse(&s)
    }
}

/// How a model's weights are held in memory. ONNX Runtime models choose; other
/// backends have one way and ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Weights {
    /// Chosen at start from the budget and the model's batching (see the README).
    #[default]
    Auto,
    /// ONNX Runtime's default: MatMul weights prepacked — fastest on batches, slowest to load.
    Prepacked,
    /// One private copy of the weights, not prepacked: little over the weights' size, quick to load.
    Compact,
    /// Served straight from a read-only mapping of the model file (its cached ORT-format
    /// copy): no private copy at all, and a reload from the page cache takes milliseconds.
    Mapped,
}

impl Weights {
    pub fn parse(s: &str) -> Option<Weights> {
        match s {
            "auto" => Some(Weights::Auto),
            "prepacked" => Some(Weights::Prepacked),
            "compact" => Some(Weights::Compact),
            "mapped" => Some(Weights::Mapped),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Weights::Auto => "auto",
            Weights::Prepacked => "prepacked",
            Weights::Compact => "compact",
            Weights::Mapped => "mapped",
        }
    }
}

/// What a model is for, which decides the APIs that serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Tensors in, tensors out (KServe).
    Tensor,
    /// Texts in, vectors out (`/v1/embeddings`, and KServe BYTES).
    Embedding,
    /// Audio in, text out (`/v1/audio/transcriptions`, and KServe BYTES): a job of many
    /// runs (encoder windows, decoder steps) advanced in slices.
    Transcription,
}

/// A backend's guess of what a model will take, and how it got there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FootprintEstimate {
    /// Resident bytes once loaded; `None` when the files do not determine it.
    pub steady_bytes: Option<u64>,
    /// Bytes at the worst moment of the load (file bytes and tensors held at once).
    pub peak_bytes: Option<u64>,
    /// A sentence on how the figure was derived (shown by `snooze estimate`).
    pub derivation: String,
}

impl FootprintEstimate {
    pub fn indeterminate(why: impl Into<String>) -> Self {
        FootprintEstimate { steady_bytes: None, peak_bytes: None, derivation: why.into() }
    }
}

/// What the shell asks a backend to load.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub name: String,
    pub path: PathBuf,
    pub device: Device,
    /// Threads a single inference may use inside the runtime (0 = runtime default).
    pub intra_op_threads: usize,
    /// Runs the scheduler may start at once on this model: a backend whose runs need
    /// exclusive access to their instance loads this many.
    pub instances: usize,
    /// How the weights are held (resolved: never `Auto` here).
    pub weights: Weights,
    /// The runtime threads of its runs at a lower CPU priority (see
    /// [`crate::lifecycle::ModelPolicy::low_cpu_priority`]); a backend that cannot set
    /// them runs as usual.
    pub low_cpu_priority: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The backend verified an allocation failure (strict match, never a guess).
    #[error("out of memory while loading: {0}")]
    OutOfMemory(String),
    /// Anything else: missing file, bad format, unsupported operator...
    #[error("{0}")]
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InferError {
    #[error("out of memory during inference: {0}")]
    OutOfMemory(String),
    /// The request does not fit the model (caught by the runtime, not by validation).
    #[error("{0}")]
    InvalidInput(String),
    #[error("{0}")]
    Failed(String),
}

/// What a text-embedding model is given.
#[derive(Debug, Clone, PartialEq)]
pub enum EmbedInput {
    Texts(Vec<String>),
    TokenIds(Vec<Vec<u32>>),
}

impl EmbedInput {
    pub fn len(&self) -> usize {
        match self {
            EmbedInput::Texts(t) => t.len(),
            EmbedInput::TokenIds(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    /// Tokens the model consumed for each input (after truncation).
    pub tokens: Vec<usize>,
}

impl Embeddings {
    pub fn new(vectors: Vec<Vec<f32>>, tokens: Vec<usize>) -> Embeddings {
        Embeddings { vectors, tokens }
    }

    /// Tokens consumed, summed over inputs.
    pub fn prompt_tokens(&self) -> usize {
        self.tokens.iter().sum()
    }
}

/// A model that turns texts into vectors.
pub trait Embedder: Send + Sync {
    fn dimensions(&self) -> usize;
    /// Longest input in tokens; longer inputs are truncated.
    fn max_tokens(&self) -> usize;
    /// Whether the vectors are L2-normalized (then truncation to fewer `dimensions` is allowed).
    fn normalized(&self) -> bool;
    fn embed(&self, input: &EmbedInput) -> Result<Embeddings, InferError>;
}

/// A resident model. Dropping the last `Arc` releases it. `Any`: a task crate reaches
/// its own model type behind the trait object (`(model as &dyn Any).downcast_ref`).
pub trait LoadedModel: std::any::Any + Send + Sync {
    fn signature(&self) -> &ModelSignature;
    /// Runs the model. `outputs` names the outputs wanted; empty = all of them.
    /// Inputs are borrowed: the caller keeps them for an out-of-memory retry.
    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError>;
    /// `Some` for text-embedding models.
    fn as_embedder(&self) -> Option<&dyn Embedder> {
        None
    }
    /// Memory one inference pass may add on top of what the load left resident
    /// (activations, attention scores). Added to the measured footprint, which is read
    /// right after the load, before any request ran.
    fn working_bytes(&self) -> u64 {
        0
    }
    /// Bytes of the model's files it serves from a mapping: resident once a run has
    /// touched them (a load touches few), so they count in its footprint from the start.
    fn mapped_bytes(&self) -> u64 {
        0
    }
}

/// An engine: reads model files, loads them, says what they will cost.
pub trait Backend: Send + Sync + 'static {
    /// The config name (`"onnx"`, `"candle"`).
    fn name(&self) -> &'static str;
    /// Footprint from the files alone of what a load in the form `weights` would take
    /// now (without its preparation while that is pending); never loads the model.
    fn estimate(&self, path: &std::path::Path, weights: Weights) -> FootprintEstimate;
    /// What the model at `path` is for, from its files.
    fn task(&self, _path: &std::path::Path) -> Task {
        Task::Tensor
    }
    /// The model's inputs and outputs, read from its files without loading it.
    fn signature(&self, path: &std::path::Path) -> Result<ModelSignature, LoadError>;
    /// Which version of the model's files is at `path` (see [`crate::learned::fingerprint`]):
    /// another value after an unload, and the model's files are read again before its
    /// next load. An engine whose model file names others (an ONNX file's external data)
    /// counts those too, or new weights beside an untouched graph go unnoticed.
    fn fingerprint(&self, path: &std::path::Path) -> String {
        crate::learned::fingerprint(path)
    }
    /// The one form this engine holds the model's weights in, whatever the config asks
    /// (`None`: the config's `weights` decides). Whisper's sessions are always prepacked.
    fn fixed_weights(&self, _path: &std::path::Path) -> Option<Weights> {
        None
    }
    /// Whether what the model answers for one row depends on the other rows run beside
    /// it (dynamic quantization takes its scale from the whole batch). Such a model never
    /// merges requests into one run: a request's answer must not depend on who else sent one.
    fn batch_dependent(&self, _path: &std::path::Path) -> bool {
        false
    }
    /// Whether the model runs faster prepacked than in the lean forms (`mapped`,
    /// `compact`): only then is a lean model that stays and batches worth promoting (its
    /// prepacked copy made, the model loaded again in it).
    fn prepacking_gains(&self, _path: &std::path::Path) -> bool {
        true
    }
    /// The one-time work still to do before the model can load in the form `weights`
    /// names (an ORT-format copy, a prepacked copy, cached on disk), as the bytes it
    /// holds at its peak; `None` when there is none. Until it is done, a load serves the
    /// model without it (see [`Backend::load`]), so a conversion that does not fit the
    /// budget never makes a model unservable.
    fn preparation(&self, _path: &std::path::Path, _weights: Weights) -> Option<u64> {
        None
    }
    /// Does that one-time work (the scheduler starts it in the background, one at a time,
    /// when memory allows; `snooze prepare` does it ahead of time). Never called by a load.
    fn prepare(&self, _spec: &LoadSpec) -> Result<(), LoadError> {
        Ok(())
    }
    /// Loads the model, in its prepared form when the preparation was done, else in a
    /// form that needs none (an ONNX model straight from its `.onnx`): a load never
    /// waits for a conversion. `estimate` says what the form a load would take costs.
    fn load(&self, spec: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError>;
}

/// Who does a model's one-time preparation (see [`Backend::prepare`]): this process, or
/// another one. The server runs it in a child process, so its transient memory (2-3x
/// the model) never mixes with the loads and runs the server measures, and all of it is
/// given back when the child exits.
pub trait Preparer: Send + Sync {
    fn prepare(&self, backend: &dyn Backend, spec: &LoadSpec) -> Result<(), LoadError>;
    /// Whether it runs in this process: then a load or a run beside it cannot be measured.
    fn in_process(&self) -> bool;
    /// Stops the preparation in progress, if it can (a load or a run needs its memory):
    /// `prepare` then returns an error soon, and whatever it left half-made is removed
    /// by the next writer of the cache. Returns false where it cannot (it runs to its end).
    fn stop(&self) -> bool {
        false
    }
}

/// Preparations in this process, by the backend itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct InProcess;

impl Preparer for InProcess {
    fn prepare(&self, backend: &dyn Backend, spec: &LoadSpec) -> Result<(), LoadError> {
        backend.prepare(spec)
    }
    fn in_process(&self) -> bool {
        true
    }
}
