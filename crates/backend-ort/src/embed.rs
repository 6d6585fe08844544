//! Sentence-embedding models whose encoder is an ONNX export: the folder layout
//! sentence-transformers' ONNX backend and most Hub repositories ship
//! (`onnx/model.onnx` next to `tokenizer.json`, `modules.json`, `1_Pooling/`).
//!
//! The export takes token ids and an attention mask and returns the token vectors
//! (`last_hidden_state`); tokenization, micro-batching, pooling and normalization are
//! `snooze_text`'s, the same code the Candle backend runs, so a model gives the same
//! vectors on either engine.

use snooze_core::{
    DataType, EmbedInput, Embedder, Embeddings, InferError, LoadedModel, ModelSignature, Tensor, TensorData,
};
use snooze_text::{kserve, Pooling, SentenceLayout, TextEncoder};

use crate::model::OrtModel;

/// The KServe platform name of an embedding model served by this backend.
pub const PLATFORM: &str = "onnxruntime_sentence_embedding";

/// Output names of the token vectors, in order of preference (Optimum / Hugging Face
/// exports, sentence-transformers' own export).
const TOKEN_OUTPUTS: [&str; 2] = ["last_hidden_state", "token_embeddings"];

/// Padded tokens per forward pass. ONNX Runtime's arena keeps the largest pass's
/// activations until the model unloads (Candle frees them, and runs 8192): measured on
/// all-MiniLM-L6-v2, a pass of 8160 tokens left +205 MiB resident, one of 2048 tokens
/// +62..77 MiB (fp32 and int8), for the same throughput (32 short sentences are about 500 tokens).
pub(crate) const TOKENS_PER_PASS: usize = 2048;

/// Activations the largest pass leaves in ONNX Runtime's arena, per unit of hidden
/// size (see `working_bytes`; tests/embedding_memory.rs measures it).
const WORKING_BYTES_PER_HIDDEN: u64 = 256 << 10;

/// What one full micro-batch pass adds, for a model of `hidden` dimensions.
pub fn working_bytes(hidden: usize) -> u64 {
    WORKING_BYTES_PER_HIDDEN.saturating_mul(hidden as u64)
}

/// How an export's graph takes its inputs and gives its token vectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EncoderGraph {
    /// The datatype of the id and mask inputs (INT64 in most exports, INT32 in some).
    ids: DataType,
    token_types: bool,
    output: String,
}

/// Checks that an export's signature is a text encoder of `hidden` dimensions.
pub(crate) fn encoder_graph(onnx: &ModelSignature, hidden: usize) -> Result<EncoderGraph, String> {
    let input = |name: &str| onnx.inputs.iter().find(|s| s.name == name);
    for spec in &onnx.inputs {
        if !["input_ids", "attention_mask", "token_type_ids"].contains(&spec.name.as_str()) {
            return Err(format!(
                "its input '{}' is not one a text encoder takes (input_ids, attention_mask, token_type_ids)",
                spec.name
            ));
        }
    }
    let ids = input("input_ids").ok_or("it has no input 'input_ids'")?;
    input("attention_mask").ok_or("it has no input 'attention_mask'")?;
    if !matches!(ids.datatype, DataType::Int64 | DataType::Int32) {
        return Err(format!("its input 'input_ids' is {}, not INT64 or INT32", ids.datatype));
    }
    if let Some(other) = onnx.inputs.iter().find(|s| s.datatype != ids.datatype) {
        return Err(format!(
            "its input '{}' is {} but 'input_ids' is {}",
            other.name, other.datatype, ids.datatype
        ));
    }
    let output = TOKEN_OUTPUTS
        .iter()
        .find_map(|n| onnx.outputs.iter().find(|s| s.name == *n))
        .or_else(|| onnx.outputs.iter().find(|s| s.shape.len() == 3))
        .ok_or(
            "it has no output of token vectors (last_hidden_state, or any [batch, tokens, hidden] output)",
        )?;
    if output.datatype != DataType::Fp32 {
        return Err(format!("its output '{}' is {}, not FP32", output.name, output.datatype));
    }
    let declared = output.shape.get(2).copied().filter(|d| *d > 0);
    if output.shape.len() != 3 || declared.is_some_and(|d| d != hidden as i64) {
        return Err(format!(
            "its output '{}' has shape {:?}, not [batch, tokens, {hidden}] (hidden_size in config.json)",
            output.name, output.shape
        ));
    }
    Ok(EncoderGraph {
        ids: ids.datatype,
        token_types: input("token_type_ids").is_some(),
        output: output.name.clone(),
    })
}

pub(crate) struct OrtEmbedder {
    model: OrtModel,
    graph: EncoderGraph,
    encoder: TextEncoder,
    signature: ModelSignature,
    pooling: Pooling,
    normalize: bool,
    dims: usize,
    heads: usize,
    pad_id: u32,
}

impl OrtEmbedder {
    pub(crate) fn new(
        model: OrtModel,
        graph: EncoderGraph,
        layout: &SentenceLayout,
        encoder: TextEncoder,
    ) -> Self {
        OrtEmbedder {
            model,
            graph,
            encoder,
            signature: kserve::signature(PLATFORM, layout.encoder.hidden_size),
            pooling: layout.pooling,
            normalize: layout.normalize,
            dims: layout.encoder.hidden_size,
            heads: layout.encoder.num_attention_heads,
            pad_id: layout.encoder.pad_token_id,
        }
    }

    /// One forward pass over sequences padded to the longest; one vector each.
    fn forward(&self, batch: &[&[u32]]) -> Result<Vec<Vec<f32>>, InferError> {
        let len = batch.iter().map(|s| s.len()).max().unwrap_or(0);
        let rows = batch.len();
        let mut ids = Vec::with_capacity(rows * len);
        let mut mask = Vec::with_capacity(rows * len);
        for seq in batch {
            ids.extend_from_slice(seq);
            ids.resize(ids.len() + len - seq.len(), self.pad_id);
            mask.resize(mask.len() + seq.len(), 1u32);
            mask.resize(mask.len() + len - seq.len(), 0u32);
        }
        let shape = vec![rows as i64, len as i64];
        let tensor = |name: &str, values: Vec<u32>| {
            let data = match self.graph.ids {
                DataType::Int32 => TensorData::Int32(values.into_iter().map(|v| v as i32).collect()),
                _ => TensorData::Int64(values.into_iter().map(i64::from).collect()),
            };
            Tensor::new(name, shape.clone(), data)
        };
        let mut inputs = vec![tensor("input_ids", ids), tensor("attention_mask", mask)];
        if self.graph.token_types {
            inputs.push(tensor("token_type_ids", vec![0; rows * len]));
        }
        let output = self.model.infer(&inputs, std::slice::from_ref(&self.graph.output))?;
        let hidden = match output.into_iter().next() {
            Some(Tensor { data: TensorData::Fp32(v), .. }) if v.len() == rows * len * self.dims => v,
            other => {
                return Err(InferError::Failed(format!(
                    "the encoder returned {} for {rows} x {len} tokens, not [{rows}, {len}, {}] FP32",
                    other.map_or("nothing".into(), |t| format!("{:?} {}", t.shape, t.data.datatype())),
                    self.dims
                )))
            }
        };
        let lengths: Vec<usize> = batch.iter().map(|s| s.len()).collect();
        let mut vectors = snooze_text::pool(&hidden, &lengths, len, self.dims, self.pooling);
        if self.normalize {
            vectors.iter_mut().for_each(|v| snooze_text::l2_normalize(v));
        }
        Ok(vectors)
    }
}

impl Embedder for OrtEmbedder {
    fn dimensions(&self) -> usize {
        self.dims
    }

    fn max_tokens(&self) -> usize {
        self.encoder.max_seq_len()
    }

    fn normalized(&self) -> bool {
        self.normalize
    }

    fn embed(&self, input: &EmbedInput) -> Result<Embeddings, InferError> {
        self.encoder.embed(input, self.heads, TOKENS_PER_PASS, |batch| self.forward(batch))
    }
}

impl LoadedModel for OrtEmbedder {
    fn signature(&self) -> &ModelSignature {
        &self.signature
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        kserve::infer(self, inputs, outputs)
    }

    fn as_embedder(&self) -> Option<&dyn Embedder> {
        Some(self)
    }

    /// The largest micro-batch pass leaves its activations in ONNX Runtime's arena.
    fn working_bytes(&self) -> u64 {
        working_bytes(self.dims)
    }

    fn mapped_bytes(&self) -> u64 {
        self.model.mapped_bytes()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use snooze_core::TensorSpec;

    use super::*;

    fn spec(name: &str, datatype: DataType, shape: &[i64]) -> TensorSpec {
        TensorSpec { name: name.into(), datatype, shape: shape.to_vec() }
    }

    fn sig(inputs: Vec<TensorSpec>, outputs: Vec<TensorSpec>) -> ModelSignature {
        ModelSignature { platform: "onnxruntime_onnx".into(), inputs, outputs }
    }

    #[test]
    fn encoder_graphs_are_recognised_or_refused_with_a_reason() {
        let ids = |n: &str| spec(n, DataType::Int64, &[-1, -1]);
        let hidden = spec("last_hidden_state", DataType::Fp32, &[-1, -1, 384]);
        let g = encoder_graph(
            &sig(vec![ids("input_ids"), ids("attention_mask"), ids("token_type_ids")], vec![hidden.clone()]),
            384,
        )
        .unwrap();
        assert_eq!(
            g,
            EncoderGraph { ids: DataType::Int64, token_types: true, output: "last_hidden_state".into() }
        );
        // Any rank-3 output, when none has a known name; no token types.
        let other = spec("out", DataType::Fp32, &[-1, -1, -1]);
        let g = encoder_graph(&sig(vec![ids("input_ids"), ids("attention_mask")], vec![other]), 384).unwrap();
        assert!(!g.token_types && g.output == "out");

        let e = encoder_graph(&sig(vec![ids("input_ids")], vec![hidden.clone()]), 384).unwrap_err();
        assert!(e.contains("attention_mask"), "{e}");
        let e = encoder_graph(&sig(vec![ids("pixels"), ids("input_ids")], vec![hidden.clone()]), 384)
            .unwrap_err();
        assert!(e.contains("'pixels'"), "{e}");
        let e = encoder_graph(&sig(vec![ids("input_ids"), ids("attention_mask")], vec![hidden.clone()]), 768)
            .unwrap_err();
        assert!(e.contains("768"), "{e}");
        let pooled = spec("sentence_embedding", DataType::Fp32, &[-1, 384]);
        let e = encoder_graph(&sig(vec![ids("input_ids"), ids("attention_mask")], vec![pooled]), 384)
            .unwrap_err();
        assert!(e.contains("no output of token vectors"), "{e}");
        let floats = spec("input_ids", DataType::Fp32, &[-1, -1]);
        let e = encoder_graph(&sig(vec![floats, ids("attention_mask")], vec![hidden]), 384).unwrap_err();
        assert!(e.contains("not INT64 or INT32"), "{e}");
    }
}
