//! Models leaving memory (rules 4, 7 and 8): asked-for unloads, collections, shutdown,
//! and what an unload's end changes (its waiters answered, a panicked model backing
//! off); `begin_unload` is the one way a ready model starts to leave.

use std::time::{Duration, Instant};

use super::*;

impl Scheduler {
    pub(super) fn on_unload(&mut self, req: RequestId, model: ModelId) {
        let s = &mut self.slots[model];
        match &s.state {
            SlotState::Unloaded | SlotState::Failed { .. } => {
                self.push(Action::Reply { req, result: Ok(()) })
            }
            SlotState::Ready { .. } if s.running == 0 && !s.queue.has_resumed() => {
                s.unload_waiters.push(req);
                self.begin_unload(model, UnloadReason::Requested);
            }
            SlotState::Unloading { .. } => s.unload_waiters.push(req),
            // Runs in flight, task jobs between two slices (a transcription, a document)
            // or a load end first; meanwhile nothing new is dispatched.
            _ => {
                s.unload_requested = true;
                s.unload_waiters.push(req);
                s.queue.resumed_first();
            }
        }
    }

    pub(super) fn on_collect(
        &mut self,
        req: RequestId,
        except: Option<ModelId>,
        include_pinned: bool,
        reason: UnloadReason,
    ) {
        let victims: Vec<ModelId> = (0..self.slots.len())
            .filter(|&id| Some(id) != except)
            .filter(|&id| {
                self.slots[id].idle().is_some() && (include_pinned || !self.slots[id].policy.pinned)
            })
            .collect();
        for &v in &victims {
            self.begin_unload(v, reason);
        }
        if victims.is_empty() {
            self.push(Action::Collected { req, models: Vec::new() });
        } else {
            self.collections.push(Collection { req, pending: victims.clone(), models: victims });
        }
    }

    /// Rule 8, emergency: the process holds `excess` bytes over the critical threshold.
    /// Idle, unpinned models holding host memory leave, the one worth least first (see
    /// `keep_value`; `min_residency` does not protect them here), until they and the
    /// models already leaving cover it. Not every idle model: an overshoot of a few
    /// percent (a page's activations in flight) used to empty the host of the light
    /// models asked for many times a second, each reloaded moments later. The shell
    /// reads the level again as each unload ends, so an excess that remains takes the next.
    pub(super) fn on_emergency(&mut self, now: Instant, excess: u64) {
        let host = Device::Cpu;
        let need = excess.saturating_sub(self.leaving(&host));
        let idle = self.idle_in_worth_order(&host, ModelId::MAX, now, true);
        for victim in Self::cover(idle, need, |id| self.slots[id].held_on(&host).unwrap_or(0)) {
            tracing::debug!(model = self.slots[victim].name(), excess, "unloaded: memory emergency");
            self.begin_unload(victim, UnloadReason::Pressure);
        }
    }

    pub(super) fn on_unload_finished(&mut self, now: Instant, model: ModelId) {
        let s = &mut self.slots[model];
        let reason = match &s.state {
            SlotState::Unloading { reason, .. } => Some(*reason),
            _ => None,
        };
        debug_assert!(reason.is_some(), "unload finished for a model that was not unloading");
        s.state = SlotState::Unloaded;
        s.draining = false;
        s.owed = 0;
        s.device_index = 0;
        self.answer_unload_waiters(model);
        for c in &mut self.collections {
            c.pending.retain(|m| *m != model);
        }
        let (done, open): (Vec<Collection>, Vec<Collection>) =
            std::mem::take(&mut self.collections).into_iter().partition(|c| c.pending.is_empty());
        self.collections = open;
        for c in done {
            self.push(Action::Collected { req: c.req, models: c.models });
        }
        if let Some(why) = self.slots[model].poisoned.take() {
            // Like a failed load: back off, so a model that panics on every request is
            // not reloaded for every request.
            let backoff = self.backoff(self.slots[model].panics);
            let s = &mut self.slots[model];
            s.state = SlotState::Failed { until: now + backoff, error: why.clone() };
            let err = SnoozeError::new(
                ErrorKind::ModelFailed,
                format!(
                    "model '{}' was unloaded after it failed ({why}); it reloads in {:.1}s",
                    s.policy.name,
                    backoff.as_secs_f64()
                ),
            )
            .retry_after(backoff);
            self.fail_all(model, err);
            return;
        }
        if reason != Some(UnloadReason::Failed) {
            // Left memory normally: earlier panics no longer count toward the backoff.
            self.slots[model].panics = 0;
        }
        if self.shutting_down {
            let err = self.shutting_down_error();
            self.fail_all(model, err);
        }
    }

    pub(super) fn on_shutdown(&mut self) {
        self.shutting_down = true;
        let err = self.shutting_down_error();
        for id in 0..self.slots.len() {
            if !self.slots[id].is_ready() {
                self.fail_all(id, err.clone());
            } else {
                // What has not started is refused; a task job between two slices is a
                // request in flight: it goes on within shutdown_timeout.
                let waiting: Vec<(Priority, Queued)> = self.slots[id].queue.drain_with_priority();
                for (priority, q) in waiting {
                    if q.resumed {
                        self.slots[id].queue.push(priority, q);
                    } else {
                        self.refuse(q.req, err.clone());
                    }
                }
            }
            if self.slots[id].idle().is_some() {
                self.begin_unload(id, UnloadReason::Shutdown);
            }
        }
    }

    /// Refuses everything waiting for the model (requests and loads) and answers its
    /// pending unloads: the model is not going to be in memory for them.
    pub(super) fn fail_all(&mut self, model: ModelId, err: SnoozeError) {
        let s = &mut self.slots[model];
        let waiting: Vec<RequestId> = s
            .queue
            .drain()
            .into_iter()
            .map(|q| q.req)
            .chain(std::mem::take(&mut s.load_waiters).into_iter().map(|(r, _)| r))
            .filter(|r| *r != NOBODY)
            .collect();
        for req in waiting {
            self.actions.push(Action::Reply { req, result: Err(err.clone()) });
        }
        self.answer_unload_waiters(model);
    }

    /// First backoff, doubled per consecutive failure, capped.
    pub(super) fn backoff(&self, failures: u32) -> Duration {
        self.config
            .backoff_base
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(self.config.backoff_max)
    }

    /// The model is not in memory any more (or never got there): every pending unload
    /// is done, and the request for one does not outlive this load.
    pub(super) fn answer_unload_waiters(&mut self, model: ModelId) {
        let s = &mut self.slots[model];
        s.unload_requested = false;
        for req in std::mem::take(&mut s.unload_waiters) {
            self.actions.push(Action::Reply { req, result: Ok(()) });
        }
    }

    /// A load asked for after an unload wins: the unload is called off and its callers
    /// are told so rather than left waiting for an unload that will not come.
    pub(super) fn supersede_unload(&mut self, model: ModelId) {
        let s = &mut self.slots[model];
        if !s.unload_requested {
            return;
        }
        s.unload_requested = false;
        let err = SnoozeError::new(
            ErrorKind::Conflict,
            format!("the unload of model '{}' was called off by a later load request", s.policy.name),
        );
        for req in std::mem::take(&mut s.unload_waiters) {
            self.actions.push(Action::Reply { req, result: Err(err.clone()) });
        }
    }

    /// Once nothing runs and nothing waits, a pending unload, a panic, shutdown or a
    /// zero keep-alive takes the model out of memory.
    pub(super) fn maybe_unload_after_work(&mut self, model: ModelId) {
        let s = &self.slots[model];
        if !s.is_ready() || s.running > 0 {
            return;
        }
        if s.poisoned.is_some() {
            return self.begin_unload(model, UnloadReason::Failed);
        }
        if s.unload_requested && !s.queue.resumed_next() {
            return self.begin_unload(model, UnloadReason::Requested);
        }
        if !s.queue.is_empty() {
            return;
        }
        if self.shutting_down {
            self.begin_unload(model, UnloadReason::Shutdown);
        } else if s.policy.keep_alive == KeepAlive::For(Duration::ZERO) && !s.policy.pinned {
            self.begin_unload(model, UnloadReason::Idle);
        }
    }

    /// Keeps what is accounted on each budgeted device within its budget once the memory
    /// picture grew by itself — a run left more resident than its model's footprint
    /// said, a running model holds its working set — by evicting idle models, the one
    /// worth least first. Models already leaving count as gone; models that are running,
    /// have work, are pinned or are younger than their `min_residency` stay. A quiet
    /// host's preparation goes before any of them: it is stopped, and counts as gone.
    pub(super) fn hold_budgets(&mut self, now: Instant) {
        let devices: Vec<Device> = self.config.budgets.keys().cloned().collect();
        for device in devices {
            let mut staying = self.accounted(&device).saturating_sub(self.leaving(&device));
            let budget = self.budget(&device);
            let yielding = self.yielding_bytes(&device);
            if staying > budget && yielding > 0 {
                self.stop_preparation();
                staying = staying.saturating_sub(yielding);
            }
            if staying <= budget {
                continue;
            }
            let idle = self.idle_by_worth(&device, ModelId::MAX, now);
            let victims =
                Self::cover(idle, staying - budget, |id| self.slots[id].held_on(&device).unwrap_or(0));
            for victim in victims {
                tracing::debug!(
                    model = self.slots[victim].name(),
                    over = staying - budget,
                    "evicted: the budget is overdrawn"
                );
                self.slots[victim].evicted_at = Some(now);
                self.begin_unload(victim, UnloadReason::Evicted);
            }
        }
    }

    /// Bytes of models unloading from `device`: accounted until they are gone, but going.
    pub(super) fn leaving(&self, device: &Device) -> u64 {
        self.slots
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Unloading { device: d, footprint, .. } if d == device => Some(*footprint),
                _ => None,
            })
            .sum()
    }

    /// Moves a Ready model with nothing running to Unloading.
    pub(super) fn begin_unload(&mut self, model: ModelId, reason: UnloadReason) {
        let s = &mut self.slots[model];
        let SlotState::Ready { device, footprint, .. } = &s.state else { return };
        // A promotion in flight ends first (then `on_promote_finished` looks again).
        if s.running > 0 || s.promoting.is_some() {
            return;
        }
        let (device, bytes) = (device.clone(), *footprint);
        if reason == UnloadReason::Evicted {
            s.evictions += 1;
        }
        s.state = SlotState::Unloading { device: device.clone(), footprint: bytes, reason };
        self.actions.push(Action::StartUnload { model, device, reason, bytes });
    }
}
