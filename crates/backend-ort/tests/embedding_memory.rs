//! What an ONNX embedding model holds: RSS after its load, after a pass of the
//! largest micro-batch (its declared working set must cover that), and after the
//! drop (given back). Its own test binary: other tests' threads would blur RSS.
#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model};
use snooze_core::{memory, Backend, EmbedInput};

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

#[test]
fn a_full_pass_fits_the_declared_working_set_and_the_drop_gives_it_back() {
    let b = backend();
    memory::trim_heap();
    let start = memory::process_rss_bytes();
    let mut last_left = 0;
    for name in ["minilm-onnx", "minilm-onnx-int8", "minilm-onnx"] {
        memory::trim_heap();
        let base = memory::process_rss_bytes();
        let m = b.load(&cpu(name, model(name))).unwrap();
        let loaded = memory::process_rss_bytes().saturating_sub(base);
        let e = m.as_embedder().unwrap();
        // The two largest passes: 8192 tokens of short texts, and 5 texts at the 256-token limit.
        let short: Vec<String> =
            (0..256).map(|i| format!("sentence {i} has about thirty words in it, so that two hundred and fifty six of them make one pass of eight thousand tokens, as large as passes get")).collect();
        let long: Vec<String> = (0..5).map(|i| format!("word{i} ").repeat(400)).collect();
        let tokens: usize = [short.clone(), long.clone()]
            .into_iter()
            .map(|t| e.embed(&EmbedInput::Texts(t)).unwrap().prompt_tokens())
            .sum();
        let after = memory::process_rss_bytes().saturating_sub(base);
        let working = after.saturating_sub(loaded);
        drop(m);
        memory::trim_heap();
        let left = memory::process_rss_bytes().saturating_sub(base);
        println!(
            "{name}: load +{:.1} MiB, passes ({tokens} tokens) +{:.1} MiB (declared {:.1} MiB), after drop +{:.1} MiB",
            mib(loaded),
            mib(working),
            mib(snooze_backend_ort::embed::working_bytes(384)),
            mib(left)
        );
        let declared = snooze_backend_ort::embed::working_bytes(384);
        assert!(
            working <= declared,
            "{name}: a pass left {:.1} MiB, over the declared working set",
            mib(working)
        );
        last_left = left;
    }
    // The first load leaves the tokenizer library's and the runtime's one-time tables
    // (measured 12..27 MiB), and any one drop may leave up to ~22 MiB of freed heap the
    // allocator keeps (measured 0..22 MiB); a model that stayed (45..120 MiB a cycle)
    // would pile up far past this over three cycles.
    let total = memory::process_rss_bytes().saturating_sub(start);
    println!("three cycles kept {:.1} MiB in all (the last drop left {:.1} MiB)", mib(total), mib(last_left));
    assert!(total < 64 << 20, "three load/pass/drop cycles kept {:.1} MiB", mib(total));
}
