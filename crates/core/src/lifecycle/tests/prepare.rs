//! One-time preparations (conversions): run in the background when the host is quiet
//! and they fit, never a condition for serving, never counted as what a model needs.

use super::{Harness, MB};
use crate::lifecycle::*;
use crate::{backend::Weights, error::ErrorKind};

fn prepare(h: &mut Harness, name: &str, peak_mb: u64) {
    let id = h.id(name);
    h.s.set_preparations(
        id,
        vec![Preparation { weights: Weights::Mapped, peak: peak_mb * MB, loads_in: true }],
    );
}

/// Unloads every idle model (as a memory-pressure collection does).
fn gc(h: &mut Harness) -> Vec<Action> {
    h.feed(Event::Collect { req: 99, except: None, include_pinned: false, reason: UnloadReason::Pressure })
}

fn prepares(actions: &[Action]) -> Vec<ModelId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::StartPrepare { model, .. } => Some(*model),
            _ => None,
        })
        .collect()
}

#[test]
fn a_conversion_larger_than_the_budget_never_stops_the_model_from_serving() {
    // The case: 300 MiB budget, a model of ~120 MiB whose conversion peaks at
    // ~290 MiB. The model is not refused "forever": it loads without the conversion.
    let mut h = Harness::new(300, &[("m", 120)]);
    prepare(&mut h, "m", 400);
    let (req, a) = h.submit("m");
    let a = h.settle(a);
    assert!(prepares(&a).is_empty(), "the conversion does not fit: not started");
    assert_eq!(h.outcome(req), Some(Ok(())), "served without it");
    assert_eq!(h.loads(), ["m"]);
    h.finish(req);
    assert!(prepares(&h.log).is_empty(), "and never started while it cannot fit");
}

#[test]
fn a_conversion_runs_only_on_a_quiet_host_and_when_it_fits_without_evicting() {
    let mut h = Harness::new(1000, &[("a", 300), ("b", 300)]);
    prepare(&mut h, "b", 600);
    // Quiet and it fits: it starts at once, its peak accounted while it runs.
    let a = h.tick();
    assert_eq!(prepares(&a), [h.id("b")]);
    assert_eq!(h.s.accounted(&Device::Cpu), 600 * MB);
    // A request meanwhile is not held up by it: `a` fits beside it.
    let (req, a) = h.submit("a");
    h.settle(a);
    assert!(h.outcome(req).is_some_and(|r| r.is_ok()), "served while the conversion runs");
    h.finish(req);
    let a = h.feed(Event::PrepareFinished {
        model: h.id("b"),
        weights: Weights::Mapped,
        result: Prepared::Done { steady: Some(250 * MB), peak: Some(260 * MB) },
    });
    assert!(prepares(&a).is_empty(), "nothing left to prepare");
    assert_eq!(h.s.accounted(&Device::Cpu), 300 * MB, "the conversion's peak is given back");
    assert_eq!(
        h.s.slot(h.id("b")).policy.estimate_steady,
        Some(250 * MB),
        "loads now cost the prepared form"
    );
}

#[test]
fn a_conversion_waits_for_room_rather_than_evicting_for_it() {
    let mut h = Harness::new(1000, &[("a", 300), ("b", 300)]);
    let (req, a) = h.submit("a");
    h.settle(a);
    h.finish(req);
    prepare(&mut h, "b", 800);
    let a = h.tick();
    assert!(prepares(&a).is_empty(), "700 MB free: no room, and nothing is evicted for it");
    assert!(h.evictions().is_empty());
    // Once `a` leaves on its own (gc), the conversion fits and runs.
    let a = gc(&mut h);
    let a = h.settle(a);
    assert_eq!(prepares(&a), [h.id("b")]);
}

#[test]
fn a_conversion_does_not_start_while_a_model_waits_to_load() {
    let mut h = Harness::new(1000, &[("a", 300), ("b", 300)]);
    prepare(&mut h, "b", 200);
    let (req, a) = h.submit("a");
    assert!(a.iter().any(|x| matches!(x, Action::StartLoad { .. })));
    assert!(prepares(&a).is_empty(), "a load is in progress");
    let a = h.settle(a);
    assert_eq!(prepares(&a), [h.id("b")], "the host is quiet again once `a` loaded");
    h.finish(req);
}

#[test]
fn a_failed_conversion_is_not_retried_and_the_model_keeps_serving() {
    let mut h = Harness::new(1000, &[("a", 300)]);
    prepare(&mut h, "a", 400);
    let a = h.tick();
    assert_eq!(prepares(&a), [0]);
    let a = h.feed(Event::PrepareFinished {
        model: 0,
        weights: Weights::Mapped,
        result: Prepared::Failed("disk full".into()),
    });
    assert!(prepares(&a).is_empty());
    h.at(10.0);
    assert!(prepares(&h.tick()).is_empty(), "not tried again");
    h.call("a").expect("served");
    assert_eq!(h.s.slot(0).last_error, None, "a successful load clears the note");
}

#[test]
fn a_model_that_can_never_fit_is_refused_by_its_own_needs_not_its_conversions() {
    let mut h = Harness::new(300, &[("big", 400)]);
    prepare(&mut h, "big", 1000);
    let (req, a) = h.submit("big");
    h.settle(a);
    let e = h.outcome(req).expect("answered").expect_err("refused");
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.message.contains("needs 400.0 MiB"), "{}", e.message);
}

#[test]
fn a_model_that_churns_is_prepared_while_the_host_is_busy() {
    // Room for one model; a and b take turns, so a load is always waiting and the host is
    // never quiet. A model swapped back in (loaded twice without its copy) gets its copy
    // made anyway; one loaded once still waits for a quiet moment.
    let mut h = Harness::new(400, &[("a", 300), ("b", 300)]);
    h.load_time = std::time::Duration::from_millis(300);
    h.call("a").unwrap();
    h.call("b").unwrap();
    let running = h.use_model("a").unwrap();
    assert_eq!((h.s.slot(h.id("a")).loads, h.s.slot(h.id("b")).loads), (2, 1));
    let (waiting, a) = h.submit("b");
    h.settle(a);
    assert_eq!(h.outcome(waiting), None, "b waits for a's run: a load is pending");
    prepare(&mut h, "b", 50);
    assert!(prepares(&h.tick()).is_empty(), "b loaded once: its conversion waits for a quiet host");
    prepare(&mut h, "a", 50);
    assert_eq!(prepares(&h.tick()), [h.id("a")], "a came back: its conversion runs beside the traffic");
    assert_eq!(h.s.accounted(&Device::Cpu), 350 * MB, "its peak accounted while it runs");
    h.finish(running);
}

/// Room for one model; `a` and `b` have each been loaded twice (they take turns, each load
/// slow), `b` is resident and idle.
fn two_churning_models() -> Harness {
    let mut h = Harness::new(300, &[("a", 200), ("b", 200)]);
    h.load_time = std::time::Duration::from_millis(300);
    for name in ["a", "b", "a", "b"] {
        h.call(name).unwrap();
    }
    assert_eq!((h.state("a"), h.state("b")), (StateName::Unloaded, StateName::Ready));
    h
}

#[test]
fn a_churning_model_s_copy_that_does_not_fit_evicts_idle_models_for_it() {
    let mut h = two_churning_models();
    prepare(&mut h, "a", 250);
    let before = h.evictions().len();
    let tick = h.tick();
    let a = h.settle(tick);
    assert_eq!(h.evictions().len(), before + 1, "one eviction");
    let evictions = h.evictions();
    assert_eq!(evictions.last().map(String::as_str), Some("b"), "{evictions:?}");
    assert_eq!(prepares(&a), [h.id("a")], "b was idle: evicted for a's copy, which then starts");
    assert_eq!(h.state("b"), StateName::Unloaded);
    // A request for a meanwhile waits for the copy (250 of 300 MB held), then loads from it.
    let (req, a) = h.submit("a");
    h.settle(a);
    assert_eq!(h.outcome(req), None, "no room beside the conversion");
    let a = h.feed(Event::PrepareFinished {
        model: h.id("a"),
        weights: Weights::Mapped,
        result: Prepared::Done { steady: Some(200 * MB), peak: Some(200 * MB) },
    });
    h.settle(a);
    assert_eq!(h.outcome(req), Some(Ok(())), "served once the copy is made");
    h.finish(req);
}

#[test]
fn a_churning_model_s_copy_never_evicts_a_model_that_runs_or_has_work_queued() {
    let mut h = two_churning_models();
    let running = h.use_model("b").unwrap();
    prepare(&mut h, "a", 250);
    let before = h.evictions().len();
    let a = h.tick();
    assert!(prepares(&a).is_empty(), "b runs: not evicted for a conversion");
    assert_eq!(h.evictions().len(), before);
    let a = h.finish(running);
    assert_eq!(prepares(&a), [h.id("a")], "once b's run ended and it is idle, it may go");
    assert_eq!(h.evictions().len(), before + 1);
}

#[test]
fn a_copy_that_cannot_fit_even_with_every_idle_model_gone_evicts_nobody() {
    let mut h = two_churning_models();
    prepare(&mut h, "a", 400);
    let before = h.evictions().len();
    let a = h.tick();
    assert!(prepares(&a).is_empty());
    assert_eq!(h.evictions().len(), before, "nothing evicted for a copy that cannot be made");
    h.call("a").expect("served from its .onnx");
}

#[test]
fn a_churning_model_that_reloads_quickly_gets_its_copy_only_on_a_quiet_host() {
    // As `two_churning_models`, but each load takes 5 ms (a mapped copy): making the copy
    // now would hold 250 of the 300 MB, so no model could load until it is made, for a
    // gain of milliseconds a swap.
    let mut h = Harness::new(300, &[("a", 200), ("b", 200)]);
    h.load_time = std::time::Duration::from_millis(5);
    for name in ["a", "b", "a", "b"] {
        h.call(name).unwrap();
    }
    prepare(&mut h, "a", 250);
    let running = h.use_model("b").unwrap();
    let (req, a) = h.submit("a");
    let a = h.settle(a);
    assert!(prepares(&a).is_empty() && prepares(&h.tick()).is_empty(), "busy: a's copy waits");
    let a = h.finish(running);
    assert!(prepares(&a).is_empty(), "b's run ended: a loads, its copy is not made in front of it");
    assert_eq!(h.outcome(req), Some(Ok(())));
    h.finish(req);
    assert!(prepares(&h.log).is_empty());
    // Slow loads (the same models from their .onnx) do get the copy made under traffic:
    // `a_churning_model_s_copy_that_does_not_fit_evicts_idle_models_for_it`. Here, once
    // the host is quiet and the copy fits, it is made.
    let a = gc(&mut h);
    let a = h.settle(a);
    assert_eq!(prepares(&a), [h.id("a")], "quiet and room: made");
}

fn stops(actions: &[Action]) -> Vec<ModelId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::StopPrepare { model } => Some(*model),
            _ => None,
        })
        .collect()
}

fn stopped(h: &mut Harness, name: &str) -> Vec<Action> {
    let a = h.feed(Event::PrepareFinished {
        model: h.id(name),
        weights: Weights::Mapped,
        result: Prepared::Stopped,
    });
    h.settle(a)
}

/// With every model unloaded, `name`'s conversion is still held back at `before` (s) and
/// starts again at `after`.
fn restarts_between(h: &mut Harness, name: &str, before: f64, after: f64) {
    let a = gc(h);
    h.settle(a);
    h.at(before);
    assert!(prepares(&h.tick()).is_empty(), "held back at {before} s");
    h.at(after);
    assert_eq!(prepares(&h.tick()), [h.id(name)], "started again at {after} s");
}

#[test]
fn a_request_stops_a_quiet_host_s_conversion_that_holds_the_memory_its_load_needs() {
    // The fresh start at a byte budget: the idle server converts `b`, holding 300
    // of 400 MB, when a request for `a` (150 MB) comes. It must not wait the conversion out.
    let mut h = Harness::new(400, &[("a", 150), ("b", 150)]);
    prepare(&mut h, "b", 300);
    assert_eq!(prepares(&h.tick()), [h.id("b")]);
    let (req, a) = h.submit("a");
    let a = h.settle(a);
    assert_eq!(stops(&a), [h.id("b")], "the conversion is stopped for the load");
    assert!(h.loads().is_empty(), "its bytes count until it has stopped");
    assert!(stops(&h.tick()).is_empty(), "asked once");
    stopped(&mut h, "b");
    assert_eq!(h.outcome(req), Some(Ok(())), "served once the memory is back");
    assert_eq!(h.s.accounted(&Device::Cpu), 150 * MB);
    h.finish(req);
    // Not a failure: it runs again on a quiet host, after a pause that doubles with each
    // stop in a row: 1 s after the first stop, 2 s after the second.
    restarts_between(&mut h, "b", 0.9, 1.1);
    let (req, a) = h.submit("a");
    assert_eq!(stops(&h.settle(a)), [h.id("b")]);
    stopped(&mut h, "b");
    h.finish(req);
    restarts_between(&mut h, "b", 3.0, 3.2);
    h.feed(Event::PrepareFinished {
        model: h.id("b"),
        weights: Weights::Mapped,
        result: Prepared::Done { steady: None, peak: None },
    });
    assert!(h.s.is_prepared(h.id("b"), Weights::Mapped));
    assert_eq!(h.s.slot(h.id("b")).last_error, None, "a stop is no failure");
}

/// `a` resident and idle, `b`'s conversion (300 MB at its peak) started on the quiet host.
fn converting_b_beside_idle_a(budget_mb: u64, models: &[(&str, u64)]) -> Harness {
    let mut h = Harness::new(budget_mb, models);
    h.call("a").unwrap();
    prepare(&mut h, "b", 300);
    assert_eq!(prepares(&h.tick()), [h.id("b")]);
    h
}

#[test]
fn a_conversion_is_not_stopped_where_evicting_an_idle_model_makes_room() {
    let mut h = converting_b_beside_idle_a(500, &[("a", 150), ("b", 150), ("c", 150)]);
    let (req, a) = h.submit("c");
    let a = h.settle(a);
    assert!(stops(&a).is_empty(), "{a:?}");
    assert_eq!(h.evictions(), ["a"]);
    assert_eq!(h.outcome(req), Some(Ok(())));
    h.finish(req);
}

#[test]
fn a_churning_model_s_conversion_is_not_stopped_for_a_load() {
    // It is made under traffic because each of that model's loads is slow: stopping it
    // would bring back the slow loads it exists to end.
    let mut h = two_churning_models();
    prepare(&mut h, "a", 250);
    let a = h.tick();
    h.settle(a);
    let (req, a) = h.submit("b");
    let a = h.settle(a);
    assert!(stops(&a).is_empty() && stops(&h.tick()).is_empty());
    assert_eq!(h.outcome(req), None, "b waits for a's copy");
}

#[test]
fn a_run_that_overdraws_the_budget_stops_a_quiet_host_s_conversion_before_evicting() {
    let mut h = converting_b_beside_idle_a(1000, &[("a", 300), ("b", 300), ("c", 200)]);
    let req = h.use_model("c").unwrap();
    assert!(stops(&h.log).is_empty(), "800 of 1000 MB with the conversion");
    // c's run left 300 MB more than its footprint said: 1100 MB accounted.
    h.s.learn_pass(h.id("c"), 300 * MB);
    let a = h.finish(req);
    assert_eq!(stops(&a), [h.id("b")], "the conversion goes first");
    assert!(h.evictions().is_empty(), "and a stays: {:?}", h.evictions());
    stopped(&mut h, "b");
    assert_eq!(h.s.accounted(&Device::Cpu), 800 * MB);
}
