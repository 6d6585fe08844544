//! `mapped` does not copy the weights: its process holds them as page cache (RssFile),
//! not as private memory (RssAnon). Its own test binary, so no other test moves RSS.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cache_dir, cpu, model, rss_parts_mib};
use snooze_core::{Backend, LoadSpec, Tensor, TensorData, Weights};

#[test]
fn mapped_weights_stay_out_of_private_memory_and_come_back_on_unload() {
    let cache = cache_dir("rss");
    let b = backend().with_cache_dir(cache.path());
    let spec = LoadSpec { weights: Weights::Mapped, ..cpu("mlp-100m-1", model("mlp-100m-1")) };
    let file_mib =
        std::fs::metadata(model("mlp-100m-1").join("model.onnx")).unwrap().len() as f64 / 1048576.0;
    // Convert first (and warm the runtime): what follows measures a load from the cache.
    b.prepare(&spec).unwrap();
    drop(b.load(&spec).unwrap());
    snooze_core::memory::trim_heap();
    let (rss0, anon0, file0) = rss_parts_mib();
    let m = b.load(&spec).unwrap();
    let x = Tensor::new("x", vec![8, 256], TensorData::Fp32(vec![0.5; 8 * 256]));
    for _ in 0..3 {
        m.infer(std::slice::from_ref(&x), &[]).unwrap();
    }
    let (rss1, anon1, file1) = rss_parts_mib();
    println!(
        "mapped: RSS +{:.1} MiB (anon +{:.1}, file +{:.1}) for a {file_mib:.1} MiB model",
        rss1 - rss0,
        anon1 - anon0,
        file1 - file0
    );
    assert!(anon1 - anon0 < 0.1 * file_mib, "RssAnon grew {:.1} MiB: the weights were copied", anon1 - anon0);
    assert!(file1 - file0 > 0.8 * file_mib, "the weights are served from the mapping");
    assert!(m.mapped_bytes() as f64 / 1048576.0 > 0.9 * file_mib, "the mapping is counted");
    drop(m);
    snooze_core::memory::trim_heap();
    let (rss2, _, _) = rss_parts_mib();
    assert!(rss2 - rss0 < 5.0, "unmapped on unload: RSS {rss0:.1} -> {rss2:.1} MiB");
}
