//! Requests arriving and leaving (rules 2 and 10): a submit joins its model's queue —
//! or is refused at once when waiting cannot help (shutdown, a model in backoff, a full
//! queue, low priority under critical pressure) — and a cancel takes it out.

use std::time::Instant;

use super::*;

impl Scheduler {
    /// Why a model cannot be used right now, if it cannot.
    pub(super) fn unavailable(&self, now: Instant, model: ModelId) -> Option<SnoozeError> {
        if self.shutting_down {
            return Some(self.shutting_down_error());
        }
        let s = &self.slots[model];
        if let Some(why) = &self.unreadable[model] {
            return Some(SnoozeError::new(
                ErrorKind::ModelFailed,
                format!("model '{}' cannot be loaded: {why}", s.policy.name),
            ));
        }
        match &s.state {
            SlotState::Failed { until, error } if *until > now => {
                let wait = *until - now;
                Some(
                    SnoozeError::new(
                        ErrorKind::ModelFailed,
                        format!(
                            "model '{}' failed and is backing off for {:.1}s more: {error}",
                            s.policy.name,
                            wait.as_secs_f64()
                        ),
                    )
                    .retry_after(wait),
                )
            }
            _ => None,
        }
    }

    pub(super) fn on_submit(&mut self, now: Instant, sub: Submit) {
        let model = sub.model;
        if let Some(err) = self.unavailable(now, model) {
            return self.refuse(sub.req, err);
        }
        let s = &self.slots[model];
        let priority = sub.priority.unwrap_or(s.policy.priority);
        if priority == Priority::Low && self.pressure >= PressureLevel::Critical {
            return self.refuse(sub.req, refusal::low_priority_under_pressure(self.config.retry_after));
        }
        if s.queue.len() >= s.policy.max_queue {
            let err = self.queue_full_error(model);
            match self.slots[model].queue.pop_least_urgent_below(priority) {
                // A full queue makes room for a more urgent request by dropping the
                // newest of its least urgent ones.
                Some(dropped) => self.refuse(dropped.req, err),
                None => return self.refuse(sub.req, err),
            }
        }
        let s = &mut self.slots[model];
        // Requests a moment apart (a burst, a batch) tell nothing of how often it is asked
        // for: the gap is measured between requests at least 1 ms apart.
        if s.last_request.is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_millis(1)) {
            s.previous_request = s.last_request;
        }
        s.last_request = Some(now);
        self.enqueue(
            model,
            priority,
            Queued {
                req: sub.req,
                rows: sub.rows,
                key: sub.key,
                size: sub.size,
                since: now,
                retry: Retry::First,
                resumed: false,
            },
        );
    }

    pub(super) fn enqueue(&mut self, model: ModelId, priority: Priority, q: Queued) {
        let s = &mut self.slots[model];
        if matches!(s.state, SlotState::Failed { .. }) {
            s.state = SlotState::Unloaded;
        }
        if matches!(s.state, SlotState::Unloaded) && !s.wants_load() {
            s.device_index = 0;
        }
        s.queue.push(priority, q);
    }

    /// The caller stopped waiting. A queued request leaves its queue; a load or an unload
    /// asked for goes on, answered to nobody, as the 503 that timed it out says.
    pub(super) fn on_cancel(&mut self, req: RequestId) {
        self.in_flight.remove(&req);
        for s in &mut self.slots {
            s.queue.remove(req);
            for (waiter, _) in s.load_waiters.iter_mut().filter(|(r, _)| *r == req) {
                *waiter = NOBODY;
            }
            s.unload_waiters.retain(|r| *r != req);
        }
    }
}
