//! A run hands its activations back when it ends (`with_activations_released(true)`, the
//! default), instead of leaving them in its session's arena for as long as the model is
//! resident. Measured on the OCR detector, whose activations for one page are many times
//! its weights. Its own test binary, so no other test moves the process's memory.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model};
use snooze_core::{memory, Backend, Tensor, TensorData};

/// Private memory a first run of the detector on a 736x960 page leaves resident, MiB.
fn kept_after_a_page(release: bool) -> f64 {
    let b = backend().with_activations_released(release);
    let m = b.load(&cpu("ocr-det", model("ocr-det"))).unwrap();
    memory::trim_heap();
    let before = memory::process_private_bytes();
    let page = Tensor::new("x", vec![1, 3, 736, 960], TensorData::Fp32(vec![0.5; 3 * 736 * 960]));
    let out = m.infer(std::slice::from_ref(&page), &[]).unwrap();
    drop(out);
    drop(page);
    memory::trim_heap();
    let kept = memory::process_private_bytes().saturating_sub(before) as f64 / 1048576.0;
    drop(m);
    memory::trim_heap();
    kept
}

#[test]
fn a_run_gives_its_activations_back_unless_told_to_keep_them() {
    // As the server sets it up with `release_activations`.
    assert!(memory::return_large_blocks());
    let released = kept_after_a_page(true);
    let kept = kept_after_a_page(false);
    println!("after one page: {released:.1} MiB kept released, {kept:.1} MiB kept in the arena");
    // A page's activations are many times the detector's ~10 MB of weights (98-141 MiB
    // kept on the CPUs measured: ONNX Runtime's kernels and their buffers differ by CPU).
    assert!(kept > 60.0, "the arena keeps a page's activations: {kept:.1} MiB");
    assert!(released < kept / 2.0, "released: {released:.1} MiB left vs {kept:.1} MiB kept");
}
