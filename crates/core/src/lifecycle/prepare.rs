//! One-time preparations (an ONNX model's ORT-format or prepacked copy): work that
//! makes later loads cheaper, never a condition for serving. A load takes whatever form
//! needs no preparation while one is pending, so a model whose conversion cannot fit
//! the budget is still served, and a refusal's "more than the budget can ever give" is
//! about the model, never about a one-time cost.
//!
//! Preparations run in the background, one at a time, pressure normal, their peak
//! accounted while they run like a load's:
//!
//! - for any model when the host is quiet (no model waiting to load, no load or unload in
//!   progress) and the peak fits what is free without evicting anything;
//! - at any time for the copy a model's loads use, once the model *churns* — loaded
//!   [`CHURN_LOADS`] times already without it — and its loads are slow (the last one took
//!   more than `QUICK_LOAD`): each of its swaps pays the slow load again (~150-300 ms for
//!   100 MB from an `.onnx` instead of ~7 ms), so waiting for a quiet moment, which a busy
//!   server never has, would leave it slow for good. If its own form's copy does not fit
//!   beside what is resident, idle models with nothing queued are evicted for it (least
//!   recently used first), as they would be for a load — a one-time wait of about a second
//!   for the requests of those models, instead of a slow load at every swap from then on.
//!   Never a model that runs or has work queued, and never while a load or an unload is in
//!   progress. A model whose loads are already quick (an ONNX model's mapped copy: ~4 ms)
//!   would gain milliseconds a swap, while the copy's accounted peak keeps every other
//!   model from loading for as long as it is made (measured: 300 MiB cold, p99 1.0 s with
//!   the copies made at once, against 73 ms once made): its copy waits for a quiet host.
//!
//! A model asked for meanwhile loads at once in the form that needs nothing; if the
//! memory a quiet host's preparation holds is what keeps that load from fitting (or a
//! run's working set overdraws the budget: before any idle model is evicted), the
//! preparation is stopped (its child process killed: a request never waits for one-time
//! work), and quiet-host preparations start again only after [`STOP_BACKOFF`], doubled at
//! each stop in a row up to [`MAX_STOP_BACKOFF`], so that sparse traffic does not stop
//! the same conversion over and over. A churning model's preparation is not stopped: it
//! exists because each of that model's loads is slow. A copy whose
//! peak cannot fit even with every idle model gone (a 300 MiB budget and a 100 MB model)
//! is never made by the server: the model is served from its `.onnx`, and `snooze
//! prepare` makes the copy ahead of time.

use std::time::Duration;

use crate::{
    backend::{Device, Weights},
    pressure::PressureLevel,
};

use super::{Action, ModelId, Scheduler, SlotState};

/// Loads without its copy after which a model's preparation no longer waits for a quiet
/// host: it has been swapped back in, so it will be again.
pub const CHURN_LOADS: u64 = 2;

/// How long quiet-host preparations wait after one was stopped for a request ...
pub const STOP_BACKOFF: Duration = Duration::from_secs(1);
/// ... doubled at each stop in a row, up to this.
pub const MAX_STOP_BACKOFF: Duration = Duration::from_secs(64);

/// The preparation in progress.
#[derive(Debug, Clone, Copy)]
pub(super) struct Preparing {
    model: ModelId,
    /// The bytes it holds at its peak (host memory).
    peak: u64,
    /// Started on a quiet host: a load or a run that needs its memory stops it.
    yields: bool,
    /// Asked to stop: its bytes count until it has.
    stopping: bool,
}

/// A preparation still to do for a model: the form it is for and its peak in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preparation {
    pub weights: Weights,
    pub peak: u64,
    /// The model's own loads take this form (else it is a promotion's copy).
    pub loads_in: bool,
}

/// What a finished preparation changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Done; the model's next loads take the prepared form, whose estimate this is
    /// (`None`: the form is not the one the model loads in, e.g. a promotion's copy).
    Done { steady: Option<u64>, peak: Option<u64> },
    /// It failed: the model keeps loading without it, and it is not tried again.
    Failed(String),
    /// It was stopped for a load or a run (`Action::StopPrepare`): it runs again later.
    Stopped,
}

impl Scheduler {
    /// The preparations a model still needs, in the order they should run.
    pub fn set_preparations(&mut self, model: ModelId, preparations: Vec<Preparation>) {
        self.slots[model].preparations = preparations;
    }

    /// The model's files were replaced (a new version copied over the old one): what
    /// was estimated, measured or learned of the old files no longer holds. Its next
    /// load is admitted by `estimate` (or `learned`: a figure kept for these very files)
    /// and its preparations start over (the cache is keyed by file version).
    pub fn files_replaced(
        &mut self,
        model: ModelId,
        estimate: (Option<u64>, Option<u64>),
        learned: (Option<u64>, Option<u64>),
        preparations: Vec<Preparation>,
    ) {
        let s = &mut self.slots[model];
        (s.policy.estimate_steady, s.policy.estimate_peak) = estimate;
        (s.learned_bytes, s.learned_peak_bytes) = learned;
        (s.measured_bytes, s.measured_peak_bytes) = (None, None);
        s.last_error = None;
        s.preparations = preparations;
        // A load that failed on the old files says nothing of the new ones.
        if matches!(s.state, SlotState::Failed { .. }) {
            s.state = SlotState::Unloaded;
        }
    }

    /// Starts the next preparation if it is due (a quiet host, or a model that churns)
    /// and it fits — for a model that churns, once idle models are evicted for it.
    pub(super) fn plan_preparation(&mut self) {
        let cpu = Device::Cpu;
        // Runs on every event (twice): cheap once nothing is left to prepare.
        if self.preparing.is_some()
            || self.shutting_down
            || self.pressure != PressureLevel::Normal
            || self.slots.iter().all(|s| s.preparations.is_empty())
        {
            return;
        }
        let busy = self.slots.iter().any(|s| s.busy_on(&cpu));
        let held_back = self.prepare_stops.1.filter(|&t| self.now < t);
        let quiet = !busy
            && held_back.is_none()
            && !self.slots.iter().any(|s| matches!(s.state, SlotState::Unloaded) && s.wants_load());
        if let Some(t) = held_back {
            self.wake_by(t);
        }
        let free = self.budget(&cpu).saturating_sub(self.accounted(&cpu)).min(self.probe_free(&cpu));
        // Models asked for most recently first: their next load is the likeliest.
        let mut order: Vec<ModelId> = (0..self.slots.len()).collect();
        order.sort_by_key(|&id| std::cmp::Reverse(self.slots[id].last_request));
        let next = order.into_iter().find_map(|id| {
            let s = &self.slots[id];
            let p = *s.preparations.first()?;
            // Only the copy its loads use: a promotion's copy waits for a quiet host.
            let churns = s.loads >= CHURN_LOADS && p.loads_in && s.slow_reload();
            let need = p.peak.saturating_add(self.config.headroom);
            if !(quiet || churns) {
                return None;
            }
            if need <= free {
                return Some((id, p, churns, Vec::new()));
            }
            if !churns || busy {
                return None;
            }
            // No exception: the model's own idle instance may go too (it comes back
            // from the copy).
            let idle = self.idle_by_worth(&cpu, ModelId::MAX, self.now);
            let bytes = |v: ModelId| self.slots[v].resident_bytes();
            let victims = Self::cover(idle, need - free, bytes);
            let freed: u64 = victims.iter().map(|&v| bytes(v)).sum();
            (need <= free.saturating_add(freed)).then_some((id, p, churns, victims))
        });
        let Some((model, p, churns, victims)) = next else { return };
        tracing::debug!(
            model = self.slots[model].name(),
            weights = p.weights.as_str(),
            peak = p.peak,
            evicting = victims.len(),
            "preparing in the background"
        );
        for v in victims {
            // Made room, as for a load: it may come back when there is room again.
            self.slots[v].evicted_at = Some(self.now);
            self.begin_unload(v, super::UnloadReason::Evicted);
        }
        self.preparing = Some(Preparing { model, peak: p.peak, yields: !churns, stopping: false });
        self.push(Action::StartPrepare { model, weights: p.weights });
    }

    /// Bytes `device` would have once the preparation in progress stopped: its peak if
    /// it yields to requests (a quiet host's), else 0.
    pub(super) fn yielding_bytes(&self, device: &Device) -> u64 {
        match (device, self.preparing) {
            (Device::Cpu, Some(p)) if p.yields => p.peak,
            _ => 0,
        }
    }

    /// Asks the preparation in progress to stop for a load or a run, once.
    pub(super) fn stop_preparation(&mut self) {
        let Some(p) = self.preparing.as_mut().filter(|p| p.yields && !p.stopping) else { return };
        p.stopping = true;
        let model = p.model;
        tracing::debug!(
            model = self.slots[model].name(),
            "stopping the background preparation: a load or a run needs its memory"
        );
        self.push(Action::StopPrepare { model });
    }

    pub(super) fn on_prepare_finished(&mut self, model: ModelId, weights: Weights, result: Prepared) {
        if self.preparing.is_some_and(|p| p.model == model) {
            self.preparing = None;
        }
        let s = &mut self.slots[model];
        match result {
            Prepared::Done { steady, peak } => {
                s.preparations.retain(|p| p.weights != weights);
                if steady.is_some() {
                    s.policy.estimate_steady = steady;
                    s.policy.estimate_peak = peak;
                }
                self.prepare_stops = (0, None);
            }
            Prepared::Stopped => {
                // Not a failure: it runs again on a quiet host, after a pause that grows
                // with each stop in a row.
                let stops = self.prepare_stops.0.saturating_add(1);
                let pause = STOP_BACKOFF.saturating_mul(1 << (stops - 1).min(6)).min(MAX_STOP_BACKOFF);
                tracing::info!(model = %s.policy.name, weights = weights.as_str(), again_in_s = pause.as_secs(), "background preparation stopped: a load or a run needed its memory");
                self.prepare_stops = (stops, Some(self.now + pause));
            }
            Prepared::Failed(why) => {
                tracing::warn!(model = %s.policy.name, weights = weights.as_str(), error = %why, "preparation failed: the model keeps loading without it");
                s.preparations.clear();
                s.last_error = Some(why);
            }
        }
    }

    /// Bytes held by the preparation in progress (host memory).
    pub(super) fn preparing_bytes(&self, device: &Device) -> u64 {
        match (device, self.preparing) {
            (Device::Cpu, Some(p)) => p.peak,
            _ => 0,
        }
    }

    /// Whether the model's loads in the form `weights` take their prepared form (none
    /// is pending for it).
    pub fn is_prepared(&self, model: ModelId, weights: Weights) -> bool {
        !self.slots[model].preparations.iter().any(|p| p.weights == weights)
    }

    /// Whether a preparation is in progress.
    pub fn is_preparing(&self) -> bool {
        self.preparing.is_some()
    }
}
