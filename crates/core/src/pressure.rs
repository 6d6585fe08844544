//! Pressure levels (rule 8): how full the budget is, what was seen over the last five
//! minutes, and which alerts are active.
//!
//! The level is the process RSS over the host budget: the budget covers the whole
//! process, and RSS is what the kernel charges it for (page cache is reclaimable and
//! left out, see `memory`).

use std::collections::VecDeque;

/// Normal < Warning < Critical < Emergency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PressureLevel {
    #[default]
    Normal,
    /// Alert recorded.
    Warning,
    /// Loads must be paid for by evictions; low-priority requests are refused.
    Critical,
    /// Every idle, unpinned model is unloaded.
    Emergency,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub warning: f64,
    pub critical: f64,
    pub emergency: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { warning: 0.80, critical: 0.95, emergency: 0.98 }
    }
}

impl Thresholds {
    pub fn validate(&self) -> Result<(), String> {
        let ok = 0.0 < self.warning
            && self.warning <= self.critical
            && self.critical <= self.emergency
            && self.emergency <= 1.0;
        ok.then_some(()).ok_or_else(|| {
            format!(
                "thresholds must satisfy 0 < warning ({}) <= critical ({}) <= emergency ({}) <= 1",
                self.warning, self.critical, self.emergency
            )
        })
    }

    pub fn level(&self, used: u64, budget: u64) -> PressureLevel {
        let ratio = if budget == 0 { 1.0 } else { used as f64 / budget as f64 };
        match ratio {
            r if r >= self.emergency => PressureLevel::Emergency,
            r if r >= self.critical => PressureLevel::Critical,
            r if r >= self.warning => PressureLevel::Warning,
            _ => PressureLevel::Normal,
        }
    }
}

/// One look at the host's memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReading {
    pub unix_ms: u64,
    pub process_bytes: u64,
    pub available_bytes: u64,
    /// Baseline + footprints of loading, resident and unloading models.
    pub accounted_bytes: u64,
    pub budget_bytes: u64,
    pub level: PressureLevel,
    /// Bytes accounted to each model holding memory (resident, loading or unloading).
    pub models: Vec<(String, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Alert {
    pub level: PressureLevel,
    pub since_unix_ms: u64,
    /// Set once the level fell back below the alert's level.
    pub resolved_unix_ms: Option<u64>,
    pub message: String,
    /// Its end was logged (once it stayed below for [`REOPEN_MS`]).
    #[serde(skip)]
    pub end_logged: bool,
}

/// Readings of the last `window_ms` and the alerts they raised.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PressureState {
    pub level: PressureLevel,
    pub history: VecDeque<MemoryReading>,
    pub alerts: Vec<Alert>,
}

const WINDOW_MS: u64 = 5 * 60 * 1000;
const MAX_ALERTS: usize = 100;
/// A level that comes back this soon after an alert at it ended continues that alert
/// (a process hovering at the threshold dips under it between readings); an alert's
/// end is logged once it stayed over this long.
pub const REOPEN_MS: u64 = 10_000;

impl PressureState {
    /// Records a reading; returns the level it puts the server at.
    pub fn record(&mut self, r: MemoryReading) -> PressureLevel {
        while self.history.front().is_some_and(|old| old.unix_ms + WINDOW_MS < r.unix_ms) {
            self.history.pop_front();
        }
        self.history.push_back(r.clone());
        for a in self.alerts.iter_mut().filter(|a| a.resolved_unix_ms.is_none() && r.level < a.level) {
            a.resolved_unix_ms = Some(r.unix_ms);
        }
        for a in self.alerts.iter_mut().filter(|a| !a.end_logged) {
            if let Some(end) = a.resolved_unix_ms.filter(|end| r.unix_ms.saturating_sub(*end) >= REOPEN_MS) {
                a.end_logged = true;
                tracing::info!(
                    level = ?a.level,
                    lasted_s = end.saturating_sub(a.since_unix_ms) as f64 / 1000.0,
                    "memory pressure {:?} over",
                    a.level
                );
            }
        }
        let resumed = self.alerts.iter_mut().rev().find(|a| {
            a.level == r.level
                && !a.end_logged
                && a.resolved_unix_ms.is_some_and(|end| r.unix_ms.saturating_sub(end) < REOPEN_MS)
        });
        if let Some(a) = resumed.filter(|_| r.level > self.level) {
            a.resolved_unix_ms = None;
        } else if r.level > self.level && r.level >= PressureLevel::Warning {
            let pct = r.process_bytes as f64 * 100.0 / r.budget_bytes.max(1) as f64;
            let message = format!(
                "memory pressure {:?}: the process holds {:.0}% of its budget ({} of {})",
                r.level,
                pct,
                crate::units::format_bytes(r.process_bytes),
                crate::units::format_bytes(r.budget_bytes)
            );
            tracing::warn!(level = ?r.level, process_bytes = r.process_bytes, budget_bytes = r.budget_bytes, "{message}");
            self.alerts.push(Alert {
                level: r.level,
                since_unix_ms: r.unix_ms,
                resolved_unix_ms: None,
                message,
                end_logged: false,
            });
            if self.alerts.len() > MAX_ALERTS {
                self.alerts.remove(0);
            }
        }
        self.level = r.level;
        r.level
    }

    pub fn active_alerts(&self) -> impl Iterator<Item = &Alert> {
        self.alerts.iter().filter(|a| a.resolved_unix_ms.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(ms: u64, used: u64) -> MemoryReading {
        let t = Thresholds::default();
        MemoryReading {
            unix_ms: ms,
            process_bytes: used,
            available_bytes: 0,
            accounted_bytes: used,
            budget_bytes: 100,
            level: t.level(used, 100),
            models: Vec::new(),
        }
    }

    #[test]
    fn levels_follow_the_thresholds() {
        let t = Thresholds::default();
        let cases = [
            (0, PressureLevel::Normal),
            (79, PressureLevel::Normal),
            (80, PressureLevel::Warning),
            (95, PressureLevel::Critical),
            (98, PressureLevel::Emergency),
            (150, PressureLevel::Emergency),
        ];
        for (used, want) in cases {
            assert_eq!(t.level(used, 100), want, "{used}%");
        }
        assert!(Thresholds { warning: 0.9, critical: 0.8, emergency: 0.99 }.validate().is_err());
    }

    #[test]
    fn alerts_open_and_resolve_and_history_keeps_five_minutes() {
        let mut s = PressureState::default();
        s.record(reading(0, 10));
        assert_eq!(s.record(reading(1_000, 85)), PressureLevel::Warning);
        assert_eq!(s.active_alerts().count(), 1);
        s.record(reading(2_000, 96));
        assert_eq!(s.active_alerts().count(), 2);
        s.record(reading(3_000, 50));
        assert_eq!(s.active_alerts().count(), 0);
        assert_eq!(s.alerts.len(), 2);
        s.record(reading(3_000 + WINDOW_MS + 1, 50));
        assert!(s.history.iter().all(|r| r.unix_ms > 3_000), "older than five minutes dropped");
    }

    #[test]
    fn a_level_that_flaps_at_its_threshold_is_one_alert() {
        // 81%, a reading at 75% 6 ms later, 81% again 2 s later: one episode (it was two
        // WARN lines, and no line said when it ended).
        let mut s = PressureState::default();
        s.record(reading(0, 10));
        s.record(reading(1_000, 81));
        s.record(reading(1_006, 75));
        assert_eq!(s.active_alerts().count(), 0);
        assert_eq!(s.record(reading(3_000, 81)), PressureLevel::Warning);
        assert_eq!((s.alerts.len(), s.active_alerts().count()), (1, 1), "{:?}", s.alerts);
        s.record(reading(4_000, 50));
        s.record(reading(4_000 + REOPEN_MS - 1, 50));
        assert!(!s.alerts[0].end_logged, "not over until it stayed under");
        s.record(reading(4_000 + REOPEN_MS, 50));
        assert!(s.alerts[0].end_logged);
        // Back later: a new episode.
        s.record(reading(5_000 + REOPEN_MS, 90));
        assert_eq!((s.alerts.len(), s.active_alerts().count()), (2, 1));
    }
}
