//! The seam to an engine: the only things an engine supplies are Whisper's two passes,
//! on plain slices with their shapes, so an engine can hand the caller's buffers (the
//! KV-cache store's rows) to its runtime as borrowed views instead of copying them.
//!
//! The contract is the one `scripts/export_whisper.py` builds its graphs to:
//! - encoder: mel `[batch, n_mels, frames]` -> per decoder layer the cross-attention
//!   keys and values `[batch, heads, frames / 2, head_dim]`;
//! - decoder: `n_new` tokens per sequence on top of `n_past` cached positions, with an
//!   additive attention mask, -> logits at the requested positions and the new tokens'
//!   keys and values (the caller appends them to its cache).

use snooze_core::InferError;

/// Per decoder layer, `[batch, heads, audio_ctx, head_dim]` each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CrossKv {
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
}

/// One decoder pass over a batch of sequences. Every slice is row-major with the
/// shape its comment gives; per-layer slices are indexed by decoder layer.
#[derive(Debug, Clone, Copy)]
pub struct DecoderInput<'a> {
    pub batch: usize,
    pub n_new: usize,
    /// Cached positions per row (the same for every row: unused ones are masked).
    pub n_past: usize,
    /// Positions per row whose logits are wanted.
    pub n_logits: usize,
    /// `[batch, n_new]`
    pub tokens: &'a [i64],
    /// `[batch, n_new]`: each token's position in its sequence.
    pub positions: &'a [i64],
    /// `[batch, n_new, n_past + n_new]`: 0 attends, a large negative value does not.
    pub attention_mask: &'a [f32],
    /// `[batch, n_logits]`: indices in `0..n_new`.
    pub logit_positions: &'a [i64],
    /// Per layer `[batch, heads, n_past, head_dim]`.
    pub past_keys: &'a [&'a [f32]],
    pub past_values: &'a [&'a [f32]],
    /// Per layer `[batch, heads, audio_ctx, head_dim]`.
    pub cross_keys: &'a [&'a [f32]],
    pub cross_values: &'a [&'a [f32]],
}

/// What a decoder pass returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecoderOutput {
    /// `[batch, n_logits, vocab]`
    pub logits: Vec<f32>,
    /// Per layer `[batch, heads, n_new, head_dim]`.
    pub new_keys: Vec<Vec<f32>>,
    pub new_values: Vec<Vec<f32>>,
}

/// An engine's Whisper. Calls may come from several threads; an engine whose runtime
/// needs exclusive access serialises them itself.
pub trait WhisperEngine: Send + Sync {
    /// `mel` is `[batch, n_mels, frames]`.
    fn encode(&self, mel: &[f32], batch: usize, frames: usize) -> Result<CrossKv, InferError>;
    fn decode(&self, input: &DecoderInput<'_>) -> Result<DecoderOutput, InferError>;
}
