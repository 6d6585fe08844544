//! `GET /metrics`: Prometheus' text format through the `metrics` facade and
//! `metrics-exporter-prometheus`.
//!
//! Counters and histograms are recorded where things happen (the actor for loads,
//! unloads, queue waits and refusals; the scheduler for out-of-memory recoveries; the
//! handlers for requests). Gauges — memory, footprints, states, leases, queue depths,
//! the pressure level — are a picture of now, so they are set from the admin view at
//! each scrape rather than kept up to date on every change.

use std::{sync::OnceLock, time::Instant};

use axum::{
    extract::State,
    http::{header, HeaderValue},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use metrics::gauge;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use snooze_core::{
    events::metric, lifecycle::StateName, memory::MemoryProbe, pressure::PressureLevel, HostProbe,
    SnoozeError,
};

use super::AppState;

/// Seconds, from 100 µs to 60 s: a cached run to a cold load of a large model.
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// The process's one recorder (installed on first use; later calls share it).
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder =
                PrometheusBuilder::new().set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS);
            match builder.and_then(|b| b.install_recorder()) {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot install the metrics recorder: /metrics will be empty");
                    None
                }
            }
        })
        .as_ref()
}

pub fn routes() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics))
}

/// Counts a request and its duration: `outcome` is `ok` or the error's code.
pub fn observe(model: &str, protocol: &'static str, started: Instant, result: Result<(), &SnoozeError>) {
    let outcome = match result {
        Ok(()) => "ok",
        Err(e) => e.kind.code(),
    };
    metrics::counter!(metric::REQUESTS, "model" => model.to_string(), "protocol" => protocol, "outcome" => outcome)
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

async fn metrics(State(state): State<AppState>) -> Response {
    let status = state.manager.status().await;
    let pressure = state.manager.pressure_state();
    let snap = HostProbe::new().snapshot();
    let accounted = pressure.history.back().map_or(0, |r| r.accounted_bytes);
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
    let text = handle().map(PrometheusHandle::render).unwrap_or_default();
    let mut resp = text.into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    resp
}
