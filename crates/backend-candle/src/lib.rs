//! SnoozeML's Candle backend: sentence-embedding models of the BERT family, run by
//! Candle (pure Rust) from a sentence-transformers model folder.
//!
//! A model folder is `config.json` + `tokenizer.json` + safetensors weights (one file,
//! or shards listed by `model.safetensors.index.json`) + the sentence-transformers
//! pipeline files (`modules.json`, `1_Pooling/config.json`) that say how token vectors
//! become one sentence vector and whether it is L2-normalized. `layout` reads those
//! files without touching the weights (for `signature` and `estimate`); `model` holds a
//! loaded encoder and serves both the KServe tensor path and the `Embedder` path.
//!
//! Weights are memory-mapped while the encoder is built, then copied into Candle's
//! own CPU tensors, so a model's steady footprint is its weights as f32 plus a floor;
//! the mapping is gone once the load returns. Dropping the model frees the tensors and
//! trims the heap. Candle reports no allocation failure as an error (Rust aborts on a
//! failed CPU allocation), so no load error is classified as out-of-memory.

mod layout;
mod model;

use std::{fs, path::Path, sync::Arc};

use candle_nn::VarBuilder;
use candle_transformers::models::bert::{self, BertModel};
use snooze_core::{Backend, Device, FootprintEstimate, LoadError, LoadSpec, LoadedModel, ModelSignature};
use snooze_text::TextEncoder;

pub use layout::{weight_files, ModelLayout};
pub use model::CandleModel;
pub use snooze_text::{kserve::OUTPUT_NAME, Pooling};

/// Footprint of a resident model = weights as f32 × `STEADY_FACTOR` + `FLOOR_BYTES`.
///
/// It covers the model *in use*, not just loaded: measured on all-MiniLM-L6-v2 (86.7 MiB
/// of f32 weights) a load adds 96 MiB of RSS, and a pass at the micro-batch limit peaks
/// at +190 MiB under `tune_allocator_for_low_ram`, and at +232..280 MiB with glibc's
/// defaults (freed buffers fragment the per-thread arenas; see the crate's memory
/// test), which the figure must cover too. The factor lets activations grow with the
/// model's width; the floor covers the tokenizer's tables, Candle's thread pools and
/// the attention buffers, whose size `model` caps per pass.
pub const STEADY_FACTOR: f64 = 1.25;
pub const FLOOR_BYTES: u64 = 192 << 20;

/// Added to the mapped files and their f32 copies for the peak of a load (measured: +8 MiB).
pub const LOAD_FLOOR_BYTES: u64 = 32 << 20;

/// The Candle engine. Stateless: each `load` builds an independent model.
#[derive(Debug, Default, Clone)]
pub struct CandleBackend;

impl CandleBackend {
    pub fn new() -> CandleBackend {
        CandleBackend
    }
}

impl Backend for CandleBackend {
    fn name(&self) -> &'static str {
        "candle"
    }

    /// Candle copies the weights into its own tensors: one private copy, not prepacked,
    /// whatever the config or the budget would pick (`auto` said `mapped` under a budget
    /// and `prepacked` without, and each restart across budgets dropped the footprint
    /// learned under the other).
    fn fixed_weights(&self, _path: &Path) -> Option<snooze_core::Weights> {
        Some(snooze_core::Weights::Compact)
    }

    fn estimate(&self, path: &Path, _weights: snooze_core::Weights) -> FootprintEstimate {
        match estimate(path) {
            Ok(e) => e,
            Err(why) => FootprintEstimate::indeterminate(why),
        }
    }

    fn task(&self, _path: &Path) -> snooze_core::Task {
        snooze_core::Task::Embedding
    }

    fn signature(&self, path: &Path) -> Result<ModelSignature, LoadError> {
        let layout = ModelLayout::read(path).map_err(LoadError::Failed)?;
        Ok(model::signature_for(layout.config.hidden_size))
    }

    fn load(&self, spec: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError> {
        let _span = tracing::info_span!("candle_load", model = %spec.name, device = %spec.device).entered();
        if spec.intra_op_threads != 0 {
            // Candle sizes its thread pools once per process (RAYON_NUM_THREADS), not per model.
            tracing::debug!(
                threads = spec.intra_op_threads,
                "intra_op_threads is not settable per model in candle"
            );
        }
        let layout = ModelLayout::read(&spec.path).map_err(LoadError::Failed)?;
        let weights = weight_files(&layout.sentence.transformer_dir).map_err(LoadError::Failed)?;
        let encoder = TextEncoder::load(&layout.sentence).map_err(LoadError::Failed)?;
        let device = candle_device(&spec.device)?;
        // SAFETY: the files are mapped read-only and only while the encoder is built;
        // Candle copies every tensor out of the mapping before `vb` is dropped.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&weights, bert::DTYPE, &device) }.map_err(|e| {
                LoadError::Failed(format!(
                    "cannot map the weights in {}: {e}",
                    layout.sentence.transformer_dir.display()
                ))
            })?;
        let bert = BertModel::load(vb, &layout.config).map_err(|e| {
            LoadError::Failed(format!(
                "the weights in {} do not fit its config.json as a BERT model: {e}",
                layout.sentence.transformer_dir.display()
            ))
        })?;
        tracing::info!(
            pooling = ?layout.sentence.pooling,
            normalize = layout.sentence.normalize,
            max_seq_len = layout.sentence.max_seq_len,
            "loaded"
        );
        Ok(Arc::new(CandleModel::new(&layout, bert, encoder, device)))
    }
}

fn candle_device(device: &Device) -> Result<candle_core::Device, LoadError> {
    match device {
        Device::Cpu => Ok(candle_core::Device::Cpu),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => candle_core::Device::new_cuda(*n as usize)
            .map_err(|e| LoadError::Failed(format!("cannot open CUDA device cuda:{n}: {e}"))),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(n) => Err(LoadError::Failed(format!(
            "device cuda:{n} needs the candle backend built with its `cuda` feature; this build runs on cpu only"
        ))),
    }
}

fn estimate(dir: &Path) -> Result<FootprintEstimate, String> {
    let layout = ModelLayout::read(dir)?;
    let weights = weight_files(&layout.sentence.transformer_dir)?;
    let mut file_bytes = 0u64;
    let mut f32_bytes = 0u64;
    for w in &weights {
        file_bytes += fs::metadata(w).map_err(|e| format!("cannot read {}: {e}", w.display()))?.len();
        f32_bytes += layout::f32_bytes(w)?;
    }
    let tokenizer = layout.sentence.tokenizer_path();
    let tokenizer_bytes =
        fs::metadata(&tokenizer).map_err(|e| format!("cannot read {}: {e}", tokenizer.display()))?.len();
    let steady = ((f32_bytes + tokenizer_bytes) as f64 * STEADY_FACTOR) as u64 + FLOOR_BYTES;
    // While loading, the mapped files are resident next to the tensors copied out of them.
    let load_peak = f32_bytes + file_bytes + tokenizer_bytes + LOAD_FLOOR_BYTES;
    Ok(FootprintEstimate {
        steady_bytes: Some(steady),
        peak_bytes: Some(steady.max(load_peak)),
        derivation: format!(
            "{} safetensors file(s): {} MiB of weights as f32 + tokenizer {} KiB, x{STEADY_FACTOR} + {} MiB floor \
             (the model and one full micro-batch); a load maps the {} MiB of files next to their f32 copies",
            weights.len(),
            f32_bytes >> 20,
            tokenizer_bytes >> 10,
            FLOOR_BYTES >> 20,
            file_bytes >> 20
        ),
    })
}
