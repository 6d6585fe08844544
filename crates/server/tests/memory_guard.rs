//! The promise, proven under a real kernel limit: inside a ~550 MB memory cgroup, with
//! six 100 MB models and eight concurrent clients, the server is never OOM-killed,
//! answers every request with the right output or 503 + Retry-After, and a client that
//! honours Retry-After gets everything served; nor under `auto` with a transcription
//! and OCR pages (models whose activations dwarf their weights). Also: load/unload
//! cycles do not leak, and measured footprints survive a restart. Where no memory cgroup can be made the
//! first test fails, saying why, unless `SNOOZE_ALLOW_SKIP=memory_guard` lets it skip.

#[path = "common/audio.rs"]
mod audio;
mod common;

#[path = "common/cgroup.rs"]
mod cgroup;

use std::{
    fs,
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use cgroup::Cgroup;
use common::*;
use serde_json::json;

/// A tiny seeded generator (xorshift64*), so the request mix is the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn never_oom_killed_under_a_real_memory_limit() {
    const LIMIT: u64 = 550 << 20;
    let Some(cg) = Cgroup::create_or_skip(LIMIT, "memory_guard") else { return };
    let dir = models_dir();
    let mut config = String::from(
        "[server]\nhost_memory_limit = \"auto\"\nretry_after = \"1s\"\nmin_residency = \"1s\"\n",
    );
    for i in 1..=6 {
        config += &format!("[models.m{i}]\npath = \"{}/mlp-100m-{i}\"\n", dir.display());
    }
    let mut s = cg.serve("guard", &config);
    let (_, admin) = s.get("/admin/models");
    let budget = admin["memory"]["budget_bytes"].as_u64().expect("budget");
    assert!(budget < LIMIT, "auto budget {budget} is below the cgroup limit");

    let refs: Vec<Reference> = (1..=6).map(|i| reference(&format!("mlp-100m-{i}"))).collect();
    let refused = AtomicUsize::new(0);
    let served = AtomicUsize::new(0);
    const CLIENTS: u64 = 8;
    const REQUESTS: usize = 25;
    let started = Instant::now();
    std::thread::scope(|scope| {
        for c in 0..CLIENTS {
            let (s, refs, refused, served) = (&s, &refs, &refused, &served);
            scope.spawn(move || {
                let http = client();
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
                for _ in 0..REQUESTS {
                    let m = (rng.next() % 6) as usize;
                    let body = infer_body(&refs[m]);
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        if tries > 200 {
                            let refusals = s.log_lines("refused");
                            panic!(
                                "request for m{} never served; last refusals: {:?}",
                                m + 1,
                                &refusals[refusals.len().saturating_sub(3)..]
                            );
                        }
                        let r = http
                            .post(s.url(&format!("/v2/models/m{}/infer", m + 1)))
                            .json(&body)
                            .send()
                            .expect("send");
                        match r.status().as_u16() {
                            200 => {
                                let v: serde_json::Value = r.json().expect("json");
                                let diff = max_abs_diff(&floats(&v["outputs"][0]["data"]), &refs[m].output);
                                assert!(diff <= 1e-4, "m{}: wrong output ({diff})", m + 1);
                                served.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            503 => {
                                let after: u64 = r.headers()["retry-after"]
                                    .to_str()
                                    .expect("ascii")
                                    .parse()
                                    .expect("seconds");
                                assert!(after >= 1);
                                refused.fetch_add(1, Ordering::Relaxed);
                                std::thread::sleep(Duration::from_secs(after));
                            }
                            other => panic!("m{}: unexpected status {other}: {:?}", m + 1, r.text()),
                        }
                    }
                }
            });
        }
    });
    let (_, admin) = s.get("/admin/models");
    let loads: u64 =
        admin["models"].as_array().expect("models").iter().map(|m| m["loads"].as_u64().unwrap_or(0)).sum();
    let evictions: u64 = admin["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| m["evictions"].as_u64().unwrap_or(0))
        .sum();
    eprintln!(
        "cgroup {} MiB: {} requests served, {} refusals (503) retried, {loads} loads, {evictions} evictions, \
         peak usage {} MiB, failcnt {}, oom_kill {}, {:.1}s",
        LIMIT >> 20,
        served.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        cg.peak() >> 20,
        cg.failcnt(),
        cg.oom_kills(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(served.load(Ordering::Relaxed), (CLIENTS as usize) * REQUESTS, "every request was served");
    assert_eq!(cg.oom_kills(), 0, "the kernel OOM-killed inside the cgroup");
    assert!(s.child.try_wait().expect("wait").is_none(), "the server is alive");
    assert!(evictions > 0, "the mix needed evictions: the limit was really binding");
    let status = s.terminate();
    assert!(status.success(), "{status:?}");
}

/// A transcription, then OCR pages, under `auto` in a memory cgroup (the mix
/// benchmark's warm-up, which was OOM-killed in a 928 MiB cgroup). Memory is bounded
/// there, so each run hands its activations back (`release_activations` defaults on) and
/// a page far larger than the ones before (`small.png`, 190 x 34 px, read at 4128 x 736
/// like rapidocr) is predicted from what the earlier pages really held. With arenas kept
/// (the default there before), the detector's arena, grown by the first page, hid what
/// the larger input needs from the working set the scheduler learned, beside Whisper's
/// and the recogniser's kept arenas: this sequence was OOM-killed on the crop at 650 and
/// at 700 MiB (the connection cut mid-request); released, it passes at 600 MiB too.
#[test]
fn a_transcription_then_ocr_pages_under_auto_in_a_cgroup_are_never_oom_killed() {
    const LIMIT: u64 = 700 << 20;
    let Some(cg) = Cgroup::create_or_skip(LIMIT, "memory_guard") else { return };
    let dir = models_dir();
    let config = format!(
        "[server]\nhost_memory_limit = \"auto\"\n\
         [models.ocr-det]\npath = \"{0}/ocr-det\"\n\
         [models.ocr-cls]\npath = \"{0}/ocr-cls\"\n\
         [models.ocr-rec]\npath = \"{0}/ocr-rec\"\n\
         [pipelines.ocr]\ndet = \"ocr-det\"\ncls = \"ocr-cls\"\nrec = \"ocr-rec\"\n\
         [models.whisper-tiny-en]\npath = \"{0}/whisper-tiny-en\"\n",
        dir.display()
    );
    let mut s = cg.serve("guard-ocr", &config);
    let heard = audio::transcribe(&s.base, "whisper-tiny-en", &audio::beckett().bytes(), &[]);
    assert_eq!(heard.status, 200, "{}", heard.text());
    let (_, admin) = s.get("/admin/models");
    assert_eq!(admin["memory"]["release_activations"], true, "memory is bounded by the cgroup: {admin}");
    let pages = repo_root().join("tests/fixtures/ocr_pages");
    for name in ["columns.png", "small.png", "fonts.png", "small.png"] {
        let bytes = fs::read(pages.join(name)).expect("fixture page");
        let (status, body) = audio::post_ocr(&s.base, &bytes, name, &[]);
        let alive = s.child.try_wait().expect("wait").is_none();
        assert!(alive, "the server died reading {name}; OOM kills: {}", cg.oom_kills());
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["pages"].as_array().map(Vec::len), Some(1), "{name}: {body}");
    }
    eprintln!(
        "cgroup {} MiB, a transcription then OCR pages: peak usage {} MiB (page cache included), failcnt {}, oom_kill {}",
        LIMIT >> 20,
        cg.peak() >> 20,
        cg.failcnt(),
        cg.oom_kills()
    );
    assert_eq!(cg.oom_kills(), 0, "the kernel OOM-killed inside the cgroup");
    let status = s.terminate();
    assert!(status.success(), "{status:?}");
}

#[test]
fn load_unload_cycles_do_not_grow_rss_and_footprints_survive_restart() {
    let dir = models_dir();
    let config = format!("[models.m]\npath = \"{}/mlp-100m-1\"\n", dir.display());
    let state = std::env::temp_dir().join(format!("snooze-cycles-state-{}", std::process::id()));
    let _ = fs::remove_dir_all(&state);
    let state_arg = state.to_str().expect("utf-8 path");
    let s = Server::start("cycles", &config, &["--state-dir", state_arg]);
    let cycle = |s: &Server| {
        assert_eq!(s.post("/v2/repository/models/m/load", &json!({})).0, 200);
        assert_eq!(s.post("/v2/repository/models/m/unload", &json!({})).0, 200);
    };
    cycle(&s);
    let first = s.rss();
    for _ in 1..200 {
        cycle(&s);
    }
    let last = s.rss();
    eprintln!("RSS after 1 load/unload cycle {} MiB, after 200 {} MiB", first >> 20, last >> 20);
    assert!(
        last < first + (30 << 20),
        "RSS grew from {} MiB to {} MiB over 200 cycles",
        first >> 20,
        last >> 20
    );
    assert_eq!(s.model("m")["loads"], 200);
    let measured = s.model("m")["footprint_measured_bytes"].as_u64().expect("measured");
    drop(s);

    // A restart with the same state dir admits by the measurement, before any load.
    assert!(state.join("footprints.json").exists());
    let s = Server::start("cycles2", &config, &["--state-dir", state_arg]);
    let m = s.model("m");
    assert_eq!(m["state"], "unloaded");
    assert!(m["footprint_measured_bytes"].as_u64().is_some_and(|b| b > 50 << 20), "{m}");
    eprintln!(
        "learned footprint {} MiB (last run measured {} MiB)",
        m["footprint_measured_bytes"].as_u64().unwrap_or(0) >> 20,
        measured >> 20
    );
    let learned = m["footprint_measured_bytes"].clone();
    let form = m["weights"].clone();
    drop(s);

    // A run that holds the weights another way (as another `weights` setting, or `auto`
    // under another budget, does) learns that form's footprint beside the first one's,
    // not over it: the next run in the first form is admitted by its own measurement
    // again. (`auto` holds this MLP `mapped`: its weights are panels.)
    assert_eq!(form, "mapped", "{m}");
    let other = format!("{config}weights = \"compact\"\n");
    let s = Server::start("cycles3", &other, &["--state-dir", state_arg]);
    assert_eq!(s.model("m")["footprint_measured_bytes"], serde_json::Value::Null, "not measured compact yet");
    cycle(&s);
    assert!(s.model("m")["footprint_measured_bytes"].as_u64().is_some());
    drop(s);
    let s = Server::start("cycles4", &config, &["--state-dir", state_arg]);
    let m = s.model("m");
    assert_eq!((&m["weights"], &m["footprint_measured_bytes"]), (&form, &learned), "{m}");
    drop(s);
    let _ = fs::remove_dir_all(&state);
}

#[test]
fn a_candle_model_is_said_to_hold_one_copy_under_any_budget() {
    // Candle copies the weights into its own tensors. `auto` said `prepacked` without a
    // budget and `mapped` under one, and the footprint learned under one was dropped
    // at a restart under the other (a model measured at 2 GiB refused at 370 MiB).
    let config = |server: &str| {
        format!(
            "[server]\n{server}\n[models.c]\nbackend = \"candle\"\npath = \"{}/minilm\"\n",
            models_dir().display()
        )
    };
    for (name, server) in [("candle-roomy", ""), ("candle-budget", "host_memory_limit = \"400MiB\"")] {
        let s = Server::start(name, &config(server), &[]);
        assert_eq!(s.model("c")["weights"], "compact", "{server}");
    }
}
