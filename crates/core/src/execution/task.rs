//! One slice of a batch of task jobs (see [`crate::task`]): the jobs' runner advances
//! them in place; a finished job goes back to its caller, a continuing one back to the
//! actor (and its model's queue), a failed one is answered with its error — or, out of
//! memory, returned unanswered for the scheduler's retry.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::{
    backend::{InferError, LoadedModel},
    error::{ErrorKind, SnoozeError},
    task::{Progress, TaskJob},
};

use super::{answer, panicked, BatchEnd, Growth, Jobs, Output, Payload, Work};

pub(super) fn run_slice(
    model: &dyn LoadedModel,
    name: &str,
    mut jobs: Jobs,
    work: &Work<'_>,
) -> (BatchEnd, Growth) {
    let held = |jobs: &Jobs| jobs.iter().map(|(_, j)| j.payload.byte_size() as u64).sum::<u64>();
    let before = held(&jobs);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut refs: Vec<&mut dyn TaskJob> = jobs
            .iter_mut()
            .filter_map(|(_, j)| match &mut j.payload {
                Payload::Task(t) => Some(t.as_mut()),
                _ => None,
            })
            .collect();
        let Some(runner) = refs.first().map(|t| t.runner()) else { return Vec::new() };
        runner(model, &mut refs)
    }));
    let results = match result {
        Err(panic) => return (panicked(name, jobs, panic), Growth::default()),
        Ok(r) => r,
    };
    // What the jobs themselves grew to hold is theirs, not the model's working set.
    let grew = work.measure(held(&jobs).saturating_sub(before));
    if results.len() != jobs.len() {
        let e = SnoozeError::new(
            ErrorKind::Internal,
            format!("model '{name}': a task slice answered {} of {} jobs", results.len(), jobs.len()),
        );
        for (_, job) in jobs {
            let _ = job.reply.send(Err(e.clone()));
        }
        return (BatchEnd::done(), grew);
    }
    let n = jobs.len();
    let (mut continuing, mut retry, mut oom) = (Vec::new(), Vec::new(), None);
    for ((req, job), result) in jobs.into_iter().zip(results) {
        match result {
            Ok(Progress::Continue) => continuing.push((req, job)),
            Ok(Progress::Done) => {
                let super::Job { payload, reply, .. } = job;
                if let Payload::Task(t) = payload {
                    let _ = reply.send(Ok(Output::Task(t)));
                }
            }
            Err(InferError::OutOfMemory(m)) => {
                oom.get_or_insert(m);
                retry.push((req, job));
            }
            Err(e) => answer(name, job, Err(e)),
        }
    }
    let answered = continuing.len() + retry.len() < n;
    let end = match oom {
        // Retried by the scheduler only when it failed as a whole; beside jobs that
        // advanced, the ones out of memory are refused (their slice is not repeated).
        Some(m) if answered => {
            for (_, job) in retry {
                answer(name, job, Err(InferError::OutOfMemory(m.clone())));
            }
            BatchEnd::Done { continuing }
        }
        Some(message) => BatchEnd::OutOfMemory { message, jobs: retry, continuing },
        None => BatchEnd::Done { continuing },
    };
    (end, grew)
}
