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
//!
//! This file holds the plan (5., then 1.-4. in children, 6., 7.) and what the phases
//! share (profiles, model files, inputs); `child.rs` is 1.-4., `cycles.rs` 6.,
//! `server.rs` 7., and `report.rs` the table and the targets.

#[path = "../../tests/common/mod.rs"]
mod common;

mod child;
mod cycles;
mod report;
mod server;

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{anyhow, bail, ensure, Context};
use common::{models_dir, ort_dylib, reference};
use serde::{Deserialize, Serialize};
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Device, LoadSpec, Tensor, TensorData, Weights};

use child::{child_main, run_child};
use cycles::load_cycles;
use report::{
    load_average, ms, print_conversion, print_cycles, print_prepacked_copies, print_report, print_targets,
};
use server::server_swaps;

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
        low_cpu_priority: false,
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

/// The largest `|a - b|`; infinite for outputs of different lengths and NaN when either
/// holds a NaN, so a `<=` check on it fails for a broken output.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |worst, d| if d > worst || d.is_nan() { d } else { worst })
}
