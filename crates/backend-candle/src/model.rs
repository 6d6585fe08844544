//! A resident BERT sentence encoder: tokenizer, encoder weights and pooling.
//!
//! Inputs of a call are tokenized together, then run in micro-batches of similar
//! length: sorting by length keeps padding (wasted compute) small, and a cap on
//! padded tokens per micro-batch bounds the attention buffers however large the
//! request. The attention mask keeps padding out of every real token's context and
//! out of the pooling, so a sentence gets the same vector alone or in any batch.

use candle_core::{DType, Device as CandleDevice, Tensor as CandleTensor, D};
use candle_transformers::models::bert::BertModel;
use snooze_core::{EmbedInput, Embedder, Embeddings, InferError, LoadedModel, ModelSignature, Tensor};
use snooze_text::{kserve, Pooling, TextEncoder};

use crate::layout::ModelLayout;

/// What one full micro-batch pass adds to RSS (see `working_bytes`).
const WORKING_BYTES: u64 = 192 << 20;

pub struct CandleModel {
    pub(crate) signature: ModelSignature,
    pub(crate) bert: BertModel,
    pub(crate) encoder: TextEncoder,
    pub(crate) device: CandleDevice,
    pub(crate) pooling: Pooling,
    pub(crate) normalize: bool,
    pub(crate) pad_id: u32,
    pub(crate) dims: usize,
    pub(crate) heads: usize,
    /// Declared last so it drops last: the heap is trimmed once the tensors above are freed.
    pub(crate) _trim: TrimHeapOnDrop,
}

/// Returns the freed heap to the OS when dropped. glibc would otherwise keep the
/// weights' pages after an unload, and the scheduler would see no memory come back.
pub(crate) struct TrimHeapOnDrop;

impl Drop for TrimHeapOnDrop {
    fn drop(&mut self) {
        snooze_core::memory::trim_heap();
    }
}

impl CandleModel {
    pub(crate) fn new(
        layout: &ModelLayout,
        bert: BertModel,
        encoder: TextEncoder,
        device: CandleDevice,
    ) -> CandleModel {
        CandleModel {
            signature: signature_for(layout.config.hidden_size),
            bert,
            encoder,
            device,
            pooling: layout.sentence.pooling,
            normalize: layout.sentence.normalize,
            pad_id: u32::try_from(layout.config.pad_token_id).unwrap_or(0),
            dims: layout.config.hidden_size,
            heads: layout.config.num_attention_heads,
            _trim: TrimHeapOnDrop,
        }
    }

    /// One forward pass over sequences padded to the longest.
    fn forward(&self, batch: &[&[u32]]) -> candle_core::Result<Vec<Vec<f32>>> {
        let len = batch.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(batch.len() * len);
        let mut mask = Vec::with_capacity(batch.len() * len);
        for seq in batch {
            ids.extend_from_slice(seq);
            ids.resize(ids.len() + len - seq.len(), self.pad_id);
            mask.resize(mask.len() + seq.len(), 1u32);
            mask.resize(mask.len() + len - seq.len(), 0u32);
        }
        let ids = CandleTensor::from_vec(ids, (batch.len(), len), &self.device)?;
        let mask = CandleTensor::from_vec(mask, (batch.len(), len), &self.device)?;
        let type_ids = ids.zeros_like()?;
        let hidden = self.bert.forward(&ids, &type_ids, Some(&mask))?;
        let pooled = pool(&hidden, &mask, self.pooling)?;
        let pooled = if self.normalize { l2_normalize(&pooled)? } else { pooled };
        pooled.to_dtype(DType::F32)?.to_vec2::<f32>()
    }
}

/// Token vectors `[batch, len, hidden]` → sentence vectors `[batch, hidden]`, as
/// sentence-transformers' `Pooling` computes them.
pub(crate) fn pool(
    hidden: &CandleTensor,
    mask: &CandleTensor,
    pooling: Pooling,
) -> candle_core::Result<CandleTensor> {
    let mask = mask.to_dtype(hidden.dtype())?.unsqueeze(2)?;
    match pooling {
        Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1),
        Pooling::Mean => {
            let sum = hidden.broadcast_mul(&mask)?.sum(1)?;
            // sentence-transformers clamps the count the same way.
            let count = mask.sum(1)?.clamp(1e-9, f64::MAX)?;
            sum.broadcast_div(&count)
        }
        Pooling::Max => {
            // Padding gets -1e9 (sentence-transformers' value) so it never wins the max.
            let offset = ((mask.ones_like()? - &mask)? * -1e9)?;
            hidden.broadcast_mul(&mask)?.broadcast_add(&offset)?.max(1)
        }
    }
}

/// `x / max(‖x‖, 1e-12)` per row, as `torch.nn.functional.normalize`.
pub(crate) fn l2_normalize(x: &CandleTensor) -> candle_core::Result<CandleTensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    x.broadcast_div(&norm)
}

impl Embedder for CandleModel {
    fn dimensions(&self) -> usize {
        self.dims
    }

    fn max_tokens(&self) -> usize {
        self.encoder.max_seq_len()
    }

    fn normalized(&self) -> bool {
        self.normalize
    }

    /// Passes of up to `TOKENS_PER_PASS` tokens: Candle's BERT keeps about five
    /// score-sized tensors alive per layer, which the attention cap bounds near 100 MiB.
    fn embed(&self, input: &EmbedInput) -> Result<Embeddings, InferError> {
        self.encoder.embed(input, self.heads, snooze_text::TOKENS_PER_PASS, |batch| {
            self.forward(batch).map_err(|e| InferError::Failed(format!("candle: {e}")))
        })
    }
}

impl LoadedModel for CandleModel {
    fn signature(&self) -> &ModelSignature {
        &self.signature
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        kserve::infer(self, inputs, outputs)
    }

    /// Measured on all-MiniLM-L6-v2 with a full micro-batch: a pass adds 95 MiB with
    /// the low-RAM allocator tuning and up to 185 MiB with glibc's defaults.
    fn working_bytes(&self) -> u64 {
        WORKING_BYTES
    }

    fn as_embedder(&self) -> Option<&dyn Embedder> {
        Some(self)
    }
}

/// The KServe signature: texts in, one vector per text out.
pub(crate) fn signature_for(hidden_size: usize) -> ModelSignature {
    kserve::signature("candle_bert", hidden_size)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn t(rows: &[&[f32]]) -> CandleTensor {
        let len = rows[0].len();
        let data: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        CandleTensor::from_vec(data, (1, rows.len(), len), &CandleDevice::Cpu).unwrap()
    }

    #[test]
    fn pooling_ignores_padding() {
        // Two real tokens and one padding token with huge values that must not count.
        let hidden = t(&[&[1.0, -2.0], &[3.0, 4.0], &[100.0, 100.0]]);
        let mask = CandleTensor::from_vec(vec![1u32, 1, 0], (1, 3), &CandleDevice::Cpu).unwrap();
        let got = |p| pool(&hidden, &mask, p).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got(Pooling::Mean), vec![vec![2.0, 1.0]]);
        assert_eq!(got(Pooling::Cls), vec![vec![1.0, -2.0]]);
        assert_eq!(got(Pooling::Max), vec![vec![3.0, 4.0]]);
    }

    #[test]
    fn normalize_gives_unit_rows_and_spares_zero_rows() {
        let x = CandleTensor::from_vec(vec![3.0f32, 4.0, 0.0, 0.0], (2, 2), &CandleDevice::Cpu).unwrap();
        let n = l2_normalize(&x).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(n, vec![vec![0.6, 0.8], vec![0.0, 0.0]]);
    }
}
