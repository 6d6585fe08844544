//! The decoding loop against a scripted engine: long-form seeking, the temperature
//! fallback, the no-speech skip, batching, and freeing cache rows — what real weights
//! are not needed for (crates/backend-ort/tests/whisper.rs runs the real models).
//!
//! The fake encoder writes each window's first mel value (the test mel holds frame `t`
//! as the value `t`, so it is the window's `seek`) into its cross keys; the fake decoder
//! reads it back to know the window and answers position `p` with the script's token
//! `p` of that window. Jobs run with `condition_on_previous_text` off, so every prompt
//! is `<|startoftranscript|>` alone and position `p` is generated token `p`.
#![allow(clippy::unwrap_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use snooze_core::{InferError, LoadedModel, Progress, TaskJob};
use tokenizers::{models::wordlevel::WordLevel, Tokenizer};

use super::{
    config::{tests::tiny_en, WhisperConfig},
    engine::{CrossKv, DecoderInput, DecoderOutput, WhisperEngine},
    model::WhisperModel,
    tokenizer::WhisperTokenizer,
    transcription::{MelInMemory, Transcription, TranscriptionOptions},
};

const B: u32 = 50363;
const EOT: u32 = 50256;

struct ScriptedEngine {
    config: WhisperConfig,
    /// Tokens per window `seek`; after them, end-of-text.
    script: BTreeMap<u64, Vec<u32>>,
    /// Windows whose `<|startoftranscript|>` says "no speech" and whose text is unlikely.
    silent: BTreeSet<u64>,
    /// Batch size of every decoder run.
    batches: Arc<Mutex<Vec<usize>>>,
}

impl WhisperEngine for ScriptedEngine {
    fn encode(&self, mel: &[f32], batch: usize, frames: usize) -> Result<CrossKv, InferError> {
        let c = &self.config;
        let row = c.n_heads * c.n_audio_ctx * c.head_dim;
        let mut keys = vec![0.0; batch * row];
        for b in 0..batch {
            keys[b * row..(b + 1) * row].fill(mel[b * c.n_mels * frames]);
        }
        Ok(CrossKv { keys: vec![keys.clone(); c.decoder_layers], values: vec![keys; c.decoder_layers] })
    }

    fn decode(&self, input: &DecoderInput<'_>) -> Result<DecoderOutput, InferError> {
        let c = &self.config;
        self.batches.lock().unwrap().push(input.batch);
        let row = input.cross_keys[0].len() / input.batch;
        let mut logits = Vec::with_capacity(input.batch * input.n_logits * c.vocab_size);
        for b in 0..input.batch {
            let seek = input.cross_keys[0][b * row] as u64;
            for k in 0..input.n_logits {
                let q = input.logit_positions[b * input.n_logits + k] as usize;
                let position = input.positions[b * input.n_new + q] as usize;
                let token = self.script.get(&seek).and_then(|s| s.get(position)).copied().unwrap_or(EOT);
                let silent = self.silent.contains(&seek);
                let mut row = vec![if silent { 0.0 } else { -10.0 }; c.vocab_size];
                row[token as usize] = if silent { 1.0 } else { 10.0 };
                if silent {
                    row[c.tokens.no_speech as usize] = 20.0;
                }
                logits.extend(row);
            }
        }
        let new = vec![0.0; input.batch * c.n_heads * input.n_new * c.head_dim];
        Ok(DecoderOutput {
            logits,
            new_keys: vec![new.clone(); c.decoder_layers],
            new_values: vec![new; c.decoder_layers],
        })
    }
}

type Batches = Arc<Mutex<Vec<usize>>>;

fn model(script: BTreeMap<u64, Vec<u32>>, silent: BTreeSet<u64>) -> (WhisperModel, Batches) {
    let mut config = tiny_en();
    (config.n_mels, config.d_model, config.n_heads, config.head_dim, config.decoder_layers) = (1, 4, 2, 2, 1);
    let vocab = (10..20).map(|i| (format!("w{i}"), i)).chain([("<unk>".to_owned(), 0)]).collect();
    let words = WordLevel::builder().vocab(vocab).unk_token("<unk>".into()).build().unwrap();
    let tokenizer = WhisperTokenizer::from_tokenizer(Tokenizer::new(words), &config);
    let batches = Batches::default();
    let engine = ScriptedEngine { config: config.clone(), script, silent, batches: batches.clone() };
    (WhisperModel::from_parts("scripted", config, tokenizer, Box::new(engine), "test"), batches)
}

/// `frames` frames of mel, frame `t` holding `t`.
fn job(frames: usize, options: TranscriptionOptions) -> Transcription {
    let mel = MelInMemory::new(1, frames, (0..frames + 1).map(|t| t as f32).collect()).unwrap();
    Transcription::new(Box::new(mel), frames as f64 / 100.0, options)
}

fn options() -> TranscriptionOptions {
    TranscriptionOptions { condition_on_previous_text: false, ..TranscriptionOptions::default() }
}

/// Runs jobs together until all are done; returns the largest `rows()` seen.
fn run(model: &WhisperModel, jobs: &mut [Transcription]) -> u32 {
    let mut rows = 0;
    for _ in 0..10_000 {
        let mut open: Vec<&mut dyn TaskJob> =
            jobs.iter_mut().filter(|j| !j.is_done()).map(|j| j as &mut dyn TaskJob).collect();
        if open.is_empty() {
            return rows;
        }
        rows = open.iter().map(|j| j.rows()).max().unwrap_or(0).max(rows);
        let runner = open[0].runner();
        for result in runner(model as &dyn LoadedModel, &mut open) {
            assert!(matches!(result, Ok(Progress::Continue | Progress::Done)), "{result:?}");
        }
    }
    panic!("the jobs do not finish");
}

#[test]
fn long_audio_seeks_by_the_last_complete_segment() {
    let script = BTreeMap::from([
        // Ends inside a segment: the next window starts at its opening timestamp (10 s).
        (0, vec![B, 10, B + 500, B + 500, 11, 12]),
        // Ends on a single timestamp: the next window starts after this one.
        (1000, vec![B, 13, B + 250]),
        (4000, vec![B, 14, B + 100, B + 100, 15, B + 300]),
    ]);
    let (model, _) = model(script, BTreeSet::new());
    let mut jobs = [job(7000, options())];
    run(&model, &mut jobs);
    let result = jobs[0].result();
    let seeks: Vec<u64> = result.windows.iter().map(|w| w.seek).collect();
    assert_eq!(seeks, vec![0, 1000, 4000]);
    let segments: Vec<(f64, f64, &str)> =
        result.segments.iter().map(|s| (s.start, s.end, s.text.trim())).collect();
    assert_eq!(
        segments,
        vec![(0.0, 10.0, "w10"), (10.0, 15.0, "w13"), (40.0, 42.0, "w14"), (42.0, 46.0, "w15")]
    );
    assert_eq!(result.segments.iter().map(|s| s.id).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(model.cache_bytes(), 0, "a finished job keeps no cache");
}

#[test]
fn a_repetitive_window_falls_back_through_the_temperatures() {
    let repeated: Vec<u32> = std::iter::once(B).chain(std::iter::repeat_n(10, 300)).collect();
    let (model, batches) = model(BTreeMap::from([(0, repeated)]), BTreeSet::new());
    let mut jobs = [job(3000, options())];
    let rows = run(&model, &mut jobs);
    let result = jobs[0].result();
    // Every attempt repeats itself: the last temperature reports the likeliest attempt.
    let window = &result.windows[0];
    assert_eq!(window.temperature, 1.0);
    assert!(window.compression_ratio > 2.4, "{}", window.compression_ratio);
    assert_eq!(window.tokens.len(), 224, "a window generates at most 224 tokens");
    assert_eq!(rows, 5, "best_of hypotheses decode side by side above temperature 0");
    assert!(batches.lock().unwrap().contains(&5));
    assert_eq!(model.cache_bytes(), 0);
}

#[test]
fn a_first_attempt_above_temperature_zero_draws_best_of_samples() {
    let (model, batches) = model(BTreeMap::from([(0, vec![B, 10, 11, B + 100])]), BTreeSet::new());
    let mut jobs = [job(3000, TranscriptionOptions { temperatures: vec![1.0], ..options() })];
    let rows = run(&model, &mut jobs);
    let result = jobs[0].result();
    assert_eq!(result.windows[0].temperature, 1.0);
    assert_eq!(rows, 5, "a sampled first attempt keeps the best of best_of, not a single draw");
    assert!(batches.lock().unwrap().contains(&5));
    let segments: Vec<_> = result.segments.iter().map(|s| s.text.as_str()).collect();
    assert_eq!(segments, ["w10 w11"]);
    assert_eq!(model.cache_bytes(), 0, "the forked rows are freed");
}

#[test]
fn a_silent_window_is_skipped() {
    let (model, _) = model(BTreeMap::from([(0, vec![B, 10, 11, B + 100])]), BTreeSet::from([0]));
    let mut jobs = [job(3000, options())];
    run(&model, &mut jobs);
    let result = jobs[0].result();
    assert!(result.segments.is_empty());
    assert!(result.windows[0].silent && result.windows[0].no_speech_prob > 0.99);
    assert_eq!(result.windows[0].temperature, 0.0, "unlikely text in silence is no reason to retry");
}

#[test]
fn jobs_batched_give_what_they_give_alone_and_share_decoder_runs() {
    let script =
        BTreeMap::from([(0, vec![B, 10, 11, B + 100, B + 100, 12, B + 200]), (3000, vec![B, 13, B + 50])]);
    let alone = {
        let (model, _) = model(script.clone(), BTreeSet::new());
        let mut jobs = [job(3500, options())];
        run(&model, &mut jobs);
        jobs[0].result()
    };
    let (model, batches) = model(script, BTreeSet::new());
    let mut jobs = [job(3500, options()), job(3500, options()), job(3000, options())];
    run(&model, &mut jobs);
    assert_eq!(jobs[0].result(), alone);
    assert_eq!(jobs[1].result(), alone);
    assert_eq!(jobs[2].result().segments, alone.segments[..2]);
    let batches = batches.lock().unwrap();
    assert!(batches.contains(&3), "steps of the three jobs share runs: {batches:?}");
}

#[test]
fn a_dropped_job_frees_its_rows_and_an_unknown_language_is_refused() {
    let (model, _) = model(BTreeMap::from([(0, vec![B, 10, 11, 12, 13, 14])]), BTreeSet::new());
    let mut one = job(3000, options());
    let runner = one.runner();
    for _ in 0..3 {
        assert_eq!(runner(&model, &mut [&mut one]).pop().unwrap(), Ok(Progress::Continue));
    }
    assert!(model.cache_bytes() > 0);
    drop(one);
    assert_eq!(model.cache_bytes(), 0);

    // English-only models take English, as faster-whisper does.
    let mut english = job(3000, TranscriptionOptions { language: Some("fr".into()), ..options() });
    run(&model, std::slice::from_mut(&mut english));
    assert_eq!(english.result().language, "en");
}
