//! The gRPC service against the real binary with the generated Rust client: hostile
//! messages are INVALID_ARGUMENT naming the tensor and leave the server serving;
//! `grpc_address = "off"` serves no gRPC; a taken port is a clear start-up error.
//! (The conformance suite with Triton's clients is tests/python/test_grpc.py.)

mod common;

use common::*;
use snooze_server::grpc::proto::{
    grpc_inference_service_client::GrpcInferenceServiceClient, model_infer_request::InferInputTensor,
    InferTensorContents, ModelInferRequest, ServerReadyRequest,
};
use tonic::{transport::Channel, Code};

fn config() -> String {
    format!(
        "[models.mlp]\npath = \"{0}/mlp-10m\"\n\n[models.types]\npath = \"{0}/test/identity-all-types\"\n",
        models_dir().display()
    )
}

fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        ..Default::default()
    }
}

fn raw(model: &str, inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
    ModelInferRequest { model_name: model.into(), inputs, raw_input_contents: raw, ..Default::default() }
}

fn good(r: &Reference) -> ModelInferRequest {
    raw(
        "mlp",
        vec![input("x", "FP32", &r.shape)],
        vec![r.input.iter().flat_map(|v| v.to_le_bytes()).collect()],
    )
}

async fn connect(s: &Server) -> GrpcInferenceServiceClient<Channel> {
    let addr = s.grpc.clone().expect("the server reports its gRPC address");
    GrpcInferenceServiceClient::connect(format!("http://{addr}")).await.expect("connect")
}

/// The blocking helpers (reqwest) must not run inside the runtime: calls go through
/// `block_on` one at a time.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

#[test]
fn hostile_messages_are_invalid_argument_and_change_nothing() {
    let rt = runtime();
    let s = Server::start("grpc-hostile", &config(), &[]);
    let mut c = rt.block_on(connect(&s));
    let r = reference("mlp-10m");
    let ok = rt.block_on(c.model_infer(good(&r))).expect("a good request").into_inner();
    let y: Vec<f32> = ok.raw_output_contents[0]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(max_abs_diff(&y, &r.output) <= 1e-4);

    let typed = |contents: InferTensorContents, shape: &[i64]| {
        let mut i = input("x", "FP32", shape);
        i.contents = Some(contents);
        raw("mlp", vec![i], vec![])
    };
    let bytes_input = |shape: &[i64], data: Vec<u8>| {
        // Every other input of the all-types model, valid, plus in_bytes as given.
        let mut inputs = Vec::new();
        let mut raws = Vec::new();
        for (dt, size) in [
            ("BOOL", 1),
            ("UINT8", 1),
            ("UINT16", 2),
            ("UINT32", 4),
            ("UINT64", 8),
            ("INT8", 1),
            ("INT16", 2),
            ("INT32", 4),
            ("INT64", 8),
            ("FP16", 2),
            ("FP32", 4),
            ("FP64", 8),
        ] {
            inputs.push(input(&format!("in_{}", dt.to_lowercase()), dt, &[1, 3]));
            raws.push(vec![0u8; 3 * size]);
        }
        inputs.push(input("in_bytes", "BYTES", shape));
        raws.push(data);
        raw("types", inputs, raws)
    };
    let cases: Vec<(&str, ModelInferRequest, &str)> = vec![
        (
            "declared shape of 2^40 x 256 with no data",
            raw("mlp", vec![input("x", "FP32", &[1 << 40, 256])], vec![vec![]]),
            "'x'",
        ),
        (
            "shape product overflows",
            raw("mlp", vec![input("x", "FP32", &[1 << 62, 1 << 62])], vec![vec![]]),
            "'x'",
        ),
        ("negative dimension", raw("mlp", vec![input("x", "FP32", &[-1, 256])], vec![vec![0; 1024]]), "'x'"),
        ("unknown datatype", raw("mlp", vec![input("x", "FP33", &[1, 256])], vec![vec![0; 1024]]), "'x'"),
        ("wrong datatype", raw("mlp", vec![input("x", "FP64", &[1, 256])], vec![vec![0; 2048]]), "'x'"),
        ("raw size mismatch", raw("mlp", vec![input("x", "FP32", &[1, 256])], vec![vec![0; 1023]]), "'x'"),
        (
            "raw entries != inputs",
            raw("mlp", vec![input("x", "FP32", &[1, 256])], vec![vec![0; 1024], vec![]]),
            "raw_input_contents",
        ),
        (
            "input given twice",
            raw(
                "mlp",
                vec![input("x", "FP32", &[1, 256]), input("x", "FP32", &[1, 256])],
                vec![vec![0; 1024], vec![0; 1024]],
            ),
            "'x'",
        ),
        ("missing input", raw("mlp", vec![], vec![]), "'x'"),
        ("unknown input", raw("mlp", vec![input("z", "FP32", &[1, 256])], vec![vec![0; 1024]]), "'z'"),
        (
            "typed contents too short",
            typed(InferTensorContents { fp32_contents: vec![0.0; 255], ..Default::default() }, &[1, 256]),
            "'x'",
        ),
        (
            "typed contents in another field",
            typed(InferTensorContents { int_contents: vec![0; 256], ..Default::default() }, &[1, 256]),
            "'x'",
        ),
        (
            "typed and raw at once",
            {
                let mut m = good(&r);
                m.inputs[0].contents =
                    Some(InferTensorContents { fp32_contents: vec![0.0; 256], ..Default::default() });
                m
            },
            "'x'",
        ),
        (
            "BYTES length prefix past the end",
            bytes_input(&[1, 3], [7u32.to_le_bytes().as_slice(), b"ab"].concat()),
            "in_bytes",
        ),
        (
            "BYTES: more elements than the shape",
            bytes_input(&[1, 3], [0u32.to_le_bytes(); 4].concat()),
            "in_bytes",
        ),
        ("BYTES: declared count no data backs", bytes_input(&[1 << 40, 3], vec![]), "in_bytes"),
    ];
    for (what, msg, names) in cases {
        let e = rt.block_on(c.model_infer(msg)).expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(e.message().contains(names), "{what}: the message names the tensor: {}", e.message());
        assert_eq!(
            e.metadata().get("x-snooze-error-code").and_then(|v| v.to_str().ok()),
            Some("invalid_input"),
            "{what}"
        );
    }
    // Unknown model and version.
    let mut m = good(&r);
    m.model_name = "nope".into();
    assert_eq!(rt.block_on(c.model_infer(m)).expect_err("unknown").code(), Code::NotFound);
    let mut m = good(&r);
    m.model_version = "7".into();
    assert_eq!(rt.block_on(c.model_infer(m)).expect_err("version").code(), Code::NotFound);
    // Still serving, and REST too.
    assert!(rt.block_on(c.model_infer(good(&r))).is_ok());
    assert_eq!(s.post("/v2/models/mlp/infer", &infer_body(&r)).0, 200);
    // Requests counted under their protocol.
    let metrics = s.metrics();
    assert!(
        metrics.lines().any(|l| l.starts_with("snooze_requests_total{")
            && l.contains("protocol=\"grpc\"")
            && l.contains("outcome=\"invalid_input\"")),
        "{metrics}"
    );
}

#[test]
fn grpc_off_serves_none_and_a_taken_port_is_a_clear_error() {
    let rt = runtime();
    let s = Server::start("grpc-off", &config(), &["--grpc-address", "off"]);
    assert!(s.grpc.is_none());
    assert!(s.log_lines("gRPC on").is_empty());
    // Not only unannounced: no socket but the HTTP one accepts connections.
    let http: u16 = s.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("the HTTP port");
    assert_eq!(listening_ports(s.child.id()), vec![http], "grpc_address = \"off\" still listens beside HTTP");
    drop(s);

    // A taken port is a clear start-up error naming the setting.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let dir = std::env::temp_dir().join(format!("snooze-grpc-taken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = dir.join("snooze.toml");
    std::fs::write(&cfg, config()).expect("config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_snooze"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(["--http-address", "127.0.0.1:0", "--grpc-address", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("grpc_address") && err.contains("off"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);

    // Ready until shutdown begins.
    let s = Server::start("grpc-ready", &config(), &[]);
    let mut c = rt.block_on(connect(&s));
    assert!(rt.block_on(c.server_ready(ServerReadyRequest {})).expect("ready").into_inner().ready);
}

/// A call takes as long as its work: only the message's arrival is timed
/// (`body_read_timeout`), as over REST. Before, the whole call was cut at
/// `acquire_timeout + queue_timeout` with CANCELLED "Timeout expired".
#[test]
fn a_call_longer_than_the_queue_and_load_timeouts_is_answered() {
    let rt = runtime();
    let s =
        Server::start("grpc-long", &config(), &["--acquire-timeout", "300ms", "--queue-timeout", "100ms"]);
    let mut c = rt.block_on(connect(&s)).max_decoding_message_size(64 << 20);
    let r = reference("mlp-10m");
    // Its first load may outlast these timeouts (a fresh state_dir, a busy machine): the
    // load goes on after the 503, so ask again until it is in.
    let loaded = (0..150).any(|_| {
        rt.block_on(c.model_infer(good(&r))).is_ok() || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            false
        }
    });
    assert!(loaded, "the model loads within 30 s");
    // 20,000 rows: over a second on 2 cores, against the 0.4 s of the two timeouts.
    let (rows, width) = (20_000usize, r.shape[1] as usize);
    let data: Vec<u8> = (0..rows * width).flat_map(|i| ((i % 7) as f32 * 0.1).to_le_bytes()).collect();
    let shape = [rows as i64, width as i64];
    let started = std::time::Instant::now();
    let answer = rt.block_on(c.model_infer(raw("mlp", vec![input("x", "FP32", &shape)], vec![data])));
    let took = started.elapsed();
    let answer = answer.unwrap_or_else(|e| panic!("cut after {took:?}: {e:?}")).into_inner();
    assert_eq!(answer.outputs[0].shape[0], rows as i64);
    eprintln!("{rows} rows over gRPC in {took:?}");
}

/// With API keys set, a call without one is refused from its metadata, before its
/// message is read: a message over max_request_size (which the limit layer would refuse
/// from its frame header, i.e. after the call got that far) is UNAUTHENTICATED without a
/// key and RESOURCE_EXHAUSTED with one; readiness needs no key.
#[test]
fn a_call_without_its_key_is_refused_before_its_message_is_read() {
    let rt = runtime();
    let s = Server::start("grpc-keys", &config(), &["--api-keys", "k1", "--max-request-size", "1MiB"]);
    let mut c = rt.block_on(connect(&s));
    let big = raw("mlp", vec![input("x", "FP32", &[1024, 512])], vec![vec![0u8; 2 << 20]]);
    let call = |key: Option<&str>| {
        let mut req = tonic::Request::new(big.clone());
        if let Some(k) = key {
            req.metadata_mut().insert("authorization", format!("Bearer {k}").parse().expect("metadata"));
        }
        let mut c = c.clone();
        rt.block_on(c.model_infer(req)).expect_err("refused").code()
    };
    assert_eq!(call(None), Code::Unauthenticated);
    assert_eq!(call(Some("wrong")), Code::Unauthenticated);
    assert_eq!(call(Some("k1")), Code::ResourceExhausted);
    assert!(rt.block_on(c.server_ready(ServerReadyRequest {})).expect("ready").into_inner().ready);
}
