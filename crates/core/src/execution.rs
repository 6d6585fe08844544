//! Running requests: what a request carries to its model ([`Payload`]), how the
//! requests of one dispatched batch are merged into a single run and split back, how
//! a run larger than `max_rows` becomes micro-batches, and how a run's failure is
//! sorted — verified out-of-memory (the scheduler retries), a panic (the model is
//! not trusted any more), or an error of the request itself.
//!
//! This runs on a blocking thread; it never sees the scheduler.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    panic::{catch_unwind, AssertUnwindSafe},
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
};

use tokio::sync::oneshot;

use crate::{
    backend::{EmbedInput, Embeddings, InferError, LoadedModel},
    error::{ErrorKind, SnoozeError},
    lifecycle::RequestId,
    tensor::Tensor,
};

/// What a request asks its model to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// KServe: tensors in, the named outputs out (empty: all of them).
    Tensors { inputs: Vec<Tensor>, outputs: Vec<String> },
    /// Texts (or token ids) to vectors.
    Embed(EmbedInput),
}

/// What a request gets back.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Tensors(Vec<Tensor>),
    Embeddings {
        embeddings: Embeddings,
        /// Whether the vectors are L2-normalized (then they may be shortened).
        normalized: bool,
    },
}

impl Payload {
    /// Rows along the batch dimension, and the key of the requests this one may share a
    /// run with (`None`: it runs alone). Tensors batch when every input has the same
    /// first dimension and `batchable` says the model's batch dimension is dynamic; the
    /// key covers input names, datatypes, the other dimensions and the outputs asked for.
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
        }
    }

    /// Bytes of request data held (for request-memory accounting).
    pub fn byte_size(&self) -> usize {
        match self {
            Payload::Tensors { inputs, .. } => inputs.iter().map(|t| t.data.byte_size()).sum(),
            Payload::Embed(EmbedInput::Texts(t)) => t.iter().map(String::len).sum(),
            Payload::Embed(EmbedInput::TokenIds(t)) => t.iter().map(|s| s.len() * 4).sum(),
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
    /// When it was submitted (its queue wait is measured from here).
    pub submitted: std::time::Instant,
    pub model: crate::lifecycle::ModelId,
}

/// How a run ended.
pub(crate) enum BatchEnd {
    /// Every request was answered.
    Done,
    /// Verified out-of-memory: nobody was answered; the jobs come back for a retry.
    OutOfMemory { message: String, jobs: Vec<(RequestId, Job)> },
    /// The backend panicked; every request was answered 500.
    Panicked(String),
}

/// Work (runs, loads) in progress in the process, to tell whether the memory a run
/// left behind is its own.
///
/// A pass can leave memory resident: ONNX Runtime's arena keeps the activations of
/// the largest shape it ran, which for a model with dynamic dimensions (an OCR
/// detector fed a larger image) is far more than its weights. What the process's RSS
/// grew across a run is that run's only when nothing else started or was in
/// progress meanwhile; then it is added to the model's learned footprint.
pub(crate) struct WorkMeter {
    started: AtomicU64,
    active: AtomicUsize,
}

/// The process's meter.
pub(crate) static WORK: WorkMeter = WorkMeter::new();

impl WorkMeter {
    pub(crate) const fn new() -> WorkMeter {
        WorkMeter { started: AtomicU64::new(0), active: AtomicUsize::new(0) }
    }

    /// Starts a piece of work; it ends when the returned guard is dropped.
    pub(crate) fn begin(&self) -> Work<'_> {
        let ticket = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let alone = self.active.fetch_add(1, Ordering::SeqCst) == 0;
        // Work that did not start alone can never be measured: no RSS reading for it.
        let before = alone.then(crate::memory::process_rss_bytes);
        Work { meter: self, ticket, before }
    }
}

pub(crate) struct Work<'a> {
    meter: &'a WorkMeter,
    ticket: u64,
    /// RSS at the start, read only when the work started alone.
    before: Option<u64>,
}

impl Work<'_> {
    /// What RSS grew since `begin`, less `held` bytes the work still holds (its
    /// outputs), if no other work was in progress or started meanwhile; `None` when
    /// the growth cannot be attributed.
    pub(crate) fn grew(&self, held: u64) -> Option<u64> {
        let still_alone = self.meter.started.load(Ordering::SeqCst) == self.ticket
            && self.meter.active.load(Ordering::SeqCst) == 1;
        let before = self.before.filter(|_| still_alone)?;
        Some(crate::memory::process_rss_bytes().saturating_sub(before).saturating_sub(held))
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        self.meter.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Output {
    /// Bytes of result data held.
    pub fn byte_size(&self) -> usize {
        match self {
            Output::Tensors(t) => t.iter().map(|t| t.data.byte_size()).sum(),
            Output::Embeddings { embeddings, .. } => embeddings.vectors.iter().map(|v| v.len() * 4).sum(),
        }
    }
}

/// Runs `jobs` as one batch on `model` and answers them. `work`: the run's meter
/// guard; what the run left resident (see [`WorkMeter`]) is returned with the end,
/// read before any answer leaves, so a caller serializing its answer does not count.
pub(crate) fn run_batch(
    model: &dyn LoadedModel,
    name: &str,
    jobs: Vec<(RequestId, Job)>,
    max_rows: u32,
    work: &Work<'_>,
) -> (BatchEnd, Option<u64>) {
    let max_rows = max_rows.max(1) as usize;
    let payloads: Vec<&Payload> = jobs.iter().map(|(_, j)| &j.payload).collect();
    let result = catch_unwind(AssertUnwindSafe(|| run(model, &payloads, max_rows)));
    let grew = match &result {
        Ok(Ok(outputs)) => work.grew(outputs.iter().map(|o| o.byte_size() as u64).sum()),
        _ => None,
    };
    (answer_batch(model, name, jobs, max_rows, result), grew)
}

fn answer_batch(
    model: &dyn LoadedModel,
    name: &str,
    jobs: Vec<(RequestId, Job)>,
    max_rows: usize,
    result: std::thread::Result<Result<Vec<Output>, InferError>>,
) -> BatchEnd {
    match result {
        Err(panic) => {
            let why = panic_text(panic);
            tracing::error!(model = name, panic = %why, "the backend panicked during inference; the model will be unloaded");
            let e = SnoozeError::new(
                ErrorKind::Inference,
                format!(
                    "model '{name}' panicked during inference ({why}); it is reloaded on a later request"
                ),
            );
            for (_, job) in jobs {
                let _ = job.reply.send(Err(e.clone()));
            }
            BatchEnd::Panicked(format!("the backend panicked during inference: {why}"))
        }
        Ok(Err(InferError::OutOfMemory(message))) => BatchEnd::OutOfMemory { message, jobs },
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
                true => BatchEnd::Done,
                false => BatchEnd::OutOfMemory { message: "out of memory".into(), jobs: returned },
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
            BatchEnd::Done
        }
    }
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
        match self {
            InferError::InvalidInput(m) => SnoozeError::invalid(m),
            InferError::OutOfMemory(m) => SnoozeError::new(
                ErrorKind::InsufficientMemory,
                format!("model '{model}' ran out of memory: {m}"),
            ),
            InferError::Failed(m) => {
                SnoozeError::new(ErrorKind::Inference, format!("model '{model}' failed: {m}"))
            }
        }
    }
}

/// One output per payload, in order.
fn run(model: &dyn LoadedModel, payloads: &[&Payload], max_rows: usize) -> Result<Vec<Output>, InferError> {
    match payloads.first() {
        None => Ok(Vec::new()),
        Some(Payload::Embed(_)) => run_embed(model, payloads, max_rows),
        Some(Payload::Tensors { outputs, .. }) => {
            let inputs: Vec<&[Tensor]> = payloads
                .iter()
                .map(|p| match p {
                    Payload::Tensors { inputs, .. } => Ok(inputs.as_slice()),
                    Payload::Embed(_) => {
                        Err(InferError::Failed("a batch mixes embeddings and tensors".into()))
                    }
                })
                .collect::<Result<_, _>>()?;
            run_tensors(model, &inputs, outputs, max_rows)
                .map(|per| per.into_iter().map(Output::Tensors).collect())
        }
    }
}

/// Merges the requests' inputs along the first dimension, runs them in micro-batches
/// of at most `max_rows` rows, and splits the outputs back per request. A lone
/// request that fits runs on its own tensors, without a copy.
fn run_tensors(
    model: &dyn LoadedModel,
    requests: &[&[Tensor]],
    outputs: &[String],
    max_rows: usize,
) -> Result<Vec<Vec<Tensor>>, InferError> {
    let rows: Vec<usize> = requests.iter().map(|r| batch_rows(r).unwrap_or(1)).collect();
    let total: usize = rows.iter().sum();
    if requests.len() == 1 && (total <= max_rows || batch_rows(requests[0]).is_none()) {
        return Ok(vec![model.infer(requests[0], outputs)?]);
    }
    let merged = if requests.len() == 1 { requests[0].to_vec() } else { concat_rows(requests)? };
    let mut joined: Option<Vec<Tensor>> = None;
    let mut start = 0;
    while start < total || (total == 0 && joined.is_none()) {
        let end = (start + max_rows).min(total);
        let part: Vec<Tensor> = merged.iter().map(|t| slice_rows(t, total, start, end)).collect();
        let out = model.infer(&part, outputs)?;
        joined = Some(match joined {
            None => out,
            Some(acc) => append_rows(acc, out)?,
        });
        if total == 0 {
            break;
        }
        start = end;
    }
    split_rows(joined.unwrap_or_default(), &rows)
}

/// Rows `start..end` of a tensor whose first dimension is `total`.
fn slice_rows(t: &Tensor, total: usize, start: usize, end: usize) -> Tensor {
    let row = t.data.len().checked_div(total).unwrap_or(0);
    let mut shape = t.shape.clone();
    if let Some(first) = shape.first_mut() {
        *first = (end - start) as i64;
    }
    Tensor::new(t.name.clone(), shape, t.data.slice(start * row, end * row))
}

/// Every request's inputs, joined along the first dimension, by input name.
fn concat_rows(requests: &[&[Tensor]]) -> Result<Vec<Tensor>, InferError> {
    let mismatch = || InferError::Failed("the requests of a batch have different inputs".into());
    let first = requests.first().ok_or_else(mismatch)?;
    first
        .iter()
        .map(|t| {
            let mut joined = Tensor::new(t.name.clone(), t.shape.clone(), t.data.clone());
            for other in &requests[1..] {
                let o = other.iter().find(|o| o.name == t.name).ok_or_else(mismatch)?;
                if !joined.data.append(o.data.clone()) || o.shape.get(1..) != t.shape.get(1..) {
                    return Err(mismatch());
                }
                joined.shape[0] += o.shape[0];
            }
            Ok(joined)
        })
        .collect()
}

/// Joins the outputs of two consecutive micro-batches.
fn append_rows(acc: Vec<Tensor>, next: Vec<Tensor>) -> Result<Vec<Tensor>, InferError> {
    crate::tensor::concat_batch(acc, next)
        .ok_or_else(|| InferError::Failed("the outputs of the micro-batches cannot be joined".into()))
}

/// Cuts every output along its first dimension into one part per request.
fn split_rows(outputs: Vec<Tensor>, rows: &[usize]) -> Result<Vec<Vec<Tensor>>, InferError> {
    let total: usize = rows.iter().sum();
    let mut per: Vec<Vec<Tensor>> = rows.iter().map(|_| Vec::with_capacity(outputs.len())).collect();
    for t in outputs {
        if t.shape.first().copied() != Some(total as i64) {
            return Err(InferError::Failed(format!(
                "output '{}' has shape {:?}, not {total} rows: it cannot be split per request",
                t.name, t.shape
            )));
        }
        let mut start = 0;
        for (i, &n) in rows.iter().enumerate() {
            per[i].push(slice_rows(&t, total, start, start + n));
            start += n;
        }
    }
    Ok(per)
}

/// Texts (or token lists) of every request in one call (or several of `max_rows`),
/// vectors split back per request.
fn run_embed(
    model: &dyn LoadedModel,
    payloads: &[&Payload],
    max_rows: usize,
) -> Result<Vec<Output>, InferError> {
    let embedder = model
        .as_embedder()
        .ok_or_else(|| InferError::InvalidInput("this model does not produce embeddings".into()))?;
    let inputs: Vec<&EmbedInput> = payloads
        .iter()
        .map(|p| match p {
            Payload::Embed(i) => Ok(i),
            Payload::Tensors { .. } => Err(InferError::Failed("a batch mixes embeddings and tensors".into())),
        })
        .collect::<Result<_, _>>()?;
    let merged = merge_embed_inputs(&inputs)?;
    let mut vectors = Vec::with_capacity(merged.len());
    let mut tokens = Vec::with_capacity(merged.len());
    for part in chunk_embed_input(&merged, max_rows) {
        let out = embedder.embed(&part)?;
        vectors.extend(out.vectors);
        tokens.extend(out.tokens);
    }
    let normalized = embedder.normalized();
    let mut vectors = vectors.into_iter();
    let mut tokens = tokens.into_iter();
    Ok(inputs
        .iter()
        .map(|i| {
            let v: Vec<Vec<f32>> = vectors.by_ref().take(i.len()).collect();
            let t: Vec<usize> = tokens.by_ref().take(i.len()).collect();
            Output::Embeddings { embeddings: Embeddings::new(v, t), normalized }
        })
        .collect())
}

fn merge_embed_inputs(inputs: &[&EmbedInput]) -> Result<EmbedInput, InferError> {
    if let [one] = inputs {
        return Ok((*one).clone());
    }
    let mut texts = Vec::new();
    let mut ids = Vec::new();
    for i in inputs {
        match i {
            EmbedInput::Texts(t) => texts.extend(t.iter().cloned()),
            EmbedInput::TokenIds(t) => ids.extend(t.iter().cloned()),
        }
    }
    match (texts.is_empty(), ids.is_empty()) {
        (_, true) => Ok(EmbedInput::Texts(texts)),
        (true, false) => Ok(EmbedInput::TokenIds(ids)),
        (false, false) => Err(InferError::Failed("a batch mixes texts and token ids".into())),
    }
}

fn chunk_embed_input(input: &EmbedInput, max_rows: usize) -> Vec<EmbedInput> {
    if input.len() <= max_rows {
        return vec![input.clone()];
    }
    match input {
        EmbedInput::Texts(t) => t.chunks(max_rows).map(|c| EmbedInput::Texts(c.to_vec())).collect(),
        EmbedInput::TokenIds(t) => t.chunks(max_rows).map(|c| EmbedInput::TokenIds(c.to_vec())).collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::tensor::{ModelSignature, TensorData};

    /// The tests' own meter: the process's is shared with tests running in parallel.
    static METER: WorkMeter = WorkMeter::new();

    /// y = 10x + row index within the run: shows how rows were grouped into runs.
    struct Counting {
        sig: ModelSignature,
        runs: std::sync::Mutex<Vec<i64>>,
    }

    impl LoadedModel for Counting {
        fn signature(&self) -> &ModelSignature {
            &self.sig
        }
        fn infer(&self, inputs: &[Tensor], _: &[String]) -> Result<Vec<Tensor>, InferError> {
            let x = &inputs[0];
            self.runs.lock().unwrap().push(x.shape[0]);
            let TensorData::Fp32(v) = &x.data else {
                return Err(InferError::InvalidInput("fp32 only".into()));
            };
            if v.iter().any(|f| f.is_nan()) {
                return Err(InferError::InvalidInput("NaN".into()));
            }
            Ok(vec![Tensor::new(
                "y",
                x.shape.clone(),
                TensorData::Fp32(v.iter().map(|f| f * 10.0).collect()),
            )])
        }
    }

    fn model() -> Counting {
        Counting { sig: ModelSignature::default(), runs: Default::default() }
    }

    fn x(rows: usize, first: f32) -> Payload {
        let data = (0..rows * 2).map(|i| first + i as f32).collect();
        Payload::Tensors {
            inputs: vec![Tensor::new("x", vec![rows as i64, 2], TensorData::Fp32(data))],
            outputs: vec![],
        }
    }

    fn job(p: Payload) -> (Job, oneshot::Receiver<Result<Output, SnoozeError>>) {
        let (reply, rx) = oneshot::channel();
        (Job { payload: p, reply, submitted: std::time::Instant::now(), model: 0 }, rx)
    }

    fn y(rx: &mut oneshot::Receiver<Result<Output, SnoozeError>>) -> Vec<f32> {
        match rx.try_recv().unwrap().unwrap() {
            Output::Tensors(t) => match &t[0].data {
                TensorData::Fp32(v) => v.clone(),
                _ => panic!(),
            },
            Output::Embeddings { .. } => panic!(),
        }
    }

    #[test]
    fn a_batch_of_mixed_sizes_runs_once_and_splits_back_per_request() {
        let m = model();
        let (a, mut ra) = job(x(1, 0.0));
        let (b, mut rb) = job(x(3, 100.0));
        let (c, mut rc) = job(x(2, 200.0));
        assert!(matches!(
            run_batch(&m, "m", vec![(1, a), (2, b), (3, c)], 8, &METER.begin()).0,
            BatchEnd::Done
        ));
        assert_eq!(*m.runs.lock().unwrap(), [6], "one run of 1 + 3 + 2 rows");
        assert_eq!(y(&mut ra), [0.0, 10.0]);
        assert_eq!(y(&mut rb), (0..6).map(|i| (100.0 + i as f32) * 10.0).collect::<Vec<_>>());
        assert_eq!(y(&mut rc), (0..4).map(|i| (200.0 + i as f32) * 10.0).collect::<Vec<_>>());
    }

    #[test]
    fn a_request_larger_than_max_rows_runs_in_micro_batches() {
        let m = model();
        let (a, mut ra) = job(x(10, 0.0));
        assert!(matches!(run_batch(&m, "m", vec![(1, a)], 4, &METER.begin()).0, BatchEnd::Done));
        assert_eq!(*m.runs.lock().unwrap(), [4, 4, 2]);
        assert_eq!(y(&mut ra), (0..20).map(|i| i as f32 * 10.0).collect::<Vec<_>>());
    }

    #[test]
    fn a_bad_request_in_a_batch_fails_alone() {
        let m = model();
        let (a, mut ra) = job(x(1, 0.0));
        let mut bad = x(1, 0.0);
        if let Payload::Tensors { inputs, .. } = &mut bad {
            inputs[0].data = TensorData::Fp32(vec![f32::NAN, 0.0]);
        }
        let (b, mut rb) = job(bad);
        assert!(matches!(run_batch(&m, "m", vec![(1, a), (2, b)], 8, &METER.begin()).0, BatchEnd::Done));
        assert_eq!(y(&mut ra), [0.0, 10.0]);
        assert_eq!(rb.try_recv().unwrap().unwrap_err().kind, ErrorKind::InvalidInput);
    }

    #[test]
    fn batch_keys_group_same_trailing_shapes_and_outputs() {
        let key = |p: &Payload| p.rows_and_key(true);
        assert_eq!(key(&x(1, 0.0)).1, key(&x(5, 1.0)).1, "rows and values do not matter");
        let (rows, k) = key(&x(5, 0.0));
        assert_eq!(rows, 5);
        let other = Payload::Tensors {
            inputs: vec![Tensor::new("x", vec![1, 3], TensorData::Fp32(vec![0.0; 3]))],
            outputs: vec![],
        };
        assert_ne!(key(&other).1, k, "another trailing shape");
        assert_eq!(x(1, 0.0).rows_and_key(false).1, None, "a model without a dynamic batch dimension");
        let scalar = Payload::Tensors {
            inputs: vec![Tensor::new("x", vec![], TensorData::Fp32(vec![1.0]))],
            outputs: vec![],
        };
        assert_eq!(scalar.rows_and_key(true), (1, None));
    }

    #[test]
    fn growth_is_attributed_only_to_work_that_ran_alone() {
        let meter = WorkMeter::new();
        let alone = meter.begin();
        let mut held = vec![1u8; 32 << 20];
        held.iter_mut().step_by(4096).for_each(|b| *b = 2);
        let grew = alone.grew(0).expect("nothing else ran");
        assert!(grew >= 16 << 20, "32 MiB touched, {grew} bytes seen");
        assert_eq!(alone.grew(u64::MAX), Some(0), "bytes still held are not growth");
        drop(alone);

        // Overlapping work: neither can tell its growth from the other's.
        let a = meter.begin();
        let b = meter.begin();
        assert_eq!((a.grew(0), b.grew(0)), (None, None));
        drop(b);
        assert_eq!(a.grew(0), None, "another piece of work started meanwhile");
        drop(a);
        // Work that starts after another ended alone is alone again.
        let c = meter.begin();
        assert!(c.grew(0).is_some());
        drop(held);
    }
}
