//! The real binary against a hostile client: well over a hundred malformed requests
//! across KServe JSON, the binary extension, BYTES, the repository, the admin API and
//! the OpenAI routes — each answered with the right 4xx (or 503 + Retry-After) and a
//! JSON body — and the server alive and serving correct results afterwards. The speech
//! routes' refusals (`common/audio.rs`, shared with `speech.rs`) are among them.

#[path = "common/audio.rs"]
mod audio;
mod common;

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    time::Duration,
};

use common::*;
use serde_json::{json, Value};

const TOKEN: &str = "s3cret";

fn config() -> String {
    let dir = models_dir();
    format!(
        "[server]\nmax_request_size = \"1MiB\"\nmax_inflight_request_bytes = \"3MiB\"\nmax_embedding_inputs = 8\n\
         max_input_chars = 64\nadmin_token = \"{TOKEN}\"\nbody_read_timeout = \"5s\"\nmax_audio_seconds = 20\n\
         [models.mlp-10m]\npath = \"{0}/mlp-10m\"\n[models.identity-all-types]\npath = \"{0}/test/identity-all-types\"\n\
         [models.minilm]\nbackend = \"candle\"\npath = \"{0}/minilm\"\n[models.broken]\npath = \"{0}/test/corrupt/model.onnx\"\n\
         [models.whisper-tiny-en]\npath = \"{0}/whisper-tiny-en\"\n",
        dir.display()
    )
}

/// One request and what it must get.
struct Case {
    what: String,
    method: &'static str,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    contains: Option<String>,
    /// OpenAI's `param`: the request field at fault (checked when set).
    param: Option<String>,
    /// Refused by hyper before any handler runs (malformed HTTP): the status is all there is.
    protocol_level: bool,
}

impl Case {
    fn post(what: impl Into<String>, path: &str, body: impl Into<Vec<u8>>, status: u16) -> Case {
        Case {
            what: what.into(),
            method: "POST",
            path: path.to_string(),
            headers: vec![("content-type", "application/json".into())],
            body: body.into(),
            status,
            contains: None,
            param: None,
            protocol_level: false,
        }
    }

    fn get(what: impl Into<String>, path: &str, status: u16) -> Case {
        Case { method: "GET", ..Case::post(what, path, Vec::new(), status) }
    }

    fn header(mut self, k: &'static str, v: impl Into<String>) -> Case {
        self.headers.push((k, v.into()));
        self
    }

    fn content_type(mut self, v: &str) -> Case {
        self.headers.retain(|(k, _)| *k != "content-type");
        self.header("content-type", v)
    }

    fn token(self, t: &str) -> Case {
        self.header("authorization", format!("Bearer {t}"))
    }

    fn protocol_level(mut self) -> Case {
        self.protocol_level = true;
        self
    }

    fn contains(mut self, s: &str) -> Case {
        self.contains = Some(s.to_string());
        self
    }

    fn param(mut self, p: &str) -> Case {
        self.param = Some(p.to_string());
        self
    }
}

/// Sends a request over a raw socket (so nothing normalizes the path or headers) and
/// returns the status, headers (lowercase) and body.
fn raw(
    s: &Server,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    let addr = s.base.trim_start_matches("http://");
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    let mut has_length = false;
    for (k, v) in headers {
        has_length |= k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding");
        head += &format!("{k}: {v}\r\n");
    }
    if !has_length {
        head += &format!("content-length: {}\r\n", body.len());
    }
    head += "\r\n";
    conn.write_all(head.as_bytes()).expect("write head");
    // The server may answer (and close) before reading the body: that is allowed.
    let _ = conn.write_all(body);
    let mut out = Vec::new();
    let _ = conn.read_to_end(&mut out);
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).to_lowercase();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut body = out.get(split + 4..).unwrap_or_default().to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, head, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < eol + 2 + n {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[(eol + 4 + n).min(b.len())..];
    }
    out
}

fn check(s: &Server, c: &Case) {
    let (status, head, body) = raw(s, c.method, &c.path, &c.headers, &c.body);
    let what = &c.what;
    assert_eq!(status, c.status, "{what}: {}", String::from_utf8_lossy(&body));
    if c.protocol_level {
        return;
    }
    let json: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{what}: the body is not JSON ({e}): {}", String::from_utf8_lossy(&body)));
    if status >= 400 {
        let message = if c.path.starts_with("/v1/") {
            json["error"]["message"].as_str().map(str::to_string)
        } else {
            json["error"].as_str().map(str::to_string)
        };
        let message = message.unwrap_or_else(|| panic!("{what}: no error message in {json}"));
        if let Some(want) = &c.contains {
            assert!(message.contains(want.as_str()), "{what}: '{message}' lacks '{want}'");
        }
        if let Some(param) = &c.param {
            assert_eq!(json["error"]["param"], param.as_str(), "{what}: {json}");
        }
    }
    if status == 503 || status == 429 {
        assert!(head.contains("retry-after:"), "{what}: {status} without Retry-After");
    }
}

/// Six valid values of a datatype.
fn values(dt: &str) -> Value {
    match dt {
        "BOOL" => json!([true, false, true, false, false, true]),
        "BYTES" => json!(["a", "bc", "", "d", "e", "f"]),
        "FP16" | "FP32" | "FP64" => json!([0.5, 1.0, 2.0, 3.0, 4.0, 5.0]),
        _ => json!([0, 1, 2, 3, 4, 5]),
    }
}

/// A valid request for every input of the identity model; `corrupt` rewrites one.
fn identity_request(corrupt: Option<(&str, Value)>) -> Value {
    let inputs: Vec<Value> = snooze_core::DataType::ALL
        .iter()
        .map(|d| {
            let dt = d.as_str();
            let name = format!("in_{}", dt.to_lowercase());
            let mut input = json!({"name": name, "shape": [2, 3], "datatype": dt, "data": values(dt)});
            if let Some((target, patch)) = &corrupt {
                if *target == dt {
                    for (k, v) in patch.as_object().expect("object") {
                        input[k] = v.clone();
                    }
                }
            }
            input
        })
        .collect();
    json!({ "inputs": inputs })
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let infer = "/v2/models/mlp-10m/infer";
    let identity = "/v2/models/identity-all-types/infer";

    // The corpus of the nastiest request bodies (also replayed at the decoder).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    for entry in std::fs::read_dir(dir).expect("corpus") {
        let path = entry.expect("entry").path();
        let case: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let name = format!("corpus {}", path.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
        let body = case["body"].as_str().expect("body");
        let model = case["model"].as_str().expect("model");
        let status = case["status"].as_u64().expect("status") as u16;
        let mut c = if case["endpoint"] == "openai" {
            Case::post(name, "/v1/embeddings", body, status)
        } else {
            let binary: Vec<u8> = {
                let h = case["binary_hex"].as_str().unwrap_or("");
                (0..h.len() / 2).map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("hex")).collect()
            };
            let mut all = body.as_bytes().to_vec();
            all.extend_from_slice(&binary);
            let c = Case::post(name, &format!("/v2/models/{model}/infer"), all, status);
            if binary.is_empty() {
                c
            } else {
                c.header("inference-header-content-length", body.len().to_string())
            }
        };
        if let Some(want) = case["contains"].as_str() {
            c = c.contains(want);
        }
        v.push(c);
    }

    // Every datatype, corrupted five ways, in an otherwise valid request.
    for d in snooze_core::DataType::ALL {
        let dt = d.as_str();
        let name = format!("'in_{}'", dt.to_lowercase());
        let wrong_value = if dt == "BYTES" { json!([1, 2, 3, 4, 5, 6]) } else { json!(["x", 1, 2, 3, 4, 5]) };
        let ok = values(dt);
        let ragged = json!([[ok[0], ok[1], ok[2]], [ok[3], ok[4]]]);
        let seven = json!([ok[0], ok[1], ok[2], ok[3], ok[4], ok[5], ok[0]]);
        let corruptions = [
            ("a value of the wrong type", json!({"data": wrong_value}), name.clone()),
            ("ragged rows", json!({"data": ragged}), "ragged".to_string()),
            ("more values than the shape", json!({"data": seven}), "more than the 6".to_string()),
            ("a shape the model does not take", json!({"shape": [2, 4]}), name.clone()),
            (
                "another datatype",
                json!({"datatype": if dt == "INT8" { "UINT8" } else { "INT8" }}),
                name.clone(),
            ),
        ];
        for (what, patch, want) in corruptions {
            let body = identity_request(Some((dt, patch))).to_string();
            v.push(Case::post(format!("{dt}: {what}"), identity, body, 400).contains(&want));
        }
    }

    // KServe JSON and the binary extension.
    let x = |data: Value, shape: Value| json!({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": data}]});
    let zeros = vec![0.0f32; 256];
    v.extend([
        Case::post("not JSON", infer, "{{{", 400),
        Case::post("JSON but not a request", infer, "[1,2,3]", 400),
        Case::post("no inputs field", infer, "{}", 400),
        Case::post("empty body", infer, "", 400),
        Case::post("inputs is not an array", infer, r#"{"inputs":{"x":1}}"#, 400),
        Case::post("unknown input", infer, json!({"inputs": [{"name": "z", "datatype": "FP32", "shape": [1, 256], "data": zeros}]}).to_string(), 400).contains("no input 'z'"),
        Case::post("missing input", infer, r#"{"inputs":[]}"#, 400).contains("'x' is missing"),
        Case::post("unknown output", infer, json!({"inputs": x(json!(zeros), json!([1, 256]))["inputs"], "outputs": [{"name": "nope"}]}).to_string(), 400).contains("no output 'nope'"),
        Case::post("string shape", infer, r#"{"inputs":[{"name":"x","datatype":"FP32","shape":"1,256","data":[]}]}"#, 400),
        Case::post("float dims", infer, r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1.5,256],"data":[]}]}"#, 400),
        Case::post("zero-size batch with data", infer, x(json!([1.0]), json!([0, 256])).to_string(), 400).contains("'x'"),
        Case::post("terabyte rows, no data", infer, x(json!([]), json!([1_099_511_627_776i64, 256])).to_string(), 400).contains("'x'"),
        Case::post("shape product near 2^62", infer, x(json!([1]), json!([1i64 << 31, 1i64 << 31])).to_string(), 400).contains("'x'"),
        Case::post("header length not a number", infer, x(json!(zeros), json!([1, 256])).to_string(), 400)
            .header("inference-header-content-length", "ten"),
        Case::post("header length past the body", infer, x(json!(zeros), json!([1, 256])).to_string(), 400)
            .header("inference-header-content-length", "99999"),
        binary_case(
            "binary size that lies",
            infer,
            r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,256],"parameters":{"binary_data_size":1000}}]}"#,
            &[0u8; 1024],
        )
        .contains("'x'"),
        Case::post("a version that does not exist", "/v2/models/mlp-10m/versions/7/infer", x(json!(zeros), json!([1, 256])).to_string(), 404),
        Case::post("unknown model", "/v2/models/nope/infer", "{}", 404),
        Case::post("a model whose file is corrupt", "/v2/models/broken/infer", x(json!(zeros), json!([1, 256])).to_string(), 500),
    ]);

    // BYTES to an embedding model: the /v1/embeddings limits hold on KServe too.
    let text = |items: Value| {
        json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [items.as_array().map_or(0, Vec::len)], "data": items}]}).to_string()
    };
    v.extend([
        Case::post("more texts than max_embedding_inputs", "/v2/models/minilm/infer", text(json!(vec!["a"; 9])), 400).contains("max_embedding_inputs"),
        Case::post("a text longer than max_input_chars", "/v2/models/minilm/infer", text(json!(["x".repeat(65)])), 400).contains("max_input_chars"),
        binary_case(
            "BYTES that are not UTF-8",
            "/v2/models/minilm/infer",
            r#"{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":6}}]}"#,
            &[2, 0, 0, 0, 0xff, 0xfe],
        )
        .contains("UTF-8"),
        Case::post("FP32 to a text model", "/v2/models/minilm/infer", x(json!([1.0]), json!([1])).to_string(), 400),
    ]);

    // The OpenAI routes answer in OpenAI's error shape.
    let emb = "/v1/embeddings";
    v.extend([
        Case::post("embeddings: not JSON", emb, "nope", 400),
        Case::post("embeddings: no model", emb, r#"{"input":"a"}"#, 400),
        Case::post("embeddings: unknown model", emb, r#"{"model":"zzz","input":"a"}"#, 404),
        Case::post("embeddings: not an embedding model", emb, r#"{"model":"mlp-10m","input":"a"}"#, 400)
            .contains("not a text-embedding model"),
        Case::post("embeddings: empty list", emb, r#"{"model":"minilm","input":[]}"#, 400).contains("empty"),
        Case::post(
            "embeddings: too many inputs",
            emb,
            json!({"model": "minilm", "input": vec!["a"; 9]}).to_string(),
            400,
        )
        .contains("max_embedding_inputs"),
        Case::post(
            "embeddings: too long",
            emb,
            json!({"model": "minilm", "input": "y".repeat(65)}).to_string(),
            400,
        )
        .contains("max_input_chars"),
        Case::post(
            "embeddings: token list too long",
            emb,
            json!({"model": "minilm", "input": vec![1; 65]}).to_string(),
            400,
        )
        .contains("max_input_chars"),
        Case::post(
            "embeddings: token outside the vocabulary",
            emb,
            r#"{"model":"minilm","input":[[999999]]}"#,
            400,
        )
        .contains("vocabulary")
        .param("input"),
        Case::post(
            "embeddings: dimensions as a string",
            emb,
            r#"{"model":"minilm","input":"a","dimensions":"8"}"#,
            400,
        )
        .param("dimensions"),
        Case::post("embeddings: user a number", emb, r#"{"model":"minilm","input":"a","user":5}"#, 400)
            .param("user"),
        Case::post("embeddings: model a number", emb, r#"{"model":5,"input":"a"}"#, 400).param("model"),
        Case::post("embeddings: negative token", emb, r#"{"model":"minilm","input":[-5]}"#, 400),
        Case::post(
            "embeddings: bad encoding_format",
            emb,
            r#"{"model":"minilm","input":"a","encoding_format":"hex"}"#,
            400,
        ),
        Case::post("embeddings: dimensions 0", emb, r#"{"model":"minilm","input":"a","dimensions":0}"#, 400),
        Case::post(
            "embeddings: dimensions beyond the model",
            emb,
            r#"{"model":"minilm","input":"a","dimensions":100000}"#,
            400,
        )
        .contains("dimensions"),
        Case::post("embeddings: input null", emb, r#"{"model":"minilm","input":null}"#, 400),
        Case::post(
            "embeddings: a multipart form",
            emb,
            "--x\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nminilm\r\n--x--\r\n",
            400,
        )
        .content_type("multipart/form-data; boundary=x")
        .contains("send the embeddings request as JSON"),
        Case::get("OpenAI model retrieve, unknown", "/v1/models/nope", 404).contains("nope"),
        Case::get("embeddings: GET", emb, 405).contains("(allowed: POST)"),
        Case::post("models: POST", "/v1/models", "", 405),
        Case::post("an unknown /v1 route", "/v1/chat/completions", "{}", 404),
    ]);

    // The repository and admin API: the token, and JSON errors for everything.
    let load = "/v2/repository/models/mlp-10m/load";
    v.extend([
        Case::post("load without the token", load, "", 401),
        Case::post("load with a wrong token", load, "", 401).token("nope"),
        Case::post("load with a longer token", load, "", 401).token("s3cret-and-more"),
        Case::post("load with the token in Basic", load, "", 401)
            .header("authorization", format!("Basic {TOKEN}")),
        Case::post("load of an unknown model", "/v2/repository/models/zzz/load", "", 404).token(TOKEN),
        Case::post("load with a body that is not JSON", load, "{nope", 400).token(TOKEN),
        Case::post("load with a body over the limit", load, vec![b' '; 100_000], 413).token(TOKEN),
        Case::post("load, lowercase bearer", load, "", 200)
            .header("authorization", format!("bearer {TOKEN}")),
        Case::get("load with GET", load, 405).token(TOKEN),
        Case::post("unload without the token", "/v2/repository/models/mlp-10m/unload", "", 401),
        Case::post("repository index with a bad body", "/v2/repository/index", "[", 400),
        Case::post("gc without the token", "/admin/memory/gc", "", 401),
        Case::get("gc with GET", "/admin/memory/gc", 405).token(TOKEN),
        Case::get("admin models without the token", "/admin/models", 401),
        Case::get("memory stats without the token", "/admin/memory/stats", 401),
        Case::get("memory dump without the token", "/admin/memory/dump", 401),
        Case::get("memory dump with a wrong token", "/admin/memory/dump", 401).token("S3CRET"),
        Case::get("admin models with the token", "/admin/models", 200).token(TOKEN),
    ]);

    // HTTP itself: paths, methods, lengths.
    v.extend([
        Case::post("a path that is not UTF-8", "/v2/models/%FF%FE/infer", "{}", 400),
        Case::get("an unknown path", "/nowhere", 404),
        Case::get("infer with GET", infer, 405).contains("(allowed: POST)"),
        Case::post("metadata with POST", "/v2/models/mlp-10m", "{}", 405).contains("allowed: GET"),
        Case::post("Content-Length over max_request_size", infer, Vec::new(), 413)
            .header("content-length", (2 << 20).to_string())
            .contains("max_request_size"),
        Case::post("Content-Length that is not a number", infer, "{}", 400)
            .header("content-length", "12abc")
            .protocol_level(),
        Case::post("a chunked body over max_request_size", infer, chunked(&vec![b' '; (1 << 20) + 1]), 413)
            .header("transfer-encoding", "chunked"),
    ]);

    // Speech: uploads that are not audio, lie about their length or ask what the model
    // cannot do, and forms that are not forms.
    let scratch = audio::Scratch::new("hostile");
    for bad in audio::bad_uploads("whisper-tiny-en", &scratch) {
        let mut c = Case::post(bad.what, &bad.route, bad.body, bad.status).contains(bad.contains);
        c.param = bad.param.map(str::to_string);
        c.headers = vec![("content-type", bad.content_type)];
        v.push(c);
    }
    v
}

/// A binary-extension request (JSON header + tail) that must get 400.
fn binary_case(what: &str, path: &str, header: &str, tail: &[u8]) -> Case {
    Case::post(what, path, [header.as_bytes(), tail].concat(), 400)
        .header("inference-header-content-length", header.len().to_string())
}

/// `body` in chunked transfer encoding, 64 KiB a chunk.
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in body.chunks(64 << 10) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// The server still serves the right answers.
fn serves_correctly(s: &Server) {
    let r = reference("mlp-10m");
    let (status, body, _) = s.post("/v2/models/mlp-10m/infer", &infer_body(&r));
    assert_eq!(status, 200, "{body}");
    assert!(max_abs_diff(&floats(&body["outputs"][0]["data"]), &r.output) <= 1e-4);
    let (status, body, _) = s.post("/v2/models/identity-all-types/infer", &identity_request(None));
    assert_eq!(status, 200, "{body}");
    let out = body["outputs"].as_array().expect("outputs");
    let bytes = out.iter().find(|o| o["name"] == "out_bytes").expect("out_bytes");
    assert_eq!(bytes["data"], json!(["a", "bc", "", "d", "e", "f"]));
    let (status, body, _) = s.post("/v1/embeddings", &json!({"model": "minilm", "input": ["hello"]}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"][0]["embedding"].as_array().map(Vec::len), Some(384));
}

#[test]
fn malformed_requests_get_the_right_4xx_and_the_server_keeps_serving() {
    let mut s = Server::start("hostile", &config(), &[]);
    serves_correctly(&s);
    let cases = cases();
    assert!(cases.len() >= 100, "only {} cases", cases.len());
    for c in &cases {
        check(&s, c);
    }
    assert!(s.child.try_wait().map(|st| st.is_none()).unwrap_or(false), "the server is alive");
    serves_correctly(&s);
    eprintln!("{} hostile requests answered", cases.len());
}

#[test]
fn requests_past_the_request_memory_budget_wait_their_turn_with_503() {
    let s = Server::start("hostile-inflight", &config(), &[]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let r = reference("mlp-10m");
    let in_flight =
        |s: &Server| s.get_with_token("/admin/memory/stats", TOKEN)["requests_in_flight"]["bytes"].as_u64();
    // Uploads declaring 1 MiB each that send nothing hold nothing: a budget charged by
    // what clients declare let 39 such connections shut every upload out for 30 s.
    let head = format!(
        "POST /v2/models/mlp-10m/infer HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        1 << 20
    );
    let idle: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).expect("connect");
            c.write_all(head.as_bytes()).expect("write");
            c
        })
        .collect();
    let (status, body, _) = s.post("/v2/models/mlp-10m/infer", &infer_body(&r));
    assert_eq!(status, 200, "declared bytes that never came hold no budget: {body}");
    assert_eq!(in_flight(&s), Some(0));
    drop(idle);
    // Three uploads that send all but their last byte and stall: the 3 MiB budget is
    // held by the bytes that arrived.
    let stalled: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).expect("connect");
            c.write_all(head.as_bytes()).expect("write");
            c.write_all(&vec![b' '; (1 << 20) - 1]).expect("write");
            c
        })
        .collect();
    s.wait_for("the uploads to be charged", |s| in_flight(s) == Some(3 * ((1 << 20) - 1)));
    let (status, body, retry) = s.post("/v2/models/mlp-10m/infer", &infer_body(&r));
    assert_eq!(status, 503, "{body}");
    assert!(
        retry.is_some() && body["error"].as_str().is_some_and(|m| m.contains("max_inflight_request_bytes"))
    );
    drop(stalled);
    s.wait_for("the stalled uploads to be given back", |s| in_flight(s) == Some(0));
    assert_eq!(s.post("/v2/models/mlp-10m/infer", &infer_body(&r)).0, 200);
}
