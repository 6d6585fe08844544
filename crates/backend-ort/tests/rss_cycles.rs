//! Unloading gives the memory back. Its own test binary (its own process), so no
//! other test's models move the RSS it measures.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model, rss_mib};
use snooze_core::{Backend, Tensor, TensorData};

#[test]
fn twenty_load_drop_cycles_do_not_grow_rss() {
    let b = backend();
    let cycle = || {
        let m = b.load(&cpu("mlp-100m-1", model("mlp-100m-1"))).expect("load");
        let x = Tensor::new("x", vec![2, 256], TensorData::Fp32(vec![0.5; 512]));
        m.infer(&[x], &[]).expect("infer");
        drop(m);
    };
    let start = rss_mib();
    // The first cycle pays one-time costs (thread pools, kernel registry, allocator arenas).
    cycle();
    let warm = rss_mib();
    for _ in 0..20 {
        cycle();
    }
    let end = rss_mib();
    println!("RSS: start {start:.1} MiB, after first cycle {warm:.1} MiB, after 20 more {end:.1} MiB");
    assert!(end - warm < 30.0, "20 load/drop cycles grew RSS by {:.1} MiB", end - warm);
}
