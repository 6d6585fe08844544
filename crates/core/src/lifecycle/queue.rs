//! One model's waiting requests: a FIFO lane per priority.
//!
//! The scheduler keeps only what it decides with — id, rows, batch key, arrival — never
//! the request's data, which stays with the shell.

use std::{collections::VecDeque, time::Instant};

use super::{RequestId, WorkSize};

/// How urgent a request is: higher runs first within a model, and a load for a
/// high-priority request is planned before one for a lower one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Refused first: under critical memory pressure, and when a queue is full.
    Low,
    #[default]
    Normal,
    High,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Low, Priority::Normal, Priority::High];

    pub fn parse(s: &str) -> Option<Priority> {
        match s.trim().to_ascii_lowercase().as_str() {
            "low" => Some(Priority::Low),
            "normal" => Some(Priority::Normal),
            "high" => Some(Priority::High),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }
}

/// What an out-of-memory failure has already cost a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Retry {
    #[default]
    First,
    /// Failed once; idle models were evicted; runs again alone.
    AfterGc,
    /// Failed twice; runs alone in halves.
    Halved,
}

/// A request waiting for its model.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub req: RequestId,
    /// Rows along the batch dimension (texts for an embedding request).
    pub rows: u32,
    /// Requests with the same key may run as one batch; `None` runs alone.
    pub key: Option<u64>,
    /// What its run's memory grows with, when it says.
    pub size: Option<WorkSize>,
    pub since: Instant,
    pub retry: Retry,
    /// A task job between two of its slices: started, so a request in flight.
    pub resumed: bool,
}

impl Queued {
    fn batchable(&self) -> bool {
        self.key.is_some() && self.retry == Retry::First
    }
}

#[derive(Debug, Default)]
pub struct RequestQueue {
    /// Indexed by `Priority as usize`.
    lanes: [VecDeque<Queued>; 3],
}

impl RequestQueue {
    pub fn len(&self) -> usize {
        self.lanes.iter().map(VecDeque::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.lanes.iter().all(VecDeque::is_empty)
    }

    pub fn len_at(&self, p: Priority) -> usize {
        self.lanes[p as usize].len()
    }

    pub fn push(&mut self, p: Priority, q: Queued) {
        self.lanes[p as usize].push_back(q);
    }

    /// Back at the head of its lane (a retry keeps its turn).
    pub fn push_front(&mut self, p: Priority, q: Queued) {
        self.lanes[p as usize].push_front(q);
    }

    /// Every task job between two slices to the front of the highest lane, in the order
    /// they waited: an asked-for unload lets the requests it holds finish first, and the
    /// rest of the queue waits for its reload.
    pub fn resumed_first(&mut self) {
        let mut resumed = Vec::new();
        for lane in &mut self.lanes {
            let (jobs, rest): (VecDeque<Queued>, VecDeque<Queued>) = lane.drain(..).partition(|q| q.resumed);
            *lane = rest;
            resumed.extend(jobs);
        }
        resumed.sort_by_key(|q| q.since);
        let top = &mut self.lanes[Priority::High as usize];
        for q in resumed.into_iter().rev() {
            top.push_front(q);
        }
    }

    /// A task job between two slices waits here.
    pub fn has_resumed(&self) -> bool {
        self.lanes.iter().flatten().any(|q| q.resumed)
    }

    /// A task job between two slices runs next.
    pub fn resumed_next(&self) -> bool {
        self.head().is_some_and(|q| q.resumed)
    }

    /// The highest priority waiting.
    pub fn top(&self) -> Option<Priority> {
        Priority::ALL.into_iter().rev().find(|p| !self.lanes[*p as usize].is_empty())
    }

    /// The request that runs next.
    pub fn head(&self) -> Option<&Queued> {
        self.top().and_then(|p| self.lanes[p as usize].front())
    }

    /// When the longest-waiting request arrived.
    pub fn oldest(&self) -> Option<Instant> {
        self.lanes.iter().filter_map(|l| l.iter().map(|q| q.since).min()).min()
    }

    pub fn remove(&mut self, req: RequestId) -> Option<Queued> {
        for lane in &mut self.lanes {
            if let Some(i) = lane.iter().position(|q| q.req == req) {
                return lane.remove(i);
            }
        }
        None
    }

    /// The next batch: the head, and — when it may be batched — every later request with
    /// the same key, highest priority first, while the rows fit `max_rows`. A head
    /// larger than `max_rows` runs alone (in micro-batches).
    /// `resumed_only`: company for the head only among task jobs between two slices (a
    /// model closing for an asked-for unload finishes those and starts nothing new).
    pub fn take_batch(&mut self, max_rows: u32, resumed_only: bool) -> Vec<(Priority, Queued)> {
        let Some(top) = self.top() else { return Vec::new() };
        let Some(head) = self.lanes[top as usize].pop_front() else { return Vec::new() };
        let mut rows = head.rows;
        let key = head.key;
        let alone = !head.batchable() || rows >= max_rows;
        let mut batch = vec![(top, head)];
        if alone {
            return batch;
        }
        for p in Priority::ALL.into_iter().rev() {
            let lane = &mut self.lanes[p as usize];
            let mut i = 0;
            while i < lane.len() {
                let q = &lane[i];
                if q.batchable()
                    && q.key == key
                    && (q.resumed || !resumed_only)
                    && rows.saturating_add(q.rows) <= max_rows
                {
                    rows += q.rows;
                    batch.extend(lane.remove(i).map(|q| (p, q)));
                } else {
                    i += 1;
                }
            }
        }
        batch
    }

    /// Rows waiting that could join a batch with the head.
    pub fn batchable_rows(&self) -> u32 {
        let Some(head) = self.head() else { return 0 };
        if !head.batchable() {
            return head.rows;
        }
        self.lanes
            .iter()
            .flatten()
            .filter(|q| q.batchable() && q.key == head.key)
            .map(|q| q.rows)
            .fold(0u32, u32::saturating_add)
    }

    /// Removes and returns every request that arrived at or before `cutoff`.
    pub fn expire(&mut self, cutoff: Instant) -> Vec<Queued> {
        let mut out = Vec::new();
        for lane in &mut self.lanes {
            let (old, keep): (VecDeque<Queued>, VecDeque<Queued>) =
                lane.drain(..).partition(|q| q.since <= cutoff);
            out.extend(old);
            *lane = keep;
        }
        out
    }

    /// The newest request of the lowest priority below `p`: the one a full queue drops
    /// to make room for a more urgent request.
    pub fn pop_least_urgent_below(&mut self, p: Priority) -> Option<Queued> {
        Priority::ALL.into_iter().filter(|q| *q < p).find_map(|q| self.lanes[q as usize].pop_back())
    }

    /// Everything, in the order it would have run.
    pub fn drain(&mut self) -> Vec<Queued> {
        self.drain_with_priority().into_iter().map(|(_, q)| q).collect()
    }

    /// Everything, highest priority first, each with its lane.
    pub fn drain_with_priority(&mut self) -> Vec<(Priority, Queued)> {
        Priority::ALL
            .into_iter()
            .rev()
            .flat_map(|p| std::mem::take(&mut self.lanes[p as usize]).into_iter().map(move |q| (p, q)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn q(req: RequestId, rows: u32, key: Option<u64>, t: Instant) -> Queued {
        Queued { req, rows, key, size: None, since: t, retry: Retry::First, resumed: false }
    }

    #[test]
    fn batches_take_the_head_then_same_key_rows_by_priority_up_to_the_limit() {
        let t = Instant::now();
        let mut queue = RequestQueue::default();
        queue.push(Priority::Normal, q(1, 3, Some(7), t));
        queue.push(Priority::Normal, q(2, 2, Some(8), t)); // another shape: not merged
        queue.push(Priority::Low, q(3, 2, Some(7), t));
        queue.push(Priority::High, q(4, 1, Some(7), t));
        queue.push(Priority::Normal, q(5, 4, Some(7), t));
        let ids = |b: Vec<(Priority, Queued)>| b.iter().map(|(_, q)| q.req).collect::<Vec<_>>();
        assert_eq!(
            ids(queue.take_batch(8, false)),
            [4, 1, 5],
            "high first, then normal: 1+3+4 = 8 rows; 3 does not fit"
        );
        assert_eq!(ids(queue.take_batch(8, false)), [2]);
        assert_eq!(ids(queue.take_batch(8, false)), [3]);
        assert!(queue.is_empty());
    }

    #[test]
    fn oversized_and_unbatchable_heads_run_alone() {
        let t = Instant::now();
        let mut queue = RequestQueue::default();
        queue.push(Priority::Normal, q(1, 100, Some(7), t));
        queue.push(Priority::Normal, q(2, 1, Some(7), t));
        queue.push(Priority::Normal, q(3, 1, None, t));
        queue.push(Priority::Normal, q(4, 1, None, t));
        assert_eq!(queue.take_batch(8, false).len(), 1, "100 rows > 8: alone, in micro-batches");
        assert_eq!(queue.take_batch(8, false).len(), 1);
        assert_eq!(queue.take_batch(8, false)[0].1.req, 3, "no key: alone");
        let mut retried = q(9, 1, Some(7), t);
        retried.retry = Retry::AfterGc;
        queue.push_front(Priority::Normal, retried);
        queue.push(Priority::Normal, q(10, 1, Some(7), t));
        let b = queue.take_batch(8, false);
        assert_eq!((b.len(), b[0].1.req), (1, 9), "a retry runs alone");
    }

    #[test]
    fn expiry_positions_and_displacement() {
        let t = Instant::now();
        let mut queue = RequestQueue::default();
        queue.push(Priority::Low, q(1, 1, None, t));
        queue.push(Priority::Normal, q(2, 1, None, t + Duration::from_secs(1)));
        queue.push(Priority::High, q(3, 1, None, t + Duration::from_secs(2)));
        assert_eq!(queue.oldest(), Some(t));
        let gone: Vec<_> = queue.expire(t + Duration::from_secs(1)).iter().map(|q| q.req).collect();
        assert_eq!(gone, [1, 2]);
        queue.push(Priority::Low, q(4, 1, None, t));
        assert_eq!(queue.pop_least_urgent_below(Priority::Normal).map(|q| q.req), Some(4));
        assert_eq!(queue.pop_least_urgent_below(Priority::Normal), None, "only lower lanes give way");
        assert_eq!(Priority::parse("HIGH"), Some(Priority::High));
    }
}
