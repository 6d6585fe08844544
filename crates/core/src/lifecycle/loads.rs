//! Loads ending (rules 1, 3, 6 and 9): a model becomes ready and learns what it took,
//! or an out-of-memory load evicts one more idle model and retries, or a failed load
//! backs off; a promotion swaps in the fast form. What starts a load is in `plan`.

use std::time::{Duration, Instant};

use super::*;

impl Scheduler {
    pub(super) fn on_load(&mut self, now: Instant, req: RequestId, model: ModelId) {
        self.supersede_unload(model);
        if let Some(err) = self.unavailable(now, model) {
            return self.refuse(req, err);
        }
        let s = &mut self.slots[model];
        match s.state {
            SlotState::Ready { .. } => self.push(Action::Reply { req, result: Ok(()) }),
            _ => {
                if matches!(s.state, SlotState::Failed { .. }) {
                    s.state = SlotState::Unloaded;
                }
                if matches!(s.state, SlotState::Unloaded) && !s.wants_load() {
                    s.device_index = 0;
                }
                s.load_waiters.push((req, now));
            }
        }
    }

    pub(super) fn on_load_finished(
        &mut self,
        now: Instant,
        model: ModelId,
        result: Result<LoadMeasurement, LoadError>,
        took: Duration,
    ) {
        let SlotState::Loading { device, .. } = self.slots[model].state.clone() else {
            debug_assert!(false, "load finished for a model that was not loading");
            return;
        };
        match result {
            Ok(measured) => self.became_ready(now, model, device, measured, took),
            Err(LoadError::OutOfMemory(msg)) => {
                // Verified OOM: make room by evicting one more idle model and retry.
                self.slots[model].state = SlotState::Unloaded;
                if !self.slots[model].wants_load() {
                    // A preload: nobody waits for it, and nothing is evicted for it.
                    return;
                }
                if let Some(victim) = self.idle_by_worth(&device, model, now).first().copied() {
                    self.slots[model].evicted_for += self.slots[victim].resident_bytes();
                    self.begin_unload(victim, UnloadReason::Evicted);
                } else {
                    let text = format!(
                        "model '{}' ran out of memory while loading on {device} and no idle model is left to evict: {msg}",
                        self.slots[model].policy.name
                    );
                    self.slots[model].last_error = Some(text.clone());
                    let err = SnoozeError::new(ErrorKind::InsufficientMemory, text)
                        .retry_after(self.config.retry_after);
                    self.fail_all(model, err);
                }
            }
            Err(LoadError::Failed(msg)) => {
                let s = &mut self.slots[model];
                s.failures += 1;
                s.last_error = Some(msg.clone());
                s.last_load = Some(took);
                let backoff = self.backoff(self.slots[model].failures);
                let s = &mut self.slots[model];
                s.state = SlotState::Failed { until: now + backoff, error: msg.clone() };
                let err = SnoozeError::new(
                    ErrorKind::ModelFailed,
                    format!("model '{}' failed to load: {msg}", s.policy.name),
                );
                self.fail_all(model, err);
            }
        }
    }

    pub(super) fn became_ready(
        &mut self,
        now: Instant,
        model: ModelId,
        device: Device,
        measured: LoadMeasurement,
        took: Duration,
    ) {
        let s = &mut self.slots[model];
        s.loads += 1;
        s.failures = 0;
        s.evicted_for = 0;
        s.last_load = Some(took);
        s.last_error = None;
        if let Some(m) = measured.steady {
            s.measured_bytes = Some(m);
            s.learned_bytes = Some(m);
        }
        if let Some(p) = measured.peak {
            s.measured_peak_bytes = Some(p);
            s.learned_peak_bytes = Some(p);
        }
        if !s.working_measured {
            s.working_bytes = s.working_bytes.max(measured.working);
        }
        s.kept_bytes = 0;
        let footprint = s.resident_bytes();
        s.evicted_at = None;
        s.fresh = true;
        s.batched_runs = 0;
        s.promoted = false;
        s.serving_promoted = false;
        s.state = SlotState::Ready { device, last_used: now, loaded_at: now, footprint };
        // It serves what waited for it before anything may evict it.
        s.owed = s.queue.len();
        for (req, _) in std::mem::take(&mut s.load_waiters).into_iter().filter(|(r, _)| *r != NOBODY) {
            self.actions.push(Action::Reply { req, result: Ok(()) });
        }
        self.maybe_unload_after_work(model);
    }

    pub(super) fn on_promote_finished(&mut self, model: ModelId, result: Result<LoadMeasurement, LoadError>) {
        let s = &mut self.slots[model];
        s.promoting = None;
        // Failed or not, not tried again until the next load.
        s.promoted = true;
        match result {
            Ok(measured) => {
                s.serving_promoted = true;
                if let (Some(bytes), SlotState::Ready { footprint, .. }) = (measured.steady, &mut s.state) {
                    if s.policy.memory.is_none() {
                        *footprint = bytes;
                        s.measured_bytes = Some(bytes);
                        s.kept_bytes = 0;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(model = %s.policy.name, error = %e, "promotion failed: the model keeps serving as it was")
            }
        }
        self.maybe_unload_after_work(model);
    }
}
