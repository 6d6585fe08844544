//! A Whisper model folder as `scripts/export_whisper.py` writes it: `whisper.json`
//! (sizes, special tokens, languages, suppress lists), `tokenizer.json`, and the two
//! graphs an engine runs. Everything the decoding loop needs to know about the model
//! is read here, once, and checked for consistency, so the loop can index logits and
//! caches by these numbers without re-checking them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The descriptor's file name: its presence makes a folder a Whisper model.
pub const DESCRIPTOR: &str = "whisper.json";

/// Whether `path` is a Whisper model folder.
pub fn is_whisper_folder(path: &Path) -> bool {
    path.is_dir() && path.join(DESCRIPTOR).is_file()
}

/// Special token ids, as the export read them from `tokenizer.json`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SpecialTokens {
    pub eot: u32,
    pub sot: u32,
    pub sot_prev: u32,
    pub sot_lm: u32,
    pub no_speech: u32,
    pub no_timestamps: u32,
    pub transcribe: u32,
    pub translate: u32,
    /// `<|0.00|>`; timestamp `t` seconds is `timestamp_begin + t / 0.02`.
    pub timestamp_begin: u32,
    /// The last timestamp token (`<|30.00|>`), the vocabulary's last id.
    pub timestamp_end: u32,
}

/// A language the model can be told or can detect.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Language {
    /// ISO 639-1 style code as Whisper spells it (`en`, `fr`, `haw`...).
    pub code: String,
    pub token: u32,
}

/// `whisper.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WhisperConfig {
    pub format: u32,
    pub encoder: String,
    pub decoder: String,
    pub sample_rate: u32,
    pub hop_length: usize,
    /// Mel frames of one encoder window (3000: 30 s).
    pub chunk_frames: usize,
    pub n_mels: usize,
    /// Encoder positions (1500): a window's frames / 2, the cross-attention length.
    pub n_audio_ctx: usize,
    /// Decoder positions (448): prompt and generated tokens of one window together.
    pub n_text_ctx: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    pub vocab_size: usize,
    pub multilingual: bool,
    pub tokens: SpecialTokens,
    /// Empty for English-only models.
    #[serde(default)]
    pub languages: Vec<Language>,
    /// Suppressed at every step (faster-whisper's default: non-speech symbols and the
    /// task, start and no-speech tokens).
    pub suppress_tokens: Vec<u32>,
    /// Suppressed at the first step of a window (a blank and end-of-text).
    pub suppress_blank: Vec<u32>,
}

impl WhisperConfig {
    /// Reads and checks `folder/whisper.json`.
    pub fn read(folder: &Path) -> Result<WhisperConfig, String> {
        let path = folder.join(DESCRIPTOR);
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config: WhisperConfig = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a Whisper descriptor: {e}", path.display()))?;
        config.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        if self.format != 1 {
            return Err(format!("format {} is not one this server reads (1)", self.format));
        }
        if self.n_heads == 0 || self.head_dim * self.n_heads != self.d_model {
            return Err(format!(
                "{} heads of {} do not make a width of {}",
                self.n_heads, self.head_dim, self.d_model
            ));
        }
        if self.chunk_frames != 2 * self.n_audio_ctx || self.hop_length == 0 || self.sample_rate == 0 {
            return Err(format!(
                "a window of {} frames does not fill {} encoder positions",
                self.chunk_frames, self.n_audio_ctx
            ));
        }
        if self.n_text_ctx < 8 || self.encoder_layers == 0 || self.decoder_layers == 0 || self.n_mels == 0 {
            return Err("its sizes are empty".into());
        }
        let t = &self.tokens;
        let all =
            [t.eot, t.sot, t.sot_prev, t.sot_lm, t.no_speech, t.no_timestamps, t.transcribe, t.translate];
        let vocab = self.vocab_size;
        let ids = all.iter().chain(&self.suppress_tokens).chain(&self.suppress_blank);
        let ids = ids.chain(self.languages.iter().map(|l| &l.token));
        if let Some(bad) = ids.copied().find(|&id| id as usize >= vocab) {
            return Err(format!("token id {bad} is outside the vocabulary of {vocab}"));
        }
        if t.timestamp_begin != t.no_timestamps + 1 || t.timestamp_end as usize != vocab - 1 {
            return Err(format!(
                "timestamps {}..={} do not follow <|notimestamps|> {} to the vocabulary's end",
                t.timestamp_begin, t.timestamp_end, t.no_timestamps
            ));
        }
        if all.iter().any(|&id| id >= t.timestamp_begin) || t.eot > t.sot {
            return Err("its special tokens are out of Whisper's order".into());
        }
        if self.multilingual && self.languages.is_empty() {
            return Err("a multilingual model lists no languages".into());
        }
        Ok(())
    }

    pub fn encoder_path(&self, folder: &Path) -> PathBuf {
        folder.join(&self.encoder)
    }

    pub fn decoder_path(&self, folder: &Path) -> PathBuf {
        folder.join(&self.decoder)
    }

    /// The language whose code is `code` among a multilingual model's; an English-only
    /// model lists none (it transcribes English only).
    pub fn language(&self, code: &str) -> Option<&Language> {
        self.languages.iter().find(|l| l.code == code)
    }

    /// Whether the model transcribes the language `code`: a multilingual model those it
    /// lists, an English-only model (which lists none) English.
    pub fn transcribes(&self, code: &str) -> bool {
        if self.multilingual {
            self.language(code).is_some()
        } else {
            code == "en"
        }
    }

    /// Seconds per timestamp token step (0.02 s: two mel frames).
    pub fn time_precision(&self) -> f64 {
        2.0 * self.hop_length as f64 / f64::from(self.sample_rate)
    }

    /// Seconds per mel frame (0.01 s).
    pub fn seconds_per_frame(&self) -> f64 {
        self.hop_length as f64 / f64::from(self.sample_rate)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// tiny.en's descriptor, as the export writes it (suppress lists shortened).
    pub(crate) fn tiny_en() -> WhisperConfig {
        serde_json::from_value(serde_json::json!({
            "format": 1, "architecture": "whisper", "encoder": "encoder.onnx", "decoder": "decoder.onnx",
            "sample_rate": 16000, "n_fft": 400, "hop_length": 160, "chunk_frames": 3000,
            "n_mels": 80, "d_model": 384, "n_heads": 6, "encoder_layers": 4, "decoder_layers": 4,
            "vocab_size": 51864, "n_audio_ctx": 1500, "n_text_ctx": 448, "head_dim": 64,
            "multilingual": false,
            "tokens": {"eot": 50256, "sot": 50257, "sot_prev": 50360, "sot_lm": 50359, "no_speech": 50361,
                       "no_timestamps": 50362, "transcribe": 50358, "translate": 50357,
                       "timestamp_begin": 50363, "timestamp_end": 51863},
            "languages": [],
            "suppress_tokens": [1, 2, 7, 50357, 50358, 50359, 50360, 50361],
            "suppress_blank": [220, 50256],
            "alignment_heads": []
        }))
        .unwrap()
    }

    #[test]
    fn descriptors_are_checked_for_consistency() {
        let good = tiny_en();
        assert_eq!(good.check(), Ok(()));
        assert!((good.time_precision() - 0.02).abs() < 1e-12);

        let mut bad = good.clone();
        bad.n_heads = 5;
        assert!(bad.check().unwrap_err().contains("heads"));
        let mut bad = good.clone();
        bad.suppress_tokens.push(60_000);
        assert!(bad.check().unwrap_err().contains("60000"));
        let mut bad = good.clone();
        bad.tokens.timestamp_begin += 1;
        assert!(bad.check().unwrap_err().contains("timestamps"));
        let mut bad = good.clone();
        bad.multilingual = true;
        assert!(bad.check().unwrap_err().contains("no languages"));
        let mut bad = good;
        bad.format = 2;
        assert!(bad.check().unwrap_err().contains("format 2"));
    }

    #[test]
    fn a_missing_or_broken_descriptor_is_named() {
        let dir = std::env::temp_dir().join(format!("snooze-whisper-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!is_whisper_folder(&dir));
        assert!(WhisperConfig::read(&dir).unwrap_err().contains("whisper.json"));
        std::fs::write(dir.join(DESCRIPTOR), "{\"format\": 1}").unwrap();
        assert!(is_whisper_folder(&dir));
        assert!(WhisperConfig::read(&dir).unwrap_err().contains("not a Whisper descriptor"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
