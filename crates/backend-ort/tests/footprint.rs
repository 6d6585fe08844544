//! Measures what ONNX Runtime really takes, to check the estimate's factors.
//!
//! Ignored by default (it loads 500 MB of models); run it with
//! `cargo test -p snooze-backend-ort --test footprint -- --ignored --nocapture`.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model};
use snooze_core::{memory, Backend, LoadSpec, Tensor, TensorData};

/// VmHWM (peak RSS) from /proc/self/status, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib * 1024
}

/// Makes VmHWM start again from the current RSS (Linux >= 4.0).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("write /proc/self/clear_refs");
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

#[test]
#[ignore = "loads 500 MB of models; run by hand to re-derive the estimate factors"]
fn measured_footprint_is_covered_by_the_estimate() {
    let b = backend();
    let first = memory::process_rss_bytes();
    // Pay the runtime's one-time costs outside the measurement.
    drop(b.load(&cpu("warmup", model("mlp-10m"))).expect("warm-up load"));
    memory::trim_heap();
    println!("one-time runtime cost: {:.1} MiB", mib(memory::process_rss_bytes().saturating_sub(first)));
    let only = std::env::var("FOOTPRINT_MODELS").unwrap_or_default();
    for name in ["mlp-10m", "mlp-100m-1", "mlp-400m"] {
        if !only.is_empty() && !only.split(',').any(|m| m == name) {
            continue;
        }
        memory::trim_heap();
        let base = memory::process_rss_bytes();
        reset_peak();
        // 0 = the runtime's default thread pool, as a server configured with no limit gets.
        let m = b.load(&LoadSpec { intra_op_threads: 0, ..cpu(name, model(name)) }).expect("load");
        let peak_load = peak_rss().saturating_sub(base);
        let steady = memory::process_rss_bytes().saturating_sub(base);
        let x = Tensor::new("x", vec![2, 256], TensorData::Fp32(vec![0.5; 512]));
        m.infer(&[x], &[]).expect("infer");
        let after_infer = memory::process_rss_bytes().saturating_sub(base);
        drop(m);
        let after_drop = memory::process_rss_bytes().saturating_sub(base);
        let e = b.estimate(&model(name), snooze_core::Weights::Prepacked);
        println!(
            "{name}: steady {:.1} MiB (after one run {:.1}), load peak {:.1} MiB, after drop {:.1} MiB; \
             estimate steady {:.1} MiB, peak {:.1} MiB ({})",
            mib(steady),
            mib(after_infer),
            mib(peak_load),
            mib(after_drop),
            mib(e.steady_bytes.unwrap_or(0)),
            mib(e.peak_bytes.unwrap_or(0)),
            e.derivation
        );
        assert!(e.steady_bytes.unwrap_or(0) >= after_infer.max(steady), "{name}: steady not covered");
        assert!(e.peak_bytes.unwrap_or(0) >= peak_load, "{name}: peak not covered");
    }
}
