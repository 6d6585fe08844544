//! What happened to models lately — loads, evictions, unloads, refusals — for the
//! dashboard's timeline and `snooze top`; and the metric names every part records under.
//!
//! The log is a bounded ring: the last [`KEEP`] events, oldest dropped first.

use std::{
    collections::VecDeque,
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

/// Events kept.
pub const KEEP: usize = 1000;

/// Metric names (Prometheus), recorded through the `metrics` facade.
pub mod metric {
    pub const REQUESTS: &str = "snooze_requests_total";
    pub const REQUEST_DURATION: &str = "snooze_request_duration_seconds";
    pub const QUEUE_WAIT: &str = "snooze_queue_wait_seconds";
    pub const LOAD_DURATION: &str = "snooze_load_duration_seconds";
    pub const LOADS: &str = "snooze_loads_total";
    pub const UNLOADS: &str = "snooze_unloads_total";
    pub const OOM_RECOVERIES: &str = "snooze_oom_recoveries_total";
    pub const REFUSALS: &str = "snooze_refusals_total";
    pub const MEMORY: &str = "snooze_memory_bytes";
    pub const FOOTPRINT: &str = "snooze_model_footprint_bytes";
    pub const STATE: &str = "snooze_model_state";
    pub const LEASES: &str = "snooze_model_leases";
    pub const QUEUE_DEPTH: &str = "snooze_queue_depth";
    pub const PRESSURE: &str = "snooze_pressure_level";
    pub const LONG_TURNS: &str = "snooze_long_turns_total";
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Loaded,
    LoadFailed,
    /// Reloaded in its fast form while serving.
    Promoted,
    /// A one-time preparation (a converted copy) was made in the background; `reason`
    /// names the form it is for.
    Prepared,
    /// A one-time preparation was stopped because a load or a run needed its memory;
    /// it runs again later. `reason` names the form it is for.
    PrepareStopped,
    /// Left memory; `reason` says why (evicted, idle, requested, pressure, shutdown, failed).
    Unloaded,
    /// A request was refused; `reason` is the error code.
    Refused,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LifecycleEvent {
    /// Its place in the log: 1, 2, 3, ... since the server started. Several events may
    /// share a millisecond, so a poller asks for those `after` the last one it saw.
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub model: String,
    pub kind: EventKind,
    pub reason: String,
    /// Bytes involved (a load's footprint, an unload's bytes), where known.
    pub bytes: Option<u64>,
}

#[derive(Debug, Default)]
pub struct EventLog {
    events: Mutex<VecDeque<LifecycleEvent>>,
}

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl EventLog {
    pub fn record(&self, model: &str, kind: EventKind, reason: impl Into<String>, bytes: Option<u64>) {
        let mut e = self.events.lock().unwrap_or_else(|p| p.into_inner());
        // Once one is kept there always is one: the last holds the count.
        let seq = e.back().map_or(1, |last| last.seq + 1);
        if e.len() == KEEP {
            e.pop_front();
        }
        e.push_back(LifecycleEvent {
            seq,
            at_ms: unix_ms(),
            model: model.to_string(),
            kind,
            reason: reason.into(),
            bytes,
        });
    }

    /// Events stamped after `since_ms` and numbered after `after_seq`, oldest first.
    pub fn since(&self, since_ms: u64, after_seq: u64) -> Vec<LifecycleEvent> {
        let e = self.events.lock().unwrap_or_else(|p| p.into_inner());
        e.iter().filter(|x| x.at_ms > since_ms && x.seq > after_seq).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_last_events_in_order() {
        let log = EventLog::default();
        for i in 0..KEEP + 5 {
            log.record(&format!("m{i}"), EventKind::Loaded, "", None);
        }
        let all = log.since(0, 0);
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0].model, "m5");
        assert!(log.since(u64::MAX, 0).is_empty());
    }

    #[test]
    fn a_poller_by_number_misses_none_of_the_events_sharing_a_millisecond() {
        let log = EventLog::default();
        let (mut seen, mut after) = (Vec::new(), 0);
        for i in 0..50 {
            log.record(&format!("m{i}"), EventKind::Refused, "queue_full", None);
            if i % 7 == 0 {
                let fresh = log.since(0, after);
                after = fresh.last().map_or(after, |e| e.seq);
                seen.extend(fresh.into_iter().map(|e| e.model));
            }
        }
        seen.extend(log.since(0, after).into_iter().map(|e| e.model));
        assert_eq!(seen, (0..50).map(|i| format!("m{i}")).collect::<Vec<_>>());
        let all = log.since(0, 0);
        assert!(all.windows(2).all(|w| w[1].seq == w[0].seq + 1) && all[0].seq == 1);
    }
}
