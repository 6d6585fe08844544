//! Sessions run without ONNX Runtime's memory pattern unless told otherwise: on a model
//! fed many shapes it nearly doubles what a run holds, for no speed (see
//! `OrtBackend::with_memory_pattern`). Measured on the OCR detector, whose activations
//! for one page are many times its weights. Its own test binary, so no other test moves
//! the process's memory.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, detector_kept_mib};

/// What two runs of the detector on pages of `height` x `width` leave in its session's
/// arena (activations kept, not released), MiB. The pattern is planned by a shape's first
/// run and used from its second (a PDF's pages, Whisper's windows).
fn arena_after_a_page(pattern: Option<bool>, height: usize, width: usize) -> f64 {
    let mut b = backend().with_activations_released(false);
    if let Some(pattern) = pattern {
        b = b.with_memory_pattern(pattern);
    }
    detector_kept_mib(&b, height, width, 2)
}

#[test]
fn a_run_without_the_memory_pattern_holds_far_less_and_that_is_the_default() {
    let (height, width) = (928, 1120);
    // The process's first run pays one-time costs; none of the measured ones may.
    arena_after_a_page(Some(false), 480, 640);
    let with_pattern = arena_after_a_page(Some(true), height, width);
    let without = arena_after_a_page(Some(false), height, width);
    let default = arena_after_a_page(None, height, width);
    println!(
        "detector, one {width}x{height} page, kept in its arena: {with_pattern:.1} MiB with the memory pattern, \
         {without:.1} MiB without, {default:.1} MiB by default"
    );
    // Measured: with the pattern about 1.9x what the same run holds without it.
    assert!(
        without < 0.75 * with_pattern,
        "without the pattern {without:.1} MiB, with it {with_pattern:.1} MiB: the pattern should cost far more"
    );
    assert!(
        default < 0.75 * with_pattern,
        "the default kept {default:.1} MiB: the pattern is not off by default"
    );
}
