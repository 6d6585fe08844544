//! Protocol benchmark (not a test): gRPC vs REST JSON vs REST binary tensor data, each
//! beside in-process ONNX Runtime measured in the same run.
//!
//! `mlp-10m` with `x` of [1,256] and [64,256] FP32; closed-loop clients (1 and 8), each
//! sending its next request when the last one is answered, for `SNOOZE_BENCH_SECS`
//! (default 3) per row. In-process = the same model loaded through `OrtBackend` and
//! called from the same number of threads. Every path's output is checked against the
//! in-process one first (bit for bit). Prints req/s, p50, p99 and the ratio of req/s to
//! in-process at the same shape and concurrency.
//!
//! ```text
//! make bench-protocols      # or: cargo bench -p snooze-server --bench protocols
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::{
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context};
use common::{client, models_dir, Server};
use serde_json::json;
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Device, LoadSpec, LoadedModel, Tensor, TensorData};
use snooze_server::grpc::proto::{
    grpc_inference_service_client::GrpcInferenceServiceClient, model_infer_request::InferInputTensor,
    ModelInferRequest,
};

const MODEL: &str = "mlp-10m";
const WIDTH: usize = 256;
const ROWS: [usize; 2] = [1, 64];
const CLIENTS: [usize; 2] = [1, 8];

#[derive(Clone, Copy, Debug)]
enum Path {
    InProcess,
    Grpc,
    RestJson,
    RestBinary,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::InProcess => "in-process ORT",
            Path::Grpc => "gRPC (raw)",
            Path::RestJson => "REST JSON",
            Path::RestBinary => "REST binary",
        }
    }
}

struct Row {
    path: Path,
    rows: usize,
    clients: usize,
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("protocols: a benchmark; run it with `cargo bench -p snooze-server --bench protocols`");
        return Ok(());
    }
    let secs: f64 = std::env::var("SNOOZE_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let per_row = Duration::from_secs_f64(secs);
    let models = models_dir();
    let backend = OrtBackend::new(None).map_err(anyhow::Error::msg)?;
    let model: Arc<dyn LoadedModel> = backend
        .load(&LoadSpec {
            name: MODEL.into(),
            path: models.join(MODEL),
            device: Device::Cpu,
            intra_op_threads: 0,
            instances: 1,
            weights: snooze_core::Weights::Prepacked,
            low_cpu_priority: false,
        })
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Batches up to 512 rows: a [64,256] request runs whole, as it does in-process
    // (the default max_batch_size of 32 would run it in two micro-batches).
    let toml = format!(
        "[models.{MODEL}]\npath = \"{}\"\nweights = \"prepacked\"\nmax_batch_size = 512\n",
        models.join(MODEL).display()
    );
    let server = Server::start("bench-protocols", &toml, &[]);
    let grpc_addr = server.grpc.clone().context("the server reported no gRPC address")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    let mut report = Vec::new();
    for rows in ROWS {
        let x: Vec<f32> = (0..rows * WIDTH).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let want = in_process(model.as_ref(), &x, rows)?;
        // Every path answers the same bits before it is timed.
        ensure!(rest(&server, &x, rows, false)? == want, "REST JSON output differs from in-process");
        ensure!(rest(&server, &x, rows, true)? == want, "REST binary output differs from in-process");
        let mut g = rt.block_on(connect(&grpc_addr))?;
        ensure!(rt.block_on(grpc(&mut g, &x, rows))? == want, "gRPC output differs from in-process");
        for clients in CLIENTS {
            for path in [Path::InProcess, Path::Grpc, Path::RestJson, Path::RestBinary] {
                let lat = match path {
                    Path::Grpc => rt.block_on(grpc_loop(&grpc_addr, &x, rows, clients, per_row))?,
                    _ => thread_loop(clients, per_row, |_| {
                        let m = model.clone();
                        let (x, s) = (x.clone(), &server);
                        move || match path {
                            Path::InProcess => in_process(m.as_ref(), &x, rows).map(drop),
                            Path::RestJson => rest(s, &x, rows, false).map(drop),
                            _ => rest(s, &x, rows, true).map(drop),
                        }
                    })?,
                };
                report.push(row(path, rows, clients, per_row, lat));
            }
        }
    }
    print_report(&report);
    Ok(())
}

fn in_process(model: &dyn LoadedModel, x: &[f32], rows: usize) -> anyhow::Result<Vec<f32>> {
    let input = Tensor::new("x", vec![rows as i64, WIDTH as i64], TensorData::Fp32(x.to_vec()));
    let out = model.infer(&[input], &[]).map_err(|e| anyhow::anyhow!("{e}"))?;
    match out.into_iter().next().map(|t| t.data) {
        Some(TensorData::Fp32(v)) => Ok(v),
        other => bail!("unexpected output {other:?}"),
    }
}

fn rest(s: &Server, x: &[f32], rows: usize, binary: bool) -> anyhow::Result<Vec<f32>> {
    let url = s.url(&format!("/v2/models/{MODEL}/infer"));
    let c = client();
    let resp = if binary {
        let header = serde_json::to_vec(&json!({
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, WIDTH],
                        "parameters": {"binary_data_size": x.len() * 4}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": true}}],
        }))?;
        let mut body = header.clone();
        body.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        c.post(url).header("inference-header-content-length", header.len()).body(body).send()?
    } else {
        c.post(url)
            .json(&json!({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, WIDTH], "data": x}]}))
            .send()?
    };
    ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    if binary {
        let json_len: usize = resp
            .headers()
            .get("inference-header-content-length")
            .context("no header length")?
            .to_str()?
            .parse()?;
        let bytes = resp.bytes()?;
        Ok(bytes[json_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    } else {
        let v: serde_json::Value = resp.json()?;
        Ok(serde_json::from_value(v["outputs"][0]["data"].clone())?)
    }
}

/// A client as grpcio configures one: windows that do not stall a 64 KiB tensor.
async fn connect(addr: &str) -> anyhow::Result<GrpcInferenceServiceClient<tonic::transport::Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .http2_adaptive_window(true)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        .connect()
        .await?;
    Ok(GrpcInferenceServiceClient::new(channel).max_decoding_message_size(usize::MAX))
}

fn grpc_request(x: &[f32], rows: usize) -> ModelInferRequest {
    ModelInferRequest {
        model_name: MODEL.into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![rows as i64, WIDTH as i64],
            ..Default::default()
        }],
        raw_input_contents: vec![x.iter().flat_map(|v| v.to_le_bytes()).collect()],
        ..Default::default()
    }
}

async fn grpc(
    c: &mut GrpcInferenceServiceClient<tonic::transport::Channel>,
    x: &[f32],
    rows: usize,
) -> anyhow::Result<Vec<f32>> {
    let resp = c.model_infer(grpc_request(x, rows)).await?.into_inner();
    let raw = resp.raw_output_contents.first().context("no raw output")?;
    Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// `clients` gRPC clients, each on its own connection, each sending back to back.
async fn grpc_loop(
    addr: &str,
    x: &[f32],
    rows: usize,
    clients: usize,
    run_for: Duration,
) -> anyhow::Result<Vec<Duration>> {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = connect(addr).await?;
        let x = x.to_vec();
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                grpc(&mut c, &x, rows).await?; // warm up
            }
            let mut lat = Vec::new();
            let end = Instant::now() + run_for;
            while Instant::now() < end {
                let t = Instant::now();
                c.model_infer(grpc_request(&x, rows)).await?;
                lat.push(t.elapsed());
            }
            anyhow::Ok(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// `clients` threads, each calling `make(i)()` back to back.
fn thread_loop<F, G>(clients: usize, run_for: Duration, make: F) -> anyhow::Result<Vec<Duration>>
where
    F: Fn(usize) -> G,
    G: FnMut() -> anyhow::Result<()> + Send,
{
    let barrier = Barrier::new(clients);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let mut call = make(i);
                let barrier = &barrier;
                scope.spawn(move || {
                    for _ in 0..5 {
                        call()?; // warm up
                    }
                    barrier.wait();
                    let mut lat = Vec::new();
                    let end = Instant::now() + run_for;
                    while Instant::now() < end {
                        let t = Instant::now();
                        call()?;
                        lat.push(t.elapsed());
                    }
                    anyhow::Ok(lat)
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??);
        }
        Ok(all)
    })
}

fn row(path: Path, rows: usize, clients: usize, run_for: Duration, mut lat: Vec<Duration>) -> Row {
    lat.sort();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied();
    Row {
        path,
        rows,
        clients,
        per_sec: lat.len() as f64 / run_for.as_secs_f64(),
        p50: pct(0.50).unwrap_or_default(),
        p99: pct(0.99).unwrap_or_default(),
    }
}

fn print_report(rows: &[Row]) {
    println!();
    println!("protocols: {MODEL}, x [N,{WIDTH}] FP32, closed-loop clients; ratio = req/s vs in-process ORT at the same shape and clients");
    println!("| x | clients | path | req/s | p50 ms | p99 ms | vs in-process |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let base = rows
            .iter()
            .find(|b| matches!(b.path, Path::InProcess) && b.rows == r.rows && b.clients == r.clients)
            .map_or(f64::NAN, |b| b.per_sec);
        println!(
            "| [{},{WIDTH}] | {} | {} | {:.0} | {:.3} | {:.3} | {:.2}x |",
            r.rows,
            r.clients,
            r.path.label(),
            r.per_sec,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.per_sec / base
        );
    }
}
