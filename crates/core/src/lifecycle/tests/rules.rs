//! One test per lifecycle rule (ARCHITECTURE's rules 1-10).

use std::time::Duration;

use super::{config, replies, Harness, MB};
use crate::{backend::LoadError, error::ErrorKind, lifecycle::*, units::KeepAlive};

#[test]
fn rule1_lazy_load_on_first_request_then_served_from_memory() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    assert_eq!(h.state("a"), StateName::Unloaded);
    h.call("a").unwrap();
    h.call("a").unwrap();
    assert_eq!(h.loads(), ["a"]);
    assert_eq!(h.state("a"), StateName::Ready);
}

#[test]
fn rule1_concurrent_first_requests_cause_one_load_and_run_as_one_batch() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let (r1, a1) = h.submit("a");
    let (r2, a2) = h.submit("a");
    let (r3, a3) = h.submit("a");
    assert!(matches!(a1[..], [Action::StartLoad { .. }]), "first request starts the load: {a1:?}");
    assert!(a2.is_empty() && a3.is_empty(), "later ones wait in the queue");
    let done = h.settle(a1);
    assert!(done.contains(&Action::Dispatch { model: 0, reqs: vec![r1, r2, r3], max_rows: 32 }), "{done:?}");
    assert_eq!(h.loads(), ["a"]);
    assert_eq!(h.s.slot(0).leases(), 1, "one run");
}

#[test]
fn rule1_loads_are_serialized_per_device() {
    let mut h = Harness::new(1000, &[("a", 100), ("b", 100)]);
    let (_, a) = h.submit("a");
    let (_, b) = h.submit("b");
    assert!(matches!(a[..], [Action::StartLoad { .. }]));
    assert!(b.is_empty(), "b waits for a's load: {b:?}");
    let after = h.feed(Event::LoadFinished {
        model: 0,
        result: Ok(LoadMeasurement::default()),
        took: Duration::ZERO,
    });
    assert!(after.contains(&Action::StartLoad { model: 1, device: Device::Cpu }));
}

#[test]
fn rule2_a_running_model_is_never_evicted_the_idle_one_is() {
    // Budget for two; a runs a request, b is idle: c must evict b, not a.
    let mut h = Harness::new(250, &[("a", 100), ("b", 100), ("c", 100)]);
    h.use_model("a").unwrap(); // still running
    h.at(1.0);
    h.call("b").unwrap();
    h.at(2.0);
    h.call("c").unwrap();
    assert_eq!(h.evictions(), ["b"]);
    assert_eq!(h.state("a"), StateName::Ready);
}

#[test]
fn rule2_last_used_is_stamped_when_the_run_ends() {
    let mut h = Harness::new(250, &[("a", 100), ("b", 100), ("c", 100)]);
    let ra = h.use_model("a").unwrap(); // starts at t=0, finishes at t=5
    h.at(1.0);
    h.call("b").unwrap(); // used at t=1
    h.at(5.0);
    h.finish(ra);
    h.at(6.0);
    h.call("c").unwrap();
    assert_eq!(h.evictions(), ["b"], "a completed last, so b is the LRU");
}

#[test]
fn rule3_admission_uses_estimate_plus_headroom_and_baseline() {
    // budget 300, baseline 100, headroom 50: a 150 MB model fits exactly, a 151 MB one never.
    let mut h = Harness::new(300, &[("fits", 150), ("big", 151)]);
    h.s.config.baselines.insert(Device::Cpu, 100 * MB);
    h.s.config.headroom = 50 * MB;
    h.call("fits").unwrap();
    let e = h.call("big").unwrap_err();
    assert_eq!(e.kind, ErrorKind::InsufficientMemory);
    assert!(e.retry_after.is_some() && e.message.contains("can ever"), "{}", e.message);
    assert_eq!(h.evictions(), Vec::<String>::new(), "a model that can never fit evicts nobody");
    // Never loaded, never measured: the operator is told the figure is an estimate
    // and how to give a better one.
    assert!(
        e.message.contains("estimated from its files") && e.message.contains("set `memory`"),
        "{}",
        e.message
    );
}

#[test]
fn rule3_a_refusal_says_where_the_footprint_came_from() {
    let mut h = Harness::new(300, &[("measured", 100), ("configured", 100)]);
    h.s.set_learned(0, Some(400 * MB), None);
    let e = h.call("measured").unwrap_err();
    assert!(e.message.contains("as measured") && !e.message.contains("set `memory`"), "{}", e.message);
    let mut h = Harness::with(300, &[("configured", 100)], |p| p.memory = Some(400 * MB));
    let e = h.call("configured").unwrap_err();
    assert!(e.message.contains("its `memory` setting"), "{}", e.message);
}

#[test]
fn rule3_configured_memory_wins_over_estimate_and_learned() {
    let mut h = Harness::with(300, &[("a", 500)], |p| p.memory = Some(100 * MB));
    h.s.set_learned(0, Some(900 * MB), None);
    h.call("a").unwrap();
}

#[test]
fn rule3_learned_footprint_is_preferred_to_the_estimate() {
    let mut h = Harness::new(300, &[("a", 500)]);
    assert!(h.call("a").is_err(), "estimate 500 > budget 300");
    h.s.set_learned(0, Some(120 * MB), Some(120 * MB));
    h.call("a").unwrap();
}

#[test]
fn rule3_probe_free_memory_makes_a_load_wait_until_it_is_there() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    h.s.observe_memory(Device::Cpu, 50 * MB);
    let (req, a) = h.submit("a");
    assert!(a.is_empty(), "waits: the machine may free memory");
    assert_eq!(h.outcome(req), None);
    h.s.observe_memory(Device::Cpu, 500 * MB);
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.outcome(req), Some(Ok(())));
}

#[test]
fn rule3_a_reading_taken_before_an_unload_ended_evicts_no_second_model() {
    // Room for three 100 MB models. The probe's last reading was taken with a, b and c
    // resident (nothing free); then a is unloaded. The reading still says 0 bytes free,
    // but a's 100 MB came back since it was taken: d loads without evicting anybody.
    // (Before, a load right after an eviction could evict a second model it did not
    // need to: the integration test saw one of its 100 MB models evicted twice over.)
    let mut h = Harness::new(300, &[("a", 100), ("b", 100), ("c", 100), ("d", 100)]);
    for m in ["a", "b", "c"] {
        h.call(m).unwrap();
    }
    h.s.observe_memory(Device::Cpu, 0);
    let a = h.id("a");
    let actions = h.feed(Event::Unload { req: 900, model: a });
    h.settle(actions);
    assert_eq!(h.state("a"), StateName::Unloaded);
    h.call("d").unwrap();
    assert!(h.evictions().is_empty(), "evicted {:?}", h.evictions());
    // The other way: a reading taken before d loaded counts d's bytes as taken now.
    h.s.observe_memory(Device::Cpu, 0);
    let actions = h.feed(Event::Unload { req: 901, model: h.id("b") });
    h.settle(actions);
    h.s.observe_memory(Device::Cpu, 100 * MB); // b's 100 MB free
    h.call("a").unwrap(); // takes them: no eviction
    assert!(h.evictions().is_empty(), "evicted {:?}", h.evictions());
    h.call("b").unwrap(); // the reading (100 free before a loaded) now says 0: one eviction
    assert_eq!(h.evictions().len(), 1, "evicted {:?}", h.evictions());
}

#[test]
fn rule3_indeterminate_footprint_loads_without_the_guard() {
    let mut h = Harness::with(10, &[("x", 0)], |p| {
        p.estimate_steady = None;
        p.estimate_peak = None;
    });
    h.call("x").unwrap();
}

#[test]
fn rule4_evictions_follow_lru_order() {
    // Budget for two 100 MB models; a scripted sequence and the evictions it must cause.
    let cases: &[(&[&str], &[&str])] = &[
        (&["a", "b", "c"], &["a"]),
        (&["a", "b", "a", "c"], &["b"]),
        (&["a", "b", "c", "d", "e"], &["a", "b", "c"]),
        (&["a", "b", "a", "c", "b", "a"], &["b", "a", "c"]),
        (&["a", "a", "a", "b", "b"], &[]),
    ];
    for (seq, want) in cases {
        let mut h = Harness::new(250, &[("a", 100), ("b", 100), ("c", 100), ("d", 100), ("e", 100)]);
        for (i, m) in seq.iter().enumerate() {
            h.at(i as f64);
            h.call(m).unwrap();
        }
        assert_eq!(h.evictions(), *want, "sequence {seq:?}");
    }
}

#[test]
fn rule4_pinned_models_are_never_evicted() {
    let mut h = Harness::with(250, &[("p", 100), ("a", 100), ("b", 100)], |p| p.pinned = p.name == "p");
    h.call("p").unwrap();
    h.at(1.0);
    h.call("a").unwrap();
    h.at(2.0);
    h.call("b").unwrap();
    assert_eq!(h.evictions(), ["a"]);
    assert_eq!(h.state("p"), StateName::Ready);
}

#[test]
fn max_loaded_models_taken_by_pinned_models_refuses_the_others_at_once() {
    let mut h = Harness::with(1000, &[("p", 100), ("a", 100)], |p| p.pinned = p.name == "p");
    h.s.config.max_loaded_models = 1;
    h.call("p").unwrap();
    let (req, a) = h.submit("a");
    let refused = replies(&a);
    assert_eq!(refused, [(req, Err(ErrorKind::InsufficientMemory))], "at once, not after queue_timeout");
    let Some(Err(e)) = h.outcome(req) else { panic!() };
    assert!(e.message.contains("max_loaded_models = 1 is taken by pinned models (p)"), "{}", e.message);
    assert!(e.retry_after.is_some());
}

#[test]
fn rule4_max_loaded_models_evicts_lru() {
    let mut h = Harness::new(10_000, &[("a", 100), ("b", 100), ("c", 100)]);
    h.s.config.max_loaded_models = 2;
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap();
    h.at(2.0);
    h.call("c").unwrap();
    assert_eq!(h.evictions(), ["a"]);
}

#[test]
fn rule4_a_young_model_makes_the_load_wait_not_fail() {
    // Budget for one; b loaded at t=0 with min_residency 10 s: a request for a at t=1
    // waits until b may be evicted (t=10), then runs.
    let mut h = Harness::with(150, &[("a", 100), ("b", 100)], |p| p.min_residency = Duration::from_secs(10));
    h.call("b").unwrap();
    h.at(1.0);
    let (req, a) = h.submit("a");
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_secs(10)));
    h.at(10.0);
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.outcome(req), Some(Ok(())));
    assert_eq!(h.evictions(), ["b"]);
}

#[test]
fn rule4_young_models_are_evicted_only_after_old_ones() {
    let mut h = Harness::with(250, &[("a", 100), ("b", 100), ("c", 100)], |p| {
        p.min_residency = if p.name == "b" { Duration::from_secs(100) } else { Duration::ZERO }
    });
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap();
    h.at(2.0);
    h.call("a").unwrap(); // b is now the LRU, but young
    h.at(3.0);
    h.call("c").unwrap();
    assert_eq!(h.evictions(), ["a"]);
}

#[test]
fn rule5_falls_back_to_the_next_device() {
    let mut s = Scheduler::new(SchedulerConfig {
        budgets: [(Device::Cpu, 1000 * MB), (Device::Cuda(0), 50 * MB)].into(),
        ..config(1000)
    });
    let mut p = ModelPolicy::new("g");
    p.devices = vec![Device::Cuda(0), Device::Cpu];
    p.estimate_steady = Some(100 * MB);
    let id = s.register(p);
    let a = s.handle(
        Instant::now(),
        Event::Submit(Submit { req: 1, model: id, priority: None, rows: 1, key: None, size: None }),
    );
    assert_eq!(a, [Action::StartLoad { model: id, device: Device::Cpu }], "too big for cuda:0, fits the CPU");
}

#[test]
fn rule6_oom_evicts_one_more_then_retries_and_fits() {
    // The estimates say all three fit, but the load of c fails with a verified OOM:
    // the LRU idle model is evicted and the load retried.
    let mut h = Harness::new(1000, &[("a", 100), ("b", 100), ("c", 100)]);
    h.call("a").unwrap();
    h.at(1.0);
    h.call("b").unwrap();
    h.at(2.0);
    let (req, a) = h.submit("c");
    assert!(matches!(a[..], [Action::StartLoad { model: 2, .. }]));
    let a = h.feed(Event::LoadFinished {
        model: 2,
        result: Err(LoadError::OutOfMemory("Failed to allocate memory".into())),
        took: Duration::ZERO,
    });
    assert!(matches!(a[..], [Action::StartUnload { model: 0, reason: UnloadReason::Evicted, .. }]), "{a:?}");
    h.settle(a);
    assert_eq!(h.outcome(req), Some(Ok(())));
    assert_eq!(h.loads(), ["a", "b", "c", "c"]);
}

#[test]
fn rule6_oom_with_nothing_left_to_evict_is_503() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let (req, a) = h.submit("a");
    assert!(matches!(a[..], [Action::StartLoad { .. }]));
    let a = h.feed(Event::LoadFinished {
        model: 0,
        result: Err(LoadError::OutOfMemory("Failed to allocate memory".into())),
        took: Duration::ZERO,
    });
    assert_eq!(replies(&a), [(req, Err(ErrorKind::InsufficientMemory))]);
    assert_eq!(h.state("a"), StateName::Unloaded, "not failed: memory may come back");
}

#[test]
fn rule6_other_load_errors_fail_fast_evict_nothing_and_back_off() {
    let mut h = Harness::new(1000, &[("bad", 100)]);
    let fail = |h: &mut Harness| {
        h.feed(Event::LoadFinished {
            model: 0,
            result: Err(LoadError::Failed("invalid protobuf".into())),
            took: Duration::ZERO,
        })
    };
    let (req, _) = h.submit("bad");
    let a = fail(&mut h);
    let [Action::Reply { req: r, result: Err(e) }] = &a[..] else { panic!("{a:?}") };
    assert_eq!((*r, e.kind), (req, ErrorKind::ModelFailed));
    assert!(e.message.contains("invalid protobuf"));
    assert_eq!(h.state("bad"), StateName::Failed);
    // During backoff: refused at once with Retry-After, no load attempted.
    h.at(0.5);
    let e = h.call("bad").unwrap_err();
    assert_eq!(e.kind, ErrorKind::ModelFailed);
    assert_eq!(e.retry_after, Some(Duration::from_millis(500)));
    // After it: tried again; a second failure doubles the backoff.
    h.at(1.1);
    let (_, a) = h.submit("bad");
    assert!(matches!(a[..], [Action::StartLoad { .. }]));
    fail(&mut h);
    h.at(2.0);
    let e = h.call("bad").unwrap_err();
    assert_eq!(e.retry_after, Some(Duration::from_millis(1100)), "2s backoff from t=1.1");
    assert_eq!(h.loads(), ["bad", "bad"]);
}

#[test]
fn unreadable_files_are_refused_before_anything_is_evicted() {
    let mut h = Harness::new(150, &[("a", 100), ("broken", 100)]);
    h.call("a").unwrap();
    h.s.observe_files(1, Some("not an ONNX file".into()));
    let e = h.call("broken").unwrap_err();
    assert_eq!(e.kind, ErrorKind::ModelFailed);
    assert!(e.message.contains("not an ONNX file"));
    assert!(h.evictions().is_empty());
    // Readiness and the admin view see it failed, with the reason.
    let st = &h.s.status(h.now)[1];
    assert_eq!((st.state, st.last_error.as_deref()), (StateName::Failed, Some("not an ONNX file")));
    h.s.observe_files(1, None);
    h.call("broken").unwrap();
    assert_eq!(h.s.status(h.now)[1].state, StateName::Ready);
}

#[test]
fn rule7_keep_alive_expiry_unloads_idle_models() {
    let mut h = Harness::with(1000, &[("a", 100), ("b", 100)], |p| {
        p.keep_alive = KeepAlive::For(Duration::from_secs(if p.name == "a" { 60 } else { 30 }))
    });
    h.call("a").unwrap();
    h.at(10.0);
    h.call("b").unwrap();
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_secs(40)));
    h.at(39.0);
    assert!(h.tick().is_empty());
    h.at(40.0);
    let a = h.tick();
    assert!(matches!(a[..], [Action::StartUnload { model: 1, reason: UnloadReason::Idle, .. }]), "{a:?}");
    h.settle(a);
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_secs(60)));
    assert_eq!(h.state("b"), StateName::Unloaded);
}

#[test]
fn rule7_keep_alive_counts_from_completion_and_never_while_running() {
    let mut h = Harness::with(1000, &[("a", 100)], |p| p.keep_alive = KeepAlive::For(Duration::from_secs(5)));
    let req = h.use_model("a").unwrap();
    assert_eq!(h.s.next_deadline(), None, "running: no idle deadline");
    h.at(100.0);
    h.finish(req);
    assert_eq!(h.s.next_deadline(), Some(h.t0 + Duration::from_secs(105)));
}

#[test]
fn rule7_keep_alive_zero_and_forever() {
    let mut h = Harness::with(1000, &[("zero", 100), ("forever", 100), ("pinned", 100)], |p| {
        p.keep_alive = match p.name.as_str() {
            "forever" => KeepAlive::Forever,
            _ => KeepAlive::For(Duration::ZERO),
        };
        p.pinned = p.name == "pinned";
    });
    h.call("zero").unwrap();
    assert_eq!(h.state("zero"), StateName::Unloaded, "0 = unload right after the request");
    h.call("forever").unwrap();
    h.call("pinned").unwrap();
    assert_eq!(h.s.next_deadline(), None);
    h.at(1e6);
    assert!(h.tick().is_empty());
}

#[test]
fn explicit_load_and_unload() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let a = h.feed(Event::Load { req: 700, model: 0 });
    let done = h.settle(a);
    assert!(done.contains(&Action::Reply { req: 700, result: Ok(()) }));
    assert_eq!(h.s.slot(0).leases(), 0);
    // Unload while a request runs: replied only once the run ended.
    let req = h.use_model("a").unwrap();
    assert!(h.feed(Event::Unload { req: 800, model: 0 }).is_empty());
    let done = h.finish(req);
    assert!(done.contains(&Action::Reply { req: 800, result: Ok(()) }));
    assert_eq!(h.state("a"), StateName::Unloaded);
}

#[test]
fn shutdown_refuses_new_and_waiting_work_and_unloads_idle() {
    let mut h = Harness::new(1000, &[("a", 100), ("b", 100)]);
    h.call("a").unwrap();
    let running = h.use_model("b").unwrap();
    let (queued, _) = h.submit("b");
    let a = h.feed(Event::Shutdown);
    assert!(a.contains(&Action::StartUnload {
        model: 0,
        device: Device::Cpu,
        reason: UnloadReason::Shutdown,
        bytes: 100 * MB
    }));
    assert_eq!(replies(&a), [(queued, Err(ErrorKind::ShuttingDown))]);
    h.settle(a);
    let e = h.call("a").unwrap_err();
    assert_eq!(e.kind, ErrorKind::ShuttingDown);
    assert!(h.s.busy(), "b still runs its request");
    h.finish(running);
    assert!(!h.s.busy());
}

#[test]
fn measured_footprint_replaces_the_estimate_in_accounting() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let (_, a) = h.submit("a");
    assert_eq!(h.s.accounted(&Device::Cpu), 100 * MB, "reserved while loading");
    let _ = a;
    h.feed(Event::LoadFinished {
        model: 0,
        result: Ok(LoadMeasurement { steady: Some(130 * MB), peak: Some(210 * MB), working: 0 }),
        took: Duration::from_millis(50),
    });
    assert_eq!(h.s.accounted(&Device::Cpu), 130 * MB);
    let st = &h.s.status(h.now)[0];
    assert_eq!(st.footprint_measured_bytes, Some(130 * MB));
    assert_eq!(st.footprint_peak_measured_bytes, Some(210 * MB));
    assert_eq!(st.last_load, Some(Duration::from_millis(50)));
    assert_eq!(h.s.slot(0).admission_bytes(), Some(210 * MB), "the learned peak guards the next load");
}

#[test]
fn a_pass_that_leaves_memory_resident_grows_the_footprint_and_the_next_admission() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    assert_eq!(h.s.learn_pass(0, 50 * MB), None, "not resident: nothing to grow");
    let (_, a) = h.submit("a");
    let _ = a;
    h.feed(Event::LoadFinished {
        model: 0,
        result: Ok(LoadMeasurement { steady: Some(30 * MB), peak: Some(40 * MB), working: 0 }),
        took: Duration::from_millis(5),
    });
    assert_eq!(h.s.accounted(&Device::Cpu), 30 * MB);
    // A larger input's activations stay in the runtime's arena.
    assert_eq!(h.s.learn_pass(0, 200 * MB), Some(230 * MB));
    assert_eq!(h.s.accounted(&Device::Cpu), 230 * MB);
    let st = &h.s.status(h.now)[0];
    assert_eq!(st.footprint_measured_bytes, Some(230 * MB));
    assert_eq!(st.footprint_peak_measured_bytes, Some(230 * MB), "a peak is never shown below what stays");
    assert_eq!(
        h.s.slot(0).admission_bytes(),
        Some(230 * MB),
        "the next load is admitted for its working set"
    );

    // A model whose memory the config fixes keeps that figure.
    let mut h = Harness::with(1000, &[("b", 100)], |p| p.memory = Some(100 * MB));
    let (_, b) = h.submit("b");
    let _ = b;
    h.feed(Event::LoadFinished {
        model: 0,
        result: Ok(LoadMeasurement { steady: Some(30 * MB), peak: None, working: 0 }),
        took: Duration::from_millis(5),
    });
    assert_eq!(h.s.learn_pass(0, 200 * MB), None);
    assert_eq!(h.s.accounted(&Device::Cpu), 100 * MB);
}

#[test]
fn rule8_critical_pressure_makes_loads_evict_first_and_refuses_low_priority() {
    let mut h = Harness::new(1000, &[("a", 100), ("b", 100), ("c", 100)]);
    h.call("a").unwrap();
    h.feed(Event::Pressure { level: crate::pressure::PressureLevel::Critical, excess: 0 });
    h.at(1.0);
    h.call("b").unwrap();
    assert_eq!(h.evictions(), ["a"], "b fits the budget, but under critical pressure it evicts first");
    let (low, a) = h.submit_with("c", Some(Priority::Low), 1, None);
    assert_eq!(replies(&a), [(low, Err(ErrorKind::InsufficientMemory))]);
    // A normal request for c waits: b runs, nothing idle can pay for the load.
    let running = h.use_model("b").unwrap();
    let (req, a) = h.submit("c");
    assert!(a.is_empty());
    h.at(2.0);
    h.finish(running);
    assert_eq!(h.outcome(req), Some(Ok(())), "b became idle and paid for c");
}

fn emergency(h: &mut Harness, excess_mb: u64) -> Vec<String> {
    let a =
        h.feed(Event::Pressure { level: crate::pressure::PressureLevel::Emergency, excess: excess_mb * MB });
    a.iter()
        .filter_map(|x| match x {
            Action::StartUnload { model, reason: UnloadReason::Pressure, .. } => {
                Some(h.s.slot(*model).name().to_string())
            }
            _ => None,
        })
        .collect()
}

#[test]
fn rule8_emergency_unloads_idle_unpinned_models_only() {
    let mut h = Harness::with(1000, &[("a", 100), ("b", 100), ("p", 100)], |p| p.pinned = p.name == "p");
    h.call("a").unwrap();
    h.call("p").unwrap();
    h.use_model("b").unwrap();
    assert_eq!(emergency(&mut h, 900), ["a"], "a only: b runs, p is pinned");
}

#[test]
fn rule8_emergency_unloads_the_least_worth_until_the_excess_is_covered() {
    // Measured in the mix benchmark: a page's activations took the process to 104% of its
    // budget, and unloading every idle model sent `mlp-10m` (asked for 20 times a second)
    // to reload moments later. Only what covers the excess leaves, the least worth first.
    let mut h = Harness::new(1000, &[("hot", 100), ("old", 100), ("cold", 100)]);
    h.call("old").unwrap();
    h.at(1.0);
    h.call("cold").unwrap();
    for i in 0..10 {
        h.at(2.0 + 0.05 * f64::from(i));
        h.call("hot").unwrap();
    }
    h.at(3.0);
    assert_eq!(emergency(&mut h, 50), ["old"], "100 MB cover 50: the least recently used leaves");
    assert!(emergency(&mut h, 50).is_empty(), "read again while it leaves: covered already");
    let a = h.feed(Event::UnloadFinished { model: h.id("old") });
    h.settle(a);
    assert_eq!(emergency(&mut h, 150), ["cold", "hot"], "still over: the next, then the hot one");
    assert_eq!(h.state("hot"), StateName::Unloading);
}

#[test]
fn a_cover_is_taken_in_order_and_keeps_no_victim_the_others_cover_without() {
    let bytes = |id: ModelId| [100, 14, 150, 30][id];
    assert_eq!(Scheduler::cover(vec![0, 1, 2, 3], 164, bytes), [0, 2], "1 is not needed beside 2");
    assert_eq!(Scheduler::cover(vec![0, 1, 2, 3], 114, bytes), [0, 1], "in order, 0 and 1 cover it");
    assert_eq!(Scheduler::cover(vec![1, 0, 2], 150, bytes), [2], "2 alone covers it: 1 and 0 stay");
    assert!(Scheduler::cover(vec![0, 1], 0, bytes).is_empty(), "nothing needed, nothing taken");
    assert_eq!(Scheduler::cover(vec![0, 1], 500, bytes), [0, 1], "short: all of them");
}

#[test]
fn rule8_emergency_spares_a_model_the_larger_ones_after_it_cover_without() {
    // In worth order "old" (100 MB) goes first, then "hot" (14 MB), then "big" (300 MB),
    // the first that covers 350 MB. "old" and "big" cover it without "hot".
    let mut h = Harness::new(1000, &[("hot", 14), ("old", 100), ("big", 300)]);
    h.call("old").unwrap();
    h.at(1.0);
    let (req, a) = h.submit("big");
    h.settle_loading_in(a, Duration::from_secs(2));
    h.finish(req);
    for i in 0..10 {
        h.at(2.0 + 0.05 * f64::from(i));
        h.call("hot").unwrap();
    }
    h.at(2.5);
    h.call("big").unwrap();
    assert_eq!(emergency(&mut h, 350), ["old", "big"]);
    assert_eq!(h.state("hot"), StateName::Ready);
}

#[test]
fn collect_unloads_idle_unpinned_models_and_answers_when_they_are_gone() {
    let mut h = Harness::with(1000, &[("a", 100), ("b", 100), ("p", 100)], |p| p.pinned = p.name == "p");
    h.call("a").unwrap();
    h.call("p").unwrap();
    let running = h.use_model("b").unwrap();
    let a = h.feed(Event::Collect {
        req: 900,
        except: None,
        include_pinned: false,
        reason: UnloadReason::Pressure,
    });
    assert!(!a.iter().any(|x| matches!(x, Action::Collected { .. })), "answered once the unloads finish");
    let done = h.settle(a);
    assert!(done.contains(&Action::Collected { req: 900, models: vec![0] }), "{done:?}");
    h.finish(running);
    let a = h.feed(Event::Collect {
        req: 901,
        except: Some(1),
        include_pinned: false,
        reason: UnloadReason::Pressure,
    });
    assert_eq!(a, [Action::Collected { req: 901, models: vec![] }], "b is spared, p is pinned");
}

#[test]
fn unloads_superseded_by_a_load_are_answered_at_once() {
    // Three unloads while a request runs, then a load: nobody may be left waiting.
    let mut h = Harness::new(1000, &[("a", 100)]);
    let running = h.use_model("a").unwrap();
    for req in [11, 12, 13] {
        assert!(h.feed(Event::Unload { req, model: 0 }).is_empty(), "waits for the run in flight");
    }
    let (waiting, a) = h.submit("a");
    assert!(a.is_empty(), "nothing is dispatched while an unload is pending: {a:?}");
    let a = h.feed(Event::Load { req: 14, model: 0 });
    let mut got = replies(&a);
    got.sort_by_key(|(r, _)| *r);
    assert_eq!(
        got,
        [
            (11, Err(ErrorKind::Conflict)),
            (12, Err(ErrorKind::Conflict)),
            (13, Err(ErrorKind::Conflict)),
            (14, Ok(()))
        ],
        "{a:?}"
    );
    // The waiting request runs once the model is free; the flag is gone.
    let a = h.finish(running);
    assert!(a.iter().any(|x| matches!(x, Action::Dispatch { reqs, .. } if reqs == &[waiting])));
    h.finish(waiting);
    assert_eq!(h.state("a"), StateName::Ready);
}

#[test]
fn requests_during_a_pending_unload_wait_then_reload() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let running = h.use_model("a").unwrap();
    h.feed(Event::Unload { req: 50, model: 0 });
    let (req, a) = h.submit("a");
    assert!(a.is_empty());
    let done = h.finish(running);
    assert!(done.iter().any(|x| matches!(x, Action::StartUnload { reason: UnloadReason::Requested, .. })));
    assert_eq!(replies(&done), [(50, Ok(())), (req, Ok(()))], "unloaded, then reloaded for the waiter");
    assert_eq!(h.loads(), ["a", "a"]);
}

#[test]
fn a_load_refused_for_memory_answers_every_waiter_and_pending_unload() {
    let mut h = Harness::new(300, &[("a", 100), ("big", 500)]);
    let (_, start_a) = h.submit("a");
    let (r1, x) = h.submit("big");
    let (r2, y) = h.submit("big");
    assert!(x.is_empty() && y.is_empty(), "waiting behind a's load");
    h.feed(Event::Load { req: 20, model: 1 });
    let a = h.feed(Event::Unload { req: 21, model: 1 });
    assert_eq!(replies(&a), [(21, Ok(()))], "not loaded: nothing to wait for");
    let [Action::StartLoad { .. }] = start_a[..] else { panic!("{start_a:?}") };
    let a = h.feed(Event::LoadFinished {
        model: 0,
        result: Ok(LoadMeasurement::default()),
        took: Duration::ZERO,
    });
    let mut got = replies(&a);
    got.retain(|(r, _)| *r != 1);
    got.sort_by_key(|(r, _)| *r);
    assert_eq!(
        got,
        [
            (r1, Err(ErrorKind::InsufficientMemory)),
            (r2, Err(ErrorKind::InsufficientMemory)),
            (20, Err(ErrorKind::InsufficientMemory))
        ]
    );
    assert_eq!(h.state("big"), StateName::Unloaded);
}

#[test]
fn the_unload_flag_does_not_outlive_a_failed_load() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let (r, a) = h.submit("a");
    assert!(matches!(a[..], [Action::StartLoad { .. }]));
    assert!(h.feed(Event::Unload { req: 30, model: 0 }).is_empty());
    let a = h.feed(Event::LoadFinished {
        model: 0,
        result: Err(LoadError::Failed("bad file".into())),
        took: Duration::ZERO,
    });
    assert_eq!(replies(&a), [(r, Err(ErrorKind::ModelFailed)), (30, Ok(()))]);
    // After the backoff the model loads and stays: no stale unload request.
    h.at(2.0);
    h.call("a").unwrap();
    assert_eq!(h.state("a"), StateName::Ready);
}

#[test]
fn a_cancelled_unload_waiter_is_forgotten() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let running = h.use_model("a").unwrap();
    h.feed(Event::Unload { req: 40, model: 0 });
    h.feed(Event::Cancel { req: 40 });
    let done = h.finish(running);
    assert!(replies(&done).is_empty(), "the unload goes on, its caller is gone: {done:?}");
    assert_eq!(h.state("a"), StateName::Unloaded);
}

#[test]
fn a_model_that_panics_is_unloaded_then_backs_off_without_a_reload_storm() {
    let mut h = Harness::new(1000, &[("a", 100)]);
    let panicked = |h: &mut Harness, req: RequestId| {
        let (model, reqs, _) = h.batch_of(req).expect("dispatched");
        let a = h.feed(Event::RunFinished {
            model,
            reqs,
            outcome: RunOutcome::Panicked("boom".into()),
            took: Duration::ZERO,
            continuing: vec![],
        });
        h.settle(a)
    };
    let r1 = h.use_model("a").unwrap();
    let (waiting, _) = h.submit("a");
    let a = panicked(&mut h, r1);
    assert!(a.iter().any(|x| matches!(x, Action::StartUnload { reason: UnloadReason::Failed, .. })), "{a:?}");
    let refused = replies(&a);
    assert!(refused.iter().any(|(r, e)| *r == waiting && *e == Err(ErrorKind::ModelFailed)), "{refused:?}");
    assert_eq!(h.state("a"), StateName::Failed);
    // Within the backoff: refused without a load. After it: reloaded once.
    h.at(0.5);
    let e = h.call("a").unwrap_err();
    assert_eq!((e.kind, e.retry_after), (ErrorKind::ModelFailed, Some(Duration::from_millis(500))));
    h.at(1.0);
    let r3 = h.use_model("a").unwrap();
    assert_eq!(h.loads(), ["a", "a"]);
    // A second panic doubles the backoff.
    panicked(&mut h, r3);
    h.at(2.5);
    assert_eq!(h.call("a").unwrap_err().retry_after, Some(Duration::from_millis(500)), "2 s from t=1");
    h.at(3.0);
    h.call("a").unwrap();
    // Leaving memory normally (idle, evicted, asked) forgives earlier panics.
    let a = h.feed(Event::Unload { req: 60, model: 0 });
    h.settle(a);
    h.at(3.1);
    let r4 = h.use_model("a").unwrap();
    panicked(&mut h, r4);
    h.at(4.1);
    h.call("a").unwrap();
}
