//! The shell with a fake backend and a fake probe, on tokio's paused clock: leases,
//! single-flight loads, keep-alive and shutdown through the real actor.

use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Mutex,
};

use super::*;
use crate::{
    memory::MemorySnapshot,
    tensor::{Tensor, TensorData},
    units::KeepAlive,
    InferError,
};

const MB: u64 = 1 << 20;

/// Free memory that the fake backend's loads and drops move.
struct FakeProbe {
    free: Arc<AtomicU64>,
}

impl MemoryProbe for FakeProbe {
    fn snapshot(&self) -> MemorySnapshot {
        let free = self.free.load(Ordering::SeqCst);
        MemorySnapshot { total_bytes: 1000 * MB, available_bytes: free, ..Default::default() }
    }
}

struct FakeBackend {
    free: Arc<AtomicU64>,
    loads: AtomicUsize,
    fail: Mutex<Option<LoadError>>,
    max_batch: Arc<AtomicU64>,
}

struct FakeModel {
    free: Arc<AtomicU64>,
    bytes: u64,
    sig: ModelSignature,
    /// Inference runs out of memory on batches larger than this.
    max_batch: Arc<AtomicU64>,
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.free.fetch_add(self.bytes, Ordering::SeqCst);
    }
}

impl LoadedModel for FakeModel {
    fn signature(&self) -> &ModelSignature {
        &self.sig
    }
    fn infer(&self, inputs: Vec<Tensor>, _: &[String]) -> Result<Vec<Tensor>, InferError> {
        assert!(inputs[0].shape[0] >= 0, "fake: a negative batch makes the backend panic");
        if inputs[0].shape[0] as u64 > self.max_batch.load(Ordering::SeqCst) {
            return Err(InferError::OutOfMemory("fake: batch too large".into()));
        }
        // y = 2x, so a split-and-joined answer is checkable.
        Ok(inputs
            .into_iter()
            .map(|t| match t.data {
                TensorData::Fp32(v) => {
                    Tensor::new("y", t.shape, TensorData::Fp32(v.iter().map(|x| x * 2.0).collect()))
                }
                other => Tensor::new("y", t.shape, other),
            })
            .collect())
    }
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn estimate(&self, _: &std::path::Path) -> crate::FootprintEstimate {
        crate::FootprintEstimate::indeterminate("fake")
    }
    fn signature(&self, _: &std::path::Path) -> Result<ModelSignature, LoadError> {
        Ok(ModelSignature::default())
    }
    fn load(&self, _: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if let Some(e) = self.fail.lock().unwrap().clone() {
            return Err(e);
        }
        let bytes = 100 * MB;
        let free = self.free.load(Ordering::SeqCst);
        if free < bytes {
            return Err(LoadError::OutOfMemory("fake: not enough".into()));
        }
        self.free.fetch_sub(bytes, Ordering::SeqCst);
        Ok(Arc::new(FakeModel {
            free: self.free.clone(),
            bytes,
            sig: ModelSignature::default(),
            max_batch: self.max_batch.clone(),
        }))
    }
}

fn fake_backend(free: &Arc<AtomicU64>) -> Arc<FakeBackend> {
    Arc::new(FakeBackend {
        free: free.clone(),
        loads: AtomicUsize::new(0),
        fail: Mutex::new(None),
        max_batch: Arc::new(AtomicU64::new(u64::MAX)),
    })
}

fn entry(backend: &Arc<FakeBackend>, policy: ModelPolicy) -> ModelEntry {
    ModelEntry {
        policy,
        backend: backend.clone() as Arc<dyn Backend>,
        path: PathBuf::from("/nowhere"),
        signature: Ok(ModelSignature::default()),
        preload: false,
        fingerprint: String::new(),
    }
}

fn setup(names: &[&str], keep_alive: KeepAlive) -> (ModelManager, Arc<FakeBackend>, Arc<AtomicU64>) {
    let free = Arc::new(AtomicU64::new(250 * MB));
    let backend = fake_backend(&free);
    let models = names
        .iter()
        .map(|n| {
            let mut policy = ModelPolicy::new(*n);
            policy.estimate_steady = Some(100 * MB);
            policy.estimate_peak = Some(100 * MB);
            policy.keep_alive = keep_alive;
            policy.min_residency = Duration::ZERO;
            entry(&backend, policy)
        })
        .collect();
    let manager = ModelManager::start(ManagerConfig {
        scheduler: SchedulerConfig {
            budgets: [(Device::Cpu, 1000 * MB)].into(),
            ..SchedulerConfig::default()
        },
        models,
        acquire_timeout: Duration::from_secs(30),
        intra_op_threads: 1,
        probe: Arc::new(FakeProbe { free: free.clone() }),
        gpu_probes: Vec::new(),
        store: None,
        thresholds: Default::default(),
        check_interval: Duration::from_secs(5),
    });
    (manager, backend, free)
}

async fn state(m: &ModelManager, name: &str) -> crate::lifecycle::StateName {
    m.status().await.into_iter().find(|s| s.name == name).expect("model").state
}

#[tokio::test]
async fn concurrent_first_requests_share_one_load_and_leases_release() {
    let (m, backend, _) = setup(&["a"], KeepAlive::Forever);
    let (l1, l2, l3) = tokio::join!(m.acquire("a"), m.acquire("a"), m.acquire("a"));
    let (l1, l2, l3) = (l1.unwrap(), l2.unwrap(), l3.unwrap());
    assert_eq!(backend.loads.load(Ordering::SeqCst), 1);
    let out = l1.model().infer(vec![Tensor::new("x", vec![1], TensorData::Fp32(vec![1.0]))], &[]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(m.status().await[0].leases, 3);
    drop((l1, l2, l3));
    assert_eq!(m.status().await[0].leases, 0);
}

#[tokio::test]
async fn unknown_model_is_not_found() {
    let (m, _, _) = setup(&["a"], KeepAlive::Forever);
    assert_eq!(m.acquire("zzz").await.err().unwrap().kind, ErrorKind::ModelNotFound);
}

#[tokio::test(start_paused = true)]
async fn idle_models_unload_when_keep_alive_runs_out() {
    let (m, _, free) = setup(&["a"], KeepAlive::For(Duration::from_secs(60)));
    drop(m.acquire("a").await.unwrap());
    assert_eq!(free.load(Ordering::SeqCst), 150 * MB);
    tokio::time::sleep(Duration::from_secs(59)).await;
    assert_eq!(state(&m, "a").await, crate::lifecycle::StateName::Ready);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The unload runs on a blocking thread: wait for it without racing the clock.
    while state(&m, "a").await != crate::lifecycle::StateName::Unloaded {
        tokio::task::yield_now().await;
    }
    assert_eq!(free.load(Ordering::SeqCst), 250 * MB, "the model's memory came back");
}

#[tokio::test]
async fn probe_oom_evicts_and_retries_through_the_actor() {
    // The budget allows three, but the fake machine has room for two: the third load
    // reports a verified OOM, the shell evicts the LRU and the retry fits.
    let (m, backend, _) = setup(&["a", "b", "c"], KeepAlive::Forever);
    drop(m.acquire("a").await.unwrap());
    drop(m.acquire("b").await.unwrap());
    let c = m.acquire("c").await;
    assert!(c.is_ok(), "{:?}", c.err());
    let st = m.status().await;
    assert_eq!(st[0].evictions, 1, "a, the LRU, made room");
    assert!(backend.loads.load(Ordering::SeqCst) >= 3);
}

#[tokio::test]
async fn failed_load_is_reported_and_backs_off() {
    let (m, backend, _) = setup(&["a"], KeepAlive::Forever);
    *backend.fail.lock().unwrap() = Some(LoadError::Failed("corrupt file".into()));
    let e = m.acquire("a").await.err().unwrap();
    assert_eq!(e.kind, ErrorKind::ModelFailed);
    assert!(e.message.contains("corrupt file"));
    let e = m.acquire("a").await.err().unwrap();
    assert!(e.retry_after.is_some(), "second try inside the backoff is refused at once");
    assert_eq!(backend.loads.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn shutdown_waits_for_leases_then_unloads() {
    let (m, _, free) = setup(&["a"], KeepAlive::Forever);
    let lease = m.acquire("a").await.unwrap();
    let m2 = m.clone();
    let done = tokio::spawn(async move { m2.shutdown(Duration::from_secs(30)).await });
    tokio::task::yield_now().await;
    assert_eq!(m.acquire("a").await.err().unwrap().kind, ErrorKind::ShuttingDown);
    drop(lease);
    assert!(done.await.unwrap(), "drained before the timeout");
    assert_eq!(free.load(Ordering::SeqCst), 250 * MB);
}

fn batch(n: usize) -> Vec<Tensor> {
    vec![Tensor::new("x", vec![n as i64, 2], TensorData::Fp32((0..2 * n).map(|i| i as f32).collect()))]
}

#[tokio::test]
async fn inference_oom_evicts_idle_then_splits_the_batch_then_refuses() {
    let (m, backend, _) = setup(&["a", "b"], KeepAlive::Forever);
    drop(m.acquire("b").await.unwrap());
    // A batch of 4 fails, halves of 2 pass: b (idle) is evicted on the way.
    backend.max_batch.store(2, Ordering::SeqCst);
    let out = m.infer("a", Priority::Normal, batch(4), vec![]).await.unwrap();
    assert_eq!(out[0].shape, [4, 2]);
    assert_eq!(out[0].data, TensorData::Fp32((0..8).map(|i| 2.0 * i as f32).collect()));
    let st = m.status().await;
    assert_eq!(st[1].state, crate::lifecycle::StateName::Unloaded, "the idle model was evicted first");
    // Nothing helps: 503 with Retry-After.
    backend.max_batch.store(0, Ordering::SeqCst);
    let e = m.infer("a", Priority::Normal, batch(4), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.retry_after.is_some() && e.message.contains("half the batch"), "{}", e.message);
    // A batch of one cannot be split.
    let e = m.infer("a", Priority::Normal, batch(1), vec![]).await.unwrap_err();
    assert!(e.message.contains("after evicting"), "{}", e.message);
}

#[tokio::test]
async fn gc_unloads_idle_unpinned_models_and_reports_them() {
    let (m, _, free) = setup(&["a", "b"], KeepAlive::Forever);
    drop(m.acquire("a").await.unwrap());
    let held = m.acquire("b").await.unwrap();
    let report = m.gc(None).await;
    assert_eq!(report.models_unloaded, ["a"], "b is leased");
    assert_eq!(free.load(Ordering::SeqCst), 150 * MB);
    drop(held);
}

#[tokio::test]
async fn low_priority_is_refused_under_critical_pressure() {
    let (mut m, _, _) = setup(&["a"], KeepAlive::Forever);
    m.pressure_level_for_test(crate::pressure::PressureLevel::Critical);
    let e = m.acquire_with("a", Priority::Low).await.err().unwrap();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(m.acquire_with("a", Priority::Normal).await.is_ok());
}

#[tokio::test]
async fn a_full_gpu_falls_back_to_the_cpu_by_the_probe() {
    // The GPU's budget would take the model, but its (fake) probe says 10 MB are free.
    let free = Arc::new(AtomicU64::new(250 * MB));
    let gpu_free = Arc::new(AtomicU64::new(10 * MB));
    let backend = fake_backend(&free);
    let mut policy = ModelPolicy::new("g");
    policy.devices = vec![Device::Cuda(0), Device::Cpu];
    policy.estimate_steady = Some(100 * MB);
    let mut no_fallback = policy.clone();
    no_fallback.name = "strict".into();
    no_fallback.cpu_fallback = false;
    let m = ModelManager::start(ManagerConfig {
        scheduler: SchedulerConfig {
            budgets: [(Device::Cpu, 1000 * MB), (Device::Cuda(0), 80_000 * MB)].into(),
            ..SchedulerConfig::default()
        },
        models: vec![entry(&backend, policy), entry(&backend, no_fallback)],
        acquire_timeout: Duration::from_secs(30),
        intra_op_threads: 1,
        probe: Arc::new(FakeProbe { free }),
        gpu_probes: vec![(Device::Cuda(0), Arc::new(FakeProbe { free: gpu_free }) as Arc<dyn MemoryProbe>)],
        store: None,
        thresholds: Default::default(),
        check_interval: Duration::from_secs(5),
    });
    drop(m.acquire("g").await.unwrap());
    assert_eq!(m.status().await[0].device.as_deref(), Some("cpu"));
    let e = m.acquire("strict").await.err().unwrap();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.message.contains("cuda:0"), "{}", e.message);
}

#[tokio::test(start_paused = true)]
async fn a_backend_panic_is_a_500_naming_the_model_then_a_backoff_not_a_reload_storm() {
    let (m, backend, _) = setup(&["a"], KeepAlive::Forever);
    let bad = || vec![Tensor::new("x", vec![-1], TensorData::Fp32(vec![]))];
    let e = m.infer("a", Priority::Normal, bad(), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Inference);
    assert!(e.message.contains("'a' panicked") && e.message.contains("negative batch"), "{}", e.message);
    // Unloaded, then refused during the backoff: hammering it loads nothing.
    while state(&m, "a").await != crate::lifecycle::StateName::Failed {
        tokio::task::yield_now().await;
    }
    for _ in 0..20 {
        let e = m.infer("a", Priority::Normal, batch(1), vec![]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ModelFailed);
        assert!(e.retry_after.is_some());
    }
    assert_eq!(backend.loads.load(Ordering::SeqCst), 1);
    // After the backoff it is reloaded and serves again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(m.infer("a", Priority::Normal, batch(1), vec![]).await.is_ok());
    assert_eq!(backend.loads.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn an_unload_waiting_on_a_long_request_answers_within_the_bound_and_still_happens() {
    let (m, _, free) = setup(&["a"], KeepAlive::Forever);
    let lease = m.acquire("a").await.unwrap();
    let e = m.unload("a").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Overloaded);
    assert!(e.retry_after.is_some() && e.message.contains("still serving"), "{}", e.message);
    drop(lease);
    while state(&m, "a").await != crate::lifecycle::StateName::Unloaded {
        tokio::task::yield_now().await;
    }
    assert_eq!(free.load(Ordering::SeqCst), 250 * MB, "the unload went on once the request ended");
}
