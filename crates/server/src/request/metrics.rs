//! Prometheus metrics through the `metrics` facade and `metrics-exporter-prometheus`.
//!
//! Counters and histograms are recorded where things happen (the actor for loads,
//! unloads, queue waits and refusals; the scheduler for out-of-memory recoveries; the
//! transports for requests, through [`observe`]). Every series whose labels are known at
//! start — per configured model, each protocol and request outcome, load outcome, unload
//! reason, refusal reason and OOM step — exists at 0 from the first scrape ([`register_models`]), so an
//! alert on `rate(snooze_refusals_total[5m])` sees 0, not "no data". Gauges — memory,
//! footprints, states, leases, queue depths, the pressure level — are a picture of now,
//! set at each scrape ([`render`]).

use std::{sync::OnceLock, time::Instant};

use metrics::{counter, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use snooze_core::{
    events::metric, lifecycle::StateName, memory::MemoryProbe, pressure::PressureLevel, ErrorKind, HostProbe,
    SnoozeError,
};

use super::AppState;

/// Seconds, from 100 µs to 60 s: a cached run to a cold load of a large model.
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// Protocols a request can come by (the `protocol` label).
pub const PROTOCOLS: [&str; 3] = ["kserve", "grpc", "openai"];
const LOAD_OUTCOMES: [&str; 3] = ["ok", "out_of_memory", "failed"];
const UNLOAD_REASONS: [&str; 6] = ["evicted", "idle", "requested", "pressure", "shutdown", "failed"];
const OOM_STEPS: [&str; 3] = ["evict", "retry", "split"];
/// What a queued request can be refused for (the actor's refusals).
const REFUSALS: [ErrorKind; 5] = [
    ErrorKind::InsufficientMemory,
    ErrorKind::QueueFull,
    ErrorKind::Overloaded,
    ErrorKind::ModelFailed,
    ErrorKind::ShuttingDown,
];

/// The process's one recorder (installed on first use; later calls share it).
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder =
                PrometheusBuilder::new().set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS);
            match builder.and_then(|b| b.install_recorder()) {
                Ok(h) => {
                    describe();
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot install the metrics recorder: /metrics will be empty");
                    None
                }
            }
        })
        .as_ref()
}

/// `# HELP` lines: what each series is, for dashboards that show it.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        metric::REQUESTS,
        "Requests answered, by model (or OCR pipeline), protocol and outcome (ok or the error code)"
    );
    describe_histogram!(
        metric::REQUEST_DURATION,
        Unit::Seconds,
        "Time from a request's arrival to its answer"
    );
    describe_histogram!(
        metric::QUEUE_WAIT,
        Unit::Seconds,
        "Time a request waited in its model's queue before its first run"
    );
    describe_histogram!(metric::LOAD_DURATION, Unit::Seconds, "Time a model's load took");
    describe_counter!(metric::LOADS, "Model loads, by outcome");
    describe_counter!(metric::UNLOADS, "Model unloads, by reason");
    describe_counter!(metric::OOM_RECOVERIES, "Steps taken to recover from an out-of-memory run");
    describe_counter!(metric::REFUSALS, "Requests a model's scheduler refused, by error code");
    describe_gauge!(
        metric::MEMORY,
        Unit::Bytes,
        "Memory per device: total, available, budget, accounted, process"
    );
    describe_gauge!(metric::FOOTPRINT, Unit::Bytes, "A model's footprint: estimated, measured, peak");
    describe_gauge!(metric::STATE, "1 for the model's current state, 0 for the others");
    describe_gauge!(metric::LEASES, "Requests running on the model");
    describe_gauge!(metric::QUEUE_DEPTH, "Requests waiting in the model's queue, by priority");
    describe_gauge!(metric::PRESSURE, "Memory pressure: 0 normal, 1 warning, 2 critical, 3 emergency");
    describe_counter!(
        metric::LONG_TURNS,
        "Turns long work was given after short runs kept every core for a second without a gap"
    );
}

/// A request's counter and duration histogram for `name` on `protocols`, at 0.
fn register_requests(name: &str, protocols: &[&'static str]) {
    for &protocol in protocols {
        let outcomes = ["ok", CANCELLED].into_iter().chain(ErrorKind::ALL.iter().map(|k| k.code()));
        for outcome in outcomes {
            counter!(metric::REQUESTS, "model" => name.to_string(), "protocol" => protocol, "outcome" => outcome)
                .increment(0);
        }
    }
    let _ = metrics::histogram!(metric::REQUEST_DURATION, "model" => name.to_string());
}

/// Creates the request counters of every OCR pipeline at 0 (its requests are counted
/// under its name; its stages' runs under theirs).
pub fn register_pipelines<'a>(pipelines: impl Iterator<Item = &'a str>) {
    for p in pipelines {
        register_requests(p, &["openai"]);
    }
}

/// Creates every counter of every configured model at 0 (and the server's own).
pub fn register_models<'a>(models: impl Iterator<Item = &'a str>) {
    counter!(metric::LONG_TURNS).increment(0);
    for m in models {
        let model = || m.to_string();
        register_requests(m, &PROTOCOLS);
        for outcome in LOAD_OUTCOMES {
            counter!(metric::LOADS, "model" => model(), "outcome" => outcome).increment(0);
        }
        for reason in UNLOAD_REASONS {
            counter!(metric::UNLOADS, "model" => model(), "reason" => reason).increment(0);
        }
        for kind in REFUSALS {
            counter!(metric::REFUSALS, "model" => model(), "reason" => kind.code()).increment(0);
        }
        // Histograms too (their `_count` and `_sum` at 0), for rates taken over them.
        for name in [metric::QUEUE_WAIT, metric::LOAD_DURATION] {
            let _ = metrics::histogram!(name, "model" => model());
        }
        for step in OOM_STEPS {
            counter!(metric::OOM_RECOVERIES, "model" => model(), "step" => step).increment(0);
        }
    }
}

/// The `outcome` of a request whose client went away before its answer (nginx's 499):
/// the server dropped its work (it left its queue, or its job stopped at its next slice).
pub const CANCELLED: &str = "cancelled";

/// Counts a request when it ends, however it ends: answered ([`Observation::finish`]),
/// or dropped mid-way because its client went away ([`CANCELLED`]). `model` is set once
/// the request names one (a `/v1` body names it only once read).
pub struct Observation {
    pub model: Option<String>,
    protocol: &'static str,
    started: Instant,
    finished: bool,
}

impl Observation {
    pub fn start(protocol: &'static str, model: Option<String>) -> Observation {
        Observation { model, protocol, started: Instant::now(), finished: false }
    }

    pub fn finish(mut self, result: Result<(), &SnoozeError>) {
        self.finished = true;
        if let Some(m) = &self.model {
            observe(m, self.protocol, self.started, result);
        }
    }
}

impl Drop for Observation {
    fn drop(&mut self) {
        let Some(model) = self.model.as_ref().filter(|_| !self.finished) else { return };
        let seconds = self.started.elapsed().as_secs_f64();
        tracing::info!(model = %model, protocol = self.protocol, seconds, "request cancelled: the client went away");
        counter!(metric::REQUESTS, "model" => model.clone(), "protocol" => self.protocol, "outcome" => CANCELLED)
            .increment(1);
    }
}

/// Counts a request and its duration: `outcome` is `ok` or the error's code.
fn observe(model: &str, protocol: &'static str, started: Instant, result: Result<(), &SnoozeError>) {
    let outcome = match result {
        Ok(()) => "ok",
        Err(e) => e.kind.code(),
    };
    counter!(metric::REQUESTS, "model" => model.to_string(), "protocol" => protocol, "outcome" => outcome)
        .increment(1);
    metrics::histogram!(metric::REQUEST_DURATION, "model" => model.to_string())
        .record(started.elapsed().as_secs_f64());
}

const STATES: [(StateName, &str); 5] = [
    (StateName::Unloaded, "unloaded"),
    (StateName::Loading, "loading"),
    (StateName::Ready, "ready"),
    (StateName::Unloading, "unloading"),
    (StateName::Failed, "failed"),
];

/// Sets the gauges to what is true now and renders every series in Prometheus' text format.
pub async fn render(state: &AppState) -> String {
    let status = state.manager.status().await;
    let pressure = state.manager.pressure_state();
    let snap = HostProbe::new().snapshot();
    let accounted = state.manager.accounted().await.unwrap_or(0);
    for (kind, bytes) in [
        ("total", snap.total_bytes),
        ("available", snap.available_bytes),
        ("budget", state.memory.budget_bytes),
        ("accounted", accounted),
        ("process", snap.process_bytes),
    ] {
        gauge!(metric::MEMORY, "device" => "cpu", "kind" => kind).set(bytes as f64);
    }
    for (device, budget, probe) in &state.memory.gpus {
        let g = probe.snapshot();
        let d = device.to_string();
        for (kind, bytes) in [
            ("total", g.total_bytes),
            ("available", g.available_bytes),
            ("budget", *budget),
            ("process", g.process_bytes),
        ] {
            gauge!(metric::MEMORY, "device" => d.clone(), "kind" => kind).set(bytes as f64);
        }
    }
    for s in &status {
        let m = s.name.clone();
        let footprints = [
            ("estimated", s.footprint_estimated_bytes),
            ("measured", s.footprint_measured_bytes),
            ("peak", s.footprint_peak_measured_bytes.or(s.footprint_peak_estimated_bytes)),
        ];
        for (kind, bytes) in footprints {
            if let Some(b) = bytes {
                gauge!(metric::FOOTPRINT, "model" => m.clone(), "kind" => kind).set(b as f64);
            }
        }
        for (st, name) in STATES {
            gauge!(metric::STATE, "model" => m.clone(), "state" => name)
                .set(f64::from(u8::from(s.state == st)));
        }
        gauge!(metric::LEASES, "model" => m.clone()).set(f64::from(s.leases));
        for (i, p) in ["low", "normal", "high"].iter().enumerate() {
            gauge!(metric::QUEUE_DEPTH, "model" => m.clone(), "priority" => *p).set(s.queued[i] as f64);
        }
    }
    let level = match pressure.level {
        PressureLevel::Normal => 0.0,
        PressureLevel::Warning => 1.0,
        PressureLevel::Critical => 2.0,
        PressureLevel::Emergency => 3.0,
    };
    gauge!(metric::PRESSURE).set(level);
    handle().map(PrometheusHandle::render).unwrap_or_default()
}
