//! One run of the Zipf benchmark: a server config, a state folder, what warms it, what
//! the clients send — started, measured and stopped without ever panicking.

use std::{
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    process::Command,
    sync::Barrier,
    time::{Duration, Instant},
};

use crate::closed_loop::{loads_and_evictions, run_client, serve_one, RssSampler, Stats, Stop, Target, Zipf};
use crate::common::{client, ort_dylib, Server};

pub const CLIENTS: usize = 8;
pub const ZIPF_S: f64 = 1.1;
/// Client `c` of every Zipf run draws from `SplitMix64::new(SEED + c)`.
pub const SEED: u64 = 0x5EED_0000_0000_2111;
const RSS_EVERY: Duration = Duration::from_millis(50);
/// A request still refused this long after its run started fails, so a server that
/// refuses forever cannot hang the benchmark.
const RUN_GIVE_UP: Duration = Duration::from_secs(15 * 60);
/// What `max_batch_size = 1` prints where the build refuses the key.
pub const NO_MAX_BATCH: &str = "max_batch_size not supported by this build";
/// How long a fully warm warm-up waits for every model's promotion.
const PROMOTION_WAIT: Duration = Duration::from_secs(60);

/// What happens before the clock starts.
#[derive(Clone, Copy, PartialEq)]
pub enum Warmup {
    /// One request per model, in rank order: every model has loaded once.
    OnePerModel,
    /// `snooze prepare` on the state folder, then rounds of concurrent requests per model
    /// until every model was promoted to its prepacked copy (all must fit).
    Promoted,
}

/// One row: a server config and what the clients send it.
pub struct Run {
    /// Printed in the table.
    pub label: &'static str,
    /// Short name for the server's temp dir.
    pub id: &'static str,
    pub config: String,
    /// (name in the config, generated model whose reference.json answers it); Zipf rank
    /// order.
    pub models: Vec<(String, String)>,
    pub requests_per_client: usize,
    /// Clients stop starting requests this long after the clock starts.
    pub time_limit: Option<Duration>,
    /// The server's `--state-dir`.
    pub state_dir: PathBuf,
    /// Emptied before the server starts: the run begins with no converted copy.
    pub fresh_state: bool,
    /// `snooze prepare` on the state folder before the server starts.
    pub prepare_ahead: bool,
    pub warmup: Warmup,
}

/// What came of a run.
pub enum Outcome {
    Measured(Measured),
    Skipped(String),
    Failed(String),
}

pub struct Measured {
    pub wall: Duration,
    pub stats: Stats,
    pub loads: u64,
    pub evictions: u64,
    pub promotions: u64,
    pub peak_rss: u64,
    pub exit: String,
}

impl Measured {
    pub fn goodput(&self) -> f64 {
        self.stats.served() as f64 / self.wall.as_secs_f64()
    }

    pub fn p99_ms(&self) -> Option<f64> {
        self.stats.percentile(99.0).map(|d| d.as_secs_f64() * 1e3)
    }
}

/// Checks the config, starts the server, measures, stops it; never panics.
pub fn execute(run: &Run) -> Outcome {
    if let Err(why) = check_config(run) {
        return if unknown_max_batch(&why) {
            Outcome::Skipped(NO_MAX_BATCH.into())
        } else {
            Outcome::Failed(format!("config refused: {why}"))
        };
    }
    if run.fresh_state {
        let _ = std::fs::remove_dir_all(&run.state_dir);
    }
    if run.prepare_ahead || run.warmup == Warmup::Promoted {
        if let Err(why) = prepare(run) {
            return Outcome::Failed(format!("snooze prepare failed: {why}"));
        }
    }
    // `SNOOZE_ZIPF_SERVER_ARGS` adds flags to every server (e.g. `--intra-op-spinning false`).
    let extra = std::env::var("SNOOZE_ZIPF_SERVER_ARGS").unwrap_or_default();
    let mut extra: Vec<&str> = extra.split_whitespace().collect();
    let state_arg = run.state_dir.display().to_string();
    extra.extend(["--state-dir", state_arg.as_str()]);
    let server = match std::panic::catch_unwind(|| Server::start(run.id, &run.config, &extra)) {
        Ok(s) => s,
        // In case a build checks the key only when serving (the panic carries its logs).
        Err(panic) if unknown_max_batch(&panic_message(&panic)) => {
            return Outcome::Skipped(NO_MAX_BATCH.into())
        }
        Err(panic) => return Outcome::Failed(format!("the server did not start: {}", panic_message(&panic))),
    };
    let measured = std::panic::catch_unwind(AssertUnwindSafe(|| measure(&server, run)));
    // `SNOOZE_ZIPF_LOG_DIR`: each run's server log (JSON lines) kept there, as `<id>.log`.
    if let Some(dir) = std::env::var_os("SNOOZE_ZIPF_LOG_DIR") {
        let path = Path::new(&dir).join(format!("{}.log", run.id));
        let text = server.logs.lock().map(|l| l.join("\n")).unwrap_or_default();
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&path, text)) {
            eprintln!("  cannot keep the server log in {}: {e}", path.display());
        }
    }
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
    snooze(run, "check")
}

/// `snooze prepare` on the run's config and state folder: every converted copy made.
pub fn prepare(run: &Run) -> Result<(), String> {
    snooze(run, "prepare")
}

/// `snooze <command> --config <the run's config> --state-dir <its state>`.
fn snooze(run: &Run, command: &str) -> Result<(), String> {
    let path = std::env::temp_dir().join(format!("snooze-{}-{command}-{}.toml", run.id, std::process::id()));
    std::fs::write(&path, &run.config).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snooze"));
    cmd.arg(command);
    if command == "check" {
        cmd.arg(&path);
    } else {
        cmd.arg("--config").arg(&path).arg("--state-dir").arg(&run.state_dir);
    }
    let out = cmd
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .map_err(|e| format!("cannot run snooze {command}: {e}"));
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

/// The warm-up, then the timed closed loop.
fn measure(server: &Server, run: &Run) -> anyhow::Result<Measured> {
    let targets: Vec<Target> =
        run.models.iter().map(|(name, file)| Target::new(&server.base, name, file)).collect();
    let zipf = Zipf::new(targets.len(), ZIPF_S);
    let give_up = Instant::now() + RUN_GIVE_UP;
    let http = client();
    match run.warmup {
        Warmup::OnePerModel => {
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
        }
        Warmup::Promoted => promote_all(server, &targets, give_up)?,
    }
    let (loads_before, evictions_before) = loads_and_evictions(&http, &server.base)?;
    let promotions_before = promotions(server)?;
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
        promotions: promotions(server)?.saturating_sub(promotions_before),
        peak_rss,
        exit: String::new(),
    })
}

/// Rounds of 8 concurrent requests per model (batches of several rows, which is what
/// promotes a model) until every model serves from its prepacked copy — loaded so (the
/// `auto` profile when all fit) or promoted to it — or [`PROMOTION_WAIT`].
fn promote_all(server: &Server, targets: &[Target], give_up: Instant) -> anyhow::Result<()> {
    let deadline = Instant::now() + PROMOTION_WAIT;
    let fast = |server: &Server| -> usize {
        let events = server.get("/admin/events").1;
        let promoted: Vec<String> = events["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["kind"] == "promoted")
            .filter_map(|e| e["model"].as_str().map(String::from))
            .collect();
        let models = server.get("/admin/models").1;
        models["models"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["weights"] == "prepacked" || promoted.iter().any(|p| m["name"] == p.as_str()))
            .count()
    };
    loop {
        for t in targets {
            std::thread::scope(|scope| {
                for _ in 0..CLIENTS {
                    scope.spawn(|| serve_one(&client(), t, Some(give_up), &mut Stats::default()));
                }
            });
        }
        let done = fast(server);
        if done >= targets.len() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {done} of {} models serve prepacked after {PROMOTION_WAIT:?} of warm-up",
            targets.len()
        );
    }
    eprintln!("  warm-up: all {} models serve from their prepacked copies", targets.len());
    Ok(())
}

/// Promotions in `/admin/events` so far.
fn promotions(server: &Server) -> anyhow::Result<u64> {
    let events = server.get("/admin/events").1;
    let list =
        events["events"].as_array().ok_or_else(|| anyhow::anyhow!("no events array in /admin/events"))?;
    Ok(list.iter().filter(|e| e["kind"] == "promoted").count() as u64)
}

pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}
