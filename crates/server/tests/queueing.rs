//! Queues on the real binary: a request for a model that cannot be admitted yet waits
//! and is served (no 503), a full queue answers 429 + Retry-After, priorities come
//! from the header and the KServe parameter, and a client that disconnects leaves
//! the queue at once.

mod common;

use std::{
    io::Write,
    net::TcpStream,
    time::{Duration, Instant},
};

use common::*;
use serde_json::{json, Value};

/// Room for one 100 MB model; a model stays at least `min_residency` once loaded, so
/// a request for the other one must wait that long (or until `queue_timeout`).
fn config(min_residency: &str, queue_timeout: &str) -> String {
    let dir = models_dir();
    format!(
        "[server]\nmax_loaded_models = 1\nkeep_alive = \"-1\"\nmin_residency = \"{min_residency}\"\nqueue_timeout = \"{queue_timeout}\"\n\
         [models.a]\npath = \"{0}/mlp-100m-1\"\n[models.b]\npath = \"{0}/mlp-100m-2\"\nmax_queue = 2\n",
        dir.display()
    )
}

fn queued(s: &Server, model: &str) -> u64 {
    let q = &s.model(model)["queued"];
    ["high", "normal", "low"].iter().map(|k| q[k].as_u64().unwrap_or(0)).sum()
}

#[test]
fn a_request_that_cannot_be_admitted_yet_waits_and_is_served() {
    let s = Server::start("queue-wait", &config("2s", "20s"), &[]);
    let a = reference("mlp-100m-1");
    assert_eq!(s.post("/v2/models/a/infer", &infer_body(&a)).0, 200);
    let b = reference("mlp-100m-2");
    let started = Instant::now();
    let (status, body, _) = s.post("/v2/models/b/infer", &infer_body(&b));
    assert_eq!(status, 200, "waited instead of a 503: {body}");
    assert!(max_abs_diff(&floats(&body["outputs"][0]["data"]), &b.output) <= 1e-4);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1500), "a had to reach its min_residency first: {waited:?}");
    assert_eq!(s.model("a")["evictions"], 1);
}

#[test]
fn a_full_queue_is_429_and_a_disconnected_client_leaves_the_queue() {
    // Nothing but their clients leaving takes b's requests out of the queue within the
    // test: a stays resident for 120 s and a request may wait that long.
    let s = Server::start("queue-full", &config("120s", "120s"), &[]);
    let a = reference("mlp-100m-1");
    assert_eq!(s.post("/v2/models/a/infer", &infer_body(&a)).0, 200);
    // Two requests for b wait behind a's residency: the queue (max_queue = 2) is full.
    let addr = s.base.trim_start_matches("http://").to_string();
    let body = serde_json::to_vec(&infer_body(&reference("mlp-100m-2"))).expect("json");
    let waiting: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).expect("connect");
            let head = format!(
                "POST /v2/models/b/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            c.write_all(head.as_bytes()).and_then(|()| c.write_all(&body)).expect("send");
            c
        })
        .collect();
    s.wait_for("two requests queued for b", |s| queued(s, "b") == 2);
    let r = client()
        .post(s.url("/v2/models/b/infer"))
        .header("x-snooze-priority", "low")
        .json(&infer_body(&reference("mlp-100m-2")))
        .send()
        .expect("post");
    assert_eq!(r.status().as_u16(), 429);
    let retry =
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    assert!(retry.is_some_and(|n| n >= 1), "Retry-After: {retry:?}");
    let err: Value = r.json().expect("json");
    assert_eq!(err["code"], "queue_full");
    assert!(err["error"].as_str().is_some_and(|m| m.contains("max_queue")), "{err}");
    // The clients go away: their requests leave the queue at once, nothing runs for them.
    drop(waiting);
    let gone = Instant::now();
    while queued(&s, "b") > 0 {
        assert!(
            gone.elapsed() < Duration::from_secs(5),
            "{} requests of clients that left 5 s ago are still queued (queue_timeout 120 s)",
            queued(&s, "b")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("the queue emptied {:.2}s after its clients left", gone.elapsed().as_secs_f64());
    assert_eq!(s.model("b")["loads"], 0);
    assert_eq!(s.model("b")["state"], "unloaded");
}

#[test]
fn priorities_are_read_from_the_header_and_the_kserve_parameter() {
    let s = Server::start("queue-priority", &config("0s", "20s"), &[]);
    let mut body = infer_body(&reference("mlp-100m-1"));
    body["parameters"] = json!({"priority": 1});
    assert_eq!(s.post("/v2/models/a/infer", &body).0, 200);
    body["parameters"] = json!({"priority": "urgent"});
    let (status, err, _) = s.post("/v2/models/a/infer", &body);
    assert_eq!(status, 400);
    assert!(err["error"].as_str().is_some_and(|m| m.contains("priority")), "{err}");
    let r = client()
        .post(s.url("/v2/models/a/infer"))
        .header("x-snooze-priority", "whenever")
        .json(&infer_body(&reference("mlp-100m-1")))
        .send()
        .expect("post");
    assert_eq!(r.status().as_u16(), 400);
}
