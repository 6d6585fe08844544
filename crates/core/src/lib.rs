//! SnoozeML's core: everything about *policy*, nothing about ML or HTTP.
//!
//! `lifecycle` is a sans-IO state machine deciding when models load, stay, sleep
//! and get evicted, and which queued requests run when; `manager` is the thin async
//! shell that feeds it events and carries out its actions against a `Backend`, with
//! `execution` running the batches it dispatches. Config types, size/duration
//! parsing, memory probes and the transport-neutral error kind live here too, so
//! the scheduler's tests never wait for ONNX Runtime or Candle to compile.

pub mod backend;
pub mod error;
pub mod events;
pub mod execution;
pub mod kept;
pub mod memory;
pub mod pressure;
pub mod task;
pub mod tensor;

pub use backend::{
    Backend, Device, EmbedInput, Embedder, Embeddings, FootprintEstimate, InProcess, InferError, LoadError,
    LoadSpec, LoadedModel, Preparer, Task, Weights,
};
pub use error::{ErrorKind, SnoozeError};
pub use memory::{HostProbe, MemoryProbe, MemorySnapshot};
pub use task::{Progress, SliceRunner, TaskJob, WorkSize};
pub use tensor::{DataType, ModelSignature, Tensor, TensorData, TensorSpec};
pub mod learned;
pub mod lifecycle;
pub mod units;

pub use lifecycle::{
    Action, Event, LoadMeasurement, ModelPolicy, Priority, Scheduler, SchedulerConfig, UnloadReason,
};
pub mod manager;

pub use manager::{GcReport, ManagerConfig, ModelEntry, ModelInfo, ModelManager, UnloadAudit};
