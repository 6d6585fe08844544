//! Turns for the cores: long work runs in the idle scheduling class (see
//! `memory::idle_thread`), so the kernel gives it only what short runs leave free —
//! which, under a flood of short requests, is nothing. When runs of short models have
//! kept going, without a pause of [`SHORT_GAP`], for [`SHORT_STREAK`] while long work (a
//! model of low CPU priority) is running, no further short run starts until those in
//! flight end, and then none for [`LONG_TURN`]: the long work has every core for that
//! long. Long work so gets at least about a tenth of the machine however many short
//! requests come (the share nice 10 gave it), and a short request waits at most one turn
//! beyond its queue.

use std::time::{Duration, Instant};

use super::{ModelId, Scheduler};

/// How long short runs may keep every core from long work before it gets a turn.
pub const SHORT_STREAK: Duration = Duration::from_secs(1);
/// How long long work then has the cores alone.
pub const LONG_TURN: Duration = Duration::from_millis(100);
/// The shortest pause between short runs that ends a streak: a model's queued requests
/// run one batch after another with no pause at all, and a pause of a few milliseconds
/// gives long work next to nothing.
pub const SHORT_GAP: Duration = Duration::from_millis(10);

/// Where the turns stand.
#[derive(Debug, Default)]
pub(super) struct Turns {
    /// Since when short runs have been in flight with no pause of `SHORT_GAP` or more.
    short_since: Option<Instant>,
    /// When the last short run ended, while none runs.
    short_ended: Option<Instant>,
    /// The end of long work's turn, while it lasts.
    long_until: Option<Instant>,
}

/// Why a short run waits for long work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LongTurn {
    /// Its turn is owed: it begins when the short runs in flight end.
    Owed,
    /// Its turn goes on until then.
    Until(Instant),
}

impl Scheduler {
    /// Whether a run of `model` must wait for long work's turn, and until when.
    pub(super) fn waits_for_long_turn(&self, model: ModelId, now: Instant) -> Option<LongTurn> {
        if self.slots[model].policy.low_cpu_priority || !self.long_running() {
            return None;
        }
        if let Some(until) = self.turns.long_until.filter(|&u| now < u) {
            return Some(LongTurn::Until(until));
        }
        let since = self.turns.short_since.filter(|_| self.short_running() > 0)?;
        (now.saturating_duration_since(since) >= SHORT_STREAK).then_some(LongTurn::Owed)
    }

    /// A run of `model` started (counted in its slot): the first short one in flight
    /// starts a streak, or goes on with one whose last run ended less than `SHORT_GAP` ago.
    pub(super) fn turn_run_started(&mut self, model: ModelId, now: Instant) {
        if self.slots[model].policy.low_cpu_priority || self.short_running() > 1 {
            return;
        }
        let t = &mut self.turns;
        let paused = t.short_ended.take().is_none_or(|e| now.saturating_duration_since(e) >= SHORT_GAP);
        if paused || t.short_since.is_none() {
            t.short_since = Some(now);
        }
    }

    /// A run of `model` ended (no longer counted in its slot): when the last short run of
    /// a streak that owes long work its turn ends, the turn begins.
    pub(super) fn turn_run_ended(&mut self, model: ModelId, now: Instant) {
        if self.slots[model].policy.low_cpu_priority || self.short_running() > 0 {
            return;
        }
        self.turns.short_ended = Some(now);
        let streak = self.turns.short_since.map(|s| now.saturating_duration_since(s));
        if streak.is_some_and(|s| s >= SHORT_STREAK) && self.long_running() {
            self.turns.short_since = None;
            self.turns.long_until = Some(now + LONG_TURN);
            metrics::counter!(crate::events::metric::LONG_TURNS).increment(1);
        }
    }

    /// Whether a run of a model of low CPU priority is in flight.
    fn long_running(&self) -> bool {
        self.slots.iter().any(|s| s.policy.low_cpu_priority && s.running > 0)
    }

    /// Runs of short models (not of low CPU priority) in flight.
    fn short_running(&self) -> usize {
        self.slots.iter().filter(|s| !s.policy.low_cpu_priority).map(|s| s.running as usize).sum()
    }
}
