//! A run hands its activations back when it ends (`with_activations_released(true)`, the
//! default), instead of leaving them in its session's arena for as long as the model is
//! resident. Measured on the OCR detector, whose activations for one page are many times
//! its weights. Its own test binary, so no other test moves the process's memory.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, detector_kept_mib};
use snooze_core::memory;

/// Private memory a first run of the detector on a 736x960 page leaves resident, MiB.
fn kept_after_a_page(release: bool) -> f64 {
    detector_kept_mib(&backend().with_activations_released(release), 736, 960, 1)
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
