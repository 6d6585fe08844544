//! The real binary, real ONNX Runtime, real 100 MB models, real sockets: a budget
//! that holds two of six models, a scripted request sequence, and the exact loads and
//! LRU evictions it must cause — plus the refusals that must evict nobody.

mod common;

use common::*;
use serde_json::{json, Value};

/// Six 100 MB models with `memory = "100MiB"` (so the accounting is exact), a budget
/// of 300 MiB (the server's own ~30-60 MB baseline leaves room for two), a model
/// bigger than the budget, and a corrupt one.
fn config() -> String {
    let dir = models_dir();
    let mut c = String::from(
        "[server]\nhost_memory_limit = \"300MiB\"\nheadroom = \"0\"\nkeep_alive = \"-1\"\nmin_residency = \"0s\"\n",
    );
    for i in 1..=6 {
        c += &format!(
            "[models.m{i}]\npath = \"{}/mlp-100m-{i}\"\nmemory = \"100MiB\"\nweights = \"mapped\"\n",
            dir.display()
        );
    }
    c += &format!("[models.big]\npath = \"{}/mlp-400m\"\n", dir.display());
    c += &format!(
        "[models.broken]\npath = \"{}/test/corrupt/model.onnx\"\nmemory = \"100MiB\"\n",
        dir.display()
    );
    c
}

fn ready_models(s: &Server) -> Vec<String> {
    let (_, v) = s.get("/admin/models");
    let mut names: Vec<String> = v["models"]
        .as_array()
        .expect("models")
        .iter()
        .filter(|m| m["state"] == "ready")
        .map(|m| m["name"].as_str().expect("name").to_string())
        .collect();
    names.sort();
    names
}

fn counts(s: &Server, field: &str) -> Vec<(String, u64)> {
    let (_, v) = s.get("/admin/models");
    v["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| (m["name"].as_str().expect("name").to_string(), m[field].as_u64().expect("count")))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Infers on `model` (an alias of `mlp-100m-N`) and checks the output against numpy.
fn call(s: &Server, model: &str) {
    let n = model.trim_start_matches('m');
    let r = reference(&format!("mlp-100m-{n}"));
    let (status, body, _) = s.post(&format!("/v2/models/{model}/infer"), &infer_body(&r));
    assert_eq!(status, 200, "{model}: {body}");
    assert_eq!(body["model_name"], model);
    let out = &body["outputs"][0];
    assert_eq!((out["name"].as_str(), out["datatype"].as_str()), (Some("y"), Some("FP32")));
    assert_eq!(out["shape"], json!(r.shape));
    let diff = max_abs_diff(&floats(&out["data"]), &r.output);
    assert!(diff <= 1e-4, "{model}: output differs from numpy by {diff}");
}

/// `snooze prepare` of m1..m6 into `state`: each loads from its ORT-format copy. Eviction
/// goes by worth (reload cost over request interval), which is LRU only among models that
/// cost the same to bring back; from a fresh state dir one model's copy may be made in the
/// background before its first load (a 1 ms load) and the next one's by its load (~60 ms),
/// and the script's LRU order would then depend on that race (seen once in a CI rehearsal).
/// Serving from a fresh state dir is `prepare.rs`'s subject.
fn prepare(state: &std::path::Path) {
    let dir = std::env::temp_dir().join(format!("snooze-lru-prepare-{}.toml", std::process::id()));
    let six = config();
    let six = &six[..six.find("[models.big]").expect("the six models come first")];
    std::fs::write(&dir, six).expect("config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_snooze"))
        .arg("prepare")
        .arg("--config")
        .arg(&dir)
        .arg("--state-dir")
        .arg(state)
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .expect("run snooze prepare");
    let _ = std::fs::remove_file(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for i in 1..=6 {
        assert!(stdout.contains(&format!("m{i}: prepared (mapped)")), "{stdout}");
    }
}

#[test]
fn lru_evictions_refusals_and_memory_given_back() {
    let state = std::env::temp_dir().join(format!("snooze-lru-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    prepare(&state);
    let state_arg = state.to_str().expect("utf-8 temp dir");
    let s = Server::start("lru", &config(), &["--state-dir", state_arg]);
    let rss_before = s.rss();

    // (pause before it, request, models resident after it): budget for two, LRU evicted.
    // Eviction weighs a model's reload cost (its load plus its first run, measured once
    // and noisy: page faults on a busy machine made one 100 MB model's first run cost over
    // twice another's in a CI run) against how often it is asked for. With even pauses
    // the models' intervals differ only 2x at each eviction, whatever the pause, and that
    // noise could decide; these pauses make the LRU's victim's interval 20x the other's
    // or more (a long pause, then a short one, then the request that evicts): a first
    // run of ~5 ms would have to take over 100 ms to reverse it.
    let (short, medium, long) = (0, 200, 4_000);
    let script: &[(u64, &str, &[&str])] = &[
        (short, "m1", &["m1"]),
        (short, "m2", &["m1", "m2"]),
        (long, "m1", &["m1", "m2"]),
        (medium, "m3", &["m1", "m3"]), // m2 is the LRU: asked for 4.2 s ago, m1 0.2 s
        (short, "m4", &["m3", "m4"]),  // m1 now: 0.2 s ago, m3 just now
        (long, "m3", &["m3", "m4"]),
        (medium, "m5", &["m3", "m5"]), // m4: 4.2 s ago, m3 0.2 s
        (short, "m6", &["m5", "m6"]),  // m3: 0.2 s ago, m5 just now
    ];
    for (step, (pause, model, resident)) in script.iter().enumerate() {
        std::thread::sleep(std::time::Duration::from_millis(*pause));
        call(&s, model);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        while ready_models(&s) != *resident {
            if std::time::Instant::now() > deadline {
                let (_, models) = s.get("/admin/models");
                let (_, events) = s.get("/admin/events");
                panic!(
                    "step {step} ({model}): resident {:?}, want {resident:?}\nmodels: {models}\nevents: {events}\nlogs: {:?}",
                    ready_models(&s),
                    s.logs.lock().expect("logs")
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let loads = counts(&s, "loads");
    let want: Vec<(String, u64)> = (1..=6).map(|i| (format!("m{i}"), 1)).collect();
    assert_eq!(loads, want, "each model loaded exactly once");
    // The events, numbered: `after` a seq gives exactly the ones after it.
    let (_, all) = s.get("/admin/events");
    let all = all["events"].as_array().expect("events").clone();
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().expect("seq")).collect();
    assert!(seqs.len() >= 10 && seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let (_, rest) = s.get(&format!("/admin/events?after={}", seqs[3]));
    let rest = rest["events"].as_array().expect("events");
    assert!(rest.len() >= all.len() - 4, "after={}: {rest:?}", seqs[3]);
    assert_eq!(rest[..all.len() - 4], all[4..], "after={}", seqs[3]);
    let mut evictions = counts(&s, "evictions");
    evictions.sort();
    assert_eq!(evictions, [("m1".into(), 1), ("m2".into(), 1), ("m3".into(), 1), ("m4".into(), 1)]);
    let m5 = s.model("m5");
    assert!(m5["footprint_measured_bytes"].as_u64().unwrap_or(0) > 50 << 20, "footprint measured: {m5}");
    assert!(m5["last_load_ms"].as_u64().is_some() && m5["last_used"].is_string(), "{m5}");
    assert_eq!(m5["unload_at"], Value::Null, "keep_alive = -1");

    // Larger than the whole budget: 503 + Retry-After, nobody evicted.
    let big = reference("mlp-400m");
    let (status, body, retry) = s.post("/v2/models/big/infer", &infer_body(&big));
    assert_eq!(status, 503, "{body}");
    assert!(retry.as_ref().is_some_and(|r| r.parse::<u64>().is_ok_and(|n| n >= 1)), "Retry-After: {retry:?}");
    let msg = body["error"].as_str().expect("error text");
    assert!(msg.contains("needs") && msg.contains("budget"), "{msg}");
    assert_eq!(ready_models(&s), ["m5", "m6"]);

    // Corrupt file: fails fast with a clear error, evicts nobody — although making room
    // for its 100 MiB would have needed an eviction.
    let (status, body, _) = s.post("/v2/models/broken/infer", &infer_body(&reference("mlp-100m-1")));
    assert_eq!(status, 500, "{body}");
    let msg = body["error"].as_str().expect("error text");
    assert!(msg.contains("broken") && msg.contains("corrupt"), "{msg}");
    assert_eq!(ready_models(&s), ["m5", "m6"]);
    assert_eq!(counts(&s, "evictions").len(), 4);
    let (status, _) = s.get("/v2/models/broken");
    assert_eq!(status, 500, "metadata of an unreadable model is an error");
    // Not ready, and the admin view says why.
    let (status, body) = s.get("/v2/models/broken/ready");
    assert_eq!(status, 503, "an unreadable model is not ready: {body}");
    let (_, models) = s.get("/admin/models");
    let broken = models["models"].as_array().expect("models").iter().find(|m| m["name"] == "broken").cloned();
    let broken = broken.expect("broken listed");
    assert_eq!(broken["state"], "failed", "{broken}");
    assert!(broken["last_error"].as_str().is_some_and(|e| e.contains("corrupt")), "{broken}");

    // Unknown model, wrong shape, wrong datatype, unknown input / output.
    let (status, body, _) = s.post("/v2/models/nope/infer", &infer_body(&reference("mlp-100m-1")));
    assert_eq!((status, body["code"].as_str()), (404, Some("model_not_found")));
    let bad_shape =
        json!({"inputs": [{"name": "x", "shape": [2, 128], "datatype": "FP32", "data": vec![0.0; 256]}]});
    let (status, body, _) = s.post("/v2/models/m5/infer", &bad_shape);
    assert_eq!(status, 400);
    assert!(body["error"].as_str().expect("error").contains("'x'"), "{body}");
    let bad_type =
        json!({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "INT32", "data": vec![0; 256]}]});
    let (status, body, _) = s.post("/v2/models/m5/infer", &bad_type);
    assert!(status == 400 && body["error"].as_str().expect("error").contains("FP32"), "{body}");
    let bad_output = json!({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": vec![0.0; 256]}],
        "outputs": [{"name": "z"}]});
    let (status, body, _) = s.post("/v2/models/m5/infer", &bad_output);
    assert!(status == 400 && body["error"].as_str().expect("error").contains("'z'"), "{body}");
    let (status, _, _) = s.post("/v2/models/m5/infer", &json!({"inputs": "nope"}));
    assert_eq!(status, 400);

    // Unload everything through the repository API: memory comes back.
    for m in ["m5", "m6"] {
        let (status, body, _) = s.post(&format!("/v2/repository/models/{m}/unload"), &json!({}));
        assert_eq!(status, 200, "{body}");
    }
    assert!(ready_models(&s).is_empty());
    let rss_after = s.rss();
    let allowed = (rss_before / 10).max(30 << 20);
    eprintln!(
        "RSS before the first load {} MiB, after unloading everything {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    assert!(
        rss_after <= rss_before + allowed,
        "RSS {} MiB after unloading, {} MiB before the first load",
        rss_after >> 20,
        rss_before >> 20
    );

    // Logs: one line per load and per eviction, with model, bytes, reason and duration.
    let evicted = s.log_lines("Evicted");
    assert_eq!(evicted.len(), 4, "{evicted:?}");
    for line in &evicted {
        let v: Value = serde_json::from_str(line).expect("json log line");
        assert!(v["model"].is_string() && v["bytes"].is_u64() && v["duration_ms"].is_u64(), "{line}");
    }
    assert_eq!(s.log_lines("\"model loaded").len(), 6);
    assert!(!s.log_lines("request refused").is_empty(), "the 503 is logged");
    let twice: Vec<String> =
        s.log_lines("request failed").into_iter().filter(|l| l.contains("insufficient_memory")).collect();
    assert!(twice.is_empty(), "each refusal is logged once, by the core: {twice:?}");
    let status = s.terminate();
    assert!(status.success(), "exit status {status:?}");
    // 1.2 GB of converted copies: not left for every run.
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn repository_api_and_metadata() {
    let s = Server::start("repo", &config(), &[]);
    // An empty body must be accepted, as must {"ready": true}.
    let r = client().post(s.url("/v2/repository/index")).send().expect("index");
    assert_eq!(r.status(), 200);
    let index: Value = r.json().expect("json");
    assert_eq!(index.as_array().expect("array").len(), 8);
    assert!(index.as_array().expect("array").iter().all(|m| m["state"] == "UNAVAILABLE"));
    let (status, body, _) = s.post("/v2/repository/models/m2/load", &json!({}));
    assert_eq!(status, 200, "{body}");
    let (_, ready, _) = s.post("/v2/repository/index", &json!({"ready": true}));
    assert_eq!(ready, json!([{"name": "m2", "version": "1", "state": "READY", "reason": ""}]));
    assert_eq!(s.model("m2")["leases"], 0);

    let (status, meta) = s.get("/v2/models/m3/versions/1");
    assert_eq!(status, 200);
    assert_eq!(meta["inputs"], json!([{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]));
    assert_eq!(meta["outputs"], json!([{"name": "y", "datatype": "FP32", "shape": [-1, 256]}]));
    assert_eq!(s.model("m3")["state"], "unloaded", "metadata did not load the model");
    assert_eq!(s.get("/v2/models/m3/versions/7").0, 404);
    assert_eq!(s.get("/v2/models/m3/ready").0, 200, "a sleeping model can take requests");
    assert_eq!(s.get("/v2/health/live").0, 200);
    assert_eq!(s.get("/v2/health/ready").0, 200);
    let (_, server) = s.get("/v2");
    assert!(server["extensions"].as_array().expect("extensions").contains(&json!("model_repository")));
    assert_eq!(s.post("/v2/repository/models/nope/load", &json!({})).0, 404);
}

#[test]
fn binary_tensor_data_round_trip_and_body_limit() {
    let s = Server::start("binary", &config(), &["--max-request-size", "1MiB"]);
    let r = reference("mlp-100m-1");
    let raw: Vec<u8> = r.input.iter().flat_map(|x| x.to_le_bytes()).collect();
    let header = json!({"inputs": [{"name": "x", "shape": r.shape, "datatype": "FP32",
        "parameters": {"binary_data_size": raw.len()}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": true}}]})
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend_from_slice(&raw);
    let resp = client()
        .post(s.url("/v2/models/m1/infer"))
        .header("Inference-Header-Content-Length", header.len())
        .header("Content-Type", "application/octet-stream")
        .body(body)
        .send()
        .expect("infer");
    assert_eq!(resp.status(), 200);
    let json_len: usize =
        resp.headers()["inference-header-content-length"].to_str().expect("ascii").parse().expect("n");
    let bytes = resp.bytes().expect("body");
    let head: Value = serde_json::from_slice(&bytes[..json_len]).expect("json head");
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 2 * 256 * 4);
    let out: Vec<f32> = bytes[json_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    assert!(max_abs_diff(&out, &r.output) <= 1e-4);

    // Over max_request_size: 413 with our error shape.
    let huge = json!({"inputs": [{"name": "x", "shape": [1024, 256], "datatype": "FP32", "data": vec![0.5; 1024 * 256]}]});
    let (status, body, _) = s.post("/v2/models/m1/infer", &huge);
    assert_eq!(status, 413, "{body}");
    assert!(body["error"].as_str().expect("error").contains("max_request_size"));
}

#[test]
fn every_datatype_round_trips_as_json() {
    let dir = models_dir();
    let cfg = format!("[models.types]\npath = \"{}/test/identity-all-types\"\n", dir.display());
    let s = Server::start("types", &cfg, &[]);
    let (_, meta) = s.get("/v2/models/types");
    let inputs = meta["inputs"].as_array().expect("inputs");
    assert_eq!(inputs.len(), 13);
    let sample = |dt: &str| -> Value {
        match dt {
            "BOOL" => json!([[true, false, true], [false, false, true]]),
            "BYTES" => json!([["a", "bc", ""], ["déjà", "x", "yz"]]),
            "FP16" | "FP32" | "FP64" => json!([[0.5, 1.5, -2.0], [3.25, 0.0, 8.0]]),
            "INT8" | "INT16" | "INT32" | "INT64" => json!([[-1, 2, -3], [4, -5, 6]]),
            _ => json!([[0, 1, 2], [3, 4, 250]]),
        }
    };
    let body = json!({"inputs": inputs.iter().map(|i| {
        let dt = i["datatype"].as_str().expect("datatype");
        json!({"name": i["name"], "shape": [2, 3], "datatype": dt, "data": sample(dt)})
    }).collect::<Vec<_>>()});
    let (status, resp, _) = s.post("/v2/models/types/infer", &body);
    assert_eq!(status, 200, "{resp}");
    let outputs = resp["outputs"].as_array().expect("outputs");
    assert_eq!(outputs.len(), 13);
    for out in outputs {
        let dt = out["datatype"].as_str().expect("datatype");
        let want: Vec<Value> = sample(dt)
            .as_array()
            .expect("rows")
            .iter()
            .flat_map(|r| r.as_array().expect("row").clone())
            .collect();
        assert_eq!(out["data"], json!(want), "{dt}");
        assert_eq!(out["shape"], json!([2, 3]));
    }
}

#[test]
fn a_model_file_replaced_on_disk_is_served_as_it_now_is_after_an_unload() {
    // A new version copied over the old one, then an `unload` through the repository
    // API: the signature, the estimate and what was learned of the old file were kept
    // from the start, so every request was refused against the wrong shape until a
    // restart.
    let folder = std::env::temp_dir().join(format!("snooze-it-replaced-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir_all(&folder).unwrap();
    let file = folder.join("model.onnx");
    std::fs::copy(models_dir().join("mlp-10m/model.onnx"), &file).unwrap();
    let config = format!("[models.m]\npath = \"{}\"\nkeep_alive = \"-1\"\n", folder.display());
    let s = Server::start("replaced", &config, &[]);
    let r = reference("mlp-10m");
    let (status, body, _) = s.post("/v2/models/m/infer", &infer_body(&r));
    assert_eq!(status, 200, "{body}");
    let before = s.model("m")["footprint_estimated_bytes"].as_u64().unwrap();

    std::fs::copy(models_dir().join("ocr-cls/model.onnx"), &file).unwrap();
    assert_eq!(s.post("/v2/repository/models/m/unload", &json!({})).0, 200);
    // The first request in the new file's shape: it was checked against the old one.
    let image = json!({"inputs": [{"name": "x", "shape": [1, 3, 48, 192], "datatype": "FP32", "data": vec![0.5; 3 * 48 * 192]}]});
    let (status, body, _) = s.post("/v2/models/m/infer", &image);
    assert_eq!(status, 200, "the new file's shape: {body}");
    let (_, meta) = s.get("/v2/models/m");
    assert_eq!(meta["inputs"][0]["shape"], json!([-1, 3, -1, -1]), "{meta}");
    assert_eq!(body["outputs"][0]["shape"], json!([1, 2]), "{body}");
    let (status, _, _) = s.post("/v2/models/m/infer", &infer_body(&r));
    assert_eq!(status, 400, "the old file's shape is refused");
    let after = s.model("m")["footprint_estimated_bytes"].as_u64().unwrap();
    // 10 MB of weights replaced by 0.6 MB (the runtime's own share stays).
    assert!(after + (8 << 20) < before, "estimated from the new file: {before} -> {after} bytes");
    assert_eq!(s.log_lines("the model's files changed since they were read").len(), 1);
    let _ = std::fs::remove_dir_all(&folder);
}
