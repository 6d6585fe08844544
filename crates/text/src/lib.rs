//! Sentence-embedding models, whichever engine runs their encoder.
//!
//! A sentence-transformers folder (`modules.json`, `1_Pooling/config.json`,
//! `tokenizer.json`, `config.json`, and weights as safetensors or an ONNX export)
//! says everything around the encoder: how texts become token ids, how token vectors
//! become one sentence vector, and whether it is L2-normalized. This crate reads
//! and does those parts, so the ONNX Runtime and Candle backends tokenize,
//! truncate, batch, pool and normalize alike and differ only in the encoder.

mod encode;
pub mod kserve;
mod layout;
mod pool;
pub mod truncate;

pub use encode::{passes, TextEncoder, ATTENTION_PER_PASS, TOKENS_PER_PASS};
pub use layout::{
    is_sentence_model, onnx_export, parse_pooling_config, EncoderConfig, Pooling, SentenceLayout,
};
pub use pool::{l2_normalize, pool};
