//! The swap benchmark's report: one table of every profile and the server, the output
//! check against raw ORT, the one-time conversions, the cycles, and the targets with
//! meets / misses, all from the same run.

use std::time::Duration;

use crate::{
    cycles::Cycles, max_abs_diff, server::Served, ChildReport, Profile, LOADS, MIB, MODEL, REL_TOLERANCE,
    RESIDENT, RUNS,
};

pub(crate) fn ms(d: Duration) -> f64 {
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

pub(crate) fn load_average() -> String {
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
pub(crate) fn print_report(reports: &[(Profile, ChildReport)], served: &[Served], onnx_bytes: u64) -> bool {
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

pub(crate) fn print_conversion(conversions: &[Duration]) {
    let v: Vec<f64> = conversions.iter().map(|d| ms(*d)).collect();
    let list = RESIDENT.iter().zip(&v).map(|(m, t)| format!("{m} {t:.0}")).collect::<Vec<_>>().join(", ");
    println!(
        "One-time conversion to the ORT format (Backend::prepare; one copy serves compact and mapped): \
         median {:.0} ms ({list} ms)",
        median(&v)
    );
}

pub(crate) fn print_prepacked_copies(copies: &[Duration]) {
    let v: Vec<f64> = copies.iter().map(|d| ms(*d)).collect();
    let list = RESIDENT.iter().zip(&v).map(|(m, t)| format!("{m} {t:.0}")).collect::<Vec<_>>().join(", ");
    println!(
        "One-time prepacked copy (Backend::prepare for prepacked; weights prepacked into a mapped data file): \
         median {:.0} ms ({list} ms)",
        median(&v)
    );
}

pub(crate) fn print_cycles(c: &Cycles) {
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

pub(crate) fn print_targets(
    reports: &[(Profile, ChildReport)],
    served: &[Served],
    c: &Cycles,
    onnx_bytes: u64,
) {
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
