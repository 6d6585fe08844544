//! Running requests: what a request carries to its model ([`Payload`]), how the
//! requests of one dispatched batch become one run (`batch`: merged, split back,
//! micro-batched), how a task job advances by one slice (`task`), and how a run's
//! failure is sorted — verified out-of-memory (the scheduler retries), a panic (the
//! model is not trusted any more), or an error of the request itself.
//!
//! This runs on a blocking thread; it never sees the scheduler.

mod batch;
pub(crate) mod low_priority;
mod meter;
mod task;
#[cfg(test)]
mod tests;

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    panic::{catch_unwind, AssertUnwindSafe},
};

use tokio::sync::oneshot;

pub use meter::{Growth, Watch, Work, WorkMeter, PREPARING, WORK};

use crate::{
    backend::{EmbedInput, Embeddings, InferError, LoadedModel},
    error::{ErrorKind, SnoozeError},
    lifecycle::RequestId,
    task::{TaskJob, WorkSize},
    tensor::Tensor,
};

/// What a request asks its model to do.
pub enum Payload {
    /// KServe: tensors in, the named outputs out (empty: all of them).
    Tensors { inputs: Vec<Tensor>, outputs: Vec<String> },
    /// Texts (or token ids) to vectors.
    Embed(EmbedInput),
    /// A job of a task that advances in slices (see [`crate::task`]).
    Task(Box<dyn TaskJob>),
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::Tensors { inputs, outputs } => {
                f.debug_struct("Tensors").field("inputs", inputs).field("outputs", outputs).finish()
            }
            Payload::Embed(input) => f.debug_tuple("Embed").field(input).finish(),
            Payload::Task(job) => f.debug_tuple("Task").field(job).finish(),
        }
    }
}

impl std::fmt::Debug for dyn TaskJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskJob").field("key", &self.batch_key()).field("rows", &self.rows()).finish()
    }
}

/// What a request gets back.
#[derive(Debug)]
pub enum Output {
    Tensors(Vec<Tensor>),
    Embeddings {
        embeddings: Embeddings,
        /// Whether the vectors are L2-normalized (then they may be shortened).
        normalized: bool,
    },
    /// A finished task job, its result inside.
    Task(Box<dyn TaskJob>),
}

impl Payload {
    /// Rows along the batch dimension, and the key of the requests this one may share a
    /// run with (`None`: it runs alone). Tensors batch when every input has the same
    /// first dimension and `batchable` says the model's batch dimension is dynamic; the
    /// key covers input names, datatypes, the other dimensions and the outputs asked for.
    /// A task job says itself what it may share a slice with.
    pub fn rows_and_key(&self, batchable: bool) -> (u32, Option<u64>) {
        let mut h = DefaultHasher::new();
        match self {
            Payload::Embed(input) => {
                matches!(input, EmbedInput::Texts(_)).hash(&mut h);
                (u32::try_from(input.len()).unwrap_or(u32::MAX), batchable.then(|| h.finish()))
            }
            Payload::Tensors { inputs, outputs } => {
                let Some(rows) = batch_rows(inputs) else { return (1, None) };
                let mut sorted: Vec<&Tensor> = inputs.iter().collect();
                sorted.sort_by(|a, b| a.name.cmp(&b.name));
                for t in sorted {
                    (&t.name, t.datatype(), &t.shape[1..]).hash(&mut h);
                }
                outputs.hash(&mut h);
                (u32::try_from(rows).unwrap_or(u32::MAX), batchable.then(|| h.finish()))
            }
            Payload::Task(job) => (job.rows(), Some(job.batch_key())),
        }
    }

    /// What its run's memory grows with, when it says (a task job's next slice).
    pub fn work_size(&self) -> Option<WorkSize> {
        match self {
            Payload::Task(job) => job.work_size(),
            Payload::Embed(_) | Payload::Tensors { .. } => None,
        }
    }

    /// Bytes of request data held (for request-memory accounting).
    pub fn byte_size(&self) -> usize {
        match self {
            Payload::Tensors { inputs, .. } => inputs.iter().map(|t| t.data.byte_size()).sum(),
            Payload::Embed(EmbedInput::Texts(t)) => t.iter().map(String::len).sum(),
            Payload::Embed(EmbedInput::TokenIds(t)) => t.iter().map(|s| s.len() * 4).sum(),
            Payload::Task(job) => job.byte_size(),
        }
    }
}

impl Output {
    /// Bytes of result data held.
    pub fn byte_size(&self) -> usize {
        match self {
            Output::Tensors(t) => t.iter().map(|t| t.data.byte_size()).sum(),
            Output::Embeddings { embeddings, .. } => embeddings.vectors.iter().map(|v| v.len() * 4).sum(),
            Output::Task(job) => job.byte_size(),
        }
    }
}

/// The shared first dimension of every input, when there is one.
fn batch_rows(inputs: &[Tensor]) -> Option<usize> {
    let first = *inputs.first()?.shape.first()?;
    let all = inputs.iter().all(|t| t.shape.first() == Some(&first));
    (all && first >= 0).then_some(first as usize)
}

/// A request waiting for (or being run by) its model.
pub(crate) struct Job {
    pub payload: Payload,
    pub reply: oneshot::Sender<Result<Output, SnoozeError>>,
    /// When it was submitted, until its first run starts: a request's queue wait is
    /// observed once, from here to that run (a task job's later slices and a retry go
    /// back in the queue as parts of a request already served).
    pub submitted: Option<std::time::Instant>,
    pub model: crate::lifecycle::ModelId,
}

/// Jobs handed back to the actor, with their request ids.
pub(crate) type Jobs = Vec<(RequestId, Job)>;

/// How a run ended.
pub(crate) enum BatchEnd {
    /// Every request was answered, but `continuing`: task jobs that ran a slice and
    /// have more to run (they go back in their model's queue).
    Done { continuing: Jobs },
    /// Verified out-of-memory: `jobs` were not answered and come back for a retry.
    OutOfMemory { message: String, jobs: Jobs, continuing: Jobs },
    /// The backend panicked; every request was answered 500.
    Panicked(String),
}

impl BatchEnd {
    pub(crate) fn done() -> BatchEnd {
        BatchEnd::Done { continuing: Vec::new() }
    }
}

/// Runs `jobs` as one batch on `model` and answers them. `work`: the run's meter
/// guard; what the run left resident (see [`WorkMeter`]) is returned with the end,
/// read before any answer leaves, so a caller serializing its answer does not count.
pub(crate) fn run_batch(
    model: &dyn LoadedModel,
    name: &str,
    jobs: Jobs,
    max_rows: u32,
    work: &Work<'_>,
) -> (BatchEnd, Growth) {
    if jobs.first().is_some_and(|(_, j)| matches!(j.payload, Payload::Task(_))) {
        return task::run_slice(model, name, jobs, work);
    }
    let max_rows = max_rows.max(1) as usize;
    let payloads: Vec<&Payload> = jobs.iter().map(|(_, j)| &j.payload).collect();
    let result = catch_unwind(AssertUnwindSafe(|| run(model, &payloads, max_rows)));
    let grew = match &result {
        Ok(Ok(outputs)) => work.measure(outputs.iter().map(|o| o.byte_size() as u64).sum()),
        _ => Growth::default(),
    };
    (answer_batch(model, name, jobs, max_rows, result), grew)
}

fn answer_batch(
    model: &dyn LoadedModel,
    name: &str,
    jobs: Jobs,
    max_rows: usize,
    result: std::thread::Result<Result<Vec<Output>, InferError>>,
) -> BatchEnd {
    match result {
        Err(panic) => panicked(name, jobs, panic),
        Ok(Err(InferError::OutOfMemory(message))) => {
            BatchEnd::OutOfMemory { message, jobs, continuing: Vec::new() }
        }
        Ok(Err(e)) if jobs.len() > 1 => {
            // One request may have spoiled the run: run each alone, so only it fails.
            tracing::debug!(model = name, error = %e, "a merged batch failed; running its requests one by one");
            let mut returned = Vec::new();
            for (req, job) in jobs {
                let alone = catch_unwind(AssertUnwindSafe(|| run(model, &[&job.payload], max_rows)));
                match alone {
                    Ok(Err(InferError::OutOfMemory(m))) => {
                        returned.push((req, job));
                        if returned.len() == 1 {
                            tracing::warn!(model = name, error = %m, "out of memory re-running a batch alone");
                        }
                    }
                    Ok(r) => answer(name, job, r.map(|mut o| o.remove(0))),
                    Err(panic) => return BatchEnd::Panicked(panic_text(panic)),
                }
            }
            match returned.is_empty() {
                true => BatchEnd::done(),
                false => BatchEnd::OutOfMemory {
                    message: "out of memory".into(),
                    jobs: returned,
                    continuing: Vec::new(),
                },
            }
        }
        Ok(result) => {
            match result {
                Ok(outputs) => {
                    for ((_, job), out) in jobs.into_iter().zip(outputs) {
                        let _ = job.reply.send(Ok(out));
                    }
                }
                Err(e) => {
                    for (_, job) in jobs {
                        answer(name, job, Err(e.clone()));
                    }
                }
            }
            BatchEnd::done()
        }
    }
}

/// Every job answered 500: the backend panicked.
fn panicked(name: &str, jobs: Jobs, panic: Box<dyn std::any::Any + Send>) -> BatchEnd {
    let why = panic_text(panic);
    tracing::error!(model = name, panic = %why, "the backend panicked during inference; the model will be unloaded");
    let e = SnoozeError::new(
        ErrorKind::Inference,
        format!("model '{name}' panicked during inference ({why}); it is reloaded on a later request"),
    );
    for (_, job) in jobs {
        let _ = job.reply.send(Err(e.clone()));
    }
    BatchEnd::Panicked(format!("the backend panicked during inference: {why}"))
}

fn answer(name: &str, job: Job, result: Result<Output, InferError>) {
    let _ = job.reply.send(result.map_err(|e| e.into_snooze(name)));
}

fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

impl InferError {
    /// The transport-neutral error a user sees.
    pub fn into_snooze(self, model: &str) -> SnoozeError {
        // Named once: a backend's message may already start with the model.
        let named = |what: &str, m: String| {
            let rest = m.strip_prefix(&format!("model '{model}'")).map(|r| r.trim_start_matches([':', ' ']));
            format!("model '{model}' {what}: {}", rest.unwrap_or(&m))
        };
        match self {
            InferError::InvalidInput(m) => SnoozeError::invalid(m),
            InferError::OutOfMemory(m) => {
                SnoozeError::new(ErrorKind::InsufficientMemory, named("ran out of memory", m))
            }
            InferError::Failed(m) => SnoozeError::new(ErrorKind::Inference, named("failed", m)),
        }
    }
}

/// One output per payload, in order.
fn run(model: &dyn LoadedModel, payloads: &[&Payload], max_rows: usize) -> Result<Vec<Output>, InferError> {
    let mixed = || InferError::Failed("a batch mixes kinds of requests".into());
    match payloads.first() {
        None => Ok(Vec::new()),
        Some(Payload::Embed(_)) => batch::run_embed(model, payloads, max_rows),
        Some(Payload::Tensors { outputs, .. }) => {
            let inputs: Vec<&[Tensor]> = payloads
                .iter()
                .map(|p| match p {
                    Payload::Tensors { inputs, .. } => Ok(inputs.as_slice()),
                    _ => Err(mixed()),
                })
                .collect::<Result<_, _>>()?;
            batch::run_tensors(model, &inputs, outputs, max_rows)
                .map(|per| per.into_iter().map(Output::Tensors).collect())
        }
        Some(Payload::Task(_)) => Err(mixed()),
    }
}
