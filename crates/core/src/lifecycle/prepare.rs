//! One-time preparations (an ONNX model's ORT-format or prepacked copy): work that
//! makes later loads cheaper, never a condition for serving. A load takes whatever form
//! needs no preparation while one is pending, so a model whose conversion cannot fit
//! the budget is still served, and a refusal's "more than the budget can ever give" is
//! about the model, never about a one-time cost.
//!
//! Preparations run in the background, one at a time, when the host is quiet — no
//! model waiting to load, no load or unload in progress, pressure normal — and when
//! their peak fits what is free without evicting anything; their peak is accounted
//! while they run, like a load's. A model asked for meanwhile loads at once in the
//! form that needs nothing.

use crate::{
    backend::{Device, Weights},
    pressure::PressureLevel,
};

use super::{Action, ModelId, Scheduler, SlotState};

/// A preparation still to do for a model: the form it is for and its peak in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preparation {
    pub weights: Weights,
    pub peak: u64,
}

/// What a finished preparation changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Done; the model's next loads take the prepared form, whose estimate this is
    /// (`None`: the form is not the one the model loads in, e.g. a promotion's copy).
    Done { steady: Option<u64>, peak: Option<u64> },
    /// It failed: the model keeps loading without it, and it is not tried again.
    Failed(String),
}

impl Scheduler {
    /// The preparations a model still needs, in the order they should run.
    pub fn set_preparations(&mut self, model: ModelId, preparations: Vec<Preparation>) {
        self.slots[model].preparations = preparations;
    }

    /// Starts the next preparation if the host is quiet and it fits.
    pub(super) fn plan_preparation(&mut self) {
        let cpu = Device::Cpu;
        let quiet = self.preparing.is_none()
            && !self.shutting_down
            && self.pressure == PressureLevel::Normal
            && !self
                .slots
                .iter()
                .any(|s| s.busy_on(&cpu) || (matches!(s.state, SlotState::Unloaded) && s.wants_load()));
        if !quiet {
            return;
        }
        let free = self.budget(&cpu).saturating_sub(self.accounted(&cpu)).min(self.probe_free(&cpu));
        // Models asked for most recently first: their next load is the likeliest.
        let mut order: Vec<ModelId> = (0..self.slots.len()).collect();
        order.sort_by_key(|&id| std::cmp::Reverse(self.slots[id].last_request));
        let next = order.into_iter().find_map(|id| {
            let p = self.slots[id].preparations.first()?;
            (p.peak.saturating_add(self.config.headroom) <= free).then_some((id, *p))
        });
        let Some((model, p)) = next else { return };
        tracing::debug!(
            model = self.slots[model].name(),
            weights = p.weights.as_str(),
            peak = p.peak,
            "preparing in the background"
        );
        self.preparing = Some((model, p.peak));
        self.push(Action::StartPrepare { model, weights: p.weights });
    }

    pub(super) fn on_prepare_finished(&mut self, model: ModelId, weights: Weights, result: Prepared) {
        if self.preparing.is_some_and(|(m, _)| m == model) {
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
            (Device::Cpu, Some((_, bytes))) => bytes,
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
