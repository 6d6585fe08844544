//! Queues, priorities, model-aware dispatch and batching, on hand-built instants.

use std::time::Duration;

use super::{replies, Harness, MB};
use crate::lifecycle::*;

fn dispatches(actions: &[Action]) -> Vec<(ModelId, Vec<RequestId>, u32)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch { model, reqs, max_rows } => Some((*model, reqs.clone(), *max_rows)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_queued_request_runs_when_the_run_blocking_it_ends_no_503() {
    // Budget for one model; a runs, b waits for it instead of being refused.
    let mut h = Harness::new(150, &[("a", 100), ("b", 100)]);
    let running = h.use_model("a").unwrap();
    let (req, a) = h.submit("b");
    assert!(a.is_empty(), "b waits: {a:?}");
    assert_eq!(h.outcome(req), None);
    h.at(0.05);
    h.finish(running);
    assert_eq!(h.outcome(req), Some(Ok(())));
    assert_eq!(h.evictions(), ["a"]);
}

#[test]
fn a_full_queue_is_429_with_retry_after_and_makes_room_for_more_urgent_work() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.max_queue = 2);
    let running = h.use_model("a").unwrap();
    let (low, _) = h.submit_with("a", Some(Priority::Low), 1, None);
    let (normal, _) = h.submit_with("a", None, 1, None);
    let (over, a) = h.submit_with("a", Some(Priority::Low), 1, None);
    assert_eq!(replies(&a), [(over, Err(ErrorKind::QueueFull))], "nothing less urgent to make room");
    let Action::Reply { result: Err(e), .. } = &a[0] else { panic!() };
    assert!(e.retry_after.is_some_and(|d| d >= Duration::from_secs(1)), "{e:?}");
    assert!(e.message.contains("max_queue"), "{}", e.message);
    // A high-priority request takes the place of the newest low-priority one.
    let (high, a) = h.submit_with("a", Some(Priority::High), 1, None);
    assert_eq!(replies(&a), [(low, Err(ErrorKind::QueueFull))]);
    let done = h.finish(running);
    assert_eq!(dispatches(&done).iter().map(|d| d.1.clone()).collect::<Vec<_>>(), [vec![high]]);
    let done = h.finish(high);
    assert_eq!(dispatches(&done).iter().map(|d| d.1.clone()).collect::<Vec<_>>(), [vec![normal]]);
}

#[test]
fn a_request_that_waited_queue_timeout_gets_503_with_retry_after() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    h.s.observe_memory(Device::Cpu, 10 * MB); // never enough, by the probe
    h.at(1.0);
    let (req, a) = h.submit("a");
    assert!(a.is_empty());
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_secs(31)));
    h.at(30.9);
    assert!(replies(&h.tick()).is_empty());
    h.at(31.0);
    let a = h.tick();
    assert_eq!(replies(&a), [(req, Err(ErrorKind::Overloaded))]);
    let Action::Reply { result: Err(e), .. } = &a[0] else { panic!() };
    assert!(e.retry_after.is_some() && e.message.contains("queue_timeout"), "{}", e.message);
}

#[test]
fn a_cancelled_request_leaves_its_queue_at_once_and_never_runs() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let running = h.use_model("a").unwrap();
    let (gone, _) = h.submit("a");
    let (stays, _) = h.submit("a");
    assert!(h.feed(Event::Cancel { req: gone }).is_empty());
    assert_eq!(h.s.slot(0).queued(), 1);
    let done = h.finish(running);
    assert_eq!(dispatches(&done).iter().map(|d| d.1.clone()).collect::<Vec<_>>(), [vec![stays]]);
    // A model whose only request went away before its load started is not loaded.
    let mut h = Harness::new(1000, &[("x", 100), ("y", 100)]);
    let (_, a) = h.submit("x");
    let (lone, b) = h.submit("y");
    assert!(b.is_empty(), "y waits for x's load");
    h.feed(Event::Cancel { req: lone });
    h.settle(a);
    assert_eq!(h.loads(), ["x"]);
}

#[test]
fn higher_priority_runs_first_within_a_model() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.max_batch_size = 1);
    let running = h.use_model("a").unwrap();
    let (low, _) = h.submit_with("a", Some(Priority::Low), 1, Some(1));
    let (normal, _) = h.submit_with("a", None, 1, Some(1));
    let (high, _) = h.submit_with("a", Some(Priority::High), 1, Some(1));
    let mut order = Vec::new();
    let mut next = running;
    for _ in 0..3 {
        let done = h.finish(next);
        let d = dispatches(&done);
        next = d[0].1[0];
        order.push(next);
    }
    assert_eq!(order, [high, normal, low]);
}

#[test]
fn a_load_for_high_priority_work_is_planned_before_one_for_low() {
    let mut h = Harness::new(1000, &[("x", 100), ("low", 100), ("high", 100)]);
    let (_, a) = h.submit("x");
    h.at(0.1);
    h.submit_with("low", Some(Priority::Low), 1, None);
    h.at(0.2);
    h.submit_with("high", Some(Priority::High), 1, None);
    h.settle(a);
    assert_eq!(h.loads(), ["x", "high", "low"]);
}

#[test]
fn requests_to_a_loaded_model_never_wait_behind_another_models_load() {
    let mut h = Harness::new(1000, &[("a", 100), ("b", 100)]);
    h.call("a").unwrap();
    let (_, loading) = h.submit("b");
    assert!(matches!(loading[..], [Action::StartLoad { model: 1, .. }]));
    let (req, a) = h.submit("a");
    assert_eq!(dispatches(&a), [(0, vec![req], 32)], "served while b loads");
}

#[test]
fn a_swap_serves_the_resident_queue_first_a_b_a_a_c_runs_as_a_a_a_b_c() {
    // Budget for one model. While a runs, requests arrive for a, b, a, a, c.
    let mut h = Harness::new(150, &[("a", 100), ("b", 100), ("c", 100)]);
    let r0 = h.use_model("a").unwrap();
    let mut ids = Vec::new();
    for (i, m) in ["a", "b", "a", "a", "c"].iter().enumerate() {
        h.at(0.001 * (i + 1) as f64);
        ids.push(h.submit(m).0);
    }
    h.at(0.01);
    let done = h.finish(r0);
    let first = dispatches(&done);
    assert_eq!(first, [(0, vec![ids[0], ids[2], ids[3]], 32)], "a's queue runs as one batch before any swap");
    h.at(0.02);
    h.finish(ids[0]);
    h.at(0.03);
    h.finish(ids[1]);
    h.at(0.04);
    h.finish(ids[4]);
    let order: Vec<String> = h
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch { model, reqs, .. } => {
                Some(format!("{}x{}", h.s.slot(*model).name(), reqs.len()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(order, ["ax1", "ax3", "bx1", "cx1"]);
    assert_eq!(h.loads(), ["a", "b", "c"], "one load per model: no ping-pong");
}

#[test]
fn a_cold_model_is_not_starved_past_max_swap_delay() {
    // Budget for two; a and b always have queued work; c waits 200 ms, then the least
    // recently used of them stops taking work and is evicted once its run ends.
    let mut h = Harness::with(250, &[("a", 100), ("b", 100), ("c", 100)], |p| p.max_batch_size = 1);
    let mut ra = h.use_model("a").unwrap();
    h.at(0.001);
    let mut rb = h.use_model("b").unwrap();
    h.submit("a");
    h.submit("b");
    h.at(0.002);
    let (rc, a) = h.submit("c");
    assert!(a.is_empty());
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_millis(202)), "the swap is due at +200 ms");
    // Before the bound, runs of a and b keep going and keep their queues busy.
    for t in [0.05, 0.1, 0.15] {
        h.at(t);
        let d = dispatches(&h.finish(ra));
        ra = d[0].1[0];
        h.submit("a");
        let d = dispatches(&h.finish(rb));
        rb = d[0].1[0];
        h.submit("b");
    }
    assert_eq!(h.outcome(rc), None);
    h.at(0.203);
    assert!(dispatches(&h.tick()).is_empty(), "a (the LRU) drains: nothing new runs on it");
    h.at(0.21);
    let done = h.finish(ra);
    assert!(
        done.iter().any(|x| matches!(x, Action::StartUnload { model: 0, reason: UnloadReason::Evicted, .. })),
        "{done:?}"
    );
    assert_eq!(h.outcome(rc), Some(Ok(())), "c runs");
    assert_eq!(h.s.slot(0).queued(), 1, "a's waiting request waits for a's reload");
}

#[test]
fn a_repository_load_whose_caller_timed_out_still_happens() {
    // Budget for one; a runs, so b's load waits. Its caller gives up (acquire_timeout).
    let mut h = Harness::new(150, &[("a", 100), ("b", 100)]);
    let running = h.use_model("a").unwrap();
    let req: RequestId = 9_000;
    let b = h.id("b");
    assert!(h.feed(Event::Load { req, model: b }).is_empty(), "b waits for a's run");
    h.feed(Event::Cancel { req });
    h.at(0.5);
    h.finish(running);
    assert_eq!(h.loads(), ["a", "b"], "the load went on");
    assert_eq!(h.state("b"), StateName::Ready);
    assert!(!h.log.iter().any(|a| matches!(a, Action::Reply { .. })), "answered to nobody: {:?}", h.log);
}

#[test]
fn the_model_a_swap_evicted_for_loads_next_though_the_evicted_queue_is_older() {
    // Budget for one. a's queue is older than b's request; once a has drained for b, the
    // room is b's, not a's again (which would leave b waiting behind a's whole queue).
    let mut h = Harness::with(150, &[("a", 100), ("b", 100)], |p| p.max_batch_size = 1);
    let r0 = h.use_model("a").unwrap();
    for i in 0..3 {
        h.at(0.001 * (i + 1) as f64);
        h.submit("a");
    }
    h.at(0.01);
    let (rb, _) = h.submit("b");
    h.at(1.0); // past the swap delay: a drains
    h.finish(r0);
    assert_eq!(h.evictions(), ["a"]);
    assert_eq!(h.outcome(rb), Some(Ok(())), "b runs once a is out");
    assert_eq!(h.loads(), ["a", "b"], "a was not loaded again ahead of b");
    assert_eq!(h.s.slot(0).queued(), 3, "a's queue waits for a's turn");
}

#[test]
fn a_model_just_loaded_serves_everything_that_waited_for_it_before_it_can_be_evicted() {
    let mut h = Harness::with(150, &[("a", 100), ("b", 100)], |p| p.max_batch_size = 1);
    let (r1, a) = h.submit("a");
    let (r2, _) = h.submit("a");
    let (r3, _) = h.submit("a");
    h.settle(a);
    h.at(1.0); // b has waited far longer than max_swap_delay by the time a is done
    let (rb, _) = h.submit("b");
    h.at(2.0);
    h.finish(r1);
    h.at(3.0);
    let done = h.finish(r2);
    assert_eq!(dispatches(&done)[0].1, [r3], "a keeps serving what waited for its load");
    h.finish(r3);
    assert_eq!(h.outcome(rb), Some(Ok(())));
}

#[test]
fn batches_merge_mixed_sizes_up_to_max_batch_size_and_keep_shapes_apart() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.max_batch_size = 8);
    let running = h.use_model("a").unwrap();
    let (r3, _) = h.submit_with("a", None, 3, Some(7));
    let (r4, _) = h.submit_with("a", None, 4, Some(7));
    let (other, _) = h.submit_with("a", None, 1, Some(9));
    let (r2, _) = h.submit_with("a", None, 2, Some(7));
    let done = h.finish(running);
    assert_eq!(dispatches(&done), [(0, vec![r3, r4], 8)], "3 + 4 rows; 2 more would make 9");
    let done = h.finish(r3);
    assert_eq!(dispatches(&done), [(0, vec![other], 8)], "another shape runs apart");
    let done = h.finish(other);
    assert_eq!(dispatches(&done), [(0, vec![r2], 8)]);
}

#[test]
fn a_request_larger_than_max_batch_size_runs_alone_in_micro_batches() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.max_batch_size = 8);
    let (big, a) = h.submit_with("a", None, 20, Some(7));
    let (small, _) = h.submit_with("a", None, 1, Some(7));
    let done = h.settle(a);
    assert_eq!(dispatches(&done), [(0, vec![big], 8)], "20 rows in runs of at most 8");
    assert_eq!(dispatches(&h.finish(big)), [(0, vec![small], 8)]);
}

#[test]
fn batch_delay_waits_for_more_rows_only_as_long_as_it_says() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| {
        p.max_batch_size = 4;
        p.batch_delay = Duration::from_millis(5);
    });
    let (first, a) = h.submit("a");
    h.settle(a);
    assert_eq!(h.outcome(first), None, "even the first request waits its 5 ms");
    h.at(0.005);
    h.tick();
    h.finish(first);
    h.at(1.0);
    let (r1, a) = h.submit("a");
    assert!(dispatches(&a).is_empty(), "waits for company");
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_millis(1005)));
    h.at(1.002);
    let (r2, _) = h.submit("a");
    h.at(1.005);
    assert_eq!(dispatches(&h.tick()), [(0, vec![r1, r2], 4)]);
    // A full batch does not wait.
    let mut h = Harness::with(1000, &[("a", 100)], |p| {
        p.max_batch_size = 2;
        p.batch_delay = Duration::from_secs(1);
    });
    let (x, a) = h.submit("a");
    let (y, b) = h.submit("a");
    let mut all = h.settle(a);
    all.extend(b);
    assert_eq!(dispatches(&all), [(0, vec![x, y], 2)]);
}

#[test]
fn concurrency_per_model_and_across_models_is_capped() {
    let mut h = Harness::with(1000, &[("a", 100), ("b", 100)], |p| {
        p.max_batch_size = 1;
        p.max_concurrency = 2;
    });
    h.s.config.max_concurrent_inferences = 3;
    let a1 = h.use_model("a").unwrap();
    let _a2 = h.use_model("a").unwrap();
    let (a3, _) = h.submit("a");
    assert_eq!(h.outcome(a3), None, "two runs of a at most");
    let b1 = h.use_model("b").unwrap();
    let (b2, _) = h.submit("b");
    assert_eq!(h.outcome(b2), None, "three runs in all at most");
    h.finish(b1);
    assert_eq!(h.outcome(b2), Some(Ok(())));
    h.finish(a1);
    assert_eq!(h.outcome(a3), Some(Ok(())), "a slot of a and of the server freed up");
}

#[test]
fn retry_after_is_queue_position_times_the_measured_time_per_request_plus_a_load() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| {
        p.max_queue = 40;
        p.max_batch_size = 1;
    });
    let r = h.use_model("a").unwrap();
    let (model, reqs, _) = h.batch_of(r).unwrap();
    h.feed(Event::RunFinished {
        model,
        reqs,
        outcome: RunOutcome::Done,
        took: Duration::from_millis(50),
        continuing: vec![],
    });
    assert_eq!(h.s.expected_wait(0), Duration::from_millis(50), "nothing queued: one request's time");
    let running = h.use_model("a").unwrap();
    for _ in 0..40 {
        h.submit("a");
    }
    let (_, a) = h.submit("a");
    let Action::Reply { result: Err(e), .. } = &a[0] else { panic!("{a:?}") };
    assert_eq!(e.retry_after, Some(Duration::from_millis(41 * 50)), "41 requests ahead at 50 ms each");
    // A model that must load first adds its measured load time (10 ms in the harness).
    h.finish(running);
    let mut h2 = Harness::new(1000, &[("b", 100)]);
    h2.call("b").unwrap();
    let a = h2.feed(Event::Unload { req: 99, model: 0 });
    h2.settle(a);
    let wait = h2.s.expected_wait(0);
    assert!(wait >= Duration::from_millis(10), "{wait:?}");
}

#[test]
fn retry_after_before_any_request_finished_is_the_configured_fallback() {
    // Two 37 s transcriptions running, none finished: the 429 said "retry in about 0.0s"
    // (10 ms a request, guessed) with `Retry-After: 1`.
    let mut h = Harness::with(1000, &[("a", 100)], |p| {
        p.max_queue = 1;
        p.max_batch_size = 1;
    });
    h.s.config.retry_after = Duration::from_secs(5);
    h.use_model("a").unwrap();
    h.submit("a");
    let (_, a) = h.submit("a");
    let Action::Reply { result: Err(e), .. } = &a[0] else { panic!("{a:?}") };
    assert_eq!(e.kind, ErrorKind::QueueFull);
    assert_eq!(e.retry_after, Some(Duration::from_secs(5)));
    assert!(e.message.contains("retry in about 5.0s"), "{}", e.message);
}

#[test]
fn a_task_job_s_time_is_all_its_slices_not_one() {
    // A transcription runs hundreds of decoder steps; Retry-After took one step for a
    // request's time ("retry in about 0.5s" before a queue of 28 s).
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.max_batch_size = 1);
    let job = h.use_model("a").unwrap();
    for slice in 0..5 {
        let (model, reqs, _) = h.batch_of(job).expect("dispatched");
        let last = slice == 4;
        let continuing = match last {
            true => vec![],
            false => vec![Resume { req: job, rows: 1, key: Some(2), size: None }],
        };
        let a = h.feed(Event::RunFinished {
            model,
            reqs,
            outcome: RunOutcome::Done,
            took: Duration::from_millis(100),
            continuing,
        });
        h.settle(a);
    }
    assert_eq!(h.outcome(job), Some(Ok(())));
    assert_eq!(h.s.expected_wait(0), Duration::from_millis(500), "five slices of 100 ms");
}

#[test]
fn out_of_memory_in_a_run_evicts_idle_models_then_halves_then_refuses() {
    let mut h = Harness::with(1000, &[("a", 100), ("idle", 100)], |p| p.max_batch_size = 8);
    h.call("idle").unwrap();
    let (req, a) = h.submit_with("a", None, 6, Some(7));
    h.settle(a);
    let oom = |h: &mut Harness| {
        let (model, reqs, max_rows) = h.batch_of(req).unwrap();
        let a = h.feed(Event::RunFinished {
            model,
            reqs,
            outcome: RunOutcome::OutOfMemory("Failed to allocate memory".into()),
            took: Duration::ZERO,
            continuing: vec![],
        });
        (max_rows, h.settle(a))
    };
    let (rows, after) = oom(&mut h);
    assert_eq!(rows, 8);
    assert!(after
        .iter()
        .any(|x| matches!(x, Action::StartUnload { model: 1, reason: UnloadReason::Evicted, .. })));
    assert_eq!(dispatches(&after), [(0, vec![req], 8)], "retried alone once the idle model is gone");
    let (_, after) = oom(&mut h);
    assert_eq!(dispatches(&after), [(0, vec![req], 3)], "then in halves of 3 rows");
    let (_, after) = oom(&mut h);
    assert_eq!(replies(&after), [(req, Err(ErrorKind::InsufficientMemory))]);
    let Action::Reply { result: Err(e), .. } = &after[0] else { panic!() };
    assert!(e.message.contains("half the batch") && e.retry_after.is_some(), "{}", e.message);
}

#[test]
fn a_model_evicted_for_another_comes_back_when_it_fits_again_and_only_then() {
    use crate::units::KeepAlive;
    let mut h = Harness::with(250, &[("a", 100), ("b", 100), ("big", 200)], |p| {
        p.keep_alive = KeepAlive::For(Duration::from_secs(if p.name == "big" { 10 } else { 600 }))
    });
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap();
    h.at(2.0);
    h.call("big").unwrap(); // evicts a and b
    assert_eq!(h.evictions(), ["a", "b"]);
    // big idles out at t=12: room for both again; b (asked for last) comes back first,
    // then a — nobody asked, nothing was evicted for them.
    h.at(12.0);
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.loads(), ["a", "b", "big", "b", "a"]);
    assert_eq!(h.evictions(), ["a", "b"], "a preload evicts nobody");
    // A model unloaded for idleness is not brought back.
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.keep_alive = KeepAlive::For(Duration::from_secs(5)));
    h.call("a").unwrap();
    h.at(6.0);
    let a = h.tick();
    h.settle(a);
    h.at(7.0);
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.loads(), ["a"]);
}

#[test]
fn nothing_is_brought_back_once_shutdown_begins() {
    // a was evicted for b; at shutdown b unloads and the room is free: a stays out.
    let mut h = Harness::with(150, &[("a", 100), ("b", 100)], |_| {});
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap(); // evicts a
    h.at(2.0);
    let actions = h.feed(Event::Shutdown);
    h.settle(actions);
    h.at(3.0);
    let actions = h.tick();
    h.settle(actions);
    assert_eq!(h.loads(), ["a", "b"], "no load after shutdown began");
}

#[test]
fn memory_given_back_on_request_is_not_refilled_by_a_preload() {
    // a is evicted for b; then b is unloaded on request: the room is free, but the user
    // asked for memory back, so a (evicted earlier, cheap to load) does not come back.
    let mut h = Harness::with(150, &[("a", 100), ("b", 100)], |_| {});
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap(); // evicts a
    assert_eq!(h.evictions(), ["a"]);
    let b = h.id("b");
    let actions = h.feed(Event::Unload { req: 900, model: b });
    h.settle(actions);
    h.at(2.0);
    let actions = h.tick();
    h.settle(actions);
    assert_eq!(h.loads(), ["a", "b"], "nothing preloaded after an unload asked for");
    assert_eq!(h.state("a"), StateName::Unloaded);
}

#[test]
fn a_swap_that_costs_little_is_due_sooner() {
    // c loads in 10 ms and its first run takes 4 ms: a swap for it is due after 4 x 14 ms,
    // not after the 200 ms max_swap_delay — a and b, which it swaps out, cost as little.
    let mut h = Harness::with(250, &[("a", 100), ("b", 100), ("c", 100)], |p| p.max_batch_size = 1);
    h.call("c").unwrap();
    assert_eq!(h.s.swap_delay(2), Duration::from_millis(56));
    h.at(0.5);
    h.call("a").unwrap();
    h.at(0.6);
    h.call("b").unwrap();
    h.at(1.0);
    h.use_model("a").unwrap();
    h.use_model("b").unwrap(); // c evicted; a and b busy
    h.submit("a");
    h.at(1.001);
    let (_, a) = h.submit("c");
    assert!(a.is_empty());
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_millis(1057)));
    // A model never loaded has no measured cost: the full max_swap_delay.
    let h = Harness::new(250, &[("x", 100)]);
    assert_eq!(h.s.swap_delay(0), Duration::from_millis(200));
}

#[test]
fn a_model_with_work_is_swapped_out_only_after_what_its_own_swap_costs() {
    // c is cheap to swap in (56 ms); a, busy with queued work, costs 4 x (400 + 4) ms to
    // come back: the swap waits the longer of the two (capped by max_swap_delay).
    let mut h = Harness::with(150, &[("a", 100), ("c", 100)], |p| p.max_batch_size = 1);
    h.call("c").unwrap();
    h.at(0.5);
    let (first, a) = h.submit("a");
    h.settle_loading_in(a, Duration::from_millis(400));
    h.finish(first);
    assert_eq!(h.s.swap_delay(h.id("a")), Duration::from_millis(200), "capped");
    h.at(1.0);
    h.use_model("a").unwrap();
    h.submit("a");
    h.at(1.001);
    let (_, a) = h.submit("c");
    assert!(a.is_empty());
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_millis(1201)), "a's 200 ms, not c's 56");
}

#[test]
fn a_lean_model_that_stays_and_batches_is_promoted_in_place_when_there_is_room() {
    let mut h = Harness::with(1000, &[("a", 100), ("b", 100)], |p| {
        p.promotable = true;
        p.max_batch_size = 8;
    });
    let run_batches = |h: &mut Harness, n: usize| {
        for _ in 0..n {
            let (r1, _) = h.submit_with("a", None, 2, Some(1));
            h.finish(r1);
        }
    };
    h.call("a").unwrap();
    run_batches(&mut h, 8);
    assert!(!h.log.iter().any(|a| matches!(a, Action::StartPromote { .. })), "too young (0.5 s)");
    h.at(1.0);
    let a = h.tick();
    assert_eq!(a, [Action::StartPromote { model: 0, device: Device::Cpu }]);
    assert_eq!(h.s.accounted(&Device::Cpu), 200 * MB, "room held for the second instance");
    // Requests keep running meanwhile; a load for b waits for the quiet device.
    let (r, a) = h.submit_with("a", None, 1, Some(1));
    assert_eq!(dispatches(&a), [(0, vec![r], 8)]);
    let (_, a) = h.submit("b");
    assert!(a.is_empty(), "the device is busy promoting");
    let a = h.feed(Event::PromoteFinished {
        model: 0,
        result: Ok(LoadMeasurement { steady: Some(90 * MB), peak: None, working: 0 }),
    });
    assert!(matches!(a[..], [Action::StartLoad { model: 1, .. }]), "{a:?}");
    assert_eq!(h.s.slot(0).measured_bytes, Some(90 * MB));
    assert!(h.s.status(h.now)[0].promoted, "the admin view says it serves its prepacked copy");
    // Once only per load.
    h.finish(r);
    run_batches(&mut h, 10);
    h.at(5.0);
    assert!(!h.tick().iter().any(|a| matches!(a, Action::StartPromote { .. })));
}

#[test]
fn no_promotion_without_room_for_the_second_instance() {
    let mut h = Harness::with(150, &[("a", 100)], |p| {
        p.promotable = true;
        p.max_batch_size = 8;
    });
    h.call("a").unwrap();
    for _ in 0..8 {
        let (r, _) = h.submit_with("a", None, 2, Some(1));
        h.finish(r);
    }
    h.at(2.0);
    assert!(!h.tick().iter().any(|a| matches!(a, Action::StartPromote { .. })));
}
