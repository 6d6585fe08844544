//! The admin view: what every model is doing and what memory the server holds.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::{extract::State, response::Response, routing::get, Router};
use serde_json::json;
use snooze_core::{lifecycle::ModelStatus, memory::process_rss_bytes};

use super::{ok_json, AppState};

pub fn routes() -> Router<AppState> {
    Router::new().route("/admin/models", get(models)).route("/admin/events", get(events))
}

#[derive(serde::Deserialize)]
struct Since {
    /// Unix milliseconds; events after it.
    #[serde(default)]
    since: u64,
    /// An event's `seq`; events after it (what a poller should send: events may share a
    /// millisecond).
    #[serde(default)]
    after: u64,
}

/// Loads, promotions, unloads (with their reason) and refusals, oldest first.
async fn events(
    State(state): State<AppState>,
    axum::extract::Query(q): axum::extract::Query<Since>,
) -> Response {
    ok_json(json!({ "events": state.manager.events(q.since, q.after) }))
}

async fn models(State(state): State<AppState>) -> Response {
    let now = SystemTime::now();
    let status = state.manager.status().await;
    let models: Vec<_> = status
        .iter()
        .map(|s| {
            let mut m = model_json(s, state.manager.info(&s.name).map(|i| i.backend).unwrap_or("?"), now);
            if let Ok(info) = state.manager.info(&s.name) {
                // The form serving now: a promotion replaced the instance it loaded in.
                m["weights"] = json!(if s.promoted { snooze_core::Weights::Prepacked } else { info.weights });
                m["batching"] = json!(info.batchable);
            }
            m
        })
        .collect();
    let mem = &state.memory;
    ok_json(json!({
        "models": models,
        "memory": {
            "budget_bytes": mem.budget_bytes,
            "baseline_bytes": mem.baseline_bytes,
            "headroom_bytes": state.settings.headroom,
            "limit_source": mem.limit_source,
            "release_activations": mem.releases_activations,
            "gpus": mem.gpus.iter().map(|(d, _, _)| d.to_string()).collect::<Vec<_>>(),
            "process_rss_bytes": process_rss_bytes(),
        },
    }))
}

/// One model as the admin view and the memory dump show it.
pub fn model_json(s: &ModelStatus, backend: &str, now: SystemTime) -> serde_json::Value {
    let before = |d: Option<Duration>| d.and_then(|d| now.checked_sub(d)).map(rfc3339);
    let after = |d: Option<Duration>| d.map(|d| rfc3339(now + d));
    json!({
        "name": s.name,
        "backend": backend,
        "state": s.state,
        "device": s.device,
        "pinned": s.pinned,
        "footprint_estimated_bytes": s.footprint_estimated_bytes,
        "footprint_measured_bytes": s.footprint_measured_bytes,
        "footprint_peak_estimated_bytes": s.footprint_peak_estimated_bytes,
        "footprint_peak_measured_bytes": s.footprint_peak_measured_bytes,
        "working_bytes": s.working_bytes,
        "leases": s.leases,
        "queued": {"high": s.queued[2], "normal": s.queued[1], "low": s.queued[0]},
        "last_used": before(s.last_used_ago),
        "loaded_at": before(s.loaded_ago),
        "unload_at": after(s.unload_in),
        "loads": s.loads,
        "evictions": s.evictions,
        "last_load_ms": s.last_load.map(|d| d.as_millis() as u64),
        "last_error": s.last_error,
    })
}

/// `2026-11-29T11:12:13.456Z` (UTC, millisecond precision). humantime formats the
/// years 1970 to 9999 and panics outside them: a clock set before 1970 reads as the epoch,
/// a deadline past 9999 as its last millisecond.
pub fn rfc3339(t: SystemTime) -> String {
    let last = UNIX_EPOCH + Duration::from_millis(253_402_300_799_999); // 9999-12-31T23:59:59.999Z
    humantime::format_rfc3339_millis(t.clamp(UNIX_EPOCH, last)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_950_733_456);
        assert_eq!(rfc3339(t), "2026-11-29T11:12:13.456Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(UNIX_EPOCH - Duration::from_secs(1)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(u64::from(u32::MAX) * 100)),
            "9999-12-31T23:59:59.999Z"
        );
    }
}
