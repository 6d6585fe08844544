//! Hot-path benchmark (not a test): what the server costs on top of ONNX Runtime.
//!
//! 1. `mlp-10m` (input `x` FP32 [2,256]) called N times in-process through
//!    `OrtBackend` + `LoadedModel::infer`, sequentially and from C threads sharing it;
//! 2. the same N requests through the real `snooze` binary over keep-alive HTTP
//!    (KServe v2 JSON and binary tensor data), one client per thread;
//! 3. time to first response of an unloaded 100 MB model: session creation + one run
//!    in-process vs the server's first `infer` request (which loads the model).
//!
//! Everything runs in one process invocation and is printed as one table with the
//! ratios. Run it with `make bench`, or:
//!
//! ```text
//! ORT_DYLIB_PATH=$PWD/.venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.1.32.0 \
//!     cargo bench -p snooze-server --bench hot_path
//! ```
//!
//! `SNOOZE_BENCH_N` fixes N (default: what fits in about 3 s in-process, 2000..=10000).

#[path = "../tests/common/mod.rs"]
mod common;

use std::{
    path::Path,
    sync::{Arc, Barrier},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context};
use common::{client, infer_body, max_abs_diff, models_dir, ort_dylib, reference, Reference, Server};
use serde_json::{json, Value};
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Device, LoadSpec, LoadedModel, Tensor, TensorData};

const HOT_MODEL: &str = "mlp-10m";
const CONCURRENCY: usize = 4;
/// Time-to-first-response runs alternate raw / server, each on a model not loaded before.
const RAW_TTFR_MODELS: [&str; 3] = ["mlp-100m-1", "mlp-100m-2", "mlp-100m-4"];
const SERVER_TTFR_MODELS: [&str; 3] = ["mlp-100m-3", "mlp-100m-5", "mlp-100m-6"];
const TOLERANCE: f32 = 1e-4;
/// The hot-path rows are measured in this many interleaved slices.
const ROUNDS: usize = 5;
/// Calls before each measured slice (spread over the threads): connections, caches.
const WARM_UP: usize = 50;

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: stay quick there.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("hot_path: a benchmark; run it with `cargo bench -p snooze-server --bench hot_path`");
        return Ok(());
    }
    let dylib = ort_dylib();
    let models = models_dir();
    let hot_ref = reference(HOT_MODEL);
    let backend = OrtBackend::new(None).map_err(anyhow::Error::msg)?;
    let started = Instant::now();

    // 1. The in-process baseline and 2. the server, side by side.
    let model = load(&backend, &models, HOT_MODEL)?;
    check_output(&infer_once(model.as_ref(), &hot_ref)?, &hot_ref, "in-process")?;
    let n = sample_size(model.as_ref(), &hot_ref)?;
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    println!(
        "hot_path: {HOT_MODEL}, x FP32 {:?}; N = {n} requests per row in {ROUNDS} interleaved rounds; \
         C = {CONCURRENCY}; {cpus} CPUs, load average {}",
        hot_ref.shape,
        load_average()
    );
    println!("ONNX Runtime: {dylib}");
    let server = Server::start("bench", &server_config(&models), &[]);
    let infer_url = server.url(&format!("/v2/models/{HOT_MODEL}/infer"));
    let json_body = serde_json::to_vec(&infer_body(&hot_ref))?;
    let (bin_body, bin_header_len) = binary_body(&hot_ref);
    // The first request loads the model; check both encodings once.
    let first = client()
        .post(&infer_url)
        .header("content-type", "application/json")
        .body(json_body.clone())
        .send()?;
    ensure!(first.status() == 200, "first infer: {} {}", first.status(), first.text()?);
    check_output(&common::floats(&first.json::<Value>()?["outputs"][0]["data"]), &hot_ref, "server JSON")?;
    check_output(
        &binary_output(send_binary(&client(), &infer_url, &bin_body, bin_header_len)?)?,
        &hot_ref,
        "server binary",
    )?;

    let input = Tensor::new("x", hot_ref.shape.clone(), TensorData::Fp32(hot_ref.input.clone()));
    let direct = |c: usize, n: usize| {
        let (model, input) = (model.clone(), input.clone());
        measure(
            "in-process ORT",
            n,
            c,
            || Ok(()),
            move |_: &mut ()| {
                model.infer(std::slice::from_ref(&input), &[]).map(drop).map_err(|e| anyhow::anyhow!("{e}"))
            },
        )
    };
    let http = |label: &str, c: usize, n: usize, binary: bool| {
        let (url, body) = (infer_url.clone(), if binary { bin_body.clone() } else { json_body.clone() });
        measure(
            label,
            n,
            c,
            || Ok(client()),
            move |cl: &mut reqwest::blocking::Client| {
                let resp = if binary {
                    send_binary(cl, &url, &body, bin_header_len)?
                } else {
                    cl.post(&url).header("content-type", "application/json").body(body.clone()).send()?
                };
                ensure!(resp.status() == 200, "infer: {}", resp.status());
                resp.bytes()?;
                Ok(())
            },
        )
    };
    let health_url = server.url("/v2/health/live");
    let floor = |n: usize| {
        measure(
            "HTTP floor: GET /v2/health/live",
            n,
            1,
            || Ok(client()),
            |cl| {
                let resp = cl.get(&health_url).send()?;
                ensure!(resp.status() == 200, "health: {}", resp.status());
                resp.bytes()?;
                Ok(())
            },
        )
    };
    // Every row gets a slice of each round, so a change in background load (other
    // processes on the machine) hits the in-process and the server rows alike.
    let per_round = n.div_ceil(ROUNDS);
    let mut rows: Vec<Row> = Vec::new();
    for round in 1..=ROUNDS {
        eprintln!("  round {round}/{ROUNDS}: {per_round} requests per row");
        let slices = [
            direct(1, per_round)?,
            http("server HTTP JSON", 1, per_round, false)?,
            http("server HTTP binary", 1, per_round, true)?,
            direct(CONCURRENCY, per_round)?,
            http("server HTTP JSON", CONCURRENCY, per_round, false)?,
            http("server HTTP binary", CONCURRENCY, per_round, true)?,
            floor(per_round)?,
        ];
        if rows.is_empty() {
            rows.extend(slices);
        } else {
            rows.iter_mut().zip(slices).for_each(|(row, slice)| row.merge(slice));
        }
    }
    rows.iter_mut().for_each(|r| r.latencies.sort_unstable());
    drop(model);

    // 3. Time to first response of an unloaded 100 MB model, alternating raw / server.
    let mut raw = Vec::new();
    let mut served = Vec::new();
    let cl = client();
    for (raw_model, server_model) in RAW_TTFR_MODELS.iter().zip(SERVER_TTFR_MODELS) {
        raw.push(raw_first_response(&backend, &models, raw_model)?);
        served.push(server_first_response(&server, &cl, &models, server_model)?);
    }
    let status = server.terminate();

    print_report(&rows);
    print_ttfr(&raw, &served);
    println!(
        "\n(total bench time {:.1} s; load average at the end {}; server stopped with SIGTERM: {status})",
        started.elapsed().as_secs_f64(),
        load_average()
    );
    ensure!(status.success(), "the server exited with {status} after SIGTERM");
    Ok(())
}

/// `mlp-10m` for the hot path and the 100 MB models for the first responses; kept
/// loaded until unloaded explicitly, as a production hot model would be.
fn server_config(models: &Path) -> String {
    let mut c = String::from("[server]\nkeep_alive = \"-1\"\nmin_residency = \"0s\"\n");
    for m in std::iter::once(HOT_MODEL).chain(SERVER_TTFR_MODELS) {
        c += &format!("[models.{m}]\npath = \"{}\"\n", models.join(m).display());
    }
    c
}

fn load(backend: &OrtBackend, models: &Path, name: &str) -> anyhow::Result<Arc<dyn LoadedModel>> {
    let spec = LoadSpec {
        name: name.into(),
        path: models.join(name),
        device: Device::Cpu,
        intra_op_threads: 0,
        instances: 1,
        weights: snooze_core::Weights::Prepacked,
        low_cpu_priority: false,
    };
    backend.load(&spec).map_err(|e| anyhow::anyhow!("{e}"))
}

fn infer_once(model: &dyn LoadedModel, r: &Reference) -> anyhow::Result<Vec<f32>> {
    let input = Tensor::new("x", r.shape.clone(), TensorData::Fp32(r.input.clone()));
    let out = model.infer(&[input], &[]).map_err(|e| anyhow::anyhow!("{e}"))?;
    match out.into_iter().next().map(|t| t.data) {
        Some(TensorData::Fp32(v)) => Ok(v),
        other => bail!("unexpected output {other:?}"),
    }
}

fn check_output(got: &[f32], r: &Reference, what: &str) -> anyhow::Result<()> {
    ensure!(got.len() == r.output.len(), "{what}: {} outputs, expected {}", got.len(), r.output.len());
    let diff = max_abs_diff(got, &r.output);
    ensure!(diff <= TOLERANCE, "{what}: output differs from numpy by {diff}");
    Ok(())
}

/// N: `SNOOZE_BENCH_N`, else what takes ~3 s in-process, within 2000..=10000.
fn sample_size(model: &dyn LoadedModel, r: &Reference) -> anyhow::Result<usize> {
    if let Some(n) = std::env::var("SNOOZE_BENCH_N").ok().and_then(|v| v.parse().ok()) {
        return Ok(n);
    }
    let t = Instant::now();
    for _ in 0..200 {
        infer_once(model, r)?;
    }
    let per_call = t.elapsed().as_secs_f64() / 200.0;
    Ok(((3.0 / per_call) as usize).clamp(2000, 10_000))
}

/// Header JSON + raw little-endian input, asking for the output as binary too.
fn binary_body(r: &Reference) -> (Vec<u8>, usize) {
    let raw: Vec<u8> = r.input.iter().flat_map(|x| x.to_le_bytes()).collect();
    let header = json!({"inputs": [{"name": "x", "shape": r.shape, "datatype": "FP32",
        "parameters": {"binary_data_size": raw.len()}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": true}}]})
    .to_string();
    let len = header.len();
    let mut body = header.into_bytes();
    body.extend_from_slice(&raw);
    (body, len)
}

fn send_binary(
    cl: &reqwest::blocking::Client,
    url: &str,
    body: &[u8],
    header_len: usize,
) -> anyhow::Result<reqwest::blocking::Response> {
    Ok(cl
        .post(url)
        .header("Inference-Header-Content-Length", header_len)
        .header("content-type", "application/octet-stream")
        .body(body.to_vec())
        .send()?)
}

/// The `y` floats of a binary-data response.
fn binary_output(resp: reqwest::blocking::Response) -> anyhow::Result<Vec<f32>> {
    ensure!(resp.status() == 200, "binary infer: {}", resp.status());
    let json_len: usize = resp
        .headers()
        .get("inference-header-content-length")
        .context("no Inference-Header-Content-Length in the response")?
        .to_str()?
        .parse()?;
    let bytes = resp.bytes()?;
    ensure!(bytes.len() >= json_len, "binary response shorter than its JSON header");
    Ok(bytes[json_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// One row: N calls over C threads (each with its own state, e.g. an HTTP client).
struct Row {
    label: String,
    concurrency: usize,
    wall: Duration,
    /// Per-call latencies, sorted once every slice is in.
    latencies: Vec<Duration>,
}

impl Row {
    fn merge(&mut self, slice: Row) {
        self.wall += slice.wall;
        self.latencies.extend(slice.latencies);
    }

    fn rps(&self) -> f64 {
        self.latencies.len() as f64 / self.wall.as_secs_f64()
    }

    /// Nearest-rank percentile, in microseconds.
    fn pct_us(&self, p: f64) -> f64 {
        let n = self.latencies.len();
        let rank = ((p / 100.0 * n as f64).ceil() as usize).clamp(1, n);
        self.latencies[rank - 1].as_secs_f64() * 1e6
    }
}

fn measure<S>(
    label: &str,
    n: usize,
    c: usize,
    state: impl Fn() -> anyhow::Result<S> + Sync,
    call: impl Fn(&mut S) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<Row> {
    let per_thread = n.div_ceil(c);
    let barrier = Barrier::new(c + 1);
    let (wall, results) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..c)
            .map(|_| {
                let (barrier, state, call) = (&barrier, &state, &call);
                scope.spawn(move || {
                    let prepared = state().and_then(|mut s| {
                        for _ in 0..WARM_UP.div_ceil(c) {
                            call(&mut s)?;
                        }
                        Ok(s)
                    });
                    barrier.wait();
                    let mut s = prepared?;
                    let mut lat = Vec::with_capacity(per_thread);
                    for _ in 0..per_thread {
                        let t = Instant::now();
                        call(&mut s)?;
                        lat.push(t.elapsed());
                    }
                    anyhow::Ok(lat)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        (start.elapsed(), results)
    });
    let mut latencies = Vec::with_capacity(per_thread * c);
    for r in results {
        latencies.extend(r.map_err(|_| anyhow::anyhow!("{label}: a worker panicked"))??);
    }
    Ok(Row { label: label.to_string(), concurrency: c, wall, latencies })
}

/// Time to first response of an unloaded model, split where the parts are known.
struct FirstResponse {
    model: String,
    total: Duration,
    /// In-process only: session creation, then the one run.
    load: Option<Duration>,
}

/// The model file in the page cache, so both sides read it from memory, not disk.
fn warm_page_cache(models: &Path, name: &str) -> anyhow::Result<()> {
    let file = snooze_backend_ort::resolve_model_file(&models.join(name)).map_err(anyhow::Error::msg)?;
    drop(std::fs::read(&file).with_context(|| format!("read {}", file.display()))?);
    Ok(())
}

fn raw_first_response(backend: &OrtBackend, models: &Path, name: &str) -> anyhow::Result<FirstResponse> {
    let r = reference(name);
    warm_page_cache(models, name)?;
    let t = Instant::now();
    let model = load(backend, models, name)?;
    let load = t.elapsed();
    let out = infer_once(model.as_ref(), &r)?;
    let total = t.elapsed();
    check_output(&out, &r, name)?;
    drop(model);
    let first = FirstResponse { model: name.into(), total, load: Some(load) };
    eprintln!("  first response, raw    {name}: {:.1} ms", ms(total));
    Ok(first)
}

fn server_first_response(
    server: &Server,
    cl: &reqwest::blocking::Client,
    models: &Path,
    name: &str,
) -> anyhow::Result<FirstResponse> {
    let r = reference(name);
    let body = serde_json::to_vec(&infer_body(&r))?;
    warm_page_cache(models, name)?;
    // The connection is open before the clock starts, as in the hot path.
    ensure!(cl.get(server.url("/v2/health/ready")).send()?.status() == 200, "server not ready");
    let t = Instant::now();
    let resp = cl
        .post(server.url(&format!("/v2/models/{name}/infer")))
        .header("content-type", "application/json")
        .body(body)
        .send()?;
    let status = resp.status();
    let bytes = resp.bytes()?;
    let total = t.elapsed();
    ensure!(status == 200, "{name}: {status} {}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes)?;
    check_output(&common::floats(&v["outputs"][0]["data"]), &r, name)?;
    let unload =
        cl.post(server.url(&format!("/v2/repository/models/{name}/unload"))).json(&json!({})).send()?;
    ensure!(unload.status() == 200, "unload {name}: {}", unload.status());
    eprintln!("  first response, server {name}: {:.1} ms", ms(total));
    Ok(FirstResponse { model: name.into(), total, load: None })
}

fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn print_report(rows: &[Row]) {
    println!("\nHot path ({HOT_MODEL}, one request = one [2,256] FP32 inference)");
    println!("{:<34} {:>2} {:>10} {:>10} {:>10}", "", "C", "req/s", "p50 µs", "p99 µs");
    for r in rows {
        println!(
            "{:<34} {:>2} {:>10.0} {:>10.1} {:>10.1}",
            r.label,
            r.concurrency,
            r.rps(),
            r.pct_us(50.0),
            r.pct_us(99.0)
        );
    }
    println!("\nServer vs in-process, same C (same run)");
    println!("{:<34} {:>2} {:>11} {:>10} {:>10}", "", "C", "req/s ratio", "p50 +µs", "p99 +µs");
    let base = |c: usize| rows.iter().find(|r| r.label == "in-process ORT" && r.concurrency == c);
    for srv in rows.iter().filter(|r| r.label.starts_with("server")) {
        let Some(base) = base(srv.concurrency) else { continue };
        println!(
            "{:<34} {:>2} {:>10.3}x {:>+10.1} {:>+10.1}",
            srv.label,
            srv.concurrency,
            srv.rps() / base.rps(),
            srv.pct_us(50.0) - base.pct_us(50.0),
            srv.pct_us(99.0) - base.pct_us(99.0)
        );
    }
}

fn print_ttfr(raw: &[FirstResponse], served: &[FirstResponse]) {
    let list = |v: &[FirstResponse]| {
        v.iter().map(|f| format!("{} {:.1}", f.model, ms(f.total))).collect::<Vec<_>>().join(", ")
    };
    let raw_med = median(raw.iter().map(|f| f.total).collect());
    let load_med = median(raw.iter().filter_map(|f| f.load).collect());
    let srv_med = median(served.iter().map(|f| f.total).collect());
    println!("\nTime to first response, unloaded 100 MB model (median of {})", raw.len());
    println!(
        "raw: session creation + 1 run     {:>8.1} ms  (creation {:.1} ms; runs: {})",
        ms(raw_med),
        ms(load_med),
        list(raw)
    );
    println!("server: first infer request       {:>8.1} ms  (runs: {})", ms(srv_med), list(served));
    println!(
        "ratio server/raw                  {:>8.3}x  overhead {:+.1} ms",
        srv_med.as_secs_f64() / raw_med.as_secs_f64(),
        ms(srv_med) - ms(raw_med)
    );
}
