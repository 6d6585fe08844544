//! Whisper's text side: GPT-2 byte-level BPE from `tokenizer.json` (the `tokenizers`
//! crate), plus what the decoding loop needs around it: the start-of-transcript
//! sequence for a language and task, prompt text as token ids, and text back from ids
//! with special and timestamp tokens left out (they are structure, not words).

use std::{path::Path, sync::Arc};

use snooze_core::kept::Kept;

use tokenizers::Tokenizer;

use super::config::{SpecialTokens, WhisperConfig};

/// What a window is asked to do (and, in `verbose_json`, what was asked: lower case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    #[default]
    Transcribe,
    /// To English (multilingual models only).
    Translate,
}

/// Whisper tokenizers by file, shared by the models that load them.
static TOKENIZERS: Kept<Tokenizer> = Kept::new();

pub struct WhisperTokenizer {
    tokenizer: Arc<Tokenizer>,
    tokens: SpecialTokens,
}

impl WhisperTokenizer {
    pub fn load(folder: &Path, config: &WhisperConfig) -> Result<WhisperTokenizer, String> {
        let path = folder.join("tokenizer.json");
        // Parsed once and kept between loads while memory allows (`snooze_core::kept`):
        // ~145 ms of a Whisper reload on 2 cores.
        let tokenizer = TOKENIZERS.get_or_parse(&path, 0, || {
            Tokenizer::from_file(&path).map_err(|e| format!("cannot load {}: {e}", path.display()))
        })?;
        // The ids the descriptor names must be the tokenizer's, or every prompt is wrong.
        for (name, id) in [("<|endoftext|>", config.tokens.eot), ("<|startoftranscript|>", config.tokens.sot)]
        {
            if tokenizer.token_to_id(name) != Some(id) {
                return Err(format!(
                    "{} gives {name} the id {:?}, but whisper.json says {id}",
                    path.display(),
                    tokenizer.token_to_id(name)
                ));
            }
        }
        Ok(WhisperTokenizer { tokenizer, tokens: config.tokens.clone() })
    }

    /// A tokenizer built in memory (tests), trusted to agree with `config`.
    pub fn from_tokenizer(tokenizer: Tokenizer, config: &WhisperConfig) -> WhisperTokenizer {
        WhisperTokenizer { tokenizer: Arc::new(tokenizer), tokens: config.tokens.clone() }
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.tokens
    }

    /// Token ids of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("cannot tokenize the prompt: {e}"))
    }

    /// The text of the ids below `<|endoftext|>`; special and timestamp tokens are dropped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let text: Vec<u32> = ids.iter().copied().filter(|&id| id < self.tokens.eot).collect();
        // Only ids outside the vocabulary fail, and those are filtered above.
        self.tokenizer.decode(&text, false).unwrap_or_default()
    }

    pub fn is_timestamp(&self, id: u32) -> bool {
        id >= self.tokens.timestamp_begin
    }

    /// `<|startoftranscript|>`, then for multilingual models the language and the task.
    pub fn sot_sequence(&self, language: Option<u32>, task: Task) -> Vec<u32> {
        let mut sequence = vec![self.tokens.sot];
        if let Some(language) = language {
            sequence.push(language);
            sequence.push(match task {
                Task::Transcribe => self.tokens.transcribe,
                Task::Translate => self.tokens.translate,
            });
        }
        sequence
    }
}
