//! The scheduler's tests, driven by hand-built instants: no clock, no sleeps. One
//! file per subject: the lifecycle rules (`rules`), queues and dispatch (`queueing`),
//! preparations (`prepare`).
//!
//! The harness plays the shell: it feeds events, completes the loads and unloads the
//! scheduler asks for, and finishes batches when a test says their runs ended.

use std::time::{Duration, Instant};

mod fairness;
mod prepare;
mod queueing;
mod rules;
mod working;

use super::*;

pub(crate) const MB: u64 = 1 << 20;

pub(crate) struct Harness {
    pub s: Scheduler,
    pub t0: Instant,
    pub now: Instant,
    next_req: RequestId,
    /// Every action seen, in order.
    pub log: Vec<Action>,
    /// What each load `settle` completes took (10 ms: quick).
    pub load_time: Duration,
}

pub(crate) fn config(budget_mb: u64) -> SchedulerConfig {
    SchedulerConfig {
        budgets: [(Device::Cpu, budget_mb * MB)].into(),
        baselines: [(Device::Cpu, 0)].into(),
        ..SchedulerConfig::default()
    }
}

impl Harness {
    /// A CPU budget of `budget_mb` and the given models (name, footprint in MB).
    pub fn new(budget_mb: u64, models: &[(&str, u64)]) -> Harness {
        Harness::with(budget_mb, models, |_| {})
    }

    pub fn with(budget_mb: u64, models: &[(&str, u64)], tweak: impl Fn(&mut ModelPolicy)) -> Harness {
        let mut s = Scheduler::new(config(budget_mb));
        for (name, mb) in models {
            let mut p = ModelPolicy::new(*name);
            p.estimate_steady = Some(mb * MB);
            p.estimate_peak = Some(mb * MB);
            tweak(&mut p);
            s.register(p);
        }
        let t0 = Instant::now();
        Harness { s, t0, now: t0, next_req: 1, log: Vec::new(), load_time: Duration::from_millis(10) }
    }

    pub fn id(&self, name: &str) -> ModelId {
        self.s.find(name).expect("model")
    }

    pub fn at(&mut self, secs: f64) {
        self.now = self.t0 + Duration::from_secs_f64(secs);
    }

    pub fn feed(&mut self, e: Event) -> Vec<Action> {
        let a = self.s.handle(self.now, e);
        self.log.extend(a.iter().cloned());
        a
    }

    pub fn tick(&mut self) -> Vec<Action> {
        let a = self.s.handle_timeout(self.now);
        self.log.extend(a.iter().cloned());
        a
    }

    /// Submits a one-row request (batch key 1) at the model's default priority.
    pub fn submit(&mut self, name: &str) -> (RequestId, Vec<Action>) {
        self.submit_with(name, None, 1, Some(1))
    }

    pub fn submit_with(
        &mut self,
        name: &str,
        priority: Option<Priority>,
        rows: u32,
        key: Option<u64>,
    ) -> (RequestId, Vec<Action>) {
        self.submit_full(name, priority, rows, key, None)
    }

    /// Submits a one-row request whose work says its size (a task job's slice), batch key
    /// `key`, at the model's default priority.
    pub fn submit_sized(&mut self, name: &str, key: u64, size: WorkSize) -> (RequestId, Vec<Action>) {
        self.submit_full(name, None, 1, Some(key), Some(size))
    }

    fn submit_full(
        &mut self,
        name: &str,
        priority: Option<Priority>,
        rows: u32,
        key: Option<u64>,
        size: Option<WorkSize>,
    ) -> (RequestId, Vec<Action>) {
        let req = self.next_req;
        self.next_req += 1;
        let model = self.id(name);
        (req, self.feed(Event::Submit(Submit { req, model, priority, rows, key, size })))
    }

    /// Completes every load / unload in `actions` (and what follows), successfully.
    /// Runs are left running.
    pub fn settle(&mut self, actions: Vec<Action>) -> Vec<Action> {
        self.settle_loading_in(actions, self.load_time)
    }

    /// [`Harness::settle`], every load taking `took`.
    pub fn settle_loading_in(&mut self, mut actions: Vec<Action>, took: Duration) -> Vec<Action> {
        let mut all = Vec::new();
        while !actions.is_empty() {
            let a = actions.remove(0);
            all.push(a.clone());
            let more = match a {
                Action::StartLoad { model, .. } => {
                    self.feed(Event::LoadFinished { model, result: Ok(LoadMeasurement::default()), took })
                }
                Action::StartUnload { model, .. } => self.feed(Event::UnloadFinished { model }),
                _ => vec![],
            };
            actions.extend(more);
        }
        all
    }

    /// The batch `req` was dispatched in, if it was.
    pub fn batch_of(&self, req: RequestId) -> Option<(ModelId, Vec<RequestId>, u32)> {
        self.log.iter().rev().find_map(|a| match a {
            Action::Dispatch { model, reqs, max_rows } if reqs.contains(&req) => {
                Some((*model, reqs.clone(), *max_rows))
            }
            _ => None,
        })
    }

    /// Refused, or still waiting (`None`), or running (`Some(Ok)`).
    pub fn outcome(&self, req: RequestId) -> Option<Result<(), SnoozeError>> {
        for a in self.log.iter().rev() {
            match a {
                Action::Dispatch { reqs, .. } if reqs.contains(&req) => return Some(Ok(())),
                Action::Reply { req: r, result } if *r == req => return Some(result.clone()),
                _ => {}
            }
        }
        None
    }

    /// Submit, let loads/evictions run, return whether it was dispatched (it keeps running).
    pub fn use_model(&mut self, name: &str) -> Result<RequestId, SnoozeError> {
        let (req, a) = self.submit(name);
        self.settle(a);
        match self.outcome(req) {
            Some(Ok(())) => Ok(req),
            Some(Err(e)) => Err(e),
            None => panic!("request for {name} neither dispatched nor refused"),
        }
    }

    /// Ends the run of the batch `req` is in.
    pub fn finish(&mut self, req: RequestId) -> Vec<Action> {
        let (model, reqs, _) = self.batch_of(req).expect("dispatched");
        let a = self.feed(Event::RunFinished {
            model,
            reqs,
            outcome: RunOutcome::Done,
            took: Duration::from_millis(4),
            continuing: vec![],
        });
        self.settle(a)
    }

    /// Runs one request to each of `names` to completion, the first now and each next one
    /// a second after the one before (t = 0, 1, 2 ... s).
    pub fn call_a_second_apart(&mut self, names: &[&str]) {
        for (i, name) in names.iter().enumerate() {
            self.at(i as f64);
            self.call(name).unwrap();
        }
    }

    /// Runs a request to completion.
    pub fn call(&mut self, name: &str) -> Result<(), SnoozeError> {
        let req = self.use_model(name)?;
        self.finish(req);
        Ok(())
    }

    pub fn evictions(&self) -> Vec<String> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::StartUnload { model, reason: UnloadReason::Evicted, .. } => {
                    Some(self.s.slot(*model).name().to_string())
                }
                _ => None,
            })
            .collect()
    }

    pub fn loads(&self) -> Vec<String> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::StartLoad { model, .. } => Some(self.s.slot(*model).name().to_string()),
                _ => None,
            })
            .collect()
    }

    pub fn state(&self, name: &str) -> StateName {
        self.s.slot(self.id(name)).state_name()
    }
}

/// The replies (and dispatches) among `actions`, by request.
pub(crate) fn replies(actions: &[Action]) -> Vec<(RequestId, Result<(), ErrorKind>)> {
    let mut out = Vec::new();
    for a in actions {
        match a {
            Action::Reply { req, result } => out.push((*req, result.clone().map_err(|e| e.kind))),
            Action::Dispatch { reqs, .. } => out.extend(reqs.iter().map(|r| (*r, Ok(())))),
            _ => {}
        }
    }
    out
}
