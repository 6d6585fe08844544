//! A transcription request as a job that advances in slices: its options, its audio (as
//! log-mel windows), where it is in faster-whisper's long-form algorithm, and its result.
//!
//! The audio is read one 30 s window at a time at frame `seek`. A window is encoded,
//! prompted (the previous windows' text, unless reset, then `<|startoftranscript|>`,
//! language and task), and decoded token by token; a failed attempt is decoded again at
//! the next temperature; the kept tokens become segments, and `seek` moves to the last
//! complete segment's end (or past the window). The job owns no model state but
//! handles to its rows in the model's cache (see `kv_cache`), so a dropped job frees
//! them and a reloaded model makes the job recompute them.

use snooze_core::{InferError, SliceRunner, TaskJob, WorkSize};

use super::{
    attempt::{Hypothesis, Outcome, Thresholds},
    kv_cache::SequenceHandle,
    tokenizer::Task,
};
use crate::{audio::SampleSource, mel::LogMelWindows};

/// Jobs of every Whisper model share this key: any two may share a slice (each row
/// carries its own options; the scheduler keeps jobs of different models apart).
const BATCH_KEY: u64 = 0x7768_6973_7065_7200;

/// What the caller asks for; `Default` is faster-whisper's `transcribe` with beam_size 1.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscriptionOptions {
    /// A language code (`en`, `fr`...); `None`: detected on the first window
    /// (multilingual models) or English.
    pub language: Option<String>,
    pub task: Task,
    /// Text given as the previous window's before the first window.
    pub initial_prompt: Option<String>,
    /// Tried in order while an attempt fails the thresholds.
    pub temperatures: Vec<f32>,
    /// Hypotheses sampled per attempt above temperature 0.
    pub best_of: usize,
    pub thresholds: Thresholds,
    /// Prompt each window with the text before it.
    pub condition_on_previous_text: bool,
    /// An attempt kept above this temperature stops the text before it being used as prompt.
    pub prompt_reset_on_temperature: f32,
    /// Timestamp tokens (segments at speech boundaries); off: one segment per window.
    pub timestamps: bool,
    /// Seed of the sampling at temperatures above 0.
    pub seed: u64,
}

impl Default for TranscriptionOptions {
    fn default() -> Self {
        TranscriptionOptions {
            language: None,
            task: Task::Transcribe,
            initial_prompt: None,
            temperatures: vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
            best_of: 5,
            thresholds: Thresholds::default(),
            condition_on_previous_text: true,
            prompt_reset_on_temperature: 0.5,
            timestamps: true,
            seed: 0,
        }
    }
}

/// One stretch of text with its times in the audio.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub id: usize,
    /// Mel frame where the window that produced it started.
    pub seek: u64,
    pub start: f64,
    pub end: f64,
    pub text: String,
    /// With its timestamp tokens.
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f64,
    pub compression_ratio: f64,
    pub no_speech_prob: f64,
}

/// How one 30 s window was decoded (the attempt kept), for verbose output and checks.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowReport {
    pub seek: u64,
    /// Mel frames of audio in the window.
    pub frames: u64,
    pub prompt: Vec<u32>,
    /// The kept attempt's tokens, end-of-text excluded.
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f64,
    pub compression_ratio: f64,
    pub no_speech_prob: f64,
    /// Skipped as silence: no segments came from it.
    pub silent: bool,
}

/// What a finished job holds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TranscriptionResult {
    pub language: String,
    pub language_probability: f64,
    /// Seconds of audio.
    pub duration: f64,
    pub segments: Vec<Segment>,
    pub windows: Vec<WindowReport>,
}

impl TranscriptionResult {
    /// The segments' text, joined as faster-whisper users usually do.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect::<String>().trim().to_owned()
    }
}

/// Log-mel windows of the audio, read in order (`seek` never goes back).
pub trait WindowSource: Send {
    fn n_mels(&self) -> usize;
    /// Fills `out` (`n_mels x 3000`, band-major) with frames `seek..seek + 3000`, zeros
    /// past the audio, and returns how many frames are audio (0: past the end).
    fn window(&mut self, seek: u64, out: &mut [f32]) -> Result<usize, InferError>;
}

impl<S: SampleSource + Send> WindowSource for LogMelWindows<S> {
    fn n_mels(&self) -> usize {
        LogMelWindows::n_mels(self)
    }

    fn window(&mut self, seek: u64, out: &mut [f32]) -> Result<usize, InferError> {
        LogMelWindows::window(self, seek, out).map_err(|e| match e.kind() {
            snooze_core::ErrorKind::InvalidInput => InferError::InvalidInput(e.to_string()),
            _ => InferError::Failed(e.to_string()),
        })
    }
}

/// A whole log-mel spectrogram already in memory (a fixture, a short clip).
#[derive(Debug, Clone)]
pub struct MelInMemory {
    n_mels: usize,
    /// Frames a window may use (the audio's `samples / 160`).
    content_frames: usize,
    /// Band-major, `values.len() / n_mels` frames per band.
    values: Vec<f32>,
}

impl MelInMemory {
    /// `values` band-major; only the first `content_frames` frames of each band are used.
    pub fn new(n_mels: usize, content_frames: usize, values: Vec<f32>) -> Result<MelInMemory, String> {
        let stored = values.len().checked_div(n_mels).unwrap_or(0);
        if n_mels == 0 || !values.len().is_multiple_of(n_mels) || stored < content_frames {
            return Err(format!(
                "{} values are not {n_mels} bands of at least {content_frames} frames",
                values.len()
            ));
        }
        Ok(MelInMemory { n_mels, content_frames, values })
    }
}

impl WindowSource for MelInMemory {
    fn n_mels(&self) -> usize {
        self.n_mels
    }

    fn window(&mut self, seek: u64, out: &mut [f32]) -> Result<usize, InferError> {
        let window = out.len() / self.n_mels;
        let stored = self.values.len() / self.n_mels;
        let start = usize::try_from(seek).unwrap_or(usize::MAX).min(self.content_frames);
        let frames = (self.content_frames - start).min(window);
        out.fill(0.0);
        for m in 0..self.n_mels {
            let band = &self.values[m * stored + start..m * stored + start + frames];
            out[m * window..m * window + frames].copy_from_slice(band);
        }
        Ok(frames)
    }
}

/// Where a window's decoding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// The mel is read; the encoder must run (again, if the model lost the cache).
    Encode,
    /// The language must be detected from the `<|startoftranscript|>` logits.
    Detect,
    /// The prompt must be fed.
    Prompt,
    /// Hypotheses are generating tokens.
    Decode,
}

/// The window being decoded.
#[derive(Debug)]
pub(crate) struct Window {
    pub seek: u64,
    /// Frames of audio in it.
    pub frames: u64,
    /// `n_mels x 3000`, kept to encode again if the model's cache is lost.
    pub mel: Vec<f32>,
    pub stage: Stage,
    /// Built once the language is known.
    pub prompt: Vec<u32>,
    /// Tokens at most per hypothesis (the end-of-text included).
    pub limit: usize,
    pub temperature_index: usize,
    pub hypotheses: Vec<Hypothesis>,
    pub no_speech_prob: Option<f64>,
    pub attempts: Vec<Outcome>,
}

/// A transcription job. Run its slices through [`TaskJob::runner`] until it reports
/// `Progress::Done`, then read [`Transcription::result`].
pub struct Transcription {
    pub(crate) options: TranscriptionOptions,
    pub(crate) source: Box<dyn WindowSource>,
    pub(crate) duration: f64,
    pub(crate) seek: u64,
    /// The language token, once told or detected (`None` for English-only models).
    pub(crate) language: Option<u32>,
    pub(crate) language_known: bool,
    pub(crate) language_probability: f64,
    pub(crate) language_code: String,
    /// Every kept segment's tokens (and the initial prompt's), for the prompts.
    pub(crate) all_tokens: Vec<u32>,
    pub(crate) prompt_reset_since: usize,
    pub(crate) initial_prompt_done: bool,
    pub(crate) segments: Vec<Segment>,
    pub(crate) reports: Vec<WindowReport>,
    pub(crate) window: Option<Window>,
    /// The job's cache row between windows, reused by the next one.
    pub(crate) spare: Option<SequenceHandle>,
    pub(crate) rng: super::rules::SplitMix64,
    pub(crate) done: bool,
}

impl std::fmt::Debug for Transcription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transcription")
            .field("seek", &self.seek)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Transcription {
    /// A job over `source`'s windows of `duration_seconds` of audio.
    pub fn new(
        source: Box<dyn WindowSource>,
        duration_seconds: f64,
        options: TranscriptionOptions,
    ) -> Transcription {
        let rng = super::rules::SplitMix64::new(options.seed);
        Transcription {
            options,
            source,
            duration: duration_seconds,
            seek: 0,
            language: None,
            language_known: false,
            language_probability: 1.0,
            language_code: String::new(),
            all_tokens: Vec::new(),
            prompt_reset_since: 0,
            initial_prompt_done: false,
            segments: Vec::new(),
            reports: Vec::new(),
            window: None,
            spare: None,
            rng,
            done: false,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The segments so far (all of them once done).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The result; complete once the job is done.
    pub fn result(&self) -> TranscriptionResult {
        TranscriptionResult {
            language: self.language_code.clone(),
            language_probability: self.language_probability,
            duration: self.duration,
            segments: self.segments.clone(),
            windows: self.reports.clone(),
        }
    }

    /// Live hypotheses: rows this job adds to a decoder step.
    fn live(&self) -> usize {
        self.window.as_ref().map_or(1, |w| w.hypotheses.iter().filter(|h| !h.done).count().max(1))
    }
}

impl TaskJob for Transcription {
    fn batch_key(&self) -> u64 {
        BATCH_KEY
    }

    fn rows(&self) -> u32 {
        u32::try_from(self.live()).unwrap_or(u32::MAX)
    }

    /// A slice that starts a window runs the encoder over it (class 1: its attention
    /// holds tens of MiB); a decoder step holds little per live hypothesis (class 0).
    fn work_size(&self) -> Option<WorkSize> {
        let starting = self.window.is_none() || super::runner::is_starting(self);
        Some(if starting { WorkSize::new(1, 1) } else { WorkSize::new(0, self.live() as u64) })
    }

    fn byte_size(&self) -> usize {
        let window = self.window.as_ref().map_or(0, |w| {
            w.mel.len() * 4
                + w.hypotheses.iter().map(|h| (h.generated.len() + h.pending.len()) * 4).sum::<usize>()
        });
        let text: usize = self.segments.iter().map(|s| s.text.len() + s.tokens.len() * 4).sum();
        std::mem::size_of::<Self>() + window + text + self.all_tokens.len() * 4
    }

    fn runner(&self) -> SliceRunner {
        super::runner::run_slice
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn mel_in_memory_gives_windows_of_its_content_frames() {
        // 2 bands, 5 stored frames of which 4 are content.
        let values: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let mut mel = MelInMemory::new(2, 4, values).unwrap();
        let mut out = vec![9.0; 2 * 3];
        assert_eq!(mel.window(0, &mut out).unwrap(), 3);
        assert_eq!(out, vec![0.0, 1.0, 2.0, 5.0, 6.0, 7.0]);
        assert_eq!(mel.window(2, &mut out).unwrap(), 2);
        assert_eq!(out, vec![2.0, 3.0, 0.0, 7.0, 8.0, 0.0]);
        assert_eq!(mel.window(4, &mut out).unwrap(), 0);
        assert_eq!(out, vec![0.0; 6]);
        assert!(MelInMemory::new(2, 6, vec![0.0; 10]).is_err());
    }
}
