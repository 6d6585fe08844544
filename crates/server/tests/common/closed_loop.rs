//! Closed-loop clients over a seeded Zipf mix, shared by the Zipf benchmark
//! (`benches/zipf.rs`) and the soak test (`tests/soak.rs`).
//!
//! Both must drive the server the same way — the same request mix for the same seed,
//! Retry-After honoured the same way, every answer checked against numpy — or the
//! benchmark's figures and the soak's verdict would not describe the same behaviour. The
//! benchmark prints what this counts; the soak asserts on it.
//!
//! Declared next to `common` (`#[path = ".../common/closed_loop.rs"] mod closed_loop;`),
//! not from `common/mod.rs`, so the other tests do not compile it.

#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::common::{infer_body, max_abs_diff, reference};

/// Outputs within this of numpy's are right (the tolerance of every other test).
pub const TOLERANCE: f32 = 1e-4;
/// The longest Retry-After a client sleeps; a longer one is slept as this.
pub const RETRY_AFTER_CAP: Duration = Duration::from_secs(30);
/// Failure messages kept per client (all are counted).
const KEPT_MESSAGES: usize = 5;

/// SplitMix64: a tiny seeded generator, so a client's request mix is the same every run
/// and in every run of one benchmark (no `rand` dependency needed).
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over ranks 1..=n: P(k) ∝ 1 / k^s. `sample` returns the 0-based index
/// (rank 1 → 0), so rank 1 is the first target: the hottest model.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        assert!(n > 0, "Zipf over no ranks");
        let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Zipf { cdf }
    }

    /// P(rank k + 1), for printing the mix.
    pub fn probability(&self, k: usize) -> f64 {
        self.cdf[k] - if k == 0 { 0.0 } else { self.cdf[k - 1] }
    }

    pub fn sample(&self, rng: &mut SplitMix64) -> usize {
        let u = rng.next_f64();
        // The last entry may round below 1.0: anything past it is the last rank.
        self.cdf.iter().position(|&c| u < c).unwrap_or(self.cdf.len() - 1)
    }
}

/// One model the clients may ask for: its request body and numpy's answer.
pub struct Target {
    /// The model's name in the server's config.
    pub name: String,
    /// `POST {base}/v2/models/{name}/infer`.
    pub url: String,
    /// A KServe v2 JSON body with the model's reference input.
    pub body: Vec<u8>,
    pub expected: Vec<f32>,
}

impl Target {
    /// `name` served from the generated model `reference_model` (its reference.json).
    pub fn new(base: &str, name: &str, reference_model: &str) -> Target {
        let r = reference(reference_model);
        Target {
            name: name.to_string(),
            url: format!("{base}/v2/models/{name}/infer"),
            body: serde_json::to_vec(&infer_body(&r)).expect("a JSON body"),
            expected: r.output,
        }
    }
}

/// When a client stops starting requests (the request in flight is still finished).
#[derive(Clone, Copy)]
pub struct Stop {
    /// After this many requests.
    pub count: Option<usize>,
    /// At this instant.
    pub at: Option<Instant>,
}

/// What clients saw; merged over clients.
#[derive(Default)]
pub struct Stats {
    /// Per request served: from the first send to the final 200, retries and their
    /// sleeps included.
    pub latencies: Vec<Duration>,
    /// Requests started (each ends served or failed).
    pub started: u64,
    /// 429 / 503 answers carrying Retry-After, which were slept on and retried, by status.
    pub retried: BTreeMap<u16, u64>,
    /// Requests that ended without a right 200: another status, a refusal without
    /// Retry-After, a transport error, a wrong output.
    pub failures: u64,
    /// The first few failures, described.
    pub failure_messages: Vec<String>,
    /// Failures by kind ("503 without Retry-After", "500", "wrong output", ...).
    pub failures_by_kind: BTreeMap<String, u64>,
    /// The slowest single attempt: one send to its answer read, sleeps excluded.
    pub longest_attempt: Duration,
}

impl Stats {
    pub fn merge(&mut self, other: Stats) {
        self.latencies.extend(other.latencies);
        self.started += other.started;
        for (status, n) in other.retried {
            *self.retried.entry(status).or_default() += n;
        }
        self.failures += other.failures;
        for (kind, n) in other.failures_by_kind {
            *self.failures_by_kind.entry(kind).or_default() += n;
        }
        let room = KEPT_MESSAGES.saturating_sub(self.failure_messages.len());
        self.failure_messages.extend(other.failure_messages.into_iter().take(room));
        self.longest_attempt = self.longest_attempt.max(other.longest_attempt);
    }

    pub fn served(&self) -> usize {
        self.latencies.len()
    }

    pub fn retried_total(&self) -> u64 {
        self.retried.values().sum()
    }

    /// Nearest-rank percentile of the served requests' latencies.
    pub fn percentile(&self, p: f64) -> Option<Duration> {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let n = sorted.len();
        let rank = ((p / 100.0 * n as f64).ceil() as usize).clamp(1, n.max(1));
        sorted.get(rank - 1).copied()
    }

    pub fn max_latency(&self) -> Option<Duration> {
        self.latencies.iter().max().copied()
    }

    fn fail(&mut self, kind: &str, message: String) {
        self.failures += 1;
        *self.failures_by_kind.entry(kind.to_string()).or_default() += 1;
        if self.failure_messages.len() < KEPT_MESSAGES {
            self.failure_messages.push(message);
        }
    }
}

/// One closed-loop client on its own keep-alive connection: picks a target from `zipf`
/// with a generator seeded by `seed`, sends it until it is served or fails, then the
/// next, until `stop`. A request still refused at `give_up` (if any) fails.
pub fn run_client(
    http: &reqwest::blocking::Client,
    targets: &[Target],
    zipf: &Zipf,
    seed: u64,
    stop: Stop,
    give_up: Option<Instant>,
) -> Stats {
    let mut rng = SplitMix64::new(seed);
    let mut stats = Stats::default();
    loop {
        let counted_out = stop.count.is_some_and(|n| stats.started >= n as u64);
        if counted_out || stop.at.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        stats.started += 1;
        let target = &targets[zipf.sample(&mut rng)];
        serve_one(http, target, give_up, &mut stats);
    }
    stats
}

/// Sends one request until a 200 or a failure, sleeping Retry-After (capped at
/// [`RETRY_AFTER_CAP`]) on 429 / 503; records the outcome in `stats`.
pub fn serve_one(
    http: &reqwest::blocking::Client,
    target: &Target,
    give_up: Option<Instant>,
    stats: &mut Stats,
) {
    let first_send = Instant::now();
    loop {
        let attempt = Instant::now();
        let sent = http
            .post(&target.url)
            .header("content-type", "application/json")
            .body(target.body.clone())
            .send();
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                stats.longest_attempt = stats.longest_attempt.max(attempt.elapsed());
                return stats.fail("transport error", format!("{}: {e}", target.name));
            }
        };
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let body = response.bytes();
        stats.longest_attempt = stats.longest_attempt.max(attempt.elapsed());
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                return stats.fail("transport error", format!("{}: reading the body: {e}", target.name))
            }
        };
        match status {
            200 => {
                return match check_output(&body, &target.expected) {
                    Ok(()) => stats.latencies.push(first_send.elapsed()),
                    Err(why) => stats.fail("wrong output", format!("{}: {why}", target.name)),
                };
            }
            429 | 503 => {
                let Some(secs) = retry_after else {
                    return stats.fail(
                        &format!("{status} without Retry-After"),
                        format!("{}: {status} without Retry-After: {}", target.name, excerpt(&body)),
                    );
                };
                let sleep = Duration::from_secs(secs).min(RETRY_AFTER_CAP);
                if give_up.is_some_and(|t| Instant::now() + sleep > t) {
                    return stats.fail(
                        &format!("{status} past the end"),
                        format!("{}: still refused ({status}) at the end of the run", target.name),
                    );
                }
                *stats.retried.entry(status).or_default() += 1;
                std::thread::sleep(sleep);
            }
            other => {
                return stats
                    .fail(&other.to_string(), format!("{}: {other}: {}", target.name, excerpt(&body)));
            }
        }
    }
}

/// The `y` floats of a JSON infer response against numpy's.
fn check_output(body: &[u8], expected: &[f32]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let data = v["outputs"][0]["data"].as_array().ok_or("no outputs[0].data array")?;
    let got: Vec<f32> = data
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32))
        .collect::<Option<_>>()
        .ok_or("a non-number output")?;
    if got.len() != expected.len() {
        return Err(format!("{} outputs, expected {}", got.len(), expected.len()));
    }
    let diff = max_abs_diff(&got, expected);
    if diff.is_nan() || diff > TOLERANCE {
        return Err(format!("output differs from numpy by {diff}"));
    }
    Ok(())
}

fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body).chars().take(200).collect()
}

/// Samples a process's VmRSS from `/proc/<pid>/status` until finished; keeps the peak.
/// Sampled from outside so it sees the process even when its HTTP side is stuck.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<u64>,
}

impl RssSampler {
    pub fn start(pid: u32, every: Duration) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut peak = 0;
            while !flag.load(Ordering::Relaxed) {
                peak = peak.max(vm_rss(pid).unwrap_or(0));
                std::thread::sleep(every);
            }
            peak.max(vm_rss(pid).unwrap_or(0))
        });
        RssSampler { stop, handle }
    }

    /// The peak VmRSS seen, in bytes (0 if the process could not be read).
    pub fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or(0)
    }
}

/// VmRSS of `pid` in bytes; None once the process is gone.
pub fn vm_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.trim_start_matches("VmRSS:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Sums of the `loads` and `evictions` counters of `GET /admin/models`.
pub fn loads_and_evictions(http: &reqwest::blocking::Client, base: &str) -> anyhow::Result<(u64, u64)> {
    let admin: Value = http.get(format!("{base}/admin/models")).send()?.error_for_status()?.json()?;
    let models =
        admin["models"].as_array().ok_or_else(|| anyhow::anyhow!("no models array in /admin/models"))?;
    let sum = |key: &str| models.iter().map(|m| m[key].as_u64().unwrap_or(0)).sum::<u64>();
    Ok((sum("loads"), sum("evictions")))
}
