//! How a job moves between model passes: a new window read, its prompt built, a token
//! chosen from a hypothesis's logits, a finished attempt judged (and retried at the next
//! temperature), a kept attempt turned into segments and the next `seek`.
//!
//! These steps touch the job and, for the cache rows they fork or free, the locked
//! store; they never run the engine (`runner` does).

use snooze_core::InferError;

use super::{
    attempt::{self, Hypothesis, Outcome},
    kv_cache::{KvStore, SequenceHandle, SharedStore},
    model::WhisperModel,
    rules::LogitRules,
    segments::{split_by_timestamps, WindowPlace},
    transcription::{Segment, Stage, Transcription, Window, WindowReport},
};

/// Prepares a job for this slice: language and initial prompt on its first slice, the
/// next window's mel when it has none. Sets `done` when the audio is finished.
pub(crate) fn prepare(model: &WhisperModel, job: &mut Transcription) -> Result<(), InferError> {
    let config = model.config();
    if job.language_code.is_empty() {
        resolve_language(model, job)?;
    }
    if !job.initial_prompt_done {
        if let Some(text) = job.options.initial_prompt.as_deref().filter(|t| !t.trim().is_empty()) {
            let ids =
                model.tokenizer().encode(&format!(" {}", text.trim())).map_err(InferError::InvalidInput)?;
            job.all_tokens.extend(ids);
        }
        job.initial_prompt_done = true;
    }
    if job.window.is_some() || job.done {
        return Ok(());
    }
    if job.source.n_mels() != config.n_mels {
        return Err(InferError::Failed(format!(
            "the audio's features have {} mel bands but model '{}' takes {}",
            job.source.n_mels(),
            model.name(),
            config.n_mels
        )));
    }
    let mut mel = vec![0.0; config.n_mels * config.chunk_frames];
    let frames = job.source.window(job.seek, &mut mel)?;
    if frames == 0 {
        job.done = true;
        job.spare = None;
        return Ok(());
    }
    let mut first = Hypothesis::new(Vec::new());
    first.seq = job.spare.take();
    job.window = Some(Window {
        seek: job.seek,
        frames: frames as u64,
        mel,
        stage: Stage::Encode,
        prompt: Vec::new(),
        limit: 0,
        temperature_index: 0,
        hypotheses: vec![first],
        no_speech_prob: None,
        attempts: Vec::new(),
    });
    Ok(())
}

fn resolve_language(model: &WhisperModel, job: &mut Transcription) -> Result<(), InferError> {
    let config = model.config();
    if !config.multilingual {
        // faster-whisper too takes English for an English-only model, whatever was asked.
        (job.language, job.language_known, job.language_code) = (None, true, "en".into());
        return Ok(());
    }
    match job.options.language.as_deref() {
        Some(code) => {
            let language = config.language(code).ok_or_else(|| {
                let known: Vec<&str> = config.languages.iter().map(|l| l.code.as_str()).collect();
                InferError::InvalidInput(format!(
                    "unknown language '{code}': model '{}' knows {}",
                    model.name(),
                    known.join(", ")
                ))
            })?;
            (job.language, job.language_known, job.language_code) = (Some(language.token), true, code.into());
        }
        // Detected from the first window; the code is filled in then.
        None => job.language_code = "?".into(),
    }
    Ok(())
}

/// The window's prompt: the text before it (unless reset), the start-of-transcript
/// sequence, and `<|notimestamps|>` when timestamps are off.
pub(crate) fn build_prompt(model: &WhisperModel, job: &Transcription) -> Vec<u32> {
    let t = model.tokenizer().special();
    let previous = &job.all_tokens[job.prompt_reset_since.min(job.all_tokens.len())..];
    let mut prompt = Vec::new();
    if !previous.is_empty() {
        prompt.push(t.sot_prev);
        let keep = model.config().n_text_ctx / 2 - 1;
        prompt.extend_from_slice(&previous[previous.len().saturating_sub(keep)..]);
    }
    prompt.extend(model.tokenizer().sot_sequence(job.language, job.options.task));
    if !job.options.timestamps {
        prompt.push(t.no_timestamps);
    }
    prompt
}

/// Tokens a hypothesis may generate after `prompt` (the end-of-text included).
pub(crate) fn token_limit(model: &WhisperModel, prompt_len: usize) -> usize {
    let ctx = model.config().n_text_ctx;
    (ctx / 2).min(ctx.saturating_sub(prompt_len.saturating_sub(1))).max(1)
}

/// The language with the highest probability among the model's languages, from the
/// logits after `<|startoftranscript|>`.
pub(crate) fn detect_language(model: &WhisperModel, job: &mut Transcription, logits: &[f32]) {
    let languages = &model.config().languages;
    let scores: Vec<f32> =
        languages.iter().map(|l| logits.get(l.token as usize).copied().unwrap_or(f32::MIN)).collect();
    let peak = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = scores.iter().map(|&s| f64::from(s - peak).exp()).sum();
    if let Some((best, score)) = scores.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)) {
        job.language = Some(languages[best].token);
        job.language_code = languages[best].code.clone();
        job.language_probability = f64::from(score - peak).exp() / total;
    }
    job.language_known = true;
}

/// The probability of `<|nospeech|>` in the logits after `<|startoftranscript|>`.
pub(crate) fn no_speech_probability(model: &WhisperModel, logits: &[f32]) -> f64 {
    let mut logprobs = logits.to_vec();
    super::rules::log_softmax(&mut logprobs);
    f64::from(logprobs[model.tokenizer().special().no_speech as usize]).exp()
}

/// Chooses hypothesis `h`'s next token from its logits (consumed).
pub(crate) fn choose(model: &WhisperModel, job: &mut Transcription, h: usize, logits: &mut [f32]) {
    let eot = model.tokenizer().special().eot;
    let timestamps = job.options.timestamps;
    let Some(window) = job.window.as_mut() else { return };
    let temperature = temperature(job.options.temperatures.as_slice(), window.temperature_index);
    let Some(hyp) = window.hypotheses.get_mut(h) else { return };
    if hyp.done {
        return;
    }
    model.rules().apply(logits, &hyp.generated, timestamps);
    let choice = if temperature > 0.0 {
        LogitRules::sample(logits, temperature, &mut job.rng)
    } else {
        LogitRules::best(logits)
    };
    hyp.generated.push(choice.token);
    hyp.sum_logprob += f64::from(choice.logprob);
    hyp.done = choice.token == eot || hyp.generated.len() >= window.limit;
    hyp.pending = if hyp.done { Vec::new() } else { vec![choice.token] };
}

pub(crate) fn temperature(temperatures: &[f32], index: usize) -> f32 {
    temperatures.get(index).copied().unwrap_or(0.0).max(0.0)
}

/// After a pass: a window whose hypotheses are all done is judged, then retried at the
/// next temperature or turned into segments.
pub(crate) fn finish_if_done(
    model: &WhisperModel,
    store: &mut KvStore,
    shared: &std::sync::Arc<SharedStore>,
    job: &mut Transcription,
) -> Result<(), InferError> {
    let Some(window) = job.window.as_mut() else { return Ok(()) };
    if window.stage != Stage::Decode || window.hypotheses.iter().any(|h| !h.done) {
        return Ok(());
    }
    let t = model.tokenizer().special();
    let temperatures = &job.options.temperatures;
    let temperature = temperature(temperatures, window.temperature_index);
    let (tokens, avg_logprob) = attempt::best_hypothesis(&window.hypotheses, t.eot).unwrap_or_default();
    let text = model.tokenizer().decode(&tokens);
    let outcome = Outcome {
        tokens,
        temperature,
        avg_logprob,
        compression_ratio: attempt::compression_ratio(text.trim()),
    };
    let no_speech = window.no_speech_prob.unwrap_or(0.0);
    let thresholds = job.options.thresholds;
    let fallback = attempt::needs_fallback(&outcome, no_speech, &thresholds);
    window.attempts.push(outcome.clone());
    if fallback && window.temperature_index + 1 < temperatures.len() {
        window.temperature_index += 1;
        let next = self::temperature(temperatures, window.temperature_index);
        let count = if next > 0.0 { job.options.best_of.max(1) } else { 1 };
        return restart_attempt(store, shared, job, count);
    }
    let kept = if fallback {
        attempt::last_resort(&window.attempts, &thresholds, temperature)
    } else {
        Some(outcome)
    };
    finish_window(model, store, job, kept);
    Ok(())
}

/// Decodes the window again from its prompt with `count` hypotheses: the first keeps its
/// row (cut back to the prompt), the others fork it.
fn restart_attempt(
    store: &mut KvStore,
    shared: &std::sync::Arc<SharedStore>,
    job: &mut Transcription,
    count: usize,
) -> Result<(), InferError> {
    let Some(window) = job.window.as_mut() else { return Ok(()) };
    let lost = || InferError::Failed("the window's cache row was lost while it was being decoded".into());
    let mut hypotheses = std::mem::take(&mut window.hypotheses).into_iter();
    let mut first = hypotheses.next().ok_or_else(lost)?;
    for other in hypotheses {
        release(store, other.seq);
    }
    let seq = first.seq.take().ok_or_else(lost)?;
    let last = *window.prompt.last().ok_or_else(lost)?;
    let id = seq.id();
    store.truncate(id, window.prompt.len() - 1);
    let mut head = Hypothesis::new(vec![last]);
    head.seq = Some(seq);
    let mut fresh = vec![head];
    for _ in 1..count {
        let mut hyp = Hypothesis::new(vec![last]);
        hyp.seq = Some(SequenceHandle::new(shared, store.fork(id).ok_or_else(lost)?));
        fresh.push(hyp);
    }
    window.hypotheses = fresh;
    Ok(())
}

/// How many hypotheses a window's first attempt draws, once its prompt is in hypothesis
/// 0's row: `best_of` when it samples (temperature above 0), as on every fallback attempt
/// (faster-whisper's `num_hypotheses`; a single sample at temperature 1 is mostly noise).
/// The others fork that row, so each draws its first token from the prompt's logits.
pub(crate) fn fork_for_sampling(
    store: &mut KvStore,
    shared: &std::sync::Arc<SharedStore>,
    job: &mut Transcription,
) -> Result<usize, InferError> {
    let temperature = match &job.window {
        Some(w) if w.hypotheses.len() == 1 && w.hypotheses[0].generated.is_empty() => {
            temperature(&job.options.temperatures, w.temperature_index)
        }
        _ => return Ok(1),
    };
    let count = if temperature > 0.0 { job.options.best_of.max(1) } else { 1 };
    let Some(window) = job.window.as_mut() else { return Ok(1) };
    let lost = || InferError::Failed("the window's cache row was lost while it was being decoded".into());
    let id = window.hypotheses[0].seq.as_ref().ok_or_else(lost)?.id();
    for _ in 1..count {
        let mut hyp = Hypothesis::new(Vec::new());
        hyp.seq = Some(SequenceHandle::new(shared, store.fork(id).ok_or_else(lost)?));
        window.hypotheses.push(hyp);
    }
    Ok(count)
}

/// Frees a hypothesis's row now (dropping the handle under the lock would only defer it).
pub(crate) fn release(store: &mut KvStore, seq: Option<SequenceHandle>) {
    if let Some(seq) = seq {
        store.free(seq.id());
    }
}

/// Turns the kept attempt into segments and moves `seek`; the window's first row stays
/// with the job for the next window.
fn finish_window(model: &WhisperModel, store: &mut KvStore, job: &mut Transcription, kept: Option<Outcome>) {
    let Some(mut window) = job.window.take() else { return };
    let mut hypotheses = std::mem::take(&mut window.hypotheses).into_iter();
    job.spare = hypotheses.next().and_then(|h| h.seq);
    for other in hypotheses {
        release(store, other.seq);
    }
    let config = model.config();
    let no_speech = window.no_speech_prob.unwrap_or(0.0);
    let past_window = window.seek + window.frames;
    let silent = kept.as_ref().is_none_or(|o| attempt::is_silent(o, no_speech, &job.options.thresholds));
    if let Some(o) = &kept {
        job.reports.push(WindowReport {
            seek: window.seek,
            frames: window.frames,
            prompt: std::mem::take(&mut window.prompt),
            tokens: o.tokens.clone(),
            temperature: o.temperature,
            avg_logprob: o.avg_logprob,
            compression_ratio: o.compression_ratio,
            no_speech_prob: no_speech,
            silent,
        });
    }
    let Some(outcome) = kept.filter(|_| !silent) else {
        job.seek = past_window;
        return;
    };
    let place = WindowPlace {
        seek: window.seek,
        frames: window.frames,
        seconds_per_frame: config.seconds_per_frame(),
        time_precision: config.time_precision(),
        timestamp_begin: model.tokenizer().special().timestamp_begin,
    };
    let (raw, next) = split_by_timestamps(&outcome.tokens, &place);
    for segment in raw {
        let text = model.tokenizer().decode(&segment.tokens);
        if segment.start == segment.end || text.trim().is_empty() {
            continue;
        }
        job.all_tokens.extend_from_slice(&segment.tokens);
        job.segments.push(Segment {
            id: job.segments.len() + 1,
            seek: window.seek,
            start: segment.start,
            end: segment.end,
            text,
            tokens: segment.tokens,
            temperature: outcome.temperature,
            avg_logprob: outcome.avg_logprob,
            compression_ratio: outcome.compression_ratio,
            no_speech_prob: no_speech,
        });
    }
    // A window must move on: a pair of 0.00 timestamps would otherwise hold it in place.
    job.seek = if next > window.seek { next } else { past_window };
    if !job.options.condition_on_previous_text
        || outcome.temperature > job.options.prompt_reset_on_temperature
    {
        job.prompt_reset_since = job.all_tokens.len();
    }
}
