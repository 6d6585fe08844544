//! Batches merged and split, micro-batches, a bad request failing alone, batch keys,
//! and the meter's attribution of memory growth.

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
        Ok(vec![Tensor::new("y", x.shape.clone(), TensorData::Fp32(v.iter().map(|f| f * 10.0).collect()))])
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
    (Job { payload: p, reply, submitted: Some(std::time::Instant::now()), model: 0 }, rx)
}

fn y(rx: &mut oneshot::Receiver<Result<Output, SnoozeError>>) -> Vec<f32> {
    match rx.try_recv().unwrap().unwrap() {
        Output::Tensors(t) => match &t[0].data {
            TensorData::Fp32(v) => v.clone(),
            _ => panic!(),
        },
        _ => panic!(),
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
        BatchEnd::Done { .. }
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
    assert!(matches!(run_batch(&m, "m", vec![(1, a)], 4, &METER.begin()).0, BatchEnd::Done { .. }));
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
    assert!(matches!(run_batch(&m, "m", vec![(1, a), (2, b)], 8, &METER.begin()).0, BatchEnd::Done { .. }));
    assert_eq!(y(&mut ra), [0.0, 10.0]);
    assert_eq!(rb.try_recv().unwrap().err().map(|e| e.kind), Some(ErrorKind::InvalidInput));
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

#[test]
fn a_failure_names_its_model_once() {
    let e =
        InferError::Failed("Non-zero status code returned while running Conv node".into()).into_snooze("det");
    assert_eq!(e.message, "model 'det' failed: Non-zero status code returned while running Conv node");
    let e = InferError::Failed("model 'det' returned no output 'y'".into()).into_snooze("det");
    assert_eq!(e.message, "model 'det' failed: returned no output 'y'");
    let e = InferError::OutOfMemory("model 'det': std::bad_alloc".into()).into_snooze("det");
    assert_eq!(e.message, "model 'det' ran out of memory: std::bad_alloc");
}
