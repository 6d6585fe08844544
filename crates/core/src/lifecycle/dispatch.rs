//! Running requests (rules 2 and 10): batches go to resident models with a free run
//! slot, highest priority first; what a batch's end changes; and the out-of-memory
//! recovery of a run — evict idle models and retry once, then run in halves, then 503.

use std::{
    cmp::Reverse,
    time::{Duration, Instant},
};

use crate::events::metric;

use super::{
    queue::{Priority, Queued, Retry},
    refusal,
    turns::LongTurn,
    working::RunHold,
    Action, ModelId, RequestId, Resume, RunOutcome, Scheduler, SlotState, UnloadReason,
};

impl Scheduler {
    /// Dispatches every batch that can run now. Models are served highest waiting
    /// priority first, then longest waiting, so a global cap on runs favours urgency.
    pub(super) fn dispatch(&mut self, now: Instant) {
        let mut order: Vec<(Reverse<Priority>, Instant, ModelId)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_ready() && !s.closed())
            .filter_map(|(id, s)| Some((Reverse(s.queue.top()?), s.queue.oldest()?, id)))
            .collect();
        order.sort();
        for (_, _, model) in order {
            self.dispatch_model(now, model);
        }
    }

    fn dispatch_model(&mut self, now: Instant, model: ModelId) {
        loop {
            let cap = self.config.max_concurrent_inferences;
            if cap != 0 && self.running >= cap {
                return;
            }
            let s = &self.slots[model];
            let Some(head) = s.queue.head() else { return };
            if s.running >= s.policy.max_concurrency.max(1) {
                return;
            }
            // A retry after an out-of-memory failure waits for the evictions it caused.
            let device = s.device().cloned();
            if head.retry == Retry::AfterGc
                && device.is_some_and(|d| self.slots.iter().any(|o| o.busy_on(&d)))
            {
                return;
            }
            // Slices of long work take turns: each already draws on every core of the
            // shared intra-op pool, and side by side they only slow each other and the
            // short requests between them.
            let slices = self.config.max_concurrent_slices;
            if head.size.is_some()
                && slices != 0
                && self.slots.iter().map(|o| o.slices_running()).sum::<usize>() >= slices as usize
            {
                return;
            }
            if self.waits_for_memory(model) {
                return;
            }
            if let Some(until) = self.slice_waits(model, now) {
                self.wake_by(until);
                return;
            }
            // Short runs that kept every core from long work for a while let it have a
            // turn (see `turns`).
            if let Some(turn) = self.waits_for_long_turn(model, now) {
                if let LongTurn::Until(until) = turn {
                    self.wake_by(until);
                }
                return;
            }
            let s = &self.slots[model];
            let max = s.policy.max_batch_size.max(1);
            if !s.policy.batch_delay.is_zero() && head.key.is_some() && s.queue.batchable_rows() < max {
                let until = head.since + s.policy.batch_delay;
                if now < until {
                    self.wake_by(until);
                    return;
                }
            }
            let max_rows = if head.retry == Retry::Halved { (head.rows / 2).max(1) } else { max };
            let s = &mut self.slots[model];
            let batch = s.queue.take_batch(max, s.unload_requested);
            if batch.iter().map(|(_, q)| q.rows).sum::<u32>() > 1 {
                s.batched_runs = s.batched_runs.saturating_add(1);
            }
            let bytes = s.reservation(batch.iter().map(|(_, q)| q.size));
            let (first, slice) = (batch[0].1.req, batch[0].1.size.is_some());
            s.reserved.push(RunHold { first, bytes, slice });
            s.running += 1;
            s.owed = s.owed.saturating_sub(batch.len());
            self.running += 1;
            self.turn_run_started(model, now);
            let reqs: Vec<RequestId> = batch.iter().map(|(_, q)| q.req).collect();
            for (priority, q) in batch {
                self.in_flight.insert(q.req, (model, priority, q));
            }
            self.push(Action::Dispatch { model, reqs, max_rows });
        }
    }

    pub(super) fn on_run_finished(
        &mut self,
        now: Instant,
        model: ModelId,
        reqs: Vec<RequestId>,
        outcome: RunOutcome,
        took: Duration,
        continuing: Vec<Resume>,
    ) {
        self.slots[model].running = self.slots[model].running.saturating_sub(1);
        self.turn_run_ended(model, now);
        let s = &mut self.slots[model];
        self.running = self.running.saturating_sub(1);
        s.release_reservation(&reqs);
        // Rule 2: idle time counts from when the work completed.
        if let SlotState::Ready { last_used, .. } = &mut s.state {
            *last_used = now;
        }
        if std::mem::take(&mut s.fresh) {
            s.first_run = Some(took);
        }
        // A request's time: its share of this run, plus its shares of the slices it ran
        // before when it is a task job (a transcription runs hundreds of decoder steps:
        // one step's time made a queue of minutes look like half a second to Retry-After).
        let share = took / u32::try_from(reqs.len().max(1)).unwrap_or(u32::MAX);
        for req in &reqs {
            let so_far = s.job_time.remove(req).unwrap_or_default() + share;
            match continuing.iter().any(|r| r.req == *req) {
                true => {
                    s.job_time.insert(*req, so_far);
                }
                false => s.per_request = Some(s.per_request.map_or(so_far, |old| (old * 7 + so_far) / 8)),
            }
        }
        // A task job with more slices goes to the back of its lane: requests that came
        // meanwhile, of this model or (by the dispatch order) of others, run first, and
        // jobs resumed together share the next slice.
        for r in continuing {
            if let Some((_, priority, _)) = self.in_flight.remove(&r.req) {
                let q = Queued {
                    req: r.req,
                    rows: r.rows,
                    key: r.key,
                    size: r.size,
                    since: now,
                    retry: Retry::First,
                    resumed: true,
                };
                self.slots[model].queue.push(priority, q);
            }
        }
        if self.slots[model].unload_requested {
            self.slots[model].queue.resumed_first();
        }
        let records: Vec<(ModelId, Priority, Queued)> =
            reqs.iter().filter_map(|r| self.in_flight.remove(r)).collect();
        match outcome {
            RunOutcome::Done => {}
            RunOutcome::Panicked(reason) => {
                let s = &mut self.slots[model];
                if s.is_ready() && s.poisoned.is_none() {
                    s.panics += 1;
                    s.last_error = Some(reason.clone());
                    s.poisoned = Some(reason);
                }
            }
            RunOutcome::OutOfMemory(msg) => self.retry_out_of_memory(model, records, &msg),
        }
        self.maybe_unload_after_work(model);
    }

    /// First failure: evict every idle model on the device and run again alone; second:
    /// run in two halves; third: 503. Requests keep their turn at the head of the queue.
    fn retry_out_of_memory(&mut self, model: ModelId, records: Vec<(ModelId, Priority, Queued)>, msg: &str) {
        let name = self.slots[model].policy.name.clone();
        let retry_after = self.config.retry_after;
        let mut evict = false;
        for (_, priority, mut q) in records.into_iter().rev() {
            let next = match q.retry {
                Retry::First => Some(Retry::AfterGc),
                Retry::AfterGc if q.rows >= 2 => Some(Retry::Halved),
                Retry::AfterGc | Retry::Halved => None,
            };
            match next {
                Some(retry) => {
                    evict |= retry == Retry::AfterGc;
                    let step = if retry == Retry::AfterGc { "retry" } else { "split" };
                    metrics::counter!(metric::OOM_RECOVERIES, "model" => name.clone(), "step" => step)
                        .increment(1);
                    q.retry = retry;
                    self.slots[model].queue.push_front(priority, q);
                }
                None => {
                    let why = if q.retry == Retry::Halved {
                        "even on half the batch"
                    } else {
                        "even after evicting idle models, and one row cannot be split"
                    };
                    self.refuse(q.req, refusal::out_of_memory(&name, why, msg, retry_after));
                }
            }
        }
        if !evict {
            return;
        }
        let Some(device) = self.slots[model].device().cloned() else { return };
        let idle: Vec<ModelId> = (0..self.slots.len())
            .filter(|&id| id != model && !self.slots[id].policy.pinned)
            .filter(|&id| self.slots[id].device() == Some(&device) && self.slots[id].idle().is_some())
            .collect();
        tracing::warn!(model = %name, evicting = idle.len(), error = %msg, "out of memory during inference: evicting idle models and retrying");
        if !idle.is_empty() {
            metrics::counter!(metric::OOM_RECOVERIES, "model" => name.clone(), "step" => "evict")
                .increment(1);
        }
        for id in idle {
            self.begin_unload(id, UnloadReason::Evicted);
        }
    }
}
