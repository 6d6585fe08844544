//! Fairness between long jobs and short requests (issue 21): a task job (a transcription,
//! an OCR page) runs in slices, and each slice's end puts it at the back of the line, so
//! requests that arrived meanwhile run first — and it is not starved, since requests that
//! arrive after its slice ended queue behind it. One run slot (`max_concurrent_inferences
//! = 1`) makes the order visible.

use super::*;

/// "long" is a task job's model, "short" a 1 ms classifier; one run at a time.
fn harness() -> Harness {
    let mut h = Harness::new(1000, &[("long", 100), ("short", 10)]);
    h.s.config.max_concurrent_inferences = 1;
    h
}

/// The slice of `req` ends; the job goes on (`continuing`).
fn slice_ends(h: &mut Harness, req: RequestId) -> Vec<Action> {
    let (model, reqs, _) = h.batch_of(req).expect("dispatched");
    let a = h.feed(Event::RunFinished {
        model,
        reqs: vec![],
        outcome: RunOutcome::Done,
        took: Duration::from_millis(200),
        continuing: reqs.iter().map(|&req| Resume { req, rows: 1, key: Some(2), size: None }).collect(),
    });
    h.settle(a)
}

/// The names of the models `pick` finds in `actions`, in order.
fn named(h: &Harness, actions: &[Action], pick: impl Fn(&Action) -> Option<ModelId>) -> Vec<String> {
    actions.iter().filter_map(pick).map(|m| h.s.slot(m).name().to_string()).collect()
}

/// The models of the batches `actions` dispatched, in order.
fn dispatched(h: &Harness, actions: &[Action]) -> Vec<String> {
    named(h, actions, |a| match a {
        Action::Dispatch { model, .. } => Some(*model),
        _ => None,
    })
}

#[test]
fn a_short_request_runs_between_two_slices_of_a_long_job() {
    let mut h = harness();
    h.call("short").unwrap();
    let job = h.use_model("long").unwrap();
    h.at(0.05);
    let (quick, a) = h.submit("short");
    assert_eq!(dispatched(&h, &a), Vec::<String>::new(), "the one run slot is the job's slice");
    h.at(0.2);
    let a = slice_ends(&mut h, job);
    assert_eq!(dispatched(&h, &a), ["short"], "the slice ended: the request that came meanwhile runs first");
    assert_eq!(h.outcome(quick), Some(Ok(())));
    h.at(0.201);
    let a = h.finish(quick);
    assert_eq!(dispatched(&h, &a), ["long"], "then the job's next slice");
}

/// A long job whose first slice ended while a short request (`quick`, now running in the
/// one run slot) waited: the job waits in line behind it. Returns (harness, job, quick).
fn a_job_between_two_slices() -> (Harness, RequestId, RequestId) {
    let mut h = harness();
    h.call("short").unwrap();
    let job = h.use_model("long").unwrap();
    let (quick, _) = h.submit("short");
    h.at(0.2);
    let a = slice_ends(&mut h, job);
    assert_eq!(dispatched(&h, &a), ["short"], "the job waits in line behind it");
    (h, job, quick)
}

#[test]
fn a_job_between_two_slices_at_shutdown_goes_on_and_what_never_started_is_refused() {
    let (mut h, job, quick) = a_job_between_two_slices();
    let (late, _) = h.submit("long");
    h.feed(Event::Shutdown);
    assert_eq!(h.outcome(late).map(|r| r.is_err()), Some(true), "never started: refused");
    let a = h.finish(quick);
    assert_eq!(dispatched(&h, &a), ["long"], "the job's next slice runs");
    assert_eq!(h.outcome(job), Some(Ok(())));
}

#[test]
fn a_long_job_is_not_starved_by_a_stream_of_short_requests() {
    // Short requests keep coming, always one waiting: still, between two short batches the
    // job gets its slice, because it went back in line before the next short one came.
    let mut h = harness();
    h.call("short").unwrap();
    let job = h.use_model("long").unwrap();
    let mut t = 0.0;
    for round in 0..10 {
        h.at(t + 0.05);
        let (during_slice, _) = h.submit("short");
        h.at(t + 0.2);
        let a = slice_ends(&mut h, job);
        assert_eq!(dispatched(&h, &a), ["short"], "round {round}: the waiting short batch first");
        h.at(t + 0.21);
        let (after_slice, a) = h.submit("short");
        assert!(dispatched(&h, &a).is_empty(), "round {round}: one run at a time");
        h.at(t + 0.22);
        let a = h.finish(during_slice);
        assert_eq!(
            dispatched(&h, &a),
            ["long"],
            "round {round}: the job, back in line before the newer short"
        );
        assert_eq!(h.outcome(after_slice), None, "round {round}: it waits for the slice");
        t += 0.22;
        // The short request that came after the slice ended runs with the next one.
        h.at(t + 0.05);
        let a = slice_ends(&mut h, job);
        assert_eq!(dispatched(&h, &a), ["short"]);
        h.at(t + 0.06);
        let a = h.finish(after_slice);
        assert_eq!(dispatched(&h, &a), ["long"], "round {round}: nothing else waits: the job goes on");
        t += 0.06;
    }
}

#[test]
fn a_slice_does_not_jump_ahead_of_requests_of_its_own_model() {
    // Two jobs of one model: the second arrived during the first's slice; at the slice's
    // end the first goes behind it, and jobs resumed together share the next slice.
    let mut h = harness();
    let first = h.use_model("long").unwrap();
    h.at(0.1);
    let (second, _) = h.submit_with("long", None, 1, Some(2));
    h.at(0.2);
    slice_ends(&mut h, first);
    let (_, reqs, _) = h.batch_of(second).expect("the second job got the slot");
    assert_eq!(reqs, [second, first], "both in one batch, the waiting one first");
}

/// Submits a slice of long work (a task job, which says its size) to `name`.
fn submit_slice(h: &mut Harness, name: &str) -> (RequestId, Vec<Action>) {
    let (req, a) = h.submit_sized(name, 3, WorkSize::new(0, 1));
    (req, h.settle(a))
}

/// The slice of `req` ends and its job goes on to the next.
fn long_slice_ends(h: &mut Harness, req: RequestId) -> Vec<Action> {
    let (model, reqs, _) = h.batch_of(req).expect("dispatched");
    let size = Some(WorkSize::new(0, 1));
    let a = h.feed(Event::RunFinished {
        model,
        reqs: reqs.clone(),
        outcome: RunOutcome::Done,
        took: Duration::from_millis(200),
        continuing: reqs.iter().map(|&req| Resume { req, rows: 1, key: Some(3), size }).collect(),
    });
    h.settle(a)
}

#[test]
fn slices_of_long_work_take_turns_while_short_requests_run_beside_them() {
    let mut h = Harness::new(1000, &[("speech", 100), ("ocr", 100), ("short", 10)]);
    h.s.config.max_concurrent_slices = 1;
    h.call_a_second_apart(&["speech", "ocr", "short"]);
    h.at(3.0);
    let (speech, a) = submit_slice(&mut h, "speech");
    assert_eq!(dispatched(&h, &a), ["speech"]);
    h.at(3.01);
    let (ocr, a) = submit_slice(&mut h, "ocr");
    assert!(dispatched(&h, &a).is_empty(), "one slice of long work at a time");
    let (quick, a) = h.submit("short");
    assert_eq!(dispatched(&h, &a), ["short"], "a request that is no slice runs beside it");
    h.finish(quick);
    h.at(3.2);
    let a = long_slice_ends(&mut h, speech);
    assert_eq!(dispatched(&h, &a), ["ocr"], "the slice that waited longest goes next");
    h.at(3.4);
    let a = long_slice_ends(&mut h, ocr);
    assert_eq!(dispatched(&h, &a), ["speech"], "then the transcription's next slice: turns, no starving");

    // Without the cap both run at once.
    let mut h = Harness::new(1000, &[("speech", 100), ("ocr", 100)]);
    h.call_a_second_apart(&["speech", "ocr"]);
    h.at(2.0);
    let (_, a) = submit_slice(&mut h, "speech");
    let (_, b) = submit_slice(&mut h, "ocr");
    assert_eq!([dispatched(&h, &a), dispatched(&h, &b)].concat(), ["speech", "ocr"]);
}

/// The models `actions` start loading, in order.
fn started_loads(h: &Harness, actions: &[Action]) -> Vec<String> {
    named(h, actions, |a| match a {
        Action::StartLoad { model, .. } => Some(*model),
        _ => None,
    })
}

/// Serves one request of `name` (its load measured) and unloads it: a model that reloads
/// as quickly as its load took.
fn loaded_once_then_unloaded(h: &mut Harness, name: &str) {
    h.call(name).unwrap();
    let model = h.id(name);
    let a = h.feed(Event::Unload { req: 900, model });
    h.settle(a);
}

/// "quick" loaded once in 10 ms and was unloaded; "slow" starts loading at t = 1 s and
/// is left loading. Returns the harness.
fn slow_load_in_flight(budget_mb: u64, models: &[(&str, u64)]) -> Harness {
    let mut h = Harness::new(budget_mb, models);
    loaded_once_then_unloaded(&mut h, "quick");
    h.at(1.0);
    let (_, a) = h.submit("slow");
    assert_eq!(started_loads(&h, &a), ["slow"]);
    assert_eq!(h.state("slow"), StateName::Loading);
    h
}

#[test]
fn a_quick_reload_does_not_wait_for_a_slow_load() {
    let mut h = slow_load_in_flight(1000, &[("slow", 300), ("quick", 10)]);
    h.at(1.1);
    let (req, a) = h.submit("quick");
    assert_eq!(started_loads(&h, &a), ["quick"], "a 10 ms reload starts beside the slow load");
    h.settle(a);
    assert_eq!(h.outcome(req), Some(Ok(())), "and serves while the slow load goes on");
    assert_eq!(h.state("slow"), StateName::Loading);
    let slow = h.id("slow");
    let took = Duration::from_secs(2);
    let a = h.feed(Event::LoadFinished { model: slow, result: Ok(LoadMeasurement::default()), took });
    h.settle(a);
    assert_eq!(h.state("slow"), StateName::Ready);
}

#[test]
fn a_quick_reload_makes_room_beside_a_slow_load() {
    // 300 MB loading + 600 MB idle + 200 MB over a 1000 MB budget: the idle one goes.
    let mut h = Harness::new(1000, &[("slow", 300), ("quick", 200), ("idle", 600)]);
    loaded_once_then_unloaded(&mut h, "quick");
    h.at(1.0);
    h.call("idle").unwrap();
    h.at(5.0);
    let (_, a) = h.submit("slow");
    assert_eq!(started_loads(&h, &a), ["slow"]);
    h.at(5.1);
    let (req, a) = h.submit("quick");
    let a = h.settle(a);
    assert_eq!(h.evictions(), ["idle"]);
    assert_eq!(started_loads(&h, &a), ["quick"]);
    assert_eq!(h.outcome(req), Some(Ok(())));
    assert_eq!(h.state("slow"), StateName::Loading, "still loading: it was never in the way");
    assert!(h.s.accounted(&Device::Cpu) <= 1000 * MB);
}

#[test]
fn beside_a_slow_load_first_loads_and_slow_ones_wait() {
    let mut h = slow_load_in_flight(1000, &[("slow", 300), ("quick", 10), ("new", 10), ("slow2", 300)]);
    h.at(1.1);
    let (_, a) = h.submit("new");
    assert!(started_loads(&h, &a).is_empty(), "never loaded: how long it takes is not known");
    h.at(1.2);
    let (_, a) = h.submit("slow2");
    assert!(started_loads(&h, &a).is_empty(), "loads run one at a time");
    let slow = h.id("slow");
    let took = Duration::from_secs(2);
    let a = h.feed(Event::LoadFinished { model: slow, result: Ok(LoadMeasurement::default()), took });
    assert_eq!(started_loads(&h, &a), ["new"], "the one waiting longest, once the slow load ended");
}

#[test]
fn an_asked_for_unload_waits_for_a_job_between_two_slices_and_starts_nothing_new() {
    let (mut h, job, quick) = a_job_between_two_slices();
    // The job waits between two slices (behind `quick`) when the unload is asked for.
    let a = h.feed(Event::Unload { req: 900, model: h.id("long") });
    assert!(!a.iter().any(|a| matches!(a, Action::StartUnload { .. })), "the job holds the model: {a:?}");
    let (late, _) = h.submit("long");
    let a = h.finish(quick);
    assert_eq!(dispatched(&h, &a), ["long"], "the job's next slice runs");
    let (_, reqs, _) = h.batch_of(job).expect("dispatched");
    assert_eq!(reqs, [job], "alone: the request that came after the unload was asked for waits");
    assert_eq!(h.outcome(900), None, "not unloaded yet");
    h.at(0.4);
    let a = slice_ends(&mut h, job);
    assert!(!a.iter().any(|a| matches!(a, Action::StartUnload { .. })), "a second slice to go: {a:?}");
    let a = h.finish(job);
    assert!(a.iter().any(|a| matches!(a, Action::StartUnload { .. })), "the job done, the unload: {a:?}");
    assert_eq!(h.outcome(900), Some(Ok(())));
    assert_eq!(h.outcome(late), Some(Ok(())), "then the late request reloads it and runs");
}

/// "job" holds 600 MB while it runs (100 MB loaded), "big" (350 MB) cannot fit beside it
/// until the run ends, even with "idle" (150 MB, used at 0.5 s) evicted; "small" was
/// loaded once (in `small_load`) and unloaded. "big" is asked for at 2.0 s, while the run
/// goes on. Returns the harness, the run and big's request.
fn big_waits_for_a_running_job(small_mb: u64, small_load: Duration) -> (Harness, RequestId, RequestId) {
    let mut h = Harness::new(1000, &[("job", 100), ("big", 350), ("small", small_mb), ("idle", 150)]);
    let job = h.id("job");
    h.s.learn_transient(job, 600 * MB);
    h.load_time = small_load;
    loaded_once_then_unloaded(&mut h, "small");
    h.load_time = Duration::from_millis(10);
    h.at(0.5);
    h.call("idle").unwrap();
    h.at(1.0);
    let run = h.use_model("job").unwrap();
    h.at(2.0);
    let (big, a) = h.submit("big");
    h.settle(a);
    assert_eq!(h.outcome(big), None, "850 MB in use: 350 more fit neither free nor by evicting idle");
    (h, run, big)
}

#[test]
fn a_quick_model_that_fits_does_not_wait_behind_a_load_that_waits_for_a_run() {
    let (mut h, run, big) = big_waits_for_a_running_job(50, Duration::from_millis(10));
    h.at(2.05);
    let (req, a) = h.submit("small");
    let a = h.settle(a);
    assert_eq!(started_loads(&h, &a), ["small"], "50 MB fit in the 150 free: it loads beside the wait");
    assert_eq!(h.outcome(req), Some(Ok(())));
    assert_eq!(h.outcome(big), None);
    h.finish(req);
    h.at(3.0);
    h.finish(run);
    assert_eq!(h.outcome(big), Some(Ok(())), "the run's 600 MB back: big loads, first in line again");
    assert!(h.evictions().is_empty(), "100 + 150 + 50 + 350 MB: {:?}", h.evictions());
    assert!(h.s.accounted(&Device::Cpu) <= 1000 * MB);
}

#[test]
fn a_quick_model_evicts_an_idle_one_rather_than_wait_behind_a_load_that_waits_for_a_run() {
    let (mut h, run, big) = big_waits_for_a_running_job(250, Duration::from_millis(10));
    h.at(2.05);
    let (req, a) = h.submit("small");
    h.settle(a);
    assert_eq!(h.evictions(), ["idle"], "250 MB fit once the idle 150 MB go; big would not");
    assert_eq!(h.outcome(req), Some(Ok(())));
    h.finish(req);
    h.at(3.0);
    h.finish(run);
    assert_eq!(h.outcome(big), Some(Ok(())), "100 + 250 + 350 MB once the run ended");
}

#[test]
fn a_slow_model_waits_its_turn_behind_a_load_that_waits_for_a_run() {
    // "small" fits, but its last load took a second: it would hold the device (and the
    // room) when the run ends and big's turn comes.
    let (mut h, run, big) = big_waits_for_a_running_job(50, Duration::from_secs(1));
    h.at(2.05);
    let (req, a) = h.submit("small");
    let a = h.settle(a);
    assert!(started_loads(&h, &a).is_empty(), "{:?}", started_loads(&h, &a));
    h.at(3.0);
    let a = h.finish(run);
    assert_eq!(started_loads(&h, &a), ["big", "small"], "big first, then small beside it");
    assert_eq!((h.outcome(big), h.outcome(req)), (Some(Ok(())), Some(Ok(()))));
}

#[test]
fn nothing_goes_ahead_of_a_model_that_models_were_evicted_for() {
    // "big" (700 MB) evicts "idle" (300 MB) to load; while "idle" unloads, "job" starts a
    // run holding 500 MB, so "big" is short again. The 300 MB "idle" left are big's: a
    // quick "small" taking them would be evicted by "big" as soon as it fits, and the two
    // could take turns.
    let mut h = Harness::new(1000, &[("job", 100), ("idle", 300), ("big", 700), ("small", 50)]);
    h.s.learn_transient(h.id("job"), 500 * MB);
    loaded_once_then_unloaded(&mut h, "small");
    h.call_a_second_apart(&["job", "idle"]);
    h.at(2.0);
    let (big, a) = h.submit("big");
    assert_eq!(h.evictions(), ["idle"]);
    let (run, b) = h.submit("job");
    assert_eq!(h.outcome(run), Some(Ok(())), "the run starts while idle unloads");
    h.settle(a.into_iter().chain(b).collect());
    assert_eq!(h.outcome(big), None, "600 MB held: big waits for the run");
    h.at(2.1);
    let (req, a) = h.submit("small");
    let a = h.settle(a);
    assert!(started_loads(&h, &a).is_empty(), "small fits, but in the room made for big");
    h.at(3.0);
    let a = h.finish(run);
    assert_eq!(started_loads(&h, &a), ["big", "small"]);
    assert_eq!((h.outcome(big), h.outcome(req)), (Some(Ok(())), Some(Ok(()))));
}

/// "long" runs long work (low CPU priority, so the kernel gives it only what short runs
/// leave), "a" and "b" are short models; every model loaded and idle at t = 3 s.
fn long_and_two_short() -> Harness {
    let mut h = Harness::with(1000, &[("long", 100), ("a", 10), ("b", 10)], |p| {
        p.low_cpu_priority = p.name == "long";
    });
    h.call_a_second_apart(&["long", "a", "b"]);
    h
}

/// Short runs of "a" and "b" overlapping from `from` to `to` (s), so that at every
/// instant one of them runs; returns the one still running at `to`.
fn short_streak(h: &mut Harness, from: f64, to: f64) -> RequestId {
    h.at(from);
    let (mut running, a) = h.submit("a");
    assert_eq!(dispatched(h, &a), ["a"]);
    let mut next = "b";
    let steps = ((to - from) / 0.05).round() as u32;
    for i in 1..steps {
        let t = from + f64::from(i) * 0.05;
        h.at(t);
        let (req, a) = h.submit(next);
        assert_eq!(dispatched(h, &a), [next], "t = {t:.2}: short runs start while the streak is young");
        h.at(t + 0.01);
        h.finish(running);
        running = req;
        next = if next == "a" { "b" } else { "a" };
    }
    running
}

#[test]
fn short_runs_that_kept_every_core_for_a_second_give_long_work_a_turn() {
    let mut h = long_and_two_short();
    h.at(3.0);
    let job = h.use_model("long").unwrap();
    let running = short_streak(&mut h, 3.0, 4.0);
    // A second of short runs without a gap while the job runs: the next short run waits.
    h.at(4.0);
    let (waiting, a) = h.submit(if h.batch_of(running).unwrap().0 == h.id("a") { "b" } else { "a" });
    assert!(dispatched(&h, &a).is_empty(), "long work is owed a turn");
    // The last short run ends: the turn begins, for LONG_TURN.
    h.at(4.02);
    let a = h.finish(running);
    assert!(dispatched(&h, &a).is_empty(), "the turn: no short run starts");
    let turn_end = h.t0 + Duration::from_secs_f64(4.02) + LONG_TURN;
    assert_eq!(h.s.next_deadline(), Some(turn_end), "the scheduler wakes when the turn ends");
    h.now = turn_end - Duration::from_millis(1);
    let a = h.tick();
    assert!(dispatched(&h, &a).is_empty());
    h.now = turn_end;
    let a = h.tick();
    assert_eq!(
        dispatched(&h, &a),
        [h.s.slot(h.batch_of(waiting).unwrap().0).name()],
        "then short runs again"
    );
    // A new streak starts: the next second's short runs go through.
    let t = (turn_end - h.t0).as_secs_f64();
    h.finish(waiting);
    let last = short_streak(&mut h, t + 0.01, t + 0.9);
    h.finish(last);
    assert_eq!(h.outcome(job), Some(Ok(())), "the job ran throughout");
}

#[test]
fn short_runs_never_wait_for_a_turn_nobody_needs() {
    // No long work running: a streak of any length holds nothing.
    let mut h = long_and_two_short();
    let running = short_streak(&mut h, 3.0, 6.0);
    h.at(6.0);
    let other = if h.batch_of(running).unwrap().0 == h.id("a") { "b" } else { "a" };
    let (_, a) = h.submit(other);
    assert_eq!(dispatched(&h, &a), [other]);

    // Long work running, but the short runs leave gaps: no turn is owed.
    let mut h = long_and_two_short();
    h.at(3.0);
    h.use_model("long").unwrap();
    for i in 0..30 {
        let t = 3.0 + i as f64 * 0.1;
        h.at(t);
        let (req, a) = h.submit("a");
        assert_eq!(dispatched(&h, &a), ["a"], "t = {t:.1}");
        h.at(t + 0.05);
        h.finish(req);
    }

    // A run of the long model itself never waits for its own turn.
    let mut h = long_and_two_short();
    h.at(3.0);
    let first = h.use_model("long").unwrap();
    // The streak's last short run goes on past a second.
    let running = short_streak(&mut h, 3.0, 4.0);
    h.at(4.5);
    let (second, _) = h.submit("long");
    h.at(4.6);
    let a = h.finish(first);
    assert_eq!(dispatched(&h, &a), ["long"], "the job's model runs during a streak that owes it a turn");
    h.finish(running);
    h.finish(second);
}

#[test]
fn back_to_back_runs_of_one_short_model_are_a_streak_too() {
    // One short model, its queue never empty: each batch starts as the one before ends,
    // with no pause, so a second of them owes long work its turn all the same.
    let mut h = long_and_two_short();
    h.at(3.0);
    h.use_model("long").unwrap();
    let (mut running, _) = h.submit("a");
    let mut t = 3.0;
    while t < 4.0 {
        t += 0.1;
        h.at(t - 0.05);
        let (next, a) = h.submit("a");
        assert!(dispatched(&h, &a).is_empty(), "one run of the model at a time");
        h.at(t);
        let a = h.finish(running);
        if t < 4.0 {
            assert_eq!(dispatched(&h, &a), ["a"], "t = {t:.1}: the next batch at once");
        } else {
            assert!(dispatched(&h, &a).is_empty(), "t = {t:.1}: a second without a pause: the turn");
            assert_eq!(h.s.next_deadline(), Some(h.now + LONG_TURN));
        }
        running = next;
    }
    h.now += LONG_TURN;
    let a = h.tick();
    assert_eq!(dispatched(&h, &a), ["a"], "after the turn");
}
