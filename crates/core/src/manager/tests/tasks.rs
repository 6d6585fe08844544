//! Task jobs through the actor: slices shared by jobs queued together, other models'
//! requests run between the slices of a long job.

use super::*;

/// A task job of `left` slices; each slice records the batch it ran in.
struct Countdown {
    left: u32,
}

impl crate::TaskJob for Countdown {
    fn batch_key(&self) -> u64 {
        7
    }
    fn byte_size(&self) -> usize {
        0
    }
    fn runner(&self) -> crate::SliceRunner {
        countdown
    }
}

/// Runs on the fake model (reached through `Any`, as a task crate reaches its own):
/// one slice takes one from every job, and logs `-(jobs in the slice)` as a run.
fn countdown(
    model: &dyn LoadedModel,
    jobs: &mut [&mut dyn crate::TaskJob],
) -> Vec<Result<crate::Progress, InferError>> {
    let any: &dyn std::any::Any = model;
    let Some(fake) = any.downcast_ref::<FakeModel>() else {
        return jobs.iter().map(|_| Err(InferError::Failed("not the fake model".into()))).collect();
    };
    fake.gate.wait();
    fake.runs.lock().unwrap().push(-(jobs.len() as i64));
    jobs.iter_mut()
        .map(|j| {
            let any: &mut dyn std::any::Any = &mut **j;
            let c = any.downcast_mut::<Countdown>().expect("a countdown job");
            c.left -= 1;
            Ok(if c.left == 0 { crate::Progress::Done } else { crate::Progress::Continue })
        })
        .collect()
}

async fn count_down(m: &ModelManager, model: &str, slices: u32) -> u32 {
    let job = m.run_task(model, None, Box::new(Countdown { left: slices })).await.unwrap();
    let any: Box<dyn std::any::Any> = job;
    any.downcast::<Countdown>().expect("the job comes back").left
}

#[tokio::test]
async fn task_jobs_queued_together_share_their_slices_until_each_is_done() {
    let s = setup(&["a"], KeepAlive::Forever);
    s.backend.gate.set(false);
    let m = s.m.clone();
    let (first, second, ()) = tokio::join!(count_down(&m, "a", 3), count_down(&m, "a", 5), async {
        // Both wait at the model's first slot before the gate opens.
        while m.status().await[0].leases == 0 {
            tokio::task::yield_now().await;
        }
        s.backend.gate.set(true);
    });
    assert_eq!((first, second), (0, 0), "both ran every slice");
    let runs = s.backend.runs.lock().unwrap().clone();
    // The first slice may have started with one job alone; from then on they share.
    assert_eq!(runs.iter().map(|r| -r).sum::<i64>(), 8, "3 + 5 slices in all: {runs:?}");
    assert!(runs.iter().filter(|r| **r == -2).count() >= 2, "slices shared: {runs:?}");
    assert_eq!(runs.last(), Some(&-1), "the longer job finishes alone: {runs:?}");
}

#[tokio::test]
async fn a_request_of_another_model_runs_between_the_slices_of_a_long_job() {
    // One run at a time across models: without slices, `b` would wait for all of `a`.
    let s =
        setup_full(&["a", "b"], KeepAlive::Forever, |_| {}, |c| c.scheduler.max_concurrent_inferences = 1);
    s.m.load("b").await.unwrap();
    s.backend.gate.set(false);
    let m = s.m.clone();
    let job = tokio::spawn(async move { count_down(&m, "a", 4).await });
    while s.m.status().await[0].leases == 0 {
        tokio::task::yield_now().await;
    }
    // `a`'s first slice holds the one run slot; `b` queues behind it.
    let m = s.m.clone();
    let short = tokio::spawn(async move { m.infer("b", None, rows(1, 1.0), vec![]).await });
    while s.m.status().await[1].queued.iter().sum::<usize>() == 0 {
        tokio::task::yield_now().await;
    }
    s.backend.gate.set(true);
    doubled(&short.await.unwrap().unwrap(), 1, 1.0);
    assert_eq!(job.await.unwrap(), 0);
    let runs = s.backend.runs.lock().unwrap().clone();
    assert_eq!(runs, [-1, 1, -1, -1, -1], "b ran after a's first slice, not after its last");
}
