//! The memory admin API: what the server holds and why, on demand garbage collection,
//! and a full snapshot to diff between two moments (`snooze dump diff`).

use axum::{
    extract::State,
    response::Response,
    routing::{get, post},
    Router,
};
use serde_json::{json, Value};
use snooze_core::{lifecycle::ModelStatus, memory::MemoryProbe, units::format_bytes, HostProbe};

use super::{
    admin::{model_json, rfc3339},
    ok_json, AppError, AppState,
};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/admin/memory/stats", get(stats))
        .route("/admin/memory/gc", post(gc))
        .route("/admin/memory/dump", get(dump))
}

/// The host, then every GPU: total, free, held by this process, budget.
async fn devices_json(state: &AppState) -> Vec<Value> {
    let snap = HostProbe::new().snapshot();
    let pressure = state.manager.pressure_state();
    let accounted = state.manager.accounted().await;
    let mut out = vec![json!({
        "device": "cpu",
        "limit_source": snap.source,
        "total_bytes": snap.total_bytes,
        "available_bytes": snap.available_bytes,
        "process_bytes": snap.process_bytes,
        "budget_bytes": state.memory.budget_bytes,
        "baseline_bytes": state.memory.baseline_bytes,
        "accounted_bytes": accounted,
        "level": pressure.level,
    })];
    for (device, budget, probe) in &state.memory.gpus {
        let g = probe.snapshot();
        out.push(json!({
            "device": device.to_string(),
            "total_bytes": g.total_bytes,
            "available_bytes": g.available_bytes,
            "process_bytes": g.process_bytes,
            "budget_bytes": budget,
        }));
    }
    out
}

/// The `memory` to advise for a model that measured `measured` bytes: a tenth more, in
/// whole MiB rounded up (never under what was measured, never "0MiB").
fn advised_mib(measured: u64) -> u64 {
    (measured + measured / 10).div_ceil(1 << 20).max(1)
}

/// Advice a user can act on, from what was measured.
pub fn recommendations(models: &[ModelStatus], budget: u64, baseline: u64, headroom: u64) -> Vec<String> {
    let mut out = Vec::new();
    for m in models {
        if let (Some(measured), Some(estimated)) = (m.footprint_measured_bytes, m.footprint_estimated_bytes) {
            let ratio = measured as f64 / estimated.max(1) as f64;
            // A set `memory` is held for the model's runs too and stops the server learning
            // their working set: the advice includes it, whether or not the model is loaded
            // (unloaded, its measured figure is its load's alone).
            let advised = advised_mib(measured.saturating_add(m.working_bytes.unwrap_or(0)));
            let working = match m.working_bytes {
                Some(w) => format!(" (its runs' working set of {} included)", format_bytes(w)),
                None => String::new(),
            };
            if ratio > 1.5 {
                out.push(format!(
                    "model '{}' measured {ratio:.1}x its estimate ({} vs {}): set memory = \"{advised}MiB\"{working} in its [models.{}] table",
                    m.name,
                    format_bytes(measured),
                    format_bytes(estimated),
                    m.name
                ));
            } else if ratio < 0.5 {
                out.push(format!(
                    "model '{}' measured only {ratio:.1}x its estimate ({} vs {}): memory = \"{advised}MiB\"{working} would let more models stay loaded",
                    m.name,
                    format_bytes(measured),
                    format_bytes(estimated),
                ));
            }
        }
        let need = m.footprint_peak_measured_bytes.or(m.footprint_peak_estimated_bytes);
        if let Some(need) = need {
            if need + headroom > budget.saturating_sub(baseline) {
                out.push(format!(
                    "model '{}' needs {} (+ {} headroom) and can never fit the budget of {} ({} of it is the server's baseline): raise host_memory_limit or remove the model",
                    m.name,
                    format_bytes(need),
                    format_bytes(headroom),
                    format_bytes(budget),
                    format_bytes(baseline)
                ));
            }
        }
    }
    out
}

async fn stats(State(state): State<AppState>) -> Response {
    let status = state.manager.status().await;
    let pressure = state.manager.pressure_state();
    let t = state.settings.thresholds();
    ok_json(json!({
        "devices": devices_json(&state).await,
        "level": pressure.level,
        "thresholds": {"warning": t.warning, "critical": t.critical, "emergency": t.emergency},
        "history": pressure.history,
        "alerts": pressure.active_alerts().collect::<Vec<_>>(),
        "recommendations": recommendations(&status, state.memory.budget_bytes, state.memory.baseline_bytes, state.settings.headroom)
            .into_iter()
            .chain(crate::request::auth::exposure_warnings(
                &state.settings.http_address,
                &state.settings.grpc_address,
                state.settings.admin_token.is_some(),
                state.keys.enabled(),
            ))
            .collect::<Vec<_>>(),
        "unloads": state.manager.unload_audit(),
        "requests_in_flight": {
            "bytes": state.request_memory.used(),
            "limit_bytes": state.request_memory.limit(),
        },
    }))
}

async fn gc(State(state): State<AppState>) -> Result<Response, AppError> {
    let report = state.manager.gc(None).await;
    Ok(ok_json(json!({"freed_bytes": report.freed_bytes, "models_unloaded": report.models_unloaded})))
}

/// glibc's own view of its heap.
fn allocator() -> Value {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads glibc's allocator statistics.
        let m = unsafe { libc::mallinfo2() };
        json!({
            "arena_bytes": m.arena,
            "mmapped_bytes": m.hblkhd,
            "in_use_bytes": m.uordblks,
            "free_bytes": m.fordblks,
            "trimmable_bytes": m.keepcost,
            "free_chunks": m.ordblks,
            "mmapped_chunks": m.hblks,
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    json!(null)
}

fn proc_status() -> Value {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mut out = serde_json::Map::new();
    for key in ["VmRSS", "VmHWM", "VmData", "RssAnon", "RssFile", "RssShmem", "Threads"] {
        if let Some(v) = text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':')) {
            let mut it = v.split_whitespace();
            let n: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            let value = if it.next() == Some("kB") { n * 1024 } else { n };
            out.insert(key.to_string(), json!(value));
        }
    }
    Value::Object(out)
}

async fn dump(State(state): State<AppState>) -> Response {
    let now = std::time::SystemTime::now();
    let status = state.manager.status().await;
    let models: Vec<Value> = status
        .iter()
        .map(|s| model_json(s, state.manager.info(&s.name).map(|i| i.backend).unwrap_or("?"), now))
        .collect();
    ok_json(json!({
        "taken_at": rfc3339(now),
        "models": models,
        "leases_total": status.iter().map(|s| s.leases as u64).sum::<u64>(),
        "probe": HostProbe::new().snapshot(),
        "devices": devices_json(&state).await,
        "pressure": state.manager.pressure_state(),
        "allocator": allocator(),
        "process": proc_status(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use snooze_core::lifecycle::StateName;

    fn status(name: &str, est: u64, measured: Option<u64>) -> ModelStatus {
        ModelStatus {
            name: name.into(),
            state: StateName::Ready,
            device: None,
            footprint_estimated_bytes: Some(est),
            footprint_peak_estimated_bytes: Some(est),
            footprint_measured_bytes: measured,
            footprint_peak_measured_bytes: None,
            working_bytes: None,
            leases: 0,
            queued: [0; 3],
            last_used_ago: None,
            loaded_ago: None,
            unload_in: None,
            loads: 0,
            evictions: 0,
            last_load: None,
            last_error: None,
            pinned: false,
            promoted: false,
        }
    }

    #[test]
    fn recommendations_name_the_model_and_the_fix() {
        let mb = 1 << 20;
        let r = recommendations(
            &[
                status("x", 100 * mb, Some(230 * mb)),
                status("ok", 100 * mb, Some(100 * mb)),
                status("y", 900 * mb, None),
            ],
            600 * mb,
            50 * mb,
            10 * mb,
        );
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r[0].contains("'x' measured 2.3x") && r[0].contains("memory = \"253MiB\""), "{}", r[0]);
        assert!(r[1].contains("'y'") && r[1].contains("never fit"), "{}", r[1]);
    }

    #[test]
    fn the_advised_memory_is_never_under_what_was_measured() {
        // ocr-cls: 1.8 MiB measured against a 20.6 MiB estimate.
        let r = recommendations(&[status("cls", 20 * (1 << 20), Some(1_887_437))], u64::MAX, 0, 0);
        assert!(r[0].contains("memory = \"2MiB\""), "{}", r[0]);
        // Unloaded, a detector measured 16.7 MiB for its load; its runs hold 430 MiB more,
        // which a fixed `memory` must cover (it stops the server learning them).
        let mut det = status("det", 40 * (1 << 20), Some(17_511_219));
        det.working_bytes = Some(430 << 20);
        let r = recommendations(&[det], u64::MAX, 0, 0);
        assert!(r[0].contains("memory = \"492MiB\" (its runs' working set of 430"), "{}", r[0]);
        assert_eq!(advised_mib(700 << 10), 1);
        assert_eq!(advised_mib(1), 1);
        assert_eq!(advised_mib(100 << 20), 110);
        assert_eq!(advised_mib((100 << 20) + 1), 111);
    }
}
