//! Whisper, engine-neutral: the model folder's descriptor and tokenizer, the decoding
//! loop in slices (faster-whisper's rules and long-form algorithm), and the KV-cache
//! store that lets decoder steps of many requests share one engine run.
//!
//! An engine implements [`WhisperEngine`] (the encoder and decoder passes) and wraps it
//! in a [`WhisperModel`]; a request is a [`Transcription`] job the scheduler advances
//! with its `runner` until it is done.

mod advance;
mod attempt;
mod config;
mod engine;
mod kv_cache;
mod model;
mod rules;
mod runner;
mod segments;
mod tokenizer;
mod transcription;

#[cfg(test)]
mod tests;

pub use attempt::Thresholds;
/// tiny.en's descriptor, for the tests of the crate's other modules.
#[cfg(test)]
pub(crate) use config::tests::tiny_en;
pub use config::{is_whisper_folder, Language, SpecialTokens, WhisperConfig, DESCRIPTOR};
pub use engine::{CrossKv, DecoderInput, DecoderOutput, WhisperEngine};
pub use kv_cache::{CacheShape, WIDTH_STEP};
pub use model::{
    encoder_run_bytes, signature, working_bytes, WhisperModel, AUDIO_INPUT, PLANNED_SEQUENCES, TEXT_OUTPUT,
};
pub use runner::{run_slice, ENCODER_BATCH};
pub use tokenizer::{Task, WhisperTokenizer};
pub use transcription::{
    MelInMemory, Segment, Transcription, TranscriptionOptions, TranscriptionResult, WindowReport,
    WindowSource,
};
