//! Admission and eviction planning (rules 3–5): does the model fit, whom to evict, or
//! why to refuse.

use std::time::{Duration, Instant};

use crate::{
    backend::Device,
    error::{ErrorKind, SnoozeError},
    pressure::PressureLevel,
    units::format_bytes as fb,
};

use super::{ModelId, Scheduler, SlotState};

pub(super) enum Plan {
    Load,
    /// Unload these first; the model stays at the head of the queue meanwhile.
    Evict(Vec<ModelId>),
    Refuse(SnoozeError),
}

impl Scheduler {
    pub(super) fn plan(&self, model: ModelId, device: &Device, now: Instant) -> Plan {
        let slot = &self.slots[model];
        let name = slot.name();
        let headroom = self.config.headroom;
        let budget = self.budget(device);
        let accounted = self.accounted(device);
        let budget_free = budget.saturating_sub(accounted);
        let probe_free = self.available.get(device).copied().unwrap_or(u64::MAX);
        let resident = self
            .slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Loading { .. } | SlotState::Ready { .. }))
            .count();
        let cap = self.config.max_loaded_models;
        let need = slot.admission_bytes();

        // Under critical pressure a load must be paid for by evictions (rule 8).
        let critical = self.pressure >= PressureLevel::Critical;
        let already_paid = slot.evicted_for;
        let fits = |freed: u64, evicted: usize| {
            let paid = !critical || need.is_none_or(|n| freed + already_paid >= n);
            let count_ok = paid && (cap == 0 || resident - evicted < cap);
            let mem_ok = need.is_none_or(|n| {
                let n = n.saturating_add(headroom);
                n <= budget_free.saturating_add(freed) && n <= probe_free.saturating_add(freed)
            });
            count_ok && mem_ok
        };
        if need.is_none() && fits(0, 0) {
            tracing::warn!(model = name, "footprint cannot be determined: loading without the memory guard");
        }
        if fits(0, 0) {
            return Plan::Load;
        }
        let need_text =
            |n: u64| format!("{} (footprint {} + headroom {})", fb(n + headroom), fb(n), fb(headroom));
        let baseline = self.config.baselines.get(device).copied().unwrap_or(0);
        if let Some(n) = need {
            let pinned: u64 =
                self.slots.iter().filter(|s| s.policy.pinned).filter_map(|s| s.held_on(device)).sum();
            if n.saturating_add(headroom) > budget.saturating_sub(baseline + pinned) {
                return Plan::Refuse(
                    SnoozeError::new(
                        ErrorKind::InsufficientMemory,
                        format!(
                            "model '{name}' needs {} on {device}, more than the budget can ever give it: \
                             {} budget - {} server baseline - {} pinned models = {} free at best; \
                             raise host_memory_limit or lower the model's memory",
                            need_text(n),
                            fb(budget),
                            fb(baseline),
                            fb(pinned),
                            fb(budget.saturating_sub(baseline + pinned)),
                        ),
                    )
                    .retry_after(self.config.retry_after),
                );
            }
        }

        let candidates = self.lru_idle(device, model, now, true);
        let mut freed = 0;
        let mut chosen = Vec::new();
        let mut young_wait: Option<Duration> = None;
        for c in candidates {
            let s = &self.slots[c];
            if let SlotState::Ready { loaded_at, .. } = s.state {
                let old_at = loaded_at + s.policy.min_residency;
                if old_at > now {
                    young_wait = Some(young_wait.unwrap_or_default().max(old_at - now));
                }
            }
            freed += s.resident_bytes();
            chosen.push(c);
            if fits(freed, chosen.len()) {
                return match young_wait {
                    None => Plan::Evict(chosen),
                    // Evicting a model younger than min_residency would let two models that
                    // cannot both fit evict each other on every request: wait it out instead.
                    Some(wait) => Plan::Refuse(
                        SnoozeError::new(
                            ErrorKind::InsufficientMemory,
                            format!(
                                "model '{name}' needs {} on {device} but only {} is free, and making room \
                                 would evict a model loaded less than its min_residency ago; retry in {:.1}s",
                                need.map_or("a model slot".into(), need_text),
                                fb(budget_free.min(probe_free)),
                                wait.as_secs_f64()
                            ),
                        )
                        .retry_after(wait.max(Duration::from_secs(1))),
                    ),
                };
            }
        }
        let busy: Vec<String> = self
            .slots
            .iter()
            .filter_map(|s| {
                let held = s.held_on(device)?;
                let why = if s.policy.pinned {
                    "pinned"
                } else if s.leases() > 0 {
                    "serving requests"
                } else {
                    match s.state {
                        SlotState::Loading { .. } => "loading",
                        SlotState::Unloading { .. } => "unloading",
                        _ => "idle",
                    }
                };
                Some(format!("'{}' {} ({why})", s.name(), fb(held)))
            })
            .collect();
        let what = match need {
            _ if cap != 0 && resident >= cap => format!("a model slot (max_loaded_models = {cap})"),
            Some(n) => need_text(n),
            None => "memory".into(),
        };
        Plan::Refuse(
            SnoozeError::new(
                ErrorKind::InsufficientMemory,
                format!(
                    "model '{name}' needs {what} on {device} but only {} is free (budget {}, in use {}: \
                     baseline {}{}{}) and nothing idle can be evicted{}; retry later",
                    fb(budget_free.min(probe_free)),
                    fb(budget),
                    fb(accounted),
                    fb(baseline),
                    if busy.is_empty() { "" } else { ", " },
                    busy.join(", "),
                    if critical {
                        " (memory pressure is critical: loads must be paid for by evictions)"
                    } else {
                        ""
                    }
                ),
            )
            .retry_after(self.config.retry_after),
        )
    }

    /// Idle, unpinned models on `device` other than `except`, least recently used first;
    /// those past min_residency come before younger ones unless `young_last` is false.
    pub(super) fn lru_idle(
        &self,
        device: &Device,
        except: ModelId,
        now: Instant,
        young_last: bool,
    ) -> Vec<ModelId> {
        let mut v: Vec<(bool, Instant, ModelId)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(id, s)| *id != except && !s.policy.pinned && s.device() == Some(device))
            .filter_map(|(id, s)| match s.state {
                SlotState::Ready { leases: 0, last_used, loaded_at, .. } => {
                    let young = young_last && loaded_at + s.policy.min_residency > now;
                    Some((young, last_used, id))
                }
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, _, id)| id).collect()
    }
}
