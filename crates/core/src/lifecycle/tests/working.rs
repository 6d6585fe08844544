//! The budget held against what runs take, not only what loads took (issue 21's mix):
//! a model's *working set* — what a run holds at its peak and gives back (activations,
//! a transcription's caches) — is reserved while the model has work and released when it
//! is idle; growth that pushes the accounted memory over the budget evicts idle models.

use super::*;
use crate::lifecycle::working::SLICE_WAIT;

/// Runs the request `req` of `model` to its end, the run having left `kept` bytes
/// resident and held `transient` bytes at its peak (what the actor learns first).
fn finish_measured(h: &mut Harness, req: RequestId, kept: u64, transient: u64) -> Vec<Action> {
    let (model, _, _) = h.batch_of(req).expect("dispatched");
    if kept > 0 {
        h.s.learn_pass(model, kept);
    }
    if transient > 0 {
        h.s.learn_transient(model, transient);
    }
    h.finish(req)
}

#[test]
fn a_run_that_leaves_the_budget_overdrawn_evicts_idle_models_least_recently_used_first() {
    let mut h = Harness::new(1000, &[("a", 300), ("b", 300), ("c", 300)]);
    h.call_a_second_apart(&["a", "b"]);
    h.at(2.0);
    let req = h.use_model("c").unwrap();
    assert!(h.evictions().is_empty(), "900 of 1000 MB");
    h.at(3.0);
    finish_measured(&mut h, req, 200 * MB, 0);
    assert_eq!(h.evictions(), ["a"], "c's run left 200 MB: 1100 MB accounted, the oldest idle model goes");
    assert_eq!(h.state("b"), StateName::Ready);
    assert_eq!(h.s.accounted(&Device::Cpu), 800 * MB);
}

#[test]
fn a_model_with_work_reserves_its_working_set_and_gives_it_back_when_idle() {
    let mut h = Harness::new(1000, &[("small1", 150), ("small2", 150), ("big", 200)]);
    h.call_a_second_apart(&["small1", "small2"]);
    h.at(2.0);
    let first = h.use_model("big").unwrap();
    h.at(3.0);
    finish_measured(&mut h, first, 0, 600 * MB);
    assert!(h.evictions().is_empty(), "idle, big holds only its footprint: 500 MB");
    assert_eq!(h.s.slot(h.id("big")).working_bytes, 600 * MB);

    h.at(4.0);
    let (job, a) = h.submit("big");
    h.settle(a);
    assert_eq!(h.outcome(job), Some(Ok(())), "it runs at once");
    assert_eq!(h.evictions(), ["small1"], "with work it holds 800 MB: the oldest idle model goes");
    assert_eq!(h.s.accounted(&Device::Cpu), 950 * MB);

    h.at(5.0);
    h.finish(job);
    assert_eq!(
        h.loads().last().map(String::as_str),
        Some("small1"),
        "idle again, big gives its working set back, and the model evicted for it returns"
    );
    assert_eq!(h.s.accounted(&Device::Cpu), 500 * MB);
    assert_eq!(h.evictions(), ["small1"]);
}

#[test]
fn a_load_for_waiting_requests_makes_room_for_the_working_set() {
    let mut h = Harness::new(1000, &[("a", 300), ("b", 300), ("w", 200)]);
    let w = h.id("w");
    h.s.learn_transient(w, 300 * MB);
    h.call_a_second_apart(&["a", "b"]);
    h.at(2.0);
    let req = h.use_model("w").unwrap();
    assert_eq!(
        h.evictions(),
        ["a"],
        "200 MB of weights fit beside a and b, but not the 300 MB its waiting request runs with"
    );
    assert!(h.s.accounted(&Device::Cpu) <= 1000 * MB);
    h.finish(req);
}

#[test]
fn a_working_set_larger_than_the_budget_still_runs() {
    let mut h = Harness::new(500, &[("w", 100), ("x", 100)]);
    h.call("x").unwrap();
    let w = h.id("w");
    h.s.learn_transient(w, 900 * MB);
    h.at(1.0);
    let req = h.use_model("w").expect("not refused: the budget cannot give more, the run gets what there is");
    assert_eq!(h.evictions(), ["x"], "everything idle made room");
    h.finish(req);
}

#[test]
fn a_configured_memory_is_the_model_s_word_no_working_set_is_learned() {
    let mut h = Harness::with(1000, &[("fixed", 100)], |p| p.memory = Some(100 * MB));
    let id = h.id("fixed");
    assert_eq!(h.s.learn_transient(id, 500 * MB), None);
    assert_eq!(h.s.slot(id).working_bytes, 0);
}

#[test]
fn what_runs_left_counts_once_the_most_one_run_left_until_the_next_load() {
    let mut h = Harness::new(1000, &[("m", 100)]);
    let footprint = |h: &Harness| h.s.holding(&Device::Cpu)[0].1;
    for (i, kept) in [60, 40, 80, 80].into_iter().enumerate() {
        h.at(i as f64);
        let req = h.use_model("m").unwrap();
        finish_measured(&mut h, req, kept * MB, 0);
    }
    assert_eq!(footprint(&h), 180 * MB, "100 MB loaded + 80 MB, the most one run left (not 360)");
    h.at(10.0);
    let m = h.id("m");
    let a = h.feed(Event::Unload { req: 900, model: m });
    h.settle(a);
    assert_eq!(h.state("m"), StateName::Unloaded);
    h.at(11.0);
    let (req, _) = h.submit("m");
    let a = h.feed(Event::LoadFinished {
        model: m,
        result: Ok(LoadMeasurement { steady: Some(100 * MB), peak: None, working: 0 }),
        took: Duration::from_millis(5),
    });
    h.settle(a);
    finish_measured(&mut h, req, 30 * MB, 0);
    assert_eq!(footprint(&h), 130 * MB, "a fresh load starts from its own measure again");
}

#[test]
fn a_working_set_that_cannot_fit_beside_another_in_use_waits_for_it_instead_of_evicting() {
    // Two long jobs' models, 450 MB of work each, and two idle small models: running
    // both at once would take every idle model; one after the other takes none.
    let mut h = Harness::new(1000, &[("long1", 100), ("long2", 100), ("s1", 50), ("s2", 50)]);
    h.call_a_second_apart(&["s1", "s2", "long1", "long2"]);
    let (l1, l2) = (h.id("long1"), h.id("long2"));
    h.s.learn_transient(l1, 450 * MB);
    h.s.learn_transient(l2, 450 * MB);
    h.at(5.0);
    let first = h.use_model("long1").unwrap();
    h.at(5.1);
    let (second, a) = h.submit("long2");
    h.settle(a);
    assert_eq!(h.outcome(second), None, "750 MB in use: 450 more fit neither free nor by evicting 100 MB");
    assert!(h.evictions().is_empty(), "{:?}", h.evictions());
    h.at(6.0);
    h.finish(first);
    assert_eq!(h.outcome(second), Some(Ok(())), "its turn once the first one's run ended");
    assert!(h.evictions().is_empty(), "{:?}", h.evictions());
    assert!(h.s.accounted(&Device::Cpu) <= 1000 * MB);
}

#[test]
fn a_large_model_asked_for_once_goes_before_a_small_one_asked_for_often() {
    // Least recently used would evict "hot" (last used at 1.0 s, before "big" at 1.5 s):
    // but it is asked for twenty times a second and holds 14 MB, "big" was asked for once
    // and holds 100 MB, and both cost as much to bring back.
    let mut h = Harness::new(200, &[("hot", 14), ("big", 100), ("x", 100)]);
    for i in 0..=20 {
        h.at(f64::from(i) * 0.05);
        h.call("hot").unwrap();
    }
    h.at(1.5);
    h.call("big").unwrap();
    h.at(2.0);
    h.call("x").unwrap();
    assert_eq!(h.evictions(), ["big"]);
    assert_eq!(h.state("hot"), StateName::Ready);
}

#[test]
fn a_load_evicts_no_model_that_the_others_make_room_without() {
    // Worth order: "old" (asked for once), "hot" (14 MB, twenty times a second, quick to
    // reload), "slow" (150 MB, a second to reload). "new" needs 164 MB more than is free:
    // "old" and "hot" (114 MB) fall short, "slow" covers it, and so would "old" and "slow"
    // alone. Measured in the mix: `mlp-10m` went with a `mlp-100m` and Whisper for a load
    // those two made room for, and its next requests waited for its reload.
    let mut h = Harness::new(300, &[("old", 100), ("hot", 14), ("slow", 150), ("new", 200)]);
    let (req, a) = h.submit("slow");
    h.settle_loading_in(a, Duration::from_secs(1));
    h.finish(req);
    h.at(0.5);
    h.call("old").unwrap();
    for i in 0..=20 {
        h.at(1.0 + f64::from(i) * 0.05);
        h.call("hot").unwrap();
    }
    h.at(2.0);
    h.call("slow").unwrap();
    h.at(2.05);
    h.call("new").unwrap();
    assert_eq!(h.evictions(), ["old", "slow"]);
    assert_eq!(h.state("hot"), StateName::Ready);
}

#[test]
fn a_model_asked_for_while_a_long_load_would_run_is_not_evicted_for_it() {
    // "cold" takes a second to bring back, "hot" 10 ms: by load times alone "hot" goes.
    // But "slow" loads in 2 s, one load runs at a time, and "hot" is asked for every
    // 50 ms: evicted for "slow", its next requests would wait the 2 s for its reload.
    let mut h = Harness::new(250, &[("slow", 100), ("hot", 100), ("cold", 100)]);
    let slow = h.id("slow");
    let (req, a) = h.submit("slow");
    h.settle_loading_in(a, Duration::from_secs(2));
    h.finish(req);
    let a = h.feed(Event::Unload { req: 900, model: slow });
    h.settle(a);
    h.at(10.0);
    let (req, a) = h.submit("cold");
    h.settle_loading_in(a, Duration::from_secs(1));
    h.finish(req);
    for i in 0..=20 {
        h.at(10.5 + f64::from(i) * 0.05);
        h.call("hot").unwrap();
    }
    h.at(11.55);
    h.call("slow").unwrap();
    assert_eq!(h.evictions(), ["cold"]);
    assert_eq!(h.state("hot"), StateName::Ready);
}

/// Submits one request of `name` whose work says its size, and lets loads run.
fn submit_sized(h: &mut Harness, name: &str, class: u8, units: u64) -> RequestId {
    let (req, a) = h.submit_sized(name, 7, WorkSize::new(class, units));
    h.settle(a);
    req
}

#[test]
fn a_run_holds_what_its_kind_of_work_measured_per_unit_not_the_model_s_largest_run() {
    // A transcription: one encoder pass (class 1) holds 600 MB, a decoder step (class 0)
    // 4 MB per live hypothesis. Holding 600 MB for each of its hundred steps would evict
    // "small" for the whole transcription.
    let mut h = Harness::new(1000, &[("w", 300), ("small", 200)]);
    let w = h.id("w");
    h.call("small").unwrap();
    h.at(1.0);
    let encode = submit_sized(&mut h, "w", 1, 1);
    assert_eq!(h.outcome(encode), Some(Ok(())));
    assert_eq!(h.s.learn_sized(w, 600 * MB, &[encode]), Some((1, (600 * MB) as f64)));
    h.s.learn_transient(w, 600 * MB);
    h.finish(encode);

    h.at(2.0);
    let step = submit_sized(&mut h, "w", 0, 2);
    assert_eq!(h.outcome(step), Some(Ok(())));
    assert_eq!(h.s.slot(w).working_reserved(), 600 * MB, "a kind never measured holds the largest run");
    assert_eq!(h.evictions(), ["small"], "300 + 200 + 600 MB is over the budget");
    assert_eq!(h.s.learn_sized(w, 8 * MB, &[step]), Some((0, (4 * MB) as f64)));
    h.finish(step);
    h.at(3.0);
    h.call("small").unwrap();

    h.at(4.0);
    let steps = submit_sized(&mut h, "w", 0, 3);
    assert_eq!(h.outcome(steps), Some(Ok(())));
    assert_eq!(h.s.slot(w).working_reserved(), 12 * MB, "three hypotheses at 4 MB each");
    assert_eq!(h.evictions(), ["small"], "nothing more evicted for a step");
    assert_eq!(h.s.accounted(&Device::Cpu), 512 * MB);
    h.finish(steps);
    assert_eq!(h.s.slot(w).working_reserved(), 0, "given back when the run ends");

    h.at(5.0);
    let encode = submit_sized(&mut h, "w", 1, 1);
    assert_eq!(h.outcome(encode), Some(Ok(())));
    assert_eq!(h.s.slot(w).working_reserved(), 600 * MB);
    assert_eq!(h.evictions(), ["small", "small"], "the next encoder pass holds its 600 MB again");
    h.finish(encode);
}

/// A detector of 50 MB beside two idle models of 300 MB each, in a budget of 1000 MB.
fn detector_beside_two_models() -> (Harness, ModelId) {
    let mut h = Harness::new(1000, &[("det", 50), ("a", 300), ("b", 300)]);
    let det = h.id("det");
    h.call_a_second_apart(&["a", "b"]);
    h.at(2.0);
    (h, det)
}

#[test]
fn a_page_s_working_set_follows_its_pixels() {
    let (mut h, det) = detector_beside_two_models();
    let large = submit_sized(&mut h, "det", 0, 1_000_000);
    assert_eq!(h.s.learn_sized(det, 400 * MB, &[large]), Some((0, 400.0 * MB as f64 / 1e6)));
    h.s.learn_transient(det, 400 * MB);
    h.finish(large);

    h.at(3.0);
    let small = submit_sized(&mut h, "det", 0, 250_000);
    assert_eq!(h.outcome(small), Some(Ok(())));
    assert_eq!(
        h.s.slot(det).working_reserved(),
        100 * MB,
        "a quarter of the pixels, a quarter of the memory"
    );
    assert!(h.evictions().is_empty(), "650 + 100 MB fit: {:?}", h.evictions());
    h.finish(small);

    h.at(4.0);
    let large = submit_sized(&mut h, "det", 0, 1_000_000);
    assert_eq!(h.outcome(large), Some(Ok(())));
    assert_eq!(h.evictions(), ["a"], "650 + 400 MB do not");
    h.finish(large);
}

#[test]
fn a_page_is_held_at_what_the_nearest_measured_pages_bound_it_by_not_the_highest_rate_times_its_size() {
    // The mix's detector: a letter-size page (810k px) held 160 MiB, a small crop read at
    // 4128 x 736 (3.04M px) 447 MiB. At the letter page's rate the crop was held at 600
    // MiB, and the light models stayed out of memory for the 2 s it ran.
    let mut h = Harness::new(1000, &[("det", 50), ("a", 300)]);
    let det = h.id("det");
    h.call("a").unwrap();
    let held = |h: &mut Harness, t: f64, units: u64, measured: Option<u64>| {
        h.at(t);
        let page = submit_sized(h, "det", 0, units);
        assert_eq!(h.outcome(page), Some(Ok(())));
        let reserved = h.s.slot(det).working_reserved();
        if let Some(bytes) = measured {
            h.s.learn_sized(det, bytes, &[page]);
        }
        h.finish(page);
        reserved
    };
    held(&mut h, 1.0, 810_000, Some(160 * MB));
    let scaled = (160.0 * MB as f64 * 3_040_000.0 / 810_000.0).ceil() as u64;
    assert_eq!(held(&mut h, 2.0, 3_040_000, Some(447 * MB)), scaled, "scaled up from the only page measured");
    assert_eq!(held(&mut h, 3.0, 3_040_000, None), 447 * MB, "what that size measured");
    let between = (160.0 * MB as f64 * 2_000_000.0 / 810_000.0).ceil() as u64;
    assert_eq!(held(&mut h, 4.0, 2_000_000, None), between, "the page below scaled up: under 447 MiB");
    let larger = (447.0 * MB as f64 * 4_000_000.0 / 3_040_000.0).ceil() as u64;
    assert_eq!(
        held(&mut h, 5.0, 4_000_000, None),
        larger,
        "scaled from the largest page, not the letter page"
    );
    let rate = 160.0 * MB as f64 / 810_000.0;
    let smaller = (rate * 400_000.0).ceil() as u64;
    assert_eq!(held(&mut h, 6.0, 400_000, None), smaller, "below every page measured: the highest rate");
    assert!(h.evictions().is_empty(), "{:?}", h.evictions());

    // Runs are noisy: a larger input that measured less than a smaller one is held at
    // the smaller one's (more units never hold less).
    held(&mut h, 7.0, 1_500_000, Some(150 * MB));
    assert_eq!(held(&mut h, 8.0, 1_500_000, None), 160 * MB);
}

#[test]
fn a_first_page_holds_its_own_prior_until_its_kind_of_work_is_measured() {
    // A detector never run declares no working set: its first page held nothing for
    // activations of hundreds of MiB, and the process went past a byte budget.
    let (mut h, det) = detector_beside_two_models();
    let size = WorkSize { prior_bytes_per_unit: 400, ..WorkSize::new(0, 1_000_000) };
    let (first, a) = h.submit_sized("det", 7, size);
    h.settle(a);
    assert_eq!(h.outcome(first), Some(Ok(())));
    assert_eq!(h.s.slot(det).working_reserved(), 400_000_000, "a million pixels at its prior");
    assert_eq!(h.evictions(), ["a"], "650 MB + 400 MB do not fit in 1000");
    // What the run measured replaces the prior.
    assert_eq!(h.s.learn_sized(det, 100 * MB, &[first]), Some((0, 100.0 * MB as f64 / 1e6)));
    h.finish(first);
    h.at(3.0);
    let (second, a) = h.submit_sized("det", 7, size);
    h.settle(a);
    assert_eq!(h.outcome(second), Some(Ok(())));
    assert_eq!(h.s.slot(det).working_reserved(), 100 * MB);
    h.finish(second);
}

#[test]
fn only_runs_of_one_kind_of_work_that_said_its_size_teach_a_rate() {
    let mut h = Harness::with(1000, &[("m", 100)], |p| p.max_batch_size = 8);
    let m = h.id("m");
    h.at(1.0);
    let unsized_req = h.use_model("m").unwrap();
    assert_eq!(h.s.learn_sized(m, 50 * MB, &[unsized_req]), None, "a request that said nothing");
    h.finish(unsized_req);
    // Two requests queued while the model is away run as one batch of two kinds.
    h.at(2.0);
    let a = h.feed(Event::Unload { req: 900, model: m });
    h.settle(a);
    let (mut sized, mut actions) = (Vec::new(), Vec::new());
    for class in [0, 1] {
        let (req, a) = h.submit_sized("m", 7, WorkSize::new(class, 1));
        actions.extend(a);
        sized.push(req);
    }
    h.settle(actions);
    assert_eq!(h.batch_of(sized[0]).map(|(_, reqs, _)| reqs), Some(sized.clone()));
    assert_eq!(h.s.learn_sized(m, 50 * MB, &sized), None, "a batch of two kinds says nothing of either");
    h.finish(sized[0]);
    assert!(h.s.slot(m).working_curves.is_empty());

    let mut fixed = Harness::with(1000, &[("fixed", 100)], |p| p.memory = Some(100 * MB));
    let id = fixed.id("fixed");
    let req = submit_sized(&mut fixed, "fixed", 0, 10);
    assert_eq!(fixed.s.learn_sized(id, 50 * MB, &[req]), None, "the config's word stands");
}

#[test]
fn a_working_set_within_the_headroom_does_not_wait_for_a_long_job() {
    // "job" runs with 650 MB of work: 950 of 1000 MB stay in use while it runs. "light"
    // runs with 20 MB, within the 64 MB of headroom: it runs beside the job at once.
    // "big" needs 100 MB: it waits for the job, as before.
    let mut h = Harness::new(1000, &[("job", 300), ("light", 10), ("big", 10)]);
    h.s.config.headroom = 64 * MB;
    h.call_a_second_apart(&["light", "big", "job"]);
    let (job, light, big) = (h.id("job"), h.id("light"), h.id("big"));
    h.s.learn_transient(job, 650 * MB);
    h.s.learn_transient(light, 20 * MB);
    h.s.learn_transient(big, 100 * MB);
    h.at(5.0);
    let running = h.use_model("job").unwrap();
    h.at(5.1);
    let (quick, a) = h.submit("light");
    h.settle(a);
    assert_eq!(h.outcome(quick), Some(Ok(())), "20 MB fits the headroom: no wait for the job");
    let (large, a) = h.submit("big");
    h.settle(a);
    assert_eq!(h.outcome(large), None, "100 MB waits for the job's run to end");
    h.finish(quick);
    h.at(6.0);
    h.finish(running);
    assert_eq!(h.outcome(large), Some(Ok(())));
}

/// Two long-work models and two light ones resident in 1000 MB: a page's slice (450 MB
/// of work) submitted at 5.0 s, then a transcription's encoder pass (300 MB) at 5.1 s.
fn a_page_then_an_encoder_pass() -> (Harness, RequestId, RequestId) {
    let mut h = Harness::new(1000, &[("det", 100), ("asr", 100), ("s1", 50), ("s2", 50)]);
    h.call_a_second_apart(&["s1", "s2", "det", "asr"]);
    h.at(5.0);
    let page = WorkSize { prior_bytes_per_unit: 450, ..WorkSize::new(0, 1_000_000) };
    let (first, a) = h.submit_sized("det", 7, page);
    h.settle(a);
    h.at(5.1);
    let pass = WorkSize { prior_bytes_per_unit: 300, ..WorkSize::new(1, 1_000_000) };
    let (second, a) = h.submit_sized("asr", 8, pass);
    h.settle(a);
    (h, first, second)
}

#[test]
fn a_slice_of_long_work_waits_for_another_rather_than_evict_idle_models() {
    // A page (450 MB of work) runs; a transcription's encoder pass (300 MB) would fit by
    // evicting the two light models asked for between them. It waits for the page's run
    // instead: side by side they only share the cores, and the light models' next
    // requests would wait for their reloads' room until the page ended.
    let (mut h, first, second) = a_page_then_an_encoder_pass();
    assert_eq!(h.outcome(first), Some(Ok(())));
    assert_eq!(h.outcome(second), None, "750 MB in use: 300 more fit only by evicting");
    assert!(h.evictions().is_empty(), "{:?}", h.evictions());
    h.at(6.0);
    h.finish(first);
    assert_eq!(h.outcome(second), Some(Ok(())), "its turn once the page's run ended");
    assert!(h.evictions().is_empty(), "550 MB in use: nothing to evict: {:?}", h.evictions());
    h.finish(second);
    // With no other slice running, a slice evicts what it must.
    h.at(7.0);
    let big = WorkSize { prior_bytes_per_unit: 750, ..WorkSize::new(0, 1_000_000) };
    let (alone, a) = h.submit_sized("det", 7, big);
    h.settle(a);
    assert_eq!(h.outcome(alone), Some(Ok(())));
    assert_eq!(h.evictions().len(), 1, "{:?}", h.evictions());
}

#[test]
fn a_slice_waits_for_another_at_most_slice_wait_then_evicts() {
    // Long work beside long work that never pauses is not starved: past SLICE_WAIT from
    // when it was queued, the slice runs, evicting what it must.
    let (mut h, long, waiting) = a_page_then_an_encoder_pass();
    assert_eq!(h.outcome(waiting), None);
    h.at(5.1 + SLICE_WAIT.as_secs_f64() - 0.01);
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.outcome(waiting), None, "still within its wait");
    h.at(5.1 + SLICE_WAIT.as_secs_f64());
    let a = h.tick();
    h.settle(a);
    assert_eq!(h.outcome(waiting), Some(Ok(())), "its wait is over: it runs beside the page");
    assert_eq!(h.evictions().len(), 1, "making room for 300 MB: {:?}", h.evictions());
    h.finish(long);
}

#[test]
fn a_size_curve_keeps_few_points_and_never_holds_a_measured_size_at_less_than_it_measured() {
    // Pages of many sizes (activations: a fixed part plus a part per pixel).
    let mut curve = crate::lifecycle::working::SizeCurve::default();
    let mut seen = Vec::new();
    let mut units = 100_000u64;
    for i in 0..40u64 {
        units = units * 23 / 20 + i; // 40 sizes, 1.15x apart
        let bytes = 50 * MB + 130 * units + (i % 3) * MB; // with noise
        curve.learn(units, bytes);
        seen.push((units, bytes));
        for &(u, b) in &seen {
            assert!(curve.predict(u) >= b, "{u} units measured {b}, held at {}", curve.predict(u));
        }
    }
    assert!(curve.points().len() <= 16, "{} points", curve.points().len());
}
