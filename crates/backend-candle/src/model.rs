//! A resident BERT sentence encoder: tokenizer, encoder weights and pooling.
//!
//! Inputs of a call are tokenized together, then run in micro-batches of similar
//! length: sorting by length keeps padding (wasted compute) small, and a cap on
//! padded tokens per micro-batch bounds the attention buffers however large the
//! request. The attention mask keeps padding out of every real token's context and
//! out of the pooling, so a sentence gets the same vector alone or in any batch.

use candle_core::{DType, Device as CandleDevice, Tensor as CandleTensor, D};
use candle_transformers::models::bert::BertModel;
use snooze_core::{
    DataType, EmbedInput, Embedder, Embeddings, InferError, LoadedModel, ModelSignature, Tensor, TensorData,
};
use tokenizers::Tokenizer;

use crate::layout::{ModelLayout, Pooling};

/// Padded tokens per forward pass, for short inputs.
const TOKENS_PER_PASS: usize = 8192;

/// Attention-score elements per forward pass (`sequences × heads × len²`), for long
/// inputs. Candle's BERT keeps about five score-sized tensors alive per layer (scores,
/// scaled, masked, softmax, ...): at 32 × 256 tokens and 12 heads that was a transient
/// 580 MiB over the weights. 4 Mi elements (16 MiB per tensor) caps it near 100 MiB and
/// still runs 5 sequences of 256 tokens at once.
const ATTENTION_PER_PASS: usize = 4 << 20;

/// The output tensor's name, for KServe and for the signature.
pub const OUTPUT_NAME: &str = "embedding";

/// What one full micro-batch pass adds to RSS (see `working_bytes`).
const WORKING_BYTES: u64 = 192 << 20;

pub struct CandleModel {
    pub(crate) signature: ModelSignature,
    pub(crate) bert: BertModel,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) device: CandleDevice,
    pub(crate) pooling: Pooling,
    pub(crate) normalize: bool,
    pub(crate) max_seq_len: usize,
    pub(crate) vocab_size: usize,
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
        tokenizer: Tokenizer,
        device: CandleDevice,
        signature: ModelSignature,
    ) -> CandleModel {
        CandleModel {
            signature,
            bert,
            tokenizer,
            device,
            pooling: layout.pooling,
            normalize: layout.normalize,
            max_seq_len: layout.max_seq_len,
            vocab_size: layout.config.vocab_size,
            pad_id: u32::try_from(layout.config.pad_token_id).unwrap_or(0),
            dims: layout.config.hidden_size,
            heads: layout.config.num_attention_heads,
            _trim: TrimHeapOnDrop,
        }
    }

    /// Token ids of each input, truncated to `max_seq_len`.
    fn token_ids(&self, input: &EmbedInput) -> Result<Vec<Vec<u32>>, InferError> {
        let seqs: Vec<Vec<u32>> = match input {
            // The tokenizer was set at load to truncate (keeping its special tokens) and not to pad.
            EmbedInput::Texts(texts) => {
                let texts: Vec<&str> = texts
                    .iter()
                    .map(|t| crate::truncate::tokenizer_prefix(&self.tokenizer, t, self.max_seq_len))
                    .collect();
                let encodings = self
                    .tokenizer
                    .encode_batch(texts, true)
                    .map_err(|e| InferError::InvalidInput(format!("cannot tokenize the input: {e}")))?;
                encodings.into_iter().map(|e| e.get_ids().to_vec()).collect()
            }
            // Ids are the caller's own tokenization, special tokens included: used as given,
            // cut to the first `max_seq_len`.
            EmbedInput::TokenIds(ids) => {
                for (i, seq) in ids.iter().enumerate() {
                    if let Some(&bad) = seq.iter().find(|&&id| id as usize >= self.vocab_size) {
                        return Err(InferError::InvalidInput(format!(
                            "input {i} holds token id {bad}, outside the model's vocabulary of {} tokens",
                            self.vocab_size
                        )));
                    }
                }
                ids.iter().map(|s| s[..s.len().min(self.max_seq_len)].to_vec()).collect()
            }
        };
        for (i, s) in seqs.iter().enumerate() {
            if s.is_empty() {
                return Err(InferError::InvalidInput(format!("input {i} has no tokens")));
            }
        }
        Ok(seqs)
    }

    fn embed_ids(&self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, InferError> {
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].len()));
        let mut vectors = vec![Vec::new(); seqs.len()];
        let mut start = 0;
        while start < order.len() {
            // Longest first, so the first sequence of a pass sets its padded length.
            let longest = seqs[order[start]].len();
            let by_tokens = TOKENS_PER_PASS / longest;
            let by_attention = ATTENTION_PER_PASS / (self.heads * longest * longest);
            let count = by_tokens.min(by_attention).clamp(1, order.len() - start);
            let pass = &order[start..start + count];
            let batch: Vec<&[u32]> = pass.iter().map(|&i| seqs[i].as_slice()).collect();
            let out = self.forward(&batch).map_err(|e| InferError::Failed(format!("candle: {e}")))?;
            for (&i, v) in pass.iter().zip(out) {
                vectors[i] = v;
            }
            start += count;
        }
        Ok(vectors)
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
        self.max_seq_len
    }

    fn normalized(&self) -> bool {
        self.normalize
    }

    fn embed(&self, input: &EmbedInput) -> Result<Embeddings, InferError> {
        let seqs = self.token_ids(input)?;
        let tokens = seqs.iter().map(Vec::len).collect();
        let vectors = self.embed_ids(&seqs)?;
        Ok(Embeddings::new(vectors, tokens))
    }
}

impl LoadedModel for CandleModel {
    fn signature(&self) -> &ModelSignature {
        &self.signature
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        if let Some(unknown) = outputs.iter().find(|o| o.as_str() != OUTPUT_NAME) {
            return Err(InferError::InvalidInput(format!(
                "unknown output '{unknown}'; this model has one output, '{OUTPUT_NAME}'"
            )));
        }
        let input = match inputs.len() {
            1 => inputs.first(),
            _ => inputs.iter().find(|t| t.name == "text"),
        };
        let input = input.ok_or_else(|| {
            InferError::InvalidInput(
                "expected one BYTES input of texts (named 'text' when there are several)".into(),
            )
        })?;
        let name = &input.name;
        let TensorData::Bytes(items) = &input.data else {
            return Err(InferError::InvalidInput(format!(
                "input '{name}' has datatype {} but the model expects BYTES (UTF-8 texts)",
                input.data.datatype()
            )));
        };
        let texts = items
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                String::from_utf8(bytes.clone()).map_err(|_| {
                    InferError::InvalidInput(format!("input '{name}' element {i} is not valid UTF-8 text"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let rows = texts.len();
        let embeddings = self.embed(&EmbedInput::Texts(texts))?;
        let data: Vec<f32> = embeddings.vectors.into_iter().flatten().collect();
        let shape =
            vec![i64::try_from(rows).unwrap_or(i64::MAX), i64::try_from(self.dims).unwrap_or(i64::MAX)];
        Ok(vec![Tensor::new(OUTPUT_NAME, shape, TensorData::Fp32(data))])
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
    let hidden = i64::try_from(hidden_size).unwrap_or(i64::MAX);
    ModelSignature {
        platform: "candle_bert".into(),
        inputs: vec![snooze_core::TensorSpec {
            name: "text".into(),
            datatype: DataType::Bytes,
            shape: vec![-1],
        }],
        outputs: vec![snooze_core::TensorSpec {
            name: OUTPUT_NAME.into(),
            datatype: DataType::Fp32,
            shape: vec![-1, hidden],
        }],
    }
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

    #[test]
    fn signature_has_text_in_and_embedding_out() {
        let s = signature_for(384);
        assert_eq!(s.platform, "candle_bert");
        assert_eq!((s.inputs[0].name.as_str(), s.inputs[0].datatype), ("text", DataType::Bytes));
        assert_eq!(s.outputs[0].shape, vec![-1, 384]);
    }
}
