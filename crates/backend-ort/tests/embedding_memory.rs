//! What an ONNX embedding model holds: RSS after its load, after a pass of the
//! largest micro-batch (its declared working set must cover that), and after the
//! drop (given back, cycle after cycle). Its own test binary: other tests' threads would
//! blur RSS.
#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model};
use snooze_backend_ort::OrtBackend;
use snooze_core::{memory, Backend, EmbedInput};

/// int8 cycles after the warm-up. A session that is never freed piles up one per
/// cycle (measured: 111..118 MiB each, its arena included), while what a drop leaves in
/// the allocator does not add up across cycles (measured 0..27 MiB after any one drop).
const CYCLES: usize = 4;

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

/// RSS the load took, and what the model's largest passes added to it.
struct Cycle {
    loaded: u64,
    working: u64,
}

/// Loads `name`, runs its two largest passes and drops it; checks the passes against
/// the declared working set.
fn cycle(b: &OrtBackend, name: &str) -> Cycle {
    memory::trim_heap();
    let base = memory::process_rss_bytes();
    let m = b.load(&cpu(name, model(name))).unwrap();
    let loaded = memory::process_rss_bytes().saturating_sub(base);
    let e = m.as_embedder().unwrap();
    // The two largest passes: 8192 tokens of short texts, and 5 texts at the 256-token limit.
    let short: Vec<String> =
        (0..256).map(|i| format!("sentence {i} has about thirty words in it, so that two hundred and fifty six of them make one pass of eight thousand tokens, as large as passes get")).collect();
    let long: Vec<String> = (0..5).map(|i| format!("word{i} ").repeat(400)).collect();
    let tokens: usize =
        [short, long].into_iter().map(|t| e.embed(&EmbedInput::Texts(t)).unwrap().prompt_tokens()).sum();
    let working = memory::process_rss_bytes().saturating_sub(base).saturating_sub(loaded);
    drop(m);
    memory::trim_heap();
    let left = memory::process_rss_bytes().saturating_sub(base);
    let declared = snooze_backend_ort::embed::working_bytes(384);
    println!(
        "{name}: load +{:.1} MiB, passes ({tokens} tokens) +{:.1} MiB (declared {:.1} MiB), after drop +{:.1} MiB",
        mib(loaded),
        mib(working),
        mib(declared),
        mib(left)
    );
    assert!(
        working <= declared,
        "{name}: a pass left {:.1} MiB, over the declared working set",
        mib(working)
    );
    Cycle { loaded, working }
}

#[test]
fn a_full_pass_fits_the_declared_working_set_and_the_drop_gives_it_back() {
    let b = backend();
    memory::trim_heap();
    let start = memory::process_rss_bytes();
    // The first loads leave the tokenizer library's and the runtime's one-time tables
    // (measured 12..27 MiB): one cycle of each model pays them.
    cycle(&b, "minilm-onnx");
    let first_int8 = cycle(&b, "minilm-onnx-int8");
    memory::trim_heap();
    let warm = memory::process_rss_bytes();
    let mut smallest_session = first_int8.loaded + first_int8.working;
    for _ in 0..CYCLES {
        let c = cycle(&b, "minilm-onnx-int8");
        smallest_session = smallest_session.min(c.loaded + c.working);
    }
    memory::trim_heap();
    let end = memory::process_rss_bytes();
    let kept = end.saturating_sub(warm);
    println!(
        "after the warm-up, {CYCLES} int8 cycles kept {:.1} MiB (one int8 session with its passes: {:.1} MiB); \
         {:.1} MiB since the start",
        mib(kept),
        mib(smallest_session),
        mib(end.saturating_sub(start))
    );
    // Judged against one session, so that one drop's leftover heap passes and a session
    // left behind per cycle (CYCLES of them) cannot.
    assert!(
        kept < smallest_session,
        "{CYCLES} int8 load/pass/drop cycles kept {:.1} MiB, more than a whole int8 session ({:.1} MiB) \
         with its passes: a model is not freed on drop",
        mib(kept),
        mib(smallest_session)
    );
    // One-time tables plus what any one drop may leave (measured up to 22 MiB).
    assert!(
        end.saturating_sub(start) < 64 << 20,
        "six load/pass/drop cycles kept {:.1} MiB in all",
        mib(end.saturating_sub(start))
    );
}
