//! What a proxy in front of several nodes relies on (deploy/nginx/snooze.conf): the
//! model's name in the path or in the `x-snooze-model` header, the same name on the
//! answer, and readiness that turns false when the node cannot take work.
#![allow(clippy::unwrap_used)]

mod common;

use common::{client, infer_body, models_dir, reference, Server};
use serde_json::json;

#[test]
fn the_model_is_named_by_path_or_header_and_on_every_answer() {
    let m = models_dir();
    let toml = format!(
        "[models.minilm]\npath = \"{0}/minilm-onnx\"\n\n[models.mlp]\npath = \"{0}/mlp-10m\"\n",
        m.display()
    );
    let s = Server::start("routing", &toml, &[]);
    let http = client();
    let model_of = |r: &reqwest::blocking::Response| {
        r.headers().get("x-snooze-model").map(|v| v.to_str().unwrap().to_string())
    };

    // KServe: the path names it; answers say so, errors included.
    let r = http.post(s.url("/v2/models/mlp/infer")).json(&infer_body(&reference("mlp-10m"))).send().unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (200, Some("mlp".into())));
    let r = http.post(s.url("/v2/models/mlp/infer")).json(&json!({"inputs": []})).send().unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (400, Some("mlp".into())));
    let r = http.get(s.url("/v2/models/mlp")).send().unwrap();
    assert_eq!(model_of(&r), Some("mlp".into()));

    // OpenAI: the header may name the model instead of the body (a proxy hashes on it).
    let r = http
        .post(s.url("/v1/embeddings"))
        .header("x-snooze-model", "minilm")
        .json(&json!({"input": "hello"}))
        .send()
        .unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (200, Some("minilm".into())));
    let body: serde_json::Value = r.json().unwrap();
    assert_eq!(body["model"], "minilm");
    // Both agree: fine. They differ: 400 naming both. Neither: 400.
    let r = http
        .post(s.url("/v1/embeddings"))
        .header("x-snooze-model", "minilm")
        .json(&json!({"model": "minilm", "input": "hello"}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = http
        .post(s.url("/v1/embeddings"))
        .header("x-snooze-model", "mlp")
        .json(&json!({"model": "minilm", "input": "hello"}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: serde_json::Value = r.json().unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("'minilm'") && msg.contains("'mlp'"), "{msg}");
    let r = http.post(s.url("/v1/embeddings")).json(&json!({"input": "hello"})).send().unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: serde_json::Value = r.json().unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("x-snooze-model"), "{e}");

    // A model (or pipeline) the server does not know: 404, and the name asked for on it,
    // on every protocol (the /v1 routes answered without it).
    let r =
        http.post(s.url("/v2/models/nope/infer")).json(&infer_body(&reference("mlp-10m"))).send().unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (404, Some("nope".into())));
    let r =
        http.post(s.url("/v1/embeddings")).json(&json!({"model": "nope", "input": "hello"})).send().unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (404, Some("nope".into())));
    let r = http.get(s.url("/v1/models/nope")).send().unwrap();
    assert_eq!((r.status().as_u16(), model_of(&r)), (404, Some("nope".into())));
    // The name is looked up before the file is read.
    let form = |field: &str| {
        format!(
            "--b0undary\r\ncontent-disposition: form-data; name=\"{field}\"\r\n\r\nnope\r\n--b0undary\r\n\
             content-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b0undary--\r\n"
        )
    };
    let post_form = |path: &str, field: &str| {
        let r = http.post(s.url(path)).header("content-type", "multipart/form-data; boundary=b0undary");
        r.body(form(field)).send().unwrap()
    };
    let r = post_form("/v1/audio/transcriptions", "model");
    assert_eq!((r.status().as_u16(), model_of(&r)), (404, Some("nope".into())));
    let r = post_form("/v1/ocr", "pipeline");
    assert_eq!((r.status().as_u16(), model_of(&r)), (404, Some("nope".into())));
    assert_eq!(s.get("/v2/health/ready").0, 200);
}

#[test]
fn readiness_is_false_under_emergency_memory_pressure() {
    // A budget the server's own baseline already fills past the emergency threshold.
    let toml = "[server]\nhost_memory_limit = \"64MiB\"\nheadroom = \"0MiB\"\n\
                memory_warning_threshold = 0.05\nmemory_critical_threshold = 0.06\n\
                memory_emergency_threshold = 0.07\nmemory_check_interval = \"50ms\"\n";
    let s = Server::start("routing-pressure", toml, &[]);
    s.wait_for("emergency pressure", |s| s.get("/v2/health/ready").0 == 503);
    let r = client().get(s.url("/v2/health/ready")).send().unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().unwrap();
    assert!(body["error"].as_str().unwrap().contains("emergency"), "{body}");
    // Alive all the same: the process is fine, only not taking work.
    assert_eq!(s.get("/v2/health/live").0, 200);
}
