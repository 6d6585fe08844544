//! Classifying ONNX Runtime failures, once, at the backend boundary.
//!
//! ONNX Runtime has no out-of-memory error code: an allocation failure arrives as
//! `ORT_FAIL` or `ORT_RUNTIME_EXCEPTION` with a message. The scheduler evicts other
//! models and retries *only* on a verified OOM, so the match is strict: the exact
//! texts ONNX Runtime and the C++ runtime produce for a failed allocation, nothing
//! that merely mentions memory. A miss costs one failed load; a false positive
//! would evict innocent models for a broken file.

use ort::ErrorCode;
use snooze_core::{InferError, LoadError};

/// Substrings that only appear when an allocation failed.
///
/// - `BFCArena::AllocateRawInternal` (the CPU and CUDA arenas) when the underlying
///   allocator returns nothing: "Failed to allocate memory for requested buffer of size N".
/// - `std::bad_alloc::what()` under libstdc++ ("std::bad_alloc"), thrown by the
///   default CPU allocator (`posix_memalign` failure) and by any container growth;
///   ONNX Runtime forwards `what()`, e.g. "Exception during loading: std::bad_alloc".
/// - The same under MSVC's runtime ("bad allocation").
///
/// Deliberately absent: the arena's "Available memory of N is smaller than requested
/// bytes of M", which is a per-session cap (`gpu_mem_limit`, arena max) being hit —
/// evicting other models cannot free memory inside that cap.
pub const OOM_MESSAGES: [&str; 3] =
    ["Failed to allocate memory for requested buffer of size", "std::bad_alloc", "bad allocation"];

/// Whether an ONNX Runtime message reports an allocation failure.
pub fn is_out_of_memory(message: &str) -> bool {
    OOM_MESSAGES.iter().any(|m| message.contains(m))
}

/// A failed session creation.
pub(crate) fn load_error(name: &str, path: &std::path::Path, message: &str) -> LoadError {
    if is_out_of_memory(message) {
        LoadError::OutOfMemory(format!("loading model '{name}' from {}: {message}", path.display()))
    } else {
        LoadError::Failed(format!("cannot load model '{name}' from {}: {message}", path.display()))
    }
}

/// Substrings of the failures a run meets when the *shape* of its input does not fit the
/// graph, though the input matches the model's declared dimensions: a detector whose
/// downsampling leaves 1 px where its skip connection has 2 ("Shape mismatch attempting
/// to re-use buffer. {1,96,1,1} != {1,96,2,2}"), an `Add` of two branches whose sizes a
/// side not divisible by the stride made differ, a `Reshape` whose element count does not
/// divide. ONNX Runtime reports them as `FAIL`; the same input fails the same way every
/// time and other inputs run, so they are the request's to fix, like `INVALID_ARGUMENT`.
pub const SHAPE_MESSAGES: [&str; 3] = [
    "Shape mismatch attempting to re-use buffer",
    "Attempting to broadcast an axis by a dimension other than 1",
    "The input tensor cannot be reshaped to the requested shape",
];

/// A failed run. ONNX Runtime flags shape and type mismatches it catches as
/// `INVALID_ARGUMENT`: those are the request's fault, not the model's. So is a shape the
/// graph cannot take ([`SHAPE_MESSAGES`]) — once the model has `served` a run: a model
/// that fails so on every input (a broken export) has never served one, and its failure
/// is a 500, not a 400 that would hide it from alerts.
pub(crate) fn infer_error(name: &str, code: ErrorCode, message: &str, served: bool) -> InferError {
    // The core names the model in front of an out-of-memory or a failure ("model 'm'
    // failed: ..."); only the invalid input's message is shown as it is.
    let misshapen = served && SHAPE_MESSAGES.iter().any(|m| message.contains(m));
    if is_out_of_memory(message) {
        InferError::OutOfMemory(message.to_string())
    } else if code == ErrorCode::InvalidArgument || misshapen {
        InferError::InvalidInput(format!("model '{name}' rejected the request: {message}"))
    } else {
        InferError::Failed(message.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_allocation_failures_count_as_oom() {
        for oom in [
            "Failed to allocate memory for requested buffer of size 4294967296",
            "Exception during loading: std::bad_alloc",
            "Exception during initialization: std::bad_alloc",
            "bad allocation",
        ] {
            assert!(is_out_of_memory(oom), "{oom}");
        }
        for other in [
            "Protobuf parsing failed.",
            "Load model from x failed:Load model x failed. File doesn't exist",
            "Available memory of 0 is smaller than requested bytes of 1024",
            "out of memory",
            "Got invalid dimensions for input: x for the following indices",
        ] {
            assert!(!is_out_of_memory(other), "{other}");
        }
    }

    #[test]
    fn run_errors_are_classified_by_code_and_message() {
        let invalid = infer_error("m", ErrorCode::InvalidArgument, "Got invalid dimensions", false);
        assert!(matches!(invalid, InferError::InvalidInput(_)));
        // What ocr-det answers for a 16 x 16 input (its metadata allows any size).
        let small = "Non-zero status code returned while running Add node. Name:'Add.178' Status Message: \
            op_kernel.cc:87 [ONNXRuntimeError] : 1 : FAIL : Shape mismatch attempting to re-use buffer. \
            {1,96,1,1} != {1,96,2,2}.";
        let never_served = infer_error("ocr-det", ErrorCode::GenericFailure, small, false);
        assert!(matches!(never_served, InferError::Failed(_)), "a model that never ran: {never_served:?}");
        let small = infer_error("ocr-det", ErrorCode::GenericFailure, small, true);
        assert!(
            matches!(&small, InferError::InvalidInput(m) if m.starts_with("model 'ocr-det' rejected")),
            "{small:?}"
        );
        let oom = infer_error("m", ErrorCode::RuntimeException, "std::bad_alloc", true);
        assert!(matches!(oom, InferError::OutOfMemory(_)));
        let other = "Non-zero status code returned while running MatMul node";
        let failed = infer_error("m", ErrorCode::GenericFailure, other, true);
        assert!(
            matches!(&failed, InferError::Failed(m) if m == other),
            "named once, by the core: {failed:?}"
        );
        let load = load_error("m", std::path::Path::new("/x.onnx"), other);
        assert_eq!(
            load,
            LoadError::Failed(
                "cannot load model 'm' from /x.onnx: Non-zero status code returned while running MatMul node"
                    .into()
            )
        );
    }
}
