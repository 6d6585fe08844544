//! A loaded Whisper model: its descriptor, tokenizer and logit rules, the engine that
//! runs its two graphs, and the KV-cache store of the sequences it is decoding.
//!
//! To the scheduler it is a `LoadedModel` whose work comes as `Transcription` jobs run
//! in slices (`runner`); on KServe it takes audio files (BYTES) and returns their text
//! (BYTES), running each job to the end in place.

use std::{path::Path, sync::Arc};

use bytes::Bytes;
use snooze_core::{
    DataType, InferError, LoadedModel, ModelSignature, Progress, TaskJob, Tensor, TensorData, TensorSpec,
};

use super::{
    config::WhisperConfig,
    engine::WhisperEngine,
    kv_cache::{CacheShape, SharedStore},
    rules::LogitRules,
    tokenizer::WhisperTokenizer,
    transcription::{Transcription, TranscriptionOptions, TranscriptionResult, WindowSource},
};
use crate::{
    audio::{self, AudioLimits, AudioStream},
    mel::LogMelWindows,
};

/// Sequences a model is sized for when the scheduler asks what its work may add:
/// eight concurrent requests decoding at once.
pub const PLANNED_SEQUENCES: usize = 8;

/// KServe names.
pub const AUDIO_INPUT: &str = "audio";
pub const TEXT_OUTPUT: &str = "text";

pub struct WhisperModel {
    name: String,
    config: WhisperConfig,
    tokenizer: WhisperTokenizer,
    rules: LogitRules,
    engine: Box<dyn WhisperEngine>,
    store: Arc<SharedStore>,
    signature: ModelSignature,
}

impl WhisperModel {
    /// The model of `folder` (`whisper.json`, `tokenizer.json`) run by `engine`.
    pub fn new(
        name: &str,
        folder: &Path,
        engine: Box<dyn WhisperEngine>,
        platform: &str,
    ) -> Result<Self, String> {
        let config = WhisperConfig::read(folder)?;
        let tokenizer = WhisperTokenizer::load(folder, &config)?;
        Ok(WhisperModel::from_parts(name, config, tokenizer, engine, platform))
    }

    pub(crate) fn from_parts(
        name: &str,
        config: WhisperConfig,
        tokenizer: WhisperTokenizer,
        engine: Box<dyn WhisperEngine>,
        platform: &str,
    ) -> WhisperModel {
        let shape = CacheShape {
            layers: config.decoder_layers,
            heads: config.n_heads,
            head_dim: config.head_dim,
            audio_ctx: config.n_audio_ctx,
            text_ctx: config.n_text_ctx,
        };
        WhisperModel {
            name: name.to_owned(),
            rules: LogitRules::new(&config),
            config,
            tokenizer,
            engine,
            store: SharedStore::new(shape),
            signature: signature(platform),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn config(&self) -> &WhisperConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &WhisperTokenizer {
        &self.tokenizer
    }

    pub(crate) fn rules(&self) -> &LogitRules {
        &self.rules
    }

    pub fn engine(&self) -> &dyn WhisperEngine {
        self.engine.as_ref()
    }

    pub(crate) fn store(&self) -> &Arc<SharedStore> {
        &self.store
    }

    /// Bytes the KV caches hold now.
    pub fn cache_bytes(&self) -> u64 {
        self.store.bytes()
    }

    /// Sequences (hypotheses of windows being decoded) holding cache rows now.
    pub fn cache_sequences(&self) -> usize {
        self.store.lock().sequences()
    }

    /// Runs a whole transcription here, slice after slice (KServe, tests, the CLI).
    pub fn transcribe(
        &self,
        source: Box<dyn WindowSource>,
        duration_seconds: f64,
        options: TranscriptionOptions,
    ) -> Result<TranscriptionResult, InferError> {
        let mut job = Transcription::new(source, duration_seconds, options);
        loop {
            let mut jobs: [&mut dyn TaskJob; 1] = [&mut job];
            match super::runner::run_slice(self, &mut jobs).pop() {
                Some(Ok(Progress::Done)) => return Ok(job.result()),
                Some(Ok(Progress::Continue)) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(InferError::Failed("the slice runner returned no result".into())),
            }
        }
    }

    /// Decodes one uploaded audio file and transcribes it.
    pub fn transcribe_file(
        &self,
        bytes: Bytes,
        limits: &AudioLimits,
        options: TranscriptionOptions,
    ) -> Result<TranscriptionResult, InferError> {
        let invalid = |e: audio::AudioError| InferError::InvalidInput(e.to_string());
        let info = audio::probe(bytes.clone(), limits).map_err(invalid)?;
        let peak = info.log_mel_peaks.get(self.config.n_mels).ok_or_else(|| {
            InferError::Failed(format!(
                "no log-mel features are computed for {} mel bands",
                self.config.n_mels
            ))
        })?;
        let stream = AudioStream::open(bytes, limits).map_err(invalid)?;
        let windows = LogMelWindows::new(stream, self.config.n_mels, peak);
        self.transcribe(Box::new(windows), info.duration_seconds(), options)
    }
}

/// What running a model may add to its loaded footprint: the caches of
/// [`PLANNED_SEQUENCES`] sequences at full length, and the encoder's attention scores
/// and probabilities for one run (two `heads x 1500 x 1500` tensors per window), which
/// the runtime's arena keeps after the first window.
pub fn working_bytes(c: &WhisperConfig) -> u64 {
    let shape = CacheShape {
        layers: c.decoder_layers,
        heads: c.n_heads,
        head_dim: c.head_dim,
        audio_ctx: c.n_audio_ctx,
        text_ctx: c.n_text_ctx,
    };
    shape.bytes_for(PLANNED_SEQUENCES) + encoder_run_bytes(c)
}

/// The encoder's attention scores and probabilities for one run (two `heads x 1500 x
/// 1500` tensors per window): the most a request's first run holds beside the weights.
pub fn encoder_run_bytes(c: &WhisperConfig) -> u64 {
    let scores = 2 * c.n_heads * c.n_audio_ctx * c.n_audio_ctx * std::mem::size_of::<f32>();
    (super::runner::ENCODER_BATCH * scores) as u64
}

/// The KServe signature: audio files in, their text out.
pub fn signature(platform: &str) -> ModelSignature {
    let spec = |name: &str| TensorSpec { name: name.into(), datatype: DataType::Bytes, shape: vec![-1] };
    ModelSignature {
        platform: platform.into(),
        inputs: vec![spec(AUDIO_INPUT)],
        outputs: vec![spec(TEXT_OUTPUT)],
    }
}

impl LoadedModel for WhisperModel {
    fn signature(&self) -> &ModelSignature {
        &self.signature
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        if let Some(unknown) = outputs.iter().find(|o| o.as_str() != TEXT_OUTPUT) {
            return Err(InferError::InvalidInput(format!(
                "unknown output '{unknown}'; this model has one output, '{TEXT_OUTPUT}'"
            )));
        }
        let input = match inputs {
            [one] => one,
            _ => inputs.iter().find(|t| t.name == AUDIO_INPUT).ok_or_else(|| {
                InferError::InvalidInput(format!("expected one BYTES input '{AUDIO_INPUT}' of audio files"))
            })?,
        };
        let TensorData::Bytes(files) = &input.data else {
            return Err(InferError::InvalidInput(format!(
                "input '{}' has datatype {} but the model expects BYTES (audio files)",
                input.name,
                input.data.datatype()
            )));
        };
        let texts = files
            .iter()
            .enumerate()
            .map(|(i, file)| {
                self.transcribe_file(
                    Bytes::copy_from_slice(file),
                    &AudioLimits::default(),
                    TranscriptionOptions::default(),
                )
                .map(|r| r.text().into_bytes())
                .map_err(|e| match e {
                    InferError::InvalidInput(m) => InferError::InvalidInput(format!("audio file {i}: {m}")),
                    other => other,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shape = vec![i64::try_from(texts.len()).unwrap_or(i64::MAX)];
        Ok(vec![Tensor::new(TEXT_OUTPUT, shape, TensorData::Bytes(texts))])
    }

    fn working_bytes(&self) -> u64 {
        working_bytes(&self.config)
    }
}
