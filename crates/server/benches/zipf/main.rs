//! Zipf benchmark (not a test): many models, a memory budget, and clients that honour
//! Retry-After — what a scheduler change must improve, measured on the real binary.
//!
//! Real traffic over many models is skewed: a few are hot, most are cold. A server that
//! cannot keep them all loaded must decide which to keep, whom to make wait and whom to
//! refuse; this measures how much useful work comes out of that. Four runs, one process
//! tree, one table:
//!
//! a. *two-model budget*: six 100 MB models (`m1..m6` = `mlp-100m-1..6`),
//!    `max_loaded_models = 2`, `keep_alive = "-1"`; 8 closed-loop clients, each on its own
//!    keep-alive connection, each sending `SNOOZE_ZIPF_REQUESTS` (default 100) KServe v2
//!    JSON requests for a model drawn from a seeded Zipf(1.1) (rank 1 = `m1`);
//! b. *all resident*: the same mix and seeds with no cap (all six fit the default budget),
//!    so (a) / (b) is what the budget costs;
//! c. *hot model, batched* / *unbatched*: `m1` only, 8 clients × `SNOOZE_ZIPF_HOT_REQUESTS`
//!    (default 400) requests, defaults vs `max_batch_size = 1` in `[models.m1]` (a row is
//!    skipped, saying so, where the build does not know that key).
//!
//! Clients sleep Retry-After (capped at 30 s) on 429 / 503 and resend; any other answer, a
//! refusal without Retry-After and an output that differs from numpy's by more than 1e-4
//! are failures, counted and printed (the run goes on). Each run warms up first (one
//! request per model, so (a) and (b) both measure steady state), then times the clients:
//! goodput = 200s / wall time; latency per request from its first send to its final 200;
//! loads and evictions from `/admin/models` over the timed part; the server's peak VmRSS
//! sampled every 50 ms. A server that fails is reported and the next run goes on.
//!
//! A server that refuses most requests makes clients sleep most of the time (on the
//! baseline, run a. took 97 s at 10 requests per client: a quarter of an hour at 100), so
//! the clients of a run stop *starting* requests after `SNOOZE_ZIPF_MAX_SECS` (default 180, `0` = no
//! limit) and finish the one in flight; the table marks such a run with `*` and counts
//! the requests started. Goodput and latencies stay what they mean: served / wall time,
//! first send to final 200.
//!
//! ```text
//! make bench-zipf
//! # or, with the models and .venv prepared:
//! ORT_DYLIB_PATH=$PWD/.venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.1.32.0 \
//!     cargo bench -p snooze-server --bench zipf
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/common/closed_loop.rs"]
mod closed_loop;

use std::{
    panic::AssertUnwindSafe,
    path::Path,
    process::Command,
    sync::Barrier,
    time::{Duration, Instant},
};

use anyhow::Context;
use closed_loop::{loads_and_evictions, run_client, serve_one, RssSampler, Stats, Stop, Target, Zipf};
use common::{client, models_dir, ort_dylib, Server};

const CLIENTS: usize = 8;
const ZIPF_S: f64 = 1.1;
/// Client `c` of every Zipf run draws from `SplitMix64::new(SEED + c)`.
const SEED: u64 = 0x5EED_0000_0000_2111;
const RSS_EVERY: Duration = Duration::from_millis(50);
/// A request still refused this long after its run started fails, so a server that
/// refuses forever cannot hang the benchmark.
const RUN_GIVE_UP: Duration = Duration::from_secs(15 * 60);
/// What `max_batch_size = 1` prints where the build refuses the key.
const NO_MAX_BATCH: &str = "max_batch_size not supported by this build";
/// Default of `SNOOZE_ZIPF_MAX_SECS`: keeps the whole benchmark to a few minutes.
const DEFAULT_MAX_SECS: u64 = 180;

/// One row: a server config and what the clients send it.
struct Run {
    /// Printed in the table.
    label: &'static str,
    /// Short name for the server's temp dir.
    id: &'static str,
    config: String,
    /// (name in the config, generated model whose reference.json answers it); Zipf rank
    /// order.
    models: Vec<(String, String)>,
    requests_per_client: usize,
    /// Clients stop starting requests this long after the clock starts.
    time_limit: Option<Duration>,
}

/// What came of a run.
enum Outcome {
    Measured(Measured),
    Skipped(String),
    Failed(String),
}

struct Measured {
    wall: Duration,
    stats: Stats,
    loads: u64,
    evictions: u64,
    peak_rss: u64,
    exit: String,
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: stay quick there.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("zipf: a benchmark; run it with `cargo bench -p snooze-server --bench zipf`");
        return Ok(());
    }
    let requests = env_count("SNOOZE_ZIPF_REQUESTS", 100)?;
    let hot_requests = env_count("SNOOZE_ZIPF_HOT_REQUESTS", 400)?;
    let time_limit = match std::env::var("SNOOZE_ZIPF_MAX_SECS") {
        Err(_) => Some(DEFAULT_MAX_SECS),
        Ok(v) => Some(v.trim().parse::<u64>().with_context(|| {
            format!("SNOOZE_ZIPF_MAX_SECS must be a number of seconds (0 = no limit), not {v:?}")
        })?),
    }
    .filter(|&secs| secs > 0)
    .map(Duration::from_secs);
    let dylib = ort_dylib();
    let models = models_dir();
    let started = Instant::now();
    let zipf = Zipf::new(6, ZIPF_S);
    let mix: Vec<String> =
        (0..6).map(|k| format!("m{} {:.1}%", k + 1, 100.0 * zipf.probability(k))).collect();
    println!(
        "zipf: {CLIENTS} closed-loop clients; Zipf(s = {ZIPF_S}) over m1..m6 = mlp-100m-1..6: {}; \
         {requests} requests per client (hot: {hot_requests}), started within {}; seed {SEED:#x}; {} CPUs, load average {}",
        mix.join(", "),
        time_limit.map_or("no time limit".into(), |d| format!("{} s", d.as_secs())),
        std::thread::available_parallelism().map_or(0, usize::from),
        load_average()
    );
    println!("ONNX Runtime: {dylib}");

    let six: Vec<(String, String)> = (1..=6).map(|i| (format!("m{i}"), format!("mlp-100m-{i}"))).collect();
    let hot = vec![("m1".to_string(), "mlp-100m-1".to_string())];
    let runs = [
        Run {
            label: "a. two-model budget",
            id: "zipf-a",
            config: config(&models, &six, "max_loaded_models = 2\n", ""),
            models: six.clone(),
            requests_per_client: requests,
            time_limit,
        },
        Run {
            label: "b. all resident",
            id: "zipf-b",
            config: config(&models, &six, "", ""),
            models: six,
            requests_per_client: requests,
            time_limit,
        },
        Run {
            label: "c. hot model, batched",
            id: "zipf-c1",
            config: config(&models, &hot, "", ""),
            models: hot.clone(),
            requests_per_client: hot_requests,
            time_limit,
        },
        Run {
            label: "c. hot model, unbatched",
            id: "zipf-c2",
            config: config(&models, &hot, "", "max_batch_size = 1\n"),
            models: hot,
            requests_per_client: hot_requests,
            time_limit,
        },
    ];
    let mut outcomes = Vec::new();
    for run in &runs {
        eprintln!("{}: starting", run.label);
        let outcome = execute(run);
        match &outcome {
            Outcome::Measured(m) => eprintln!(
                "{}: {} served, {} failures in {:.1} s",
                run.label,
                m.stats.served(),
                m.stats.failures,
                m.wall.as_secs_f64()
            ),
            Outcome::Skipped(why) => eprintln!("{}: skipped: {why}", run.label),
            Outcome::Failed(why) => eprintln!("{}: FAILED: {why}", run.label),
        }
        outcomes.push(outcome);
    }
    print_table(&runs, &outcomes);
    print_ratios(&outcomes);
    println!(
        "\n(total bench time {:.1} s; load average at the end {})",
        started.elapsed().as_secs_f64(),
        load_average()
    );
    Ok(())
}

/// A positive count from the environment, else `default`.
fn env_count(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("{name} must be a positive integer, not {v:?}")),
    }
}

/// `keep_alive = "-1"` (a model leaves only by eviction) plus `server_extra`; every model
/// gets `model_extra`.
fn config(models: &Path, list: &[(String, String)], server_extra: &str, model_extra: &str) -> String {
    let mut c = format!("[server]\nkeep_alive = \"-1\"\n{server_extra}");
    for (name, file) in list {
        c += &format!("[models.{name}]\npath = \"{}\"\n{model_extra}", models.join(file).display());
    }
    c
}

/// Checks the config, starts the server, measures, stops it; never panics.
fn execute(run: &Run) -> Outcome {
    if let Err(why) = check_config(run) {
        return if unknown_max_batch(&why) {
            Outcome::Skipped(NO_MAX_BATCH.into())
        } else {
            Outcome::Failed(format!("config refused: {why}"))
        };
    }
    // `SNOOZE_ZIPF_SERVER_ARGS` adds flags to every server (e.g. `--intra-op-spinning false`).
    // Every server keeps its state (the ORT-format and prepacked copies of the models) in
    // one directory that outlives the run, as a server's state_dir does: the first run
    // after `make clean` converts the models (during warm-up); later ones start warm.
    let state = std::env::temp_dir().join("snooze-zipf-state");
    let extra = std::env::var("SNOOZE_ZIPF_SERVER_ARGS").unwrap_or_default();
    let mut extra: Vec<&str> = extra.split_whitespace().collect();
    let state_arg = state.display().to_string();
    if !extra.contains(&"--state-dir") {
        extra.extend(["--state-dir", state_arg.as_str()]);
    }
    let server = match std::panic::catch_unwind(|| Server::start(run.id, &run.config, &extra)) {
        Ok(s) => s,
        // In case a build checks the key only when serving (the panic carries its logs).
        Err(panic) if unknown_max_batch(&panic_message(&panic)) => {
            return Outcome::Skipped(NO_MAX_BATCH.into())
        }
        Err(panic) => return Outcome::Failed(format!("the server did not start: {}", panic_message(&panic))),
    };
    let measured = std::panic::catch_unwind(AssertUnwindSafe(|| measure(&server, run)));
    let exit = match std::panic::catch_unwind(AssertUnwindSafe(|| server.terminate())) {
        Ok(status) => status.to_string(),
        Err(panic) => format!("did not stop after SIGTERM: {}", panic_message(&panic)),
    };
    match measured {
        Ok(Ok(m)) => Outcome::Measured(Measured { exit, ..m }),
        Ok(Err(e)) => Outcome::Failed(format!("{e:#} (server: {exit})")),
        Err(panic) => Outcome::Failed(format!("{} (server: {exit})", panic_message(&panic))),
    }
}

/// serde's words for a key the build does not know: "unknown field `max_batch_size`".
fn unknown_max_batch(error: &str) -> bool {
    error.contains("unknown field `max_batch_size`")
}

/// `snooze check` on the run's config: an unknown key is refused here, before any
/// server starts.
fn check_config(run: &Run) -> Result<(), String> {
    let path = std::env::temp_dir().join(format!("snooze-{}-check-{}.toml", run.id, std::process::id()));
    std::fs::write(&path, &run.config).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let out = Command::new(env!("CARGO_BIN_EXE_snooze"))
        .arg("check")
        .arg(&path)
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .map_err(|e| format!("cannot run snooze check: {e}"));
    let _ = std::fs::remove_file(&path);
    let out = out?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr).trim(),
        String::from_utf8_lossy(&out.stdout).trim()
    ))
}

/// Warm-up (one request per model, in rank order), then the timed closed loop.
fn measure(server: &Server, run: &Run) -> anyhow::Result<Measured> {
    let targets: Vec<Target> =
        run.models.iter().map(|(name, file)| Target::new(&server.base, name, file)).collect();
    let zipf = Zipf::new(targets.len(), ZIPF_S);
    let give_up = Instant::now() + RUN_GIVE_UP;
    let http = client();
    let mut warm = Stats::default();
    for t in &targets {
        serve_one(&http, t, Some(give_up), &mut warm);
    }
    eprintln!(
        "  warm-up: {} of {} served, {} refusals retried, {} failures {:?}",
        warm.served(),
        targets.len(),
        warm.retried_total(),
        warm.failures,
        warm.failure_messages
    );
    let (loads_before, evictions_before) = loads_and_evictions(&http, &server.base)?;
    let sampler = RssSampler::start(server.child.id(), RSS_EVERY);
    let barrier = Barrier::new(CLIENTS + 1);
    let (wall, per_client) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (barrier, targets, zipf) = (&barrier, &targets, &zipf);
                let live = server.url("/v2/health/live");
                scope.spawn(move || {
                    let http = client();
                    // Open the keep-alive connection before the clock starts.
                    let _ = http.get(&live).send().and_then(|r| r.bytes());
                    barrier.wait();
                    let at = run.time_limit.map(|limit| Instant::now() + limit);
                    let stop = Stop { count: Some(run.requests_per_client), at };
                    run_client(&http, targets, zipf, SEED + c as u64, stop, Some(give_up))
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let stats: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        (start.elapsed(), stats)
    });
    let peak_rss = sampler.finish();
    let mut stats = Stats::default();
    for s in per_client {
        stats.merge(s.map_err(|_| anyhow::anyhow!("a client thread panicked"))?);
    }
    let (loads_after, evictions_after) = loads_and_evictions(&http, &server.base)?;
    Ok(Measured {
        wall,
        stats,
        loads: loads_after.saturating_sub(loads_before),
        evictions: evictions_after.saturating_sub(evictions_before),
        peak_rss,
        exit: String::new(),
    })
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn goodput(m: &Measured) -> f64 {
    m.stats.served() as f64 / m.wall.as_secs_f64()
}

fn print_table(runs: &[Run], outcomes: &[Outcome]) {
    println!("\nZipf benchmark ({CLIENTS} clients; latency from first send to final 200, retries included)");
    println!(
        "{:<25} {:>8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7}",
        "run",
        "requests",
        "goodput/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "429",
        "503",
        "fail",
        "loads",
        "evict",
        "RSS MiB",
        "wall s"
    );
    for (run, outcome) in runs.iter().zip(outcomes) {
        let requests = CLIENTS * run.requests_per_client;
        match outcome {
            Outcome::Measured(m) => {
                let started = m.stats.started as usize;
                let mark = if started < requests { "*" } else { "" };
                let retried = |status| m.stats.retried.get(&status).copied().unwrap_or(0);
                println!(
                    "{:<25} {:>8} {:>9.1} {:>9} {:>9} {:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7.1}",
                    run.label,
                    format!("{mark}{started}"),
                    goodput(m),
                    ms(m.stats.percentile(50.0)),
                    ms(m.stats.percentile(99.0)),
                    ms(m.stats.max_latency()),
                    retried(429),
                    retried(503),
                    m.stats.failures,
                    m.loads,
                    m.evictions,
                    m.peak_rss >> 20,
                    m.wall.as_secs_f64()
                );
            }
            Outcome::Skipped(why) => println!("{:<25} {requests:>8}  skipped: {why}", run.label),
            Outcome::Failed(why) => println!("{:<25} {requests:>8}  FAILED: {why}", run.label),
        }
    }
    println!(
        "(requests: started; *: SNOOZE_ZIPF_MAX_SECS stopped the clients before all they planned. \
         429 / 503: refusals with Retry-After, slept on and retried; fail: requests not served)"
    );
    for (run, outcome) in runs.iter().zip(outcomes) {
        if let Outcome::Measured(m) = outcome {
            if m.stats.failures > 0 {
                println!("{} failures by kind: {:?}", run.label, m.stats.failures_by_kind);
                for msg in &m.stats.failure_messages {
                    println!("    {msg}");
                }
            }
            println!("{}: server stopped with SIGTERM: {}", run.label, m.exit);
        }
    }
}

fn print_ratios(outcomes: &[Outcome]) {
    let verdict = |ok: bool| if ok { "meets" } else { "misses" };
    println!("\nRatios (same run)");
    match (&outcomes[0], &outcomes[1]) {
        (Outcome::Measured(a), Outcome::Measured(b)) => {
            let r = goodput(a) / goodput(b);
            println!(
                "goodput two-model budget / all resident   {r:>8.3}x  (target >= 0.6: {})",
                verdict(r >= 0.6)
            );
        }
        _ => println!("goodput two-model budget / all resident        n/a  (a run did not complete)"),
    }
    match &outcomes[0] {
        Outcome::Measured(a) => match a.stats.percentile(99.0) {
            Some(p99) => {
                let p99 = p99.as_secs_f64() * 1e3;
                println!(
                    "p99 two-model budget                    {p99:>8.1} ms (target <= 600 ms: {})",
                    verdict(p99 <= 600.0)
                );
            }
            None => println!("p99 two-model budget                         n/a  (nothing served)"),
        },
        _ => println!("p99 two-model budget                         n/a  (the run did not complete)"),
    }
    match (&outcomes[2], &outcomes[3]) {
        (Outcome::Measured(b), Outcome::Measured(u)) => {
            let r = goodput(b) / goodput(u);
            println!(
                "goodput hot batched / unbatched          {r:>8.3}x  (target >= 3: {})",
                verdict(r >= 3.0)
            );
        }
        (_, Outcome::Skipped(why)) => println!("goodput hot batched / unbatched               n/a  ({why})"),
        _ => println!("goodput hot batched / unbatched               n/a  (a run did not complete)"),
    }
}
