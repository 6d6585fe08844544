//! What a load costs and whether an unload gives it back, measured as process RSS.
//!
//! One test in its own binary, so no other test allocates while RSS is read. Peaks
//! come from the kernel's high-water mark (`VmHWM`, reset through `clear_refs`), since
//! the largest buffers of a pass are freed before anyone could sample RSS. The numbers
//! are printed (`cargo test -p snooze-backend-candle --test memory -- --nocapture`) and
//! are where `STEADY_FACTOR` / `FLOOR_BYTES` come from.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Instant;

use common::{model_dir, spec};
use snooze_backend_candle::CandleBackend;
use snooze_core::{
    memory::{self, process_rss_bytes, reset_peak_rss},
    Backend, EmbedInput,
};

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn delta(after: u64, before: u64) -> f64 {
    mib(after) - mib(before)
}

/// Peak RSS since the last `reset_peak_rss` (the current RSS where the kernel keeps none).
fn peak_rss_bytes() -> u64 {
    memory::peak_rss_bytes().unwrap_or_else(process_rss_bytes)
}

/// Long inputs per measured call: two passes of 5 at the attention cap.
const LONG: usize = 10;

/// `n` inputs at the 256-token limit.
fn long_batch(n: usize) -> EmbedInput {
    let long = "memory is measured after a full pass over long inputs ".repeat(40);
    EmbedInput::Texts((0..n).map(|i| format!("{i} {long}")).collect())
}

fn short_batch(n: usize) -> EmbedInput {
    EmbedInput::Texts((0..n).map(|i| format!("short sentence number {i} about a sleepy cat")).collect())
}

#[test]
fn load_costs_what_the_estimate_says_and_unload_gives_it_back() {
    // As the server does at start. With glibc's defaults (a sliding mmap threshold, an
    // arena per thread) freed tensors stay in arenas malloc_trim cannot fully shrink:
    // RSS after an unload varied by +6..36 MiB and a pass's peak by +232..280 MiB.
    let tuned = memory::tune_allocator_for_low_ram();
    let backend = CandleBackend::new();
    let dir = model_dir();
    let estimate = backend.estimate(&dir, snooze_core::Weights::Prepacked);
    let (steady, peak) = (estimate.steady_bytes.unwrap(), estimate.peak_bytes.unwrap());
    let weights = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();

    let _ = reset_peak_rss();
    let before = process_rss_bytes();
    let model = backend.load(&spec(dir.clone())).unwrap();
    let loaded = process_rss_bytes();
    let load_peak = peak_rss_bytes();
    let embedder = model.as_embedder().unwrap();
    let start = Instant::now();
    // Two full micro-batches of the longest inputs: the largest a pass gets.
    embedder.embed(&long_batch(LONG)).unwrap();
    let long_secs = start.elapsed().as_secs_f64();
    embedder.embed(&short_batch(512)).unwrap();
    let used = process_rss_bytes();
    let use_peak = peak_rss_bytes();

    let short = short_batch(32);
    embedder.embed(&short).unwrap();
    let runs = 5;
    let start = Instant::now();
    for _ in 0..runs {
        embedder.embed(&short).unwrap();
    }
    let per_batch = start.elapsed().as_secs_f64() / f64::from(runs);

    drop(model);
    let dropped = process_rss_bytes();
    eprintln!("allocator tuned for low RAM: {tuned}");
    eprintln!(
        "weights {:.1} MiB; estimate steady {:.1} MiB, peak {:.1} MiB ({})",
        mib(weights),
        mib(steady),
        mib(peak),
        estimate.derivation
    );
    eprintln!(
        "first load from rss {:.1} MiB: +{:.1} MiB loaded (+{:.1} MiB at the load's peak); \
         +{:.1} MiB after {LONG}x256 and 512 short inputs (+{:.1} MiB at the peak of a pass); {:+.1} MiB after drop",
        mib(before),
        delta(loaded, before),
        delta(load_peak, before),
        delta(used, before),
        delta(use_peak, before),
        delta(dropped, before)
    );
    eprintln!(
        "throughput: 32 short sentences in {:.0} ms ({:.0}/s); {LONG} x 256 tokens in {:.1} s ({:.0} tokens/s)",
        per_batch * 1e3,
        32.0 / per_batch,
        long_secs,
        LONG as f64 * 256.0 / long_secs
    );
    assert!(steady >= use_peak - before, "the steady estimate must cover a load and its largest pass");
    assert!(peak >= load_peak - before, "the peak estimate must cover the load");
    assert!(delta(dropped, before) < 30.0, "a single unload must give the memory back");

    // The first cycle paid for one-time pools; ten more must not creep.
    let baseline = process_rss_bytes();
    let mut highest = baseline;
    for _ in 0..10 {
        let model = backend.load(&spec(dir.clone())).unwrap();
        let embedder = model.as_embedder().unwrap();
        embedder.embed(&long_batch(2)).unwrap();
        embedder.embed(&short_batch(32)).unwrap();
        highest = highest.max(process_rss_bytes());
        drop(model);
    }
    let after = process_rss_bytes();
    eprintln!(
        "10 load/embed/drop cycles: rss {:.1} MiB -> {:.1} MiB ({:+.1} MiB), highest {:.1} MiB",
        mib(baseline),
        mib(after),
        delta(after, baseline),
        mib(highest)
    );
    assert!(delta(after, baseline) < 30.0, "10 load/drop cycles must not grow RSS by 30 MiB");
    assert!(delta(after, before) < 30.0, "RSS after the cycles must be within 30 MiB of the start");
}
