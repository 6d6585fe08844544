//! The shell with a fake backend and a fake probe, on tokio's clock: single-flight
//! loads, batches through the actor, keep-alive, cancellation and shutdown.

use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Condvar, Mutex,
};

mod tasks;

use super::*;
use crate::{
    backend::LoadSpec,
    lifecycle::StateName,
    memory::MemorySnapshot,
    tensor::{Tensor, TensorData},
    units::KeepAlive,
    InferError,
};

const MB: u64 = 1 << 20;

/// Free memory that the fake backend's loads and drops move, and the process's RSS.
struct FakeProbe {
    free: Arc<AtomicU64>,
    process: Arc<AtomicU64>,
}

impl MemoryProbe for FakeProbe {
    fn snapshot(&self) -> MemorySnapshot {
        MemorySnapshot {
            total_bytes: 1000 * MB,
            available_bytes: self.free.load(Ordering::SeqCst),
            process_bytes: self.process.load(Ordering::SeqCst),
            ..Default::default()
        }
    }
}

/// Holds every run until opened.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    fn set(&self, open: bool) {
        *self.open.lock().unwrap() = open;
        self.cv.notify_all();
    }
    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }
}

/// A run's thread: its nice value, and whether it was in the idle scheduling class.
type RunPriority = (Option<i32>, bool);

struct FakeBackend {
    free: Arc<AtomicU64>,
    /// The process's RSS: a dropped model gives its bytes back (loads leave it as set).
    process: Arc<AtomicU64>,
    loads: AtomicUsize,
    fail: Mutex<Option<LoadError>>,
    /// Inference runs out of memory on batches larger than this.
    max_batch: Arc<AtomicU64>,
    gate: Arc<Gate>,
    /// Rows of every run, in order.
    runs: Arc<Mutex<Vec<i64>>>,
    /// The nice value of the thread each run ran on, in order.
    run_nice: Arc<Mutex<Vec<RunPriority>>>,
    /// Each load's model and whether it asked for low CPU priority.
    low_asked: Mutex<Vec<(String, bool)>>,
}

struct FakeModel {
    free: Arc<AtomicU64>,
    process: Arc<AtomicU64>,
    bytes: u64,
    sig: ModelSignature,
    max_batch: Arc<AtomicU64>,
    gate: Arc<Gate>,
    runs: Arc<Mutex<Vec<i64>>>,
    run_nice: Arc<Mutex<Vec<RunPriority>>>,
    /// Models named `slow-drop*` take this long to drop, counted in `SLOW_DROPS`.
    drop_pause: Duration,
}

/// Slow drops running now, and the most ever at once.
static SLOW_DROPS: (AtomicUsize, AtomicUsize) = (AtomicUsize::new(0), AtomicUsize::new(0));

impl Drop for FakeModel {
    fn drop(&mut self) {
        if !self.drop_pause.is_zero() {
            let now = SLOW_DROPS.0.fetch_add(1, Ordering::SeqCst) + 1;
            SLOW_DROPS.1.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(self.drop_pause);
            SLOW_DROPS.0.fetch_sub(1, Ordering::SeqCst);
        }
        self.free.fetch_add(self.bytes, Ordering::SeqCst);
        let _ = self
            .process
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| Some(p.saturating_sub(self.bytes)));
    }
}

impl LoadedModel for FakeModel {
    fn signature(&self) -> &ModelSignature {
        &self.sig
    }
    fn infer(&self, inputs: &[Tensor], _: &[String]) -> Result<Vec<Tensor>, InferError> {
        self.gate.wait();
        let rows = inputs[0].shape[0];
        if let TensorData::Fp32(v) = &inputs[0].data {
            assert!(!v.iter().any(|x| *x < -1000.0), "fake: a value below -1000 makes the backend panic");
        }
        self.runs.lock().unwrap().push(rows);
        self.run_nice.lock().unwrap().push((crate::memory::thread_nice(), crate::memory::thread_is_idle()));
        if rows as u64 > self.max_batch.load(Ordering::SeqCst) {
            return Err(InferError::OutOfMemory("fake: batch too large".into()));
        }
        // y = 2x, so a merged, split or halved answer is checkable.
        Ok(inputs
            .iter()
            .map(|t| match &t.data {
                TensorData::Fp32(v) => {
                    Tensor::new("y", t.shape.clone(), TensorData::Fp32(v.iter().map(|x| x * 2.0).collect()))
                }
                other => Tensor::new("y", t.shape.clone(), other.clone()),
            })
            .collect())
    }
}

fn batch_signature() -> ModelSignature {
    let spec = |name: &str| crate::tensor::TensorSpec {
        name: name.into(),
        datatype: crate::DataType::Fp32,
        shape: vec![-1, 2],
    };
    ModelSignature { platform: "fake".into(), inputs: vec![spec("x")], outputs: vec![spec("y")] }
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn estimate(&self, _: &std::path::Path, _: crate::Weights) -> crate::FootprintEstimate {
        crate::FootprintEstimate::indeterminate("fake")
    }
    fn signature(&self, _: &std::path::Path) -> Result<ModelSignature, LoadError> {
        Ok(batch_signature())
    }
    fn load(&self, spec: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        self.low_asked.lock().unwrap().push((spec.name.clone(), spec.low_cpu_priority));
        if let Some(e) = self.fail.lock().unwrap().clone() {
            return Err(e);
        }
        let bytes = 100 * MB;
        if self.free.load(Ordering::SeqCst) < bytes {
            return Err(LoadError::OutOfMemory("fake: not enough".into()));
        }
        self.free.fetch_sub(bytes, Ordering::SeqCst);
        Ok(Arc::new(FakeModel {
            free: self.free.clone(),
            process: self.process.clone(),
            bytes,
            sig: batch_signature(),
            max_batch: self.max_batch.clone(),
            gate: self.gate.clone(),
            runs: self.runs.clone(),
            run_nice: self.run_nice.clone(),
            drop_pause: if spec.name.starts_with("slow-drop") {
                Duration::from_millis(40)
            } else {
                Duration::ZERO
            },
        }))
    }
}

struct Setup {
    m: ModelManager,
    backend: Arc<FakeBackend>,
    free: Arc<AtomicU64>,
    process: Arc<AtomicU64>,
}

fn setup(names: &[&str], keep_alive: KeepAlive) -> Setup {
    setup_with(names, keep_alive, |_| {})
}

fn setup_with(names: &[&str], keep_alive: KeepAlive, tweak: impl Fn(&mut ModelPolicy)) -> Setup {
    setup_full(names, keep_alive, tweak, |_| {})
}

fn setup_full(
    names: &[&str],
    keep_alive: KeepAlive,
    tweak: impl Fn(&mut ModelPolicy),
    configure: impl FnOnce(&mut ManagerConfig),
) -> Setup {
    let free = Arc::new(AtomicU64::new(250 * MB));
    let process = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(Gate::default());
    gate.set(true);
    let backend = Arc::new(FakeBackend {
        free: free.clone(),
        process: process.clone(),
        loads: AtomicUsize::new(0),
        fail: Mutex::new(None),
        max_batch: Arc::new(AtomicU64::new(u64::MAX)),
        gate,
        runs: Arc::default(),
        run_nice: Arc::default(),
        low_asked: Mutex::default(),
    });
    let models = names
        .iter()
        .map(|n| {
            let mut policy = ModelPolicy::new(*n);
            policy.estimate_steady = Some(100 * MB);
            policy.estimate_peak = Some(100 * MB);
            policy.keep_alive = keep_alive;
            tweak(&mut policy);
            ModelEntry {
                policy,
                backend: backend.clone() as Arc<dyn Backend>,
                path: PathBuf::from("/nowhere"),
                signature: Ok(batch_signature()),
                preload: false,
                // What the files at the path say (none): the files never change.
                fingerprint: crate::learned::model_fingerprint(
                    &*backend,
                    std::path::Path::new("/nowhere"),
                    crate::Weights::Prepacked,
                ),
                weights: crate::Weights::Prepacked,
                batch_dependent: false,
            }
        })
        .collect();
    let mut config = ManagerConfig {
        scheduler: SchedulerConfig {
            budgets: [(Device::Cpu, 1000 * MB)].into(),
            ..SchedulerConfig::default()
        },
        models,
        acquire_timeout: Duration::from_secs(30),
        intra_op_threads: 1,
        probe: Arc::new(FakeProbe { free: free.clone(), process: process.clone() }),
        gpu_probes: Vec::new(),
        store: None,
        thresholds: Default::default(),
        check_interval: Duration::from_secs(5),
        preparer: Arc::new(crate::InProcess),
    };
    configure(&mut config);
    let m = ModelManager::start(config);
    Setup { m, backend, free, process }
}

async fn state(m: &ModelManager, name: &str) -> StateName {
    m.status().await.into_iter().find(|s| s.name == name).expect("model").state
}

/// Waits for the actor (and its blocking threads) without racing the clock.
async fn until(m: &ModelManager, name: &str, want: StateName) {
    while state(m, name).await != want {
        tokio::task::yield_now().await;
    }
}

fn rows(n: usize, first: f32) -> Vec<Tensor> {
    vec![Tensor::new(
        "x",
        vec![n as i64, 2],
        TensorData::Fp32((0..2 * n).map(|i| first + i as f32).collect()),
    )]
}

fn doubled(out: &[Tensor], n: usize, first: f32) {
    assert_eq!(out[0].shape, [n as i64, 2]);
    assert_eq!(out[0].data, TensorData::Fp32((0..2 * n).map(|i| 2.0 * (first + i as f32)).collect()));
}

/// Requests of 1, 2 and 3 rows sent together to `a`, each answered with its own rows doubled.
async fn one_two_and_three_rows_at_once(s: &Setup) {
    let (a, b, c) = tokio::join!(
        s.m.infer("a", None, rows(1, 0.0), vec![]),
        s.m.infer("a", None, rows(2, 10.0), vec![]),
        s.m.infer("a", None, rows(3, 20.0), vec![]),
    );
    doubled(&a.unwrap(), 1, 0.0);
    doubled(&b.unwrap(), 2, 10.0);
    doubled(&c.unwrap(), 3, 20.0);
}

#[tokio::test]
async fn concurrent_first_requests_share_one_load_and_one_batch() {
    let s = setup(&["a"], KeepAlive::Forever);
    one_two_and_three_rows_at_once(&s).await;
    assert_eq!(s.backend.loads.load(Ordering::SeqCst), 1);
    assert_eq!(*s.backend.runs.lock().unwrap(), [6], "one run of 1 + 2 + 3 rows");
}

#[tokio::test]
async fn a_batch_dependent_model_runs_each_request_alone_with_all_its_rows() {
    let s = setup_full(&["a"], KeepAlive::Forever, |_| {}, |c| c.models[0].batch_dependent = true);
    assert!(!s.m.info("a").unwrap().batchable);
    one_two_and_three_rows_at_once(&s).await;
    let mut runs = s.backend.runs.lock().unwrap().clone();
    runs.sort_unstable();
    assert_eq!(runs, [1, 2, 3], "each request in a run of its own, none split");
}

#[tokio::test]
async fn requests_queued_behind_a_run_are_batched_and_split_back() {
    let s = setup(&["a"], KeepAlive::Forever);
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap(); // loaded
    s.backend.gate.set(false);
    let first = tokio::spawn({
        let m = s.m.clone();
        async move { m.infer("a", None, rows(1, 0.0), vec![]).await }
    });
    // Running, not just queued behind the end of the previous run.
    while s.m.status().await[0].leases == 0 || s.m.status().await[0].queued.iter().sum::<usize>() > 0 {
        tokio::task::yield_now().await;
    }
    let waiting: Vec<_> = (0..7)
        .map(|i| {
            let m = s.m.clone();
            tokio::spawn(async move { m.infer("a", None, rows(1, 100.0 * i as f32), vec![]).await })
        })
        .collect();
    while s.m.status().await[0].queued.iter().sum::<usize>() < 7 {
        tokio::task::yield_now().await;
    }
    s.backend.gate.set(true);
    first.await.unwrap().unwrap();
    for (i, w) in waiting.into_iter().enumerate() {
        doubled(&w.await.unwrap().unwrap(), 1, 100.0 * i as f32);
    }
    assert_eq!(*s.backend.runs.lock().unwrap(), [1, 1, 7], "the seven that waited ran together");
}

#[tokio::test]
async fn a_caller_that_goes_away_leaves_the_queue_and_its_request_never_runs() {
    let s = setup(&["a"], KeepAlive::Forever);
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.backend.gate.set(false);
    let running = tokio::spawn({
        let m = s.m.clone();
        async move { m.infer("a", None, rows(1, 0.0), vec![]).await }
    });
    // Running, not just queued behind the end of the previous run.
    while s.m.status().await[0].leases == 0 || s.m.status().await[0].queued.iter().sum::<usize>() > 0 {
        tokio::task::yield_now().await;
    }
    let gone = tokio::spawn({
        let m = s.m.clone();
        async move { m.infer("a", None, rows(5, 0.0), vec![]).await }
    });
    while s.m.status().await[0].queued.iter().sum::<usize>() == 0 {
        tokio::task::yield_now().await;
    }
    gone.abort();
    let _ = gone.await;
    while s.m.status().await[0].queued.iter().sum::<usize>() > 0 {
        tokio::task::yield_now().await;
    }
    s.backend.gate.set(true);
    running.await.unwrap().unwrap();
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    assert_eq!(*s.backend.runs.lock().unwrap(), [1, 1, 1], "the 5-row request never ran");
}

#[tokio::test]
async fn unknown_model_is_not_found() {
    let s = setup(&["a"], KeepAlive::Forever);
    assert_eq!(
        s.m.infer("zzz", None, rows(1, 0.0), vec![]).await.unwrap_err().kind,
        ErrorKind::ModelNotFound
    );
}

#[tokio::test(start_paused = true)]
async fn idle_models_unload_when_keep_alive_runs_out() {
    let s = setup(&["a"], KeepAlive::For(Duration::from_secs(60)));
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    assert_eq!(s.free.load(Ordering::SeqCst), 150 * MB);
    tokio::time::sleep(Duration::from_secs(59)).await;
    assert_eq!(state(&s.m, "a").await, StateName::Ready);
    tokio::time::sleep(Duration::from_secs(2)).await;
    until(&s.m, "a", StateName::Unloaded).await;
    assert_eq!(s.free.load(Ordering::SeqCst), 250 * MB, "the model's memory came back");
}

#[tokio::test]
async fn probe_oom_evicts_and_retries_through_the_actor() {
    // The budget allows three, but the fake machine has room for two: the third load
    // reports a verified OOM, the shell evicts an idle model and the retry fits. Which
    // one goes is the eviction order's (by worth: each was asked for once, and their
    // load times, measured on the real clock here, decide) — not this test's subject.
    let s = setup(&["a", "b", "c"], KeepAlive::Forever);
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.m.infer("b", None, rows(1, 0.0), vec![]).await.unwrap();
    let c = s.m.infer("c", None, rows(1, 0.0), vec![]).await;
    assert!(c.is_ok(), "{:?}", c.err());
    let status = s.m.status().await;
    assert_eq!(status[0].evictions + status[1].evictions, 1, "one idle model made room");
    assert_eq!(status[2].state, StateName::Ready);
}

#[tokio::test]
async fn failed_load_is_reported_and_backs_off() {
    let s = setup(&["a"], KeepAlive::Forever);
    *s.backend.fail.lock().unwrap() = Some(LoadError::Failed("corrupt file".into()));
    let e = s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::ModelFailed);
    assert!(e.message.contains("corrupt file"));
    let e = s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap_err();
    assert!(e.retry_after.is_some(), "second try inside the backoff is refused at once");
    assert_eq!(s.backend.loads.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn shutdown_waits_for_runs_then_unloads() {
    let s = setup(&["a"], KeepAlive::Forever);
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.backend.gate.set(false);
    let running = tokio::spawn({
        let m = s.m.clone();
        async move { m.infer("a", None, rows(1, 0.0), vec![]).await }
    });
    // Running, not just queued behind the end of the previous run.
    while s.m.status().await[0].leases == 0 || s.m.status().await[0].queued.iter().sum::<usize>() > 0 {
        tokio::task::yield_now().await;
    }
    let m2 = s.m.clone();
    let done = tokio::spawn(async move { m2.shutdown(Duration::from_secs(30)).await });
    tokio::task::yield_now().await;
    let e = s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::ShuttingDown);
    s.backend.gate.set(true);
    running.await.unwrap().unwrap();
    assert!(done.await.unwrap(), "drained before the timeout");
    assert_eq!(s.free.load(Ordering::SeqCst), 250 * MB);
}

#[tokio::test]
async fn inference_oom_evicts_idle_then_splits_the_batch_then_refuses() {
    let s = setup(&["a", "b"], KeepAlive::Forever);
    s.m.infer("b", None, rows(1, 0.0), vec![]).await.unwrap();
    // The answer leaves from inside the run: b is idle only once its end reached the actor
    // (on a loaded machine its thread can be descheduled between the two).
    while s.m.status().await[1].leases > 0 {
        tokio::task::yield_now().await;
    }
    // A batch of 4 fails, halves of 2 pass: b (idle) is evicted on the way.
    s.backend.max_batch.store(2, Ordering::SeqCst);
    let out = s.m.infer("a", None, rows(4, 0.0), vec![]).await.unwrap();
    doubled(&out, 4, 0.0);
    assert_eq!(s.m.status().await[1].state, StateName::Unloaded, "the idle model was evicted first");
    // Nothing helps: 503 with Retry-After.
    s.backend.max_batch.store(0, Ordering::SeqCst);
    let e = s.m.infer("a", None, rows(4, 0.0), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.retry_after.is_some() && e.message.contains("half the batch"), "{}", e.message);
    // A batch of one cannot be split.
    let e = s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap_err();
    assert!(e.message.contains("cannot be split"), "{}", e.message);
}

#[tokio::test]
async fn gc_unloads_idle_unpinned_models_and_reports_them() {
    let s = setup_with(&["a", "b", "p"], KeepAlive::Forever, |p| p.pinned = p.name == "p");
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.m.infer("p", None, rows(1, 0.0), vec![]).await.unwrap();
    // The answers leave from inside the runs: a is idle (and collectable) only once its
    // run's end reached the actor.
    while s.m.status().await[0].leases > 0 {
        tokio::task::yield_now().await;
    }
    let report = s.m.gc(None).await;
    assert_eq!(report.models_unloaded, ["a"], "p is pinned, b is not loaded");
    assert_eq!(s.free.load(Ordering::SeqCst), 150 * MB);
}

#[tokio::test]
async fn unloads_side_by_side_are_measured_one_at_a_time() {
    // Each unload reads the process's RSS before and after its drop: side by side, each
    // counted the other's memory as its own ("368 MiB returned to the OS" twice).
    let s = setup(&["slow-drop-a", "slow-drop-b"], KeepAlive::Forever);
    s.m.infer("slow-drop-a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.m.infer("slow-drop-b", None, rows(1, 0.0), vec![]).await.unwrap();
    while s.m.status().await.iter().any(|m| m.leases > 0) {
        tokio::task::yield_now().await;
    }
    let report = s.m.gc(None).await;
    assert_eq!(report.models_unloaded.len(), 2);
    until(&s.m, "slow-drop-a", StateName::Unloaded).await;
    until(&s.m, "slow-drop-b", StateName::Unloaded).await;
    assert_eq!(SLOW_DROPS.1.load(Ordering::SeqCst), 1, "two drops measured at once");
}

#[tokio::test(start_paused = true)]
async fn low_priority_is_refused_under_critical_pressure_by_the_scheduler() {
    let s = setup(&["a"], KeepAlive::Forever);
    s.process.store(990 * MB, Ordering::SeqCst); // 99% of the 1000 MiB budget
    tokio::time::sleep(Duration::from_secs(6)).await; // a pressure reading
    assert!(s.m.pressure_level() >= PressureLevel::Critical);
    let e = s.m.infer("a", Some(Priority::Low), rows(1, 0.0), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.message.contains("low-priority"), "{}", e.message);
}

#[tokio::test(start_paused = true)]
async fn loads_resume_as_soon_as_an_emergency_s_unloads_end_it() {
    // Under critical pressure a load must pay for itself with evictions; after an
    // emergency unloaded every idle model there is nothing left to evict, so until the
    // level is read again no model can load. Measured in the mix benchmark: every light
    // task stalled for the 5 s between two readings.
    let s = setup(&["a", "b"], KeepAlive::Forever);
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.m.infer("b", None, rows(1, 0.0), vec![]).await.unwrap();
    s.process.store(1050 * MB, Ordering::SeqCst); // 105% of the 1000 MiB budget
    tokio::time::sleep(Duration::from_secs(6)).await; // a reading: emergency
    until(&s.m, "a", StateName::Unloaded).await;
    until(&s.m, "b", StateName::Unloaded).await;
    // The two drops gave 200 MB back: 85%, read as the unloads ended (the clock is paused
    // between readings: the next one is 4 s away).
    assert!(s.m.pressure_level() < PressureLevel::Critical, "{:?}", s.m.pressure_level());
    let asked = tokio::time::Instant::now();
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    assert!(asked.elapsed() < Duration::from_secs(1), "loaded after {:?}", asked.elapsed());
}

#[tokio::test(start_paused = true)]
async fn parsed_files_kept_between_loads_go_when_memory_pressure_turns_critical() {
    static KEPT: crate::kept::Kept<String> = crate::kept::Kept::new();
    let dir = std::env::temp_dir().join(format!("snooze-kept-manager-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, "{}").unwrap();
    let s = setup(&["a"], KeepAlive::Forever);
    s.process.store(850 * MB, Ordering::SeqCst); // over the warning threshold (80%)
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(s.m.pressure_level(), PressureLevel::Warning);
    // (Kept only now: another test reaching the critical level drops it too.)
    KEPT.get_or_parse(&file, 0, || Ok::<_, String>("parsed".to_string())).unwrap();
    s.process.store(960 * MB, Ordering::SeqCst); // over the critical threshold (95%)
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(s.m.pressure_level(), PressureLevel::Critical);
    assert!(KEPT.is_empty(), "dropped at the critical level");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_full_gpu_falls_back_to_the_cpu_by_the_probe() {
    // The GPU's budget would take the model, but its (fake) probe says 10 MB are free.
    let free = Arc::new(AtomicU64::new(250 * MB));
    let process = Arc::new(AtomicU64::new(0));
    let s = setup(&[], KeepAlive::Forever);
    let backend = s.backend.clone();
    let mut policy = ModelPolicy::new("g");
    policy.devices = vec![Device::Cuda(0), Device::Cpu];
    policy.estimate_steady = Some(100 * MB);
    let mut no_fallback = policy.clone();
    no_fallback.name = "strict".into();
    no_fallback.cpu_fallback = false;
    let entry = |policy| ModelEntry {
        policy,
        backend: backend.clone() as Arc<dyn Backend>,
        path: PathBuf::from("/nowhere"),
        signature: Ok(batch_signature()),
        preload: false,
        fingerprint: crate::learned::model_fingerprint(
            &*backend,
            std::path::Path::new("/nowhere"),
            crate::Weights::Prepacked,
        ),
        weights: crate::Weights::Prepacked,
        batch_dependent: false,
    };
    let gpu = Arc::new(FakeProbe { free: Arc::new(AtomicU64::new(10 * MB)), process: process.clone() });
    let m = ModelManager::start(ManagerConfig {
        scheduler: SchedulerConfig {
            budgets: [(Device::Cpu, 1000 * MB), (Device::Cuda(0), 80_000 * MB)].into(),
            queue_timeout: Duration::from_millis(300),
            ..SchedulerConfig::default()
        },
        models: vec![entry(policy), entry(no_fallback)],
        acquire_timeout: Duration::from_secs(30),
        intra_op_threads: 1,
        probe: Arc::new(FakeProbe { free, process }),
        gpu_probes: vec![(Device::Cuda(0), gpu as Arc<dyn MemoryProbe>)],
        store: None,
        thresholds: Default::default(),
        check_interval: Duration::from_secs(5),
        preparer: Arc::new(crate::InProcess),
    });
    m.infer("g", None, rows(1, 0.0), vec![]).await.unwrap();
    assert_eq!(m.status().await[0].device.as_deref(), Some("cpu"));
    // Without a fallback it waits for the GPU to free memory, then gives up.
    let e = m.infer("strict", None, rows(1, 0.0), vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Overloaded);
    assert!(e.retry_after.is_some() && e.message.contains("queue_timeout"), "{}", e.message);
}

#[tokio::test(start_paused = true)]
async fn a_backend_panic_is_a_500_naming_the_model_then_a_backoff_not_a_reload_storm() {
    let s = setup(&["a"], KeepAlive::Forever);
    let bad = vec![Tensor::new("x", vec![1, 2], TensorData::Fp32(vec![-5000.0, 0.0]))];
    let e = s.m.infer("a", None, bad, vec![]).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Inference);
    assert!(e.message.contains("'a' panicked") && e.message.contains("below -1000"), "{}", e.message);
    // Unloaded, then refused during the backoff: hammering it loads nothing.
    until(&s.m, "a", StateName::Failed).await;
    for _ in 0..20 {
        let e = s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::ModelFailed);
        assert!(e.retry_after.is_some());
    }
    assert_eq!(s.backend.loads.load(Ordering::SeqCst), 1);
    // After the backoff it is reloaded and serves again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(s.m.infer("a", None, rows(1, 0.0), vec![]).await.is_ok());
    assert_eq!(s.backend.loads.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_unload_waiting_on_a_long_run_answers_within_the_bound_and_still_happens() {
    // A real (short) clock: a run blocked on a thread keeps tokio's paused clock still.
    let s =
        setup_full(&["a"], KeepAlive::Forever, |_| {}, |c| c.acquire_timeout = Duration::from_millis(200));
    s.m.infer("a", None, rows(1, 0.0), vec![]).await.unwrap();
    s.backend.gate.set(false);
    let running = tokio::spawn({
        let m = s.m.clone();
        async move { m.infer("a", None, rows(1, 0.0), vec![]).await }
    });
    // Running, not just queued behind the end of the first run.
    while s.m.status().await[0].leases == 0 || s.m.status().await[0].queued.iter().sum::<usize>() > 0 {
        tokio::task::yield_now().await;
    }
    let e = s.m.unload("a").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Overloaded);
    assert!(e.retry_after.is_some() && e.message.contains("still serving"), "{}", e.message);
    s.backend.gate.set(true);
    running.await.unwrap().unwrap();
    until(&s.m, "a", StateName::Unloaded).await;
    assert_eq!(s.free.load(Ordering::SeqCst), 250 * MB, "the unload went on once the run ended");
}

#[tokio::test]
async fn a_model_of_low_cpu_priority_loads_for_it_and_runs_on_an_idle_class_thread() {
    let s = setup_with(&["long", "short"], KeepAlive::Forever, |p| p.low_cpu_priority = p.name == "long");
    // The blocking pool's threads have the priority the process started with.
    let normal = crate::memory::thread_nice().expect("this thread's nice value");
    for _ in 0..2 {
        s.m.infer("long", None, rows(1, 0.0), vec![]).await.unwrap();
        s.m.infer("short", None, rows(1, 0.0), vec![]).await.unwrap();
    }
    assert_eq!(
        *s.backend.low_asked.lock().unwrap(),
        [("long".to_string(), true), ("short".to_string(), false)],
        "the backend is asked for low-priority runtime threads for the long model only"
    );
    let low = (Some(normal.max(crate::memory::low_priority_nice())), true);
    let plain = (Some(normal), false);
    assert_eq!(
        *s.backend.run_nice.lock().unwrap(),
        [low, plain, low, plain],
        "the long model's runs on idle-class threads at nice 10, the short one's as the process; \
         the shared pool's threads are never lowered"
    );
}
