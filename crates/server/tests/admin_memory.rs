//! The memory admin API on the real binary: stats, gc, dump + `snooze dump diff`,
//! the admin token, and the pressure levels driven by real RSS readings.

mod common;

use std::{process::Command, time::Duration};

use common::*;
use serde_json::Value;

fn config(extra_server: &str) -> String {
    format!(
        "[server]\nmemory_check_interval = \"50ms\"\n{extra_server}\n[models.a]\npath = \"{0}/mlp-10m\"\n[models.b]\npath = \"{0}/mlp-100m-1\"\n[models.p]\npath = \"{0}/mlp-10m\"\npinned = true\n",
        models_dir().display()
    )
}

fn post_auth(s: &Server, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut r = client().post(s.url(path));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().expect("post");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn stats_gc_dump_and_the_admin_token() {
    let s = Server::start("admin-mem", &config("admin_token = \"s3cret\""), &[]);
    // Admin writes and admin reads need the token; inference and metadata do not.
    assert_eq!(post_auth(&s, "/v2/repository/models/a/load", None).0, 401);
    for path in ["/admin/models", "/admin/memory/stats", "/admin/memory/dump"] {
        let (status, body) = s.get(path);
        assert_eq!((status, body["code"].as_str()), (401, Some("unauthorized")), "{path}");
    }
    assert_eq!(s.get("/v2/models/a").0, 200);
    let s = s.with_token("s3cret");
    // `auto`: activations are kept in each model's arena on a whole machine, handed back
    // after each run under a memory cgroup's limit (memory_guard.rs runs one).
    let memory = &s.get("/admin/models").1["memory"];
    let bounded = memory["limit_source"] != "machine";
    assert_eq!(memory["release_activations"], bounded, "{memory}");
    let (status, body) = post_auth(&s, "/admin/memory/gc", Some("wrong"));
    assert_eq!((status, body["code"].as_str()), (401, Some("unauthorized")));
    assert_eq!(post_auth(&s, "/v2/repository/models/a/load", Some("s3cret")).0, 200);
    assert_eq!(s.post("/v2/models/b/infer", &infer_body(&reference("mlp-100m-1"))).0, 200);
    assert_eq!(s.post("/v2/models/p/infer", &infer_body(&reference("mlp-10m"))).0, 200);

    std::thread::sleep(Duration::from_millis(200));
    let (status, stats) = s.get("/admin/memory/stats");
    assert_eq!(status, 200);
    let dev = &stats["devices"][0];
    assert_eq!(dev["device"], "cpu");
    assert!(
        dev["budget_bytes"].as_u64().unwrap_or(0) > 0 && dev["process_bytes"].as_u64().unwrap_or(0) > 0,
        "{dev}"
    );
    assert!(stats["history"].as_array().is_some_and(|h| !h.is_empty()), "readings are kept");
    assert_eq!(stats["level"], "normal");
    assert!(stats["recommendations"].is_array() && stats["alerts"].is_array());
    assert!(stats["unloads"]["short"].is_u64(), "{}", stats["unloads"]);

    let dump_before = s.get("/admin/memory/dump").1;
    assert!(dump_before["allocator"]["arena_bytes"].is_u64(), "{}", dump_before["allocator"]);
    assert!(dump_before["process"]["VmRSS"].as_u64().unwrap_or(0) > 0);
    assert_eq!(dump_before["models"].as_array().map(Vec::len), Some(3));

    // gc: every idle, unpinned model goes; the pinned one stays.
    let (status, gc) = post_auth(&s, "/admin/memory/gc", Some("s3cret"));
    assert_eq!(status, 200, "{gc}");
    let mut unloaded: Vec<&str> =
        gc["models_unloaded"].as_array().expect("list").iter().filter_map(Value::as_str).collect();
    unloaded.sort();
    assert_eq!(unloaded, ["a", "b"]);
    assert!(
        gc["freed_bytes"].as_u64().is_some_and(|b| b > 50 << 20),
        "the 100 MB model's memory came back: {gc}"
    );
    assert_eq!(s.model("p")["state"], "ready");
    let audit = &s.get("/admin/memory/stats").1["unloads"];
    assert_eq!(
        (audit["unloads"].as_u64(), audit["short"].as_u64()),
        (Some(2), Some(0)),
        "both unloads gave their memory back: {audit}"
    );

    let dump_after = s.get("/admin/memory/dump").1;
    let dir = std::env::temp_dir().join(format!("snooze-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("a.json"), dump_before.to_string()).expect("write");
    std::fs::write(dir.join("b.json"), dump_after.to_string()).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_snooze"))
        .args(["dump", "diff"])
        .arg(dir.join("a.json"))
        .arg(dir.join("b.json"))
        .output()
        .expect("diff");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("process.VmRSS") && text.contains("MiB"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn warning_records_an_alert_and_emergency_unloads_idle_models() {
    // Thresholds far below the real RSS: the first reading is already over them.
    let s = Server::start(
        "pressure-warn",
        &config("memory_warning_threshold = 0.001\nmemory_critical_threshold = 1.0\nmemory_emergency_threshold = 1.0"),
        &[],
    );
    s.wait_for("a warning alert", |s| s.get("/admin/memory/stats").1["level"] == "warning");
    let stats = s.get("/admin/memory/stats").1;
    let alert = &stats["alerts"][0];
    assert_eq!(alert["level"], "warning");
    assert!(alert["message"].as_str().is_some_and(|m| m.contains("budget")), "{alert}");
    assert_eq!(
        s.post("/v2/models/a/infer", &infer_body(&reference("mlp-10m"))).0,
        200,
        "warning refuses nothing"
    );
    assert_eq!(s.model("a")["state"], "ready");
    drop(s);

    // 1 GiB budget: the idle server (~40 MB) is under the warning line (8%); with the
    // 100 MB model loaded it is over the emergency line (11%).
    let s = Server::start(
        "pressure-emergency",
        &config("host_memory_limit = \"1GiB\"\nmemory_warning_threshold = 0.08\nmemory_critical_threshold = 0.10\nmemory_emergency_threshold = 0.11"),
        &[],
    );
    assert_eq!(s.get("/admin/memory/stats").1["level"], "normal");
    assert_eq!(s.post("/v2/models/b/infer", &infer_body(&reference("mlp-100m-1"))).0, 200);
    s.wait_for("the emergency to unload the idle model", |s| {
        let b = s.model("b");
        b["state"] == "unloaded" && b["loads"] == 1
    });
    assert!(!s.log_lines("Pressure").is_empty(), "the unload is logged with its reason");
    s.wait_for("the level to fall back", |s| s.get("/admin/memory/stats").1["level"] == "normal");
    let (_, stats) = s.get("/admin/memory/stats");
    assert!(stats["alerts"].as_array().is_some_and(Vec::is_empty), "resolved alerts are not active: {stats}");
    let history = stats["history"].as_array().expect("history");
    assert!(history.iter().any(|r| r["level"] == "emergency"), "the history shows the emergency");
}

/// The accounted figure is what the budget holds now, not the last memory reading:
/// with readings an hour apart, an unloaded 100 MB model leaves it at once.
#[test]
fn accounted_memory_is_current_right_after_an_unload() {
    let cfg = format!(
        "[server]\nmemory_check_interval = \"1h\"\n[models.b]\npath = \"{}/mlp-100m-1\"\n",
        models_dir().display()
    );
    let s = Server::start("admin-accounted", &cfg, &[]);
    assert_eq!(s.post("/v2/models/b/infer", &infer_body(&reference("mlp-100m-1"))).0, 200);
    // The one-time copies a fresh state dir makes in the background are accounted while
    // they run: let them end.
    std::thread::sleep(Duration::from_secs(3));
    let accounted = |s: &Server| s.get("/admin/memory/stats").1["devices"][0]["accounted_bytes"].as_u64();
    let loaded = accounted(&s).expect("accounted");
    assert_eq!(post_auth(&s, "/v2/repository/models/b/unload", None).0, 200);
    let unloaded = accounted(&s).expect("accounted");
    assert!(unloaded + (80 << 20) < loaded, "accounted {loaded} loaded, {unloaded} right after the unload");
    let metrics = s.metrics();
    let gauge = metrics
        .lines()
        .find_map(|l| l.strip_prefix("snooze_memory_bytes{device=\"cpu\",kind=\"accounted\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no accounted gauge in:\n{metrics}"));
    assert_eq!(gauge as u64, unloaded, "/metrics says what the stats say");
}
