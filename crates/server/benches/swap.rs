//! Swap benchmark (not a test): what each way of holding an ONNX model's weights
//! (`weights = "prepacked" | "compact" | "mapped"`) costs in memory and buys in
//! swap time, against ONNX Runtime used directly.
//!
//! A server that cannot keep every model resident evicts and reloads all day, so the
//! two figures that matter are how much RAM a resident model takes and how long a
//! request for an evicted model waits. For the 100 MiB demo MLP (`mlp-100m-1`; `-2` and
//! `-3` where several models are resident) and for each of
//!
//! - *raw ORT*: the `ort` crate alone, `Session::builder(&env)?.commit_from_file(model.onnx)`
//!   with default options — the baseline;
//! - *prepacked (.onnx)*: `OrtBackend` without a cache directory (what the server does
//!   for a `prepacked` model when no ORT-format copy exists);
//! - *prepacked*, *compact*, *mapped*: `OrtBackend::new(None)?.with_cache_dir(tmp)` +
//!   `Backend::load` with that profile (prepacked then reads the cached ORT-format copy);
//!
//! it measures, each in a fresh child process of this binary (ONNX Runtime allows one
//! environment per process, and a fresh process keeps the RSS deltas clean):
//!
//! 1. resident memory per model ÷ `.onnx` size: three models loaded and run once at
//!    batch 8 (mapped pages are touched), `VmRSS`, `RssAnon`, `RssFile` deltas ÷ 3;
//! 2. load time: median of 5 loads (dropped and heap trimmed between them);
//! 3. time to first response after an eviction: load + one batch-1 run, median of 5;
//! 4. run time at batch 1 and 8 (`x` FP32 [1,256] / [8,256]), median of 50 runs;
//!
//! with every model file (and its ORT-format copy) in the page cache and the one-time
//! conversion already done — it is timed separately (5.), per model. Then, in this
//! process:
//!
//! 6. `SNOOZE_SWAP_CYCLES` (1000) load / one run / drop / `trim_heap` cycles of
//!    `mlp-100m-1`, rotating through the three profiles: RSS growth (target < 20 MiB)
//!    and the time taken;
//! 7. the real `snooze` binary with two 100 MiB models and `max_loaded_models = 1`:
//!    after both were loaded once, `SNOOZE_SWAP_REQUESTS` (20) requests alternating
//!    m1, m2, m1, ... so every one is an eviction + load + first run, timed from send
//!    to response; once with `weights = "mapped"`, once with `"prepacked"`.
//!
//! Every batch-8 output is checked against raw ORT's (1e-5 of its largest magnitude)
//! and every batch-1 output against numpy's. One table, the targets with meets /
//! misses, all from the same run. Run it with `make bench-swap`, or:
//!
//! ```text
//! ORT_DYLIB_PATH=$PWD/.venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.1.32.0 \
//!     cargo bench -p snooze-server --bench swap
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context};
use common::{client, models_dir, ort_dylib, reference, Server};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Device, LoadSpec, LoadedModel, Tensor, TensorData, Weights};

/// The model every per-model figure is about.
const MODEL: &str = "mlp-100m-1";
/// Resident together for the memory figures.
const RESIDENT: [&str; 3] = ["mlp-100m-1", "mlp-100m-2", "mlp-100m-3"];
/// Loaded once in each child before anything is measured: the runtime's one-time
/// costs (kernel registries, thread pool, first-run allocations) stay out of the deltas.
const WARM_UP_MODEL: &str = "mlp-10m";
const LOADS: usize = 5;
const RUNS: usize = 50;
const RUN_WARM_UP: usize = 5;
/// A profile's batch-8 output vs raw ORT's, relative to the largest output magnitude.
const REL_TOLERANCE: f32 = 1e-5;
/// A batch-1 output vs numpy's `reference.json`.
const NUMPY_TOLERANCE: f32 = 1e-4;
/// Runs this binary as a measuring child: `--swap-child <profile> <cache dir>`.
const CHILD_ARG: &str = "--swap-child";

const MIB: f64 = 1048576.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Profile {
    Raw,
    PrepackedOnnx,
    Prepacked,
    Compact,
    Mapped,
}

impl Profile {
    const ALL: [Profile; 5] =
        [Profile::Raw, Profile::PrepackedOnnx, Profile::Prepacked, Profile::Compact, Profile::Mapped];

    fn arg(self) -> &'static str {
        match self {
            Profile::Raw => "raw",
            Profile::PrepackedOnnx => "prepacked-onnx",
            Profile::Prepacked => "prepacked",
            Profile::Compact => "compact",
            Profile::Mapped => "mapped",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Profile::Raw => "raw ORT (baseline)",
            Profile::PrepackedOnnx => "prepacked (.onnx)",
            Profile::Prepacked => "prepacked",
            Profile::Compact => "compact",
            Profile::Mapped => "mapped",
        }
    }

    fn parse(s: &str) -> Option<Profile> {
        Profile::ALL.into_iter().find(|p| p.arg() == s)
    }

    fn weights(self) -> Weights {
        match self {
            Profile::Raw | Profile::PrepackedOnnx | Profile::Prepacked => Weights::Prepacked,
            Profile::Compact => Weights::Compact,
            Profile::Mapped => Weights::Mapped,
        }
    }
}

/// What a child measured (1.-4.), sent back as one JSON line on its stdout.
#[derive(Serialize, Deserialize)]
struct ChildReport {
    /// Per resident model, MiB: VmRSS, RssAnon and RssFile deltas ÷ 3.
    rss_mib: f64,
    anon_mib: f64,
    file_mib: f64,
    load_ms: Vec<f64>,
    ttfr_ms: Vec<f64>,
    run1_ms: Vec<f64>,
    run8_ms: Vec<f64>,
    /// `MODEL`'s output at batch 8, for the comparison with raw ORT.
    out8: Vec<f32>,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == CHILD_ARG) {
        return child_main(&args[i + 1..]);
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: stay quick there.
    if !args.iter().any(|a| a == "--bench") {
        eprintln!("swap: a benchmark; run it with `cargo bench -p snooze-server --bench swap`");
        return Ok(());
    }
    let started = Instant::now();
    let dylib = ort_dylib();
    let models = models_dir();
    let cycles: usize = env_number("SNOOZE_SWAP_CYCLES", 1000);
    let requests: usize = env_number("SNOOZE_SWAP_REQUESTS", 20);
    let cache = TempDir::new("snooze-swap-cache")?;
    let backend = OrtBackend::new(None).map_err(anyhow::Error::msg)?.with_cache_dir(cache.path());
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let load_at_start = load_average();

    // 5. The one-time conversion, per model (compact and mapped share its result).
    let mut conversions = Vec::new();
    let mut prepacked_copies = Vec::new();
    for name in RESIDENT {
        warm_page_cache(&[onnx_file(&models, name)?])?;
        let t = Instant::now();
        backend.prepare(&spec(&models, name, Weights::Mapped)).map_err(|e| anyhow!("{e}"))?;
        conversions.push(t.elapsed());
        snooze_core::memory::trim_heap();
        eprintln!("  converted {name} to the ORT format in {:.0} ms", ms(conversions[conversions.len() - 1]));
        // And the prepacked copy (prepacked weights in a mapped data file).
        let t = Instant::now();
        backend.prepare(&spec(&models, name, Weights::Prepacked)).map_err(|e| anyhow!("{e}"))?;
        prepacked_copies.push(t.elapsed());
        snooze_core::memory::trim_heap();
    }
    let onnx_bytes = std::fs::metadata(onnx_file(&models, MODEL)?)?.len();
    let ort_bytes = std::fs::metadata(ort_copy(cache.path(), MODEL)?)?.len();

    // 1.-4., one child process per profile.
    let mut reports = Vec::new();
    for p in Profile::ALL {
        eprintln!("  measuring {} in a child process", p.label());
        reports.push((p, run_child(p, cache.path())?));
    }

    // 6. Load / unload cycles in this process.
    let cycles = load_cycles(&backend, &models, cache.path(), cycles)?;

    // 7. The real server: every request an eviction + a load.
    let mut served = Vec::new();
    for weights in ["mapped", "prepacked"] {
        eprintln!("  server, weights = \"{weights}\": {requests} alternating requests");
        served.push(server_swaps(&models, weights, requests)?);
    }

    println!(
        "\nswap: {MODEL} (.onnx {:.1} MiB, ORT-format copy {:.1} MiB); resident: {}; {cpus} CPUs, load average {load_at_start}",
        onnx_bytes as f64 / MIB,
        ort_bytes as f64 / MIB,
        RESIDENT.join(", ")
    );
    println!("ONNX Runtime: {dylib}");
    let outputs_ok = print_report(&reports, &served, onnx_bytes);
    print_conversion(&conversions);
    print_prepacked_copies(&prepacked_copies);
    print_cycles(&cycles);
    print_targets(&reports, &served, &cycles, onnx_bytes);
    println!(
        "\n(total bench time {:.1} s; load average at the end {})",
        started.elapsed().as_secs_f64(),
        load_average()
    );
    ensure!(outputs_ok, "a profile's output differs from raw ORT's (see above)");
    for s in &served {
        ensure!(s.exit_ok, "the server ({}) did not exit cleanly after SIGTERM", s.weights);
    }
    Ok(())
}

fn env_number(key: &str, default: usize) -> usize {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A directory removed when dropped, also when the bench fails.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> anyhow::Result<TempDir> {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(TempDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spec(models: &Path, name: &str, weights: Weights) -> LoadSpec {
    LoadSpec {
        name: name.into(),
        path: models.join(name),
        device: Device::Cpu,
        intra_op_threads: 0,
        instances: 1,
        weights,
    }
}

fn onnx_file(models: &Path, name: &str) -> anyhow::Result<PathBuf> {
    snooze_backend_ort::resolve_model_file(&models.join(name)).map_err(anyhow::Error::msg)
}

/// The ORT-format copy of `name` in the backend's cache (`<name>-<hash>.ort`).
fn ort_copy(cache: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let prefix = format!("{name}-");
    for entry in std::fs::read_dir(cache).with_context(|| format!("read {}", cache.display()))? {
        let path = entry?.path();
        let file = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let rest = file.strip_prefix(&prefix).unwrap_or_default();
        // `mlp-100m-1-` must not match `mlp-100m-10-...`: the rest is `<hash>.ort`.
        if rest.ends_with(".ort") && rest.chars().take_while(|c| *c != '.').all(|c| c.is_ascii_hexdigit()) {
            return Ok(path);
        }
    }
    bail!("no ORT-format copy of {name} in {}", cache.display())
}

/// Reads the files once, so loads read them from memory, not disk.
fn warm_page_cache(files: &[PathBuf]) -> anyhow::Result<()> {
    for f in files {
        drop(std::fs::read(f).with_context(|| format!("read {}", f.display()))?);
    }
    Ok(())
}

/// `/proc/self/status` in MiB: (VmRSS, RssAnon, RssFile).
fn rss_parts_mib() -> anyhow::Result<(f64, f64, f64)> {
    let text = std::fs::read_to_string("/proc/self/status")?;
    let kib = |key: &str| -> anyhow::Result<f64> {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse::<f64>().ok())
            .map(|k| k / 1024.0)
            .with_context(|| format!("no {key} in /proc/self/status"))
    };
    Ok((kib("VmRSS:")?, kib("RssAnon:")?, kib("RssFile:")?))
}

/// An input `x` of `rows` rows: `MODEL`'s reference row, scaled row by row (as in the
/// backend's weights test), so the rows differ. (Each model has its own reference.)
struct Input {
    shape: Vec<i64>,
    data: Vec<f32>,
}

impl Input {
    fn rows(rows: usize) -> Input {
        Input::rows_of(MODEL, rows)
    }

    fn rows_of(model: &str, rows: usize) -> Input {
        let r = reference(model);
        let width = r.input.len() / r.shape[0] as usize;
        let data = (0..rows)
            .flat_map(|i| r.input[..width].iter().map(move |x| x * (1.0 + i as f32 / 8.0)))
            .collect();
        Input { shape: vec![rows as i64, width as i64], data }
    }

    fn tensor(&self) -> Tensor {
        Tensor::new("x", self.shape.clone(), TensorData::Fp32(self.data.clone()))
    }
}

/// numpy's output for `name`'s reference row (`Input::rows_of(name, 1)`).
fn numpy_row(name: &str) -> Vec<f32> {
    let r = reference(name);
    let width = r.output.len() / r.shape[0] as usize;
    r.output[..width].to_vec()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

// ---------------------------------------------------------------------------------
// The child: 1.-4. for one profile.

/// How a child loads: the `ort` crate directly, or the backend with a profile.
enum Loader {
    Raw(ort::environment::Environment),
    Backend(OrtBackend, Weights),
}

enum Loaded {
    Raw(ort::session::Session),
    Backend(Arc<dyn LoadedModel>),
}

impl Loader {
    fn load(&self, models: &Path, name: &str) -> anyhow::Result<Loaded> {
        Ok(match self {
            Loader::Raw(env) => Loaded::Raw(
                ort::session::Session::builder(env)
                    .map_err(|e| anyhow!("{e}"))?
                    .commit_from_file(onnx_file(models, name)?)
                    .map_err(|e| anyhow!("{name}: {e}"))?,
            ),
            Loader::Backend(b, w) => {
                Loaded::Backend(b.load(&spec(models, name, *w)).map_err(|e| anyhow!("{e}"))?)
            }
        })
    }
}

impl Loaded {
    fn run(&mut self, x: &Input) -> anyhow::Result<Vec<f32>> {
        match self {
            Loaded::Raw(session) => {
                let view = ort::value::TensorRef::from_array_view((x.shape.clone(), x.data.as_slice()))
                    .map_err(|e| anyhow!("{e}"))?;
                let out = session.run(ort::inputs!["x" => view]).map_err(|e| anyhow!("{e}"))?;
                let y = out.get("y").context("no output y")?;
                let (_, data) = y.try_extract_tensor::<f32>().map_err(|e| anyhow!("{e}"))?;
                Ok(data.to_vec())
            }
            Loaded::Backend(m) => {
                let out = m.infer(&[x.tensor()], &[]).map_err(|e| anyhow!("{e}"))?;
                match out.into_iter().next().map(|t| t.data) {
                    Some(TensorData::Fp32(v)) => Ok(v),
                    other => bail!("unexpected output {other:?}"),
                }
            }
        }
    }
}

fn child_main(args: &[String]) -> anyhow::Result<()> {
    let [profile, cache] = args else { bail!("usage: {CHILD_ARG} <profile> <cache dir>") };
    let profile = Profile::parse(profile).with_context(|| format!("unknown profile {profile}"))?;
    let loader = match profile {
        Profile::Raw => {
            // Default options: ONNX Runtime as an application would use it.
            let env = ort::init_from(ort_dylib())
                .map_err(|e| anyhow!("{e}"))?
                .build()
                .map_err(|e| anyhow!("{e}"))?;
            Loader::Raw(env)
        }
        Profile::PrepackedOnnx => {
            Loader::Backend(OrtBackend::new(None).map_err(anyhow::Error::msg)?, Weights::Prepacked)
        }
        p => Loader::Backend(
            OrtBackend::new(None).map_err(anyhow::Error::msg)?.with_cache_dir(cache),
            p.weights(),
        ),
    };
    let report = measure(&loader, &models_dir(), Path::new(cache))?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn measure(loader: &Loader, models: &Path, cache: &Path) -> anyhow::Result<ChildReport> {
    let one = Input::rows(1);
    let eight = Input::rows(8);
    let trim = snooze_core::memory::trim_heap;
    let mut files = Vec::new();
    for name in RESIDENT.iter().chain([&WARM_UP_MODEL]) {
        files.push(onnx_file(models, name)?);
        files.extend(ort_copy(cache, name).ok());
    }
    warm_page_cache(&files)?;

    let mut warm = loader.load(models, WARM_UP_MODEL)?;
    warm.run(&eight)?;
    drop(warm);
    trim();

    // 1. Three models resident, each run once at batch 8.
    let (rss0, anon0, file0) = rss_parts_mib()?;
    let mut resident = Vec::new();
    let mut out8 = Vec::new();
    for name in RESIDENT {
        let mut m = loader.load(models, name)?;
        let out = m.run(&eight)?;
        if name == MODEL {
            out8 = out;
        }
        resident.push(m);
    }
    let (rss1, anon1, file1) = rss_parts_mib()?;
    drop(resident);
    trim();
    let per_model = |a: f64, b: f64| (b - a) / RESIDENT.len() as f64;

    // 2. Load time.
    warm_page_cache(&files)?;
    let mut load_ms = Vec::new();
    for _ in 0..LOADS {
        let t = Instant::now();
        let m = loader.load(models, MODEL)?;
        load_ms.push(ms(t.elapsed()));
        drop(m);
        trim();
    }

    // 3. Time to first response after an eviction: load + one batch-1 run.
    let want = numpy_row(MODEL);
    let mut ttfr_ms = Vec::new();
    for _ in 0..LOADS {
        let t = Instant::now();
        let mut m = loader.load(models, MODEL)?;
        let out = m.run(&one)?;
        ttfr_ms.push(ms(t.elapsed()));
        let diff = max_abs_diff(&out, &want);
        ensure!(diff <= NUMPY_TOLERANCE, "batch-1 output differs from numpy by {diff}");
        drop(m);
        trim();
    }

    // 4. Run time, batch 1 then batch 8.
    let mut m = loader.load(models, MODEL)?;
    let mut timed = |x: &Input| -> anyhow::Result<Vec<f64>> {
        for _ in 0..RUN_WARM_UP {
            m.run(x)?;
        }
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                m.run(x)?;
                Ok(ms(t.elapsed()))
            })
            .collect()
    };
    let run1_ms = timed(&one)?;
    let run8_ms = timed(&eight)?;
    drop(m);

    Ok(ChildReport {
        rss_mib: per_model(rss0, rss1),
        anon_mib: per_model(anon0, anon1),
        file_mib: per_model(file0, file1),
        load_ms,
        ttfr_ms,
        run1_ms,
        run8_ms,
        out8,
    })
}

fn run_child(profile: Profile, cache: &Path) -> anyhow::Result<ChildReport> {
    let exe = std::env::current_exe().context("this benchmark's executable")?;
    let out = Command::new(exe)
        .arg(CHILD_ARG)
        .arg(profile.arg())
        .arg(cache)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("start the {} child", profile.arg()))?;
    ensure!(out.status.success(), "the {} child failed: {}", profile.arg(), out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).context("no report from the child")?;
    serde_json::from_str(line).with_context(|| format!("the {} child's report", profile.arg()))
}

// ---------------------------------------------------------------------------------
// 6. Load / unload cycles.

struct Cycles {
    n: usize,
    rss_before: f64,
    rss_after: f64,
    took: Duration,
    /// Mean cycle time per profile, ms: prepacked, compact, mapped.
    mean_ms: [f64; 3],
}

fn load_cycles(backend: &OrtBackend, models: &Path, cache: &Path, n: usize) -> anyhow::Result<Cycles> {
    const ROTATION: [Weights; 3] = [Weights::Prepacked, Weights::Compact, Weights::Mapped];
    let one = Input::rows(1);
    warm_page_cache(&[onnx_file(models, MODEL)?, ort_copy(cache, MODEL)?])?;
    let cycle = |w: Weights| -> anyhow::Result<()> {
        let m = backend.load(&spec(models, MODEL, w)).map_err(|e| anyhow!("{e}"))?;
        m.infer(&[one.tensor()], &[]).map_err(|e| anyhow!("{e}"))?;
        drop(m);
        snooze_core::memory::trim_heap();
        Ok(())
    };
    for w in ROTATION {
        cycle(w)?;
    }
    let (rss_before, _, _) = rss_parts_mib()?;
    let mut total = [Duration::ZERO; 3];
    let mut count = [0usize; 3];
    let t = Instant::now();
    for i in 0..n {
        let k = i % ROTATION.len();
        let c = Instant::now();
        cycle(ROTATION[k])?;
        total[k] += c.elapsed();
        count[k] += 1;
        if (i + 1) % 250 == 0 {
            eprintln!("  cycles: {} of {n}, RSS {:.1} MiB", i + 1, rss_parts_mib()?.0);
        }
    }
    let took = t.elapsed();
    let (rss_after, _, _) = rss_parts_mib()?;
    let mean = |k: usize| if count[k] == 0 { f64::NAN } else { ms(total[k]) / count[k] as f64 };
    Ok(Cycles { n, rss_before, rss_after, took, mean_ms: [mean(0), mean(1), mean(2)] })
}

// ---------------------------------------------------------------------------------
// 7. The real server.

struct Served {
    weights: &'static str,
    latencies: Vec<Duration>,
    loads: u64,
    evictions: u64,
    exit_ok: bool,
}

fn server_config(models: &Path, weights: &str) -> String {
    let mut c =
        String::from("[server]\nkeep_alive = \"-1\"\nmin_residency = \"0s\"\nmax_loaded_models = 1\n");
    for (name, dir) in [("m1", "mlp-100m-1"), ("m2", "mlp-100m-2")] {
        c +=
            &format!("[models.{name}]\npath = \"{}\"\nweights = \"{weights}\"\n", models.join(dir).display());
    }
    c
}

fn loads_and_evictions(cl: &reqwest::blocking::Client, server: &Server) -> anyhow::Result<(u64, u64)> {
    let admin: Value = cl.get(server.url("/admin/models")).send()?.error_for_status()?.json()?;
    let models = admin["models"].as_array().context("no models array in /admin/models")?;
    let sum = |key: &str| models.iter().map(|m| m[key].as_u64().unwrap_or(0)).sum::<u64>();
    Ok((sum("loads"), sum("evictions")))
}

fn server_swaps(models: &Path, weights: &'static str, n: usize) -> anyhow::Result<Served> {
    let case = |name: &'static str, file: &str| -> anyhow::Result<(&'static str, Vec<u8>, Vec<f32>)> {
        let one = Input::rows_of(file, 1);
        let body = serde_json::to_vec(
            &json!({"inputs": [{"name": "x", "shape": one.shape, "datatype": "FP32", "data": one.data}]}),
        )?;
        Ok((name, body, numpy_row(file)))
    };
    let cases = [case("m1", "mlp-100m-1")?, case("m2", "mlp-100m-2")?];
    warm_page_cache(&[onnx_file(models, "mlp-100m-1")?, onnx_file(models, "mlp-100m-2")?])?;
    let server = Server::start(&format!("swap-{weights}"), &server_config(models, weights), &[]);
    let cl = client();
    let request = |k: usize| -> anyhow::Result<Duration> {
        let (name, body, want) = &cases[k % 2];
        // The connection is open before the clock starts.
        ensure!(cl.get(server.url("/v2/health/ready")).send()?.status() == 200, "server not ready");
        let t = Instant::now();
        let resp = cl
            .post(server.url(&format!("/v2/models/{name}/infer")))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()?;
        let status = resp.status();
        let bytes = resp.bytes()?;
        let took = t.elapsed();
        ensure!(status == 200, "{name}: {status} {}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes)?;
        let diff = max_abs_diff(&common::floats(&v["outputs"][0]["data"]), want);
        ensure!(diff <= NUMPY_TOLERANCE, "{name} ({weights}): output differs from numpy by {diff}");
        Ok(took)
    };
    // Both loaded once (converted, for mapped) and swapped once more, untimed.
    for k in 0..4 {
        request(k)?;
    }
    let (loads0, evictions0) = loads_and_evictions(&cl, &server)?;
    let latencies = (0..n).map(request).collect::<anyhow::Result<Vec<_>>>()?;
    let (loads1, evictions1) = loads_and_evictions(&cl, &server)?;
    let status = server.terminate();
    Ok(Served {
        weights,
        latencies,
        loads: loads1.saturating_sub(loads0),
        evictions: evictions1.saturating_sub(evictions0),
        exit_ok: status.success(),
    })
}

// ---------------------------------------------------------------------------------
// The report.

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn report(reports: &[(Profile, ChildReport)], p: Profile) -> Option<&ChildReport> {
    reports.iter().find(|(q, _)| *q == p).map(|(_, r)| r)
}

fn served_ms(s: &Served) -> Vec<f64> {
    s.latencies.iter().map(|d| ms(*d)).collect()
}

/// The table and the output check; returns whether every output matched.
fn print_report(reports: &[(Profile, ChildReport)], served: &[Served], onnx_bytes: u64) -> bool {
    let file_mib = onnx_bytes as f64 / MIB;
    let raw = report(reports, Profile::Raw);
    let raw_load = raw.map_or(f64::NAN, |r| median(&r.load_ms));
    let raw_ttfr = raw.map_or(f64::NAN, |r| median(&r.ttfr_ms));
    let raw_b8 = raw.map_or(f64::NAN, |r| median(&r.run8_ms));
    println!(
        "\nPer profile ({MODEL}; in-process rows: each in a fresh process; files in the page cache, converted beforehand)"
    );
    println!(
        "{:<22} {:>7} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7}",
        "", "RSS", "anon", "file", "load", "TTFR", "TTFR", "TTFR ÷", "TTFR ÷", "run b1", "run b8", "b8 ÷"
    );
    println!(
        "{:<22} {:>7} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7}",
        "",
        "÷ file",
        "÷ file",
        "÷ file",
        "med ms",
        "med ms",
        "max ms",
        "raw load",
        "raw TTFR",
        "med ms",
        "med ms",
        "raw"
    );
    for (p, r) in reports {
        let ttfr = median(&r.ttfr_ms);
        let b8 = median(&r.run8_ms);
        println!(
            "{:<22} {:>7.3} {:>7.3} {:>7.3} {:>8.1} {:>8.1} {:>8.1} {:>7.3}x {:>7.3}x {:>7.2} {:>7.2} {:>6.2}x",
            p.label(),
            r.rss_mib / file_mib,
            r.anon_mib / file_mib,
            r.file_mib / file_mib,
            median(&r.load_ms),
            ttfr,
            max(&r.ttfr_ms),
            ttfr / raw_load,
            ttfr / raw_ttfr,
            median(&r.run1_ms),
            b8,
            b8 / raw_b8
        );
    }
    for s in served {
        let v = served_ms(s);
        let ttfr = median(&v);
        let blank = "";
        println!(
            "{:<22} {blank:>7} {blank:>7} {blank:>7} {blank:>8} {:>8.1} {:>8.1} {:>7.3}x {:>7.3}x",
            format!("server, {}", s.weights),
            ttfr,
            max(&v),
            ttfr / raw_load,
            ttfr / raw_ttfr,
        );
    }
    println!(
        "(RSS / anon / file: VmRSS / RssAnon / RssFile growth per resident model, 3 models each run once at batch 8, \
         ÷ the .onnx size {file_mib:.1} MiB. load: session creation, median of {LOADS}. TTFR: load + one batch-1 run, \
         median and max of {LOADS}. run: median of {RUNS}, x FP32 [1,256] / [8,256].)"
    );
    for s in served {
        println!(
            "(server, {}: {} requests alternating m1 = mlp-100m-1, m2 = mlp-100m-2 under max_loaded_models = 1, \
             send to response read; loads +{}, evictions +{} during them)",
            s.weights,
            s.latencies.len(),
            s.loads,
            s.evictions
        );
    }

    let Some(raw) = raw else {
        println!("\nOutputs: no raw ORT row to compare with");
        return false;
    };
    let scale = raw.out8.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut ok = true;
    let parts: Vec<String> = reports
        .iter()
        .filter(|(p, _)| *p != Profile::Raw)
        .map(|(p, r)| {
            let rel = max_abs_diff(&r.out8, &raw.out8) / scale;
            ok &= rel <= REL_TOLERANCE;
            format!("{} {rel:.1e}", p.arg())
        })
        .collect();
    println!(
        "\nOutputs at batch 8 vs raw ORT, max |diff| ÷ max |raw| (limit {REL_TOLERANCE:e}): {} — {}",
        parts.join(", "),
        if ok { "all within" } else { "MISMATCH" }
    );
    ok
}

fn print_conversion(conversions: &[Duration]) {
    let v: Vec<f64> = conversions.iter().map(|d| ms(*d)).collect();
    let list = RESIDENT.iter().zip(&v).map(|(m, t)| format!("{m} {t:.0}")).collect::<Vec<_>>().join(", ");
    println!(
        "One-time conversion to the ORT format (Backend::prepare; one copy serves compact and mapped): \
         median {:.0} ms ({list} ms)",
        median(&v)
    );
}

fn print_prepacked_copies(copies: &[Duration]) {
    let v: Vec<f64> = copies.iter().map(|d| ms(*d)).collect();
    let list = RESIDENT.iter().zip(&v).map(|(m, t)| format!("{m} {t:.0}")).collect::<Vec<_>>().join(", ");
    println!(
        "One-time prepacked copy (Backend::prepare for prepacked; weights prepacked into a mapped data file): \
         median {:.0} ms ({list} ms)",
        median(&v)
    );
}

fn print_cycles(c: &Cycles) {
    println!(
        "Cycles: {} load / batch-1 run / drop / trim_heap cycles of {MODEL} (prepacked, compact, mapped in turn) took \
         {:.1} s (mean per cycle: prepacked {:.1}, compact {:.1}, mapped {:.1} ms); RSS {:.1} -> {:.1} MiB ({:+.1} MiB)",
        c.n,
        c.took.as_secs_f64(),
        c.mean_ms[0],
        c.mean_ms[1],
        c.mean_ms[2],
        c.rss_before,
        c.rss_after,
        c.rss_after - c.rss_before
    );
}

fn print_targets(reports: &[(Profile, ChildReport)], served: &[Served], c: &Cycles, onnx_bytes: u64) {
    let line = |what: &str, value: String, ok: bool| {
        println!("{what:<56} {value:>10}  {}", if ok { "meets" } else { "misses" });
    };
    let get = |p: Profile, f: fn(&ChildReport) -> f64| report(reports, p).map_or(f64::NAN, f);
    let ttfr = |r: &ChildReport| median(&r.ttfr_ms);
    let load = |r: &ChildReport| median(&r.load_ms);
    let served_median =
        |w: &str| served.iter().find(|s| s.weights == w).map_or(f64::NAN, |s| median(&served_ms(s)));
    let onnx = onnx_bytes as f64 / MIB;
    println!("\nTargets (same run)");
    let compact_rss = get(Profile::Compact, |r| r.rss_mib) / onnx;
    line(
        "resident <= 1.15x weights (compact, RSS ÷ file)",
        format!("{compact_rss:.3}x"),
        compact_rss <= 1.15,
    );
    let mapped_anon = get(Profile::Mapped, |r| r.anon_mib) / onnx;
    line("anon <= 0.1x weights (mapped, RssAnon ÷ file)", format!("{mapped_anon:.3}x"), mapped_anon <= 0.1);
    let server_mapped = served_median("mapped");
    line(
        "TTFR after eviction <= 30 ms (mapped, server, median)",
        format!("{server_mapped:.1} ms"),
        server_mapped <= 30.0,
    );
    let raw_load = get(Profile::Raw, load);
    for p in [Profile::Compact, Profile::Mapped] {
        let r = get(p, ttfr) / raw_load;
        line(&format!("TTFR <= 0.5x raw session creation ({})", p.arg()), format!("{r:.3}x"), r <= 0.5);
    }
    let raw_ttfr = get(Profile::Raw, ttfr);
    let prepacked = get(Profile::Prepacked, ttfr) / raw_ttfr;
    line("TTFR prepacked <= raw creation + first run", format!("{prepacked:.3}x"), prepacked <= 1.0);
    println!(
        "  (info: prepacked from the .onnx {:.3}x raw; server prepacked {:.3}x raw)",
        get(Profile::PrepackedOnnx, ttfr) / raw_ttfr,
        served_median("prepacked") / raw_ttfr
    );
    let growth = c.rss_after - c.rss_before;
    line(&format!("RSS growth over {} cycles < 20 MiB", c.n), format!("{growth:+.1} MiB"), growth < 20.0);
}
