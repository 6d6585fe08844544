//! The Zipf benchmark's table and the ratios its targets are read from.

use std::time::Duration;

use crate::run::{Measured, Outcome, Run, CLIENTS};

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

pub fn print_table(runs: &[Run], outcomes: &[Outcome]) {
    println!("\nZipf benchmark ({CLIENTS} clients; latency from first send to final 200, retries included)");
    println!(
        "{:<34} {:>8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7}",
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
        "promo",
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
                    "{:<34} {:>8} {:>9.1} {:>9} {:>9} {:>9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7.1}",
                    run.label,
                    format!("{mark}{started}"),
                    m.goodput(),
                    ms(m.stats.percentile(50.0)),
                    ms(m.stats.percentile(99.0)),
                    ms(m.stats.max_latency()),
                    retried(429),
                    retried(503),
                    m.stats.failures,
                    m.loads,
                    m.evictions,
                    m.promotions,
                    m.peak_rss >> 20,
                    m.wall.as_secs_f64()
                );
            }
            Outcome::Skipped(why) => println!("{:<34} {requests:>8}  skipped: {why}", run.label),
            Outcome::Failed(why) => println!("{:<34} {requests:>8}  FAILED: {why}", run.label),
        }
    }
    println!(
        "(requests: started; *: SNOOZE_ZIPF_MAX_SECS stopped the clients before all they planned. \
         429 / 503: refusals with Retry-After, slept on and retried; fail: requests not served; \
         promo: promotions to the prepacked copy during the timed part)"
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

/// A measured run by its id, if it ran.
fn find<'a>(runs: &[Run], outcomes: &'a [Outcome], id: &str) -> Option<&'a Measured> {
    runs.iter().zip(outcomes).find(|(r, _)| r.id == id).and_then(|(_, o)| match o {
        Outcome::Measured(m) => Some(m),
        _ => None,
    })
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "meets"
    } else {
        "misses"
    }
}

/// `what  a / b  (target …: verdict)`, or why it cannot be said.
fn ratio(what: &str, a: Option<f64>, b: Option<f64>, target: &str, ok: impl Fn(f64) -> bool) {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            println!("{what:<58} {r:>8.3}x  (target {target}: {})", verdict(ok(r)));
        }
        _ => println!("{what:<58}      n/a  (a run did not complete)"),
    }
}

/// A p99 against an absolute target.
fn p99(what: &str, m: Option<&Measured>, target_ms: f64) {
    match m.and_then(Measured::p99_ms) {
        Some(p) => println!("{what:<58} {p:>8.1} ms (target <= {target_ms} ms: {})", verdict(p <= target_ms)),
        None => println!("{what:<58}      n/a  (the run did not complete)"),
    }
}

pub fn print_ratios(runs: &[Run], outcomes: &[Outcome]) {
    let m = |id: &str| find(runs, outcomes, id);
    let goodput = |id: &str| m(id).map(Measured::goodput);
    let p99_of = |id: &str| m(id).and_then(Measured::p99_ms);
    println!("\nRatios (same run)");
    ratio("goodput two-model budget / all resident", goodput("zipf-a"), goodput("zipf-b"), ">= 0.6", |r| {
        r >= 0.6
    });
    p99("p99 two-model budget", m("zipf-a"), 600.0);
    ratio("goodput hot batched / unbatched", goodput("zipf-c1"), goodput("zipf-c2"), ">= 3", |r| r >= 3.0);
    if runs.iter().any(|r| r.id == "zipf-d") {
        println!("Issue 21 (cold start, churn, byte budgets)");
        ratio(
            "goodput two-model budget / all resident fully warm",
            goodput("zipf-a"),
            goodput("zipf-d"),
            ">= 0.8",
            |r| r >= 0.8,
        );
        p99("p99 two-model budget, warm", m("zipf-a"), 150.0);
        // The ceilings (`SNOOZE_ZIPF_ONLY` only): holding the hot model; no swap at all.
        for (what, id) in [
            ("goodput, m1 pinned prepacked (a ceiling) / fully warm", "zipf-ap"),
            ("goodput, all resident mapped (no swaps) / fully warm", "zipf-bm"),
        ] {
            if m(id).is_some() {
                ratio(what, goodput(id), goodput("zipf-d"), ">= 0.8", |r| r >= 0.8);
            }
        }
        ratio(
            "goodput cold (fresh state_dir) / warm, two-model",
            goodput("zipf-e"),
            goodput("zipf-a"),
            ">= 0.7",
            |r| r >= 0.7,
        );
        ratio("p99 cold / warm, two-model", p99_of("zipf-e"), p99_of("zipf-a"), "<= 2", |r| r <= 2.0);
        let budgets = [("300MiB", "zipf-f300"), ("400MiB", "zipf-f400"), ("600MiB", "zipf-f600")];
        for (label, id) in budgets {
            let served = m(id).map(|m| (m.stats.failures, m.stats.started, m.stats.served()));
            match served {
                Some((0, started, served)) if served as u64 == started => {
                    println!(
                        "{:<58} {served:>8} of {started} (target: all: meets)",
                        format!("served at {label}, fresh state_dir")
                    )
                }
                Some((failures, started, served)) => println!(
                    "{:<58} {served:>8} of {started}, {failures} failed (target: all: misses)",
                    format!("served at {label}, fresh state_dir")
                ),
                None => println!(
                    "{:<58}      n/a  (the run did not complete)",
                    format!("served at {label}, fresh state_dir")
                ),
            }
            p99(&format!("p99 at {label}, warm (second run, same state_dir)"), m(&format!("{id}w")), 150.0);
        }
        for (phase, suffix) in [("fresh", ""), ("warm", "w")] {
            for pair in budgets.windows(2) {
                let (lo, hi) = (pair[0], pair[1]);
                ratio(
                    &format!("goodput {} / {} ({phase})", hi.0, lo.0),
                    goodput(&format!("{}{suffix}", hi.1)),
                    goodput(&format!("{}{suffix}", lo.1)),
                    ">= 0.95",
                    |r| r >= 0.95,
                );
            }
        }
    }
}
