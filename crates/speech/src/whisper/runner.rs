//! One slice of work for a batch of transcription jobs on a loaded Whisper model.
//!
//! A slice is either a *start* — the encoder for the jobs beginning a window (or whose
//! cache the model lost), the language detection pass of those that need one, and
//! their prompt pass — or a *step*: one decoder run that gives every live hypothesis
//! of every decoding job its next token. A batch mixing both runs the start first (its
//! jobs join the steps from the next slice on); the decoding jobs keep their state.
//!
//! Every decoder run is [`feed`]: each row feeds its pending tokens on top of its cached
//! positions, rows of different lengths side by side (the attention mask hides each
//! row's unused cache positions and padding), and gets its logits at the positions it
//! asked for. The cache store is locked for the whole slice.

use std::any::Any;

use snooze_core::{InferError, LoadedModel, Progress, TaskJob};

use super::{
    advance,
    engine::DecoderInput,
    kv_cache::{KvStore, SequenceHandle, SequenceId},
    model::WhisperModel,
    transcription::{Stage, Transcription},
};

/// Windows per encoder run. Measured on 2 cores (tiny.en, fp32): one 30 s window
/// takes as long per window alone as in a batch of 4, and each window in a batch adds
/// two `heads x 1500 x 1500` attention tensors to the runtime's arena.
pub const ENCODER_BATCH: usize = 1;

/// Additive mask value of a position a query must not see.
const MASKED: f32 = -1e9;

/// Advances every job by one slice (the `SliceRunner` of `Transcription`).
pub fn run_slice(
    model: &dyn LoadedModel,
    jobs: &mut [&mut dyn TaskJob],
) -> Vec<Result<Progress, InferError>> {
    let any: &dyn Any = model;
    let Some(model) = any.downcast_ref::<WhisperModel>() else {
        let e =
            InferError::Failed("a transcription job was given to a model that is not a Whisper model".into());
        return jobs.iter().map(|_| Err(e.clone())).collect();
    };
    let mut results: Vec<Result<Progress, InferError>> = Vec::with_capacity(jobs.len());
    let mut live: Vec<(usize, &mut Transcription)> = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter_mut().enumerate() {
        let any: &mut dyn Any = &mut **job;
        match any.downcast_mut::<Transcription>() {
            Some(job) => {
                results.push(Ok(Progress::Continue));
                live.push((i, job));
            }
            None => results.push(Err(InferError::Failed(
                "a Whisper model was given a job that is not a transcription".into(),
            ))),
        }
    }
    live.retain_mut(|(i, job)| match advance::prepare(model, job) {
        Err(e) => {
            results[*i] = Err(e);
            false
        }
        Ok(()) if job.done => {
            results[*i] = Ok(Progress::Done);
            false
        }
        Ok(()) => true,
    });
    {
        let shared = model.store();
        let mut store = shared.lock();
        for (_, job) in live.iter_mut() {
            reclaim_lost_cache(&store, shared, job);
        }
        let starting = live.iter().any(|(_, job)| is_starting(job));
        let failed =
            if starting { start(model, &mut store, &mut live) } else { step(model, &mut store, &mut live) };
        for (i, e) in failed {
            results[live[i].0] = Err(e);
        }
        for (i, job) in live.iter_mut() {
            if results[*i].is_ok() {
                if let Err(e) = advance::finish_if_done(model, &mut store, shared, job) {
                    results[*i] = Err(e);
                }
            }
        }
    }
    // A job whose last window just ended is done at its next slice, whose read of the
    // next window finds the end of the audio.
    for (i, job) in live {
        if job.done && results[i].is_ok() {
            results[i] = Ok(Progress::Done);
        }
    }
    results
}

pub(super) fn is_starting(job: &Transcription) -> bool {
    job.window
        .as_ref()
        .is_some_and(|w| w.stage != Stage::Decode || w.hypotheses.iter().any(|h| h.pending.len() > 1))
}

/// A job whose rows are not in this model's store (the model was reloaded, or the rows
/// were freed) encodes its window again and feeds its tokens again.
fn reclaim_lost_cache(
    store: &KvStore,
    shared: &std::sync::Arc<super::kv_cache::SharedStore>,
    job: &mut Transcription,
) {
    let here = |seq: &SequenceHandle| seq.belongs_to(shared) && store.contains(seq.id());
    if job.spare.as_ref().is_some_and(|s| !here(s)) {
        job.spare = None;
    }
    let Some(window) = job.window.as_mut() else { return };
    // A handle into another store must go even before encoding: its id may name a row here.
    let mut lost = false;
    for hyp in &mut window.hypotheses {
        if hyp.seq.as_ref().is_some_and(|s| !here(s)) {
            hyp.seq = None;
            lost = true;
        }
    }
    if window.stage != Stage::Encode && (lost || window.hypotheses.iter().any(|h| h.seq.is_none())) {
        tracing::debug!(seek = window.seek, "whisper: cache lost, encoding the window again");
        for hyp in &mut window.hypotheses {
            hyp.seq = None;
        }
        window.stage = Stage::Encode;
    }
}

/// One row of a decoder run.
struct Row {
    job: usize,
    hyp: usize,
    seq: SequenceId,
    tokens: Vec<u32>,
    logits_at: Vec<usize>,
}

/// The start of windows: encoder, language detection, prompts. Returns the jobs that failed.
fn start(
    model: &WhisperModel,
    store: &mut KvStore,
    live: &mut [(usize, &mut Transcription)],
) -> Vec<(usize, InferError)> {
    let mut failed: Vec<(usize, InferError)> = Vec::new();
    let encoding: Vec<usize> = (0..live.len())
        .filter(|&j| live[j].1.window.as_ref().is_some_and(|w| w.stage == Stage::Encode))
        .collect();
    for chunk in encoding.chunks(ENCODER_BATCH) {
        if let Err(e) = encode(model, store, live, chunk) {
            failed.extend(chunk.iter().map(|&j| (j, e.clone())));
        }
    }
    let ok = |j: usize, failed: &[(usize, InferError)]| !failed.iter().any(|(f, _)| *f == j);

    // Language detection: `<|startoftranscript|>` alone, its logits.
    let detecting: Vec<Row> = (0..live.len())
        .filter(|&j| ok(j, &failed))
        .filter_map(|j| {
            let w = live[j].1.window.as_ref().filter(|w| w.stage == Stage::Detect)?;
            let seq = w.hypotheses.first()?.seq.as_ref()?.id();
            Some(Row {
                job: j,
                hyp: 0,
                seq,
                tokens: vec![model.tokenizer().special().sot],
                logits_at: vec![0],
            })
        })
        .collect();
    match feed(model, store, &detecting) {
        Ok(logits) => {
            for (row, logits) in detecting.iter().zip(logits) {
                after_detection(model, store, live[row.job].1, row.seq, &logits);
            }
        }
        Err(e) => failed.extend(detecting.iter().map(|r| (r.job, e.clone()))),
    }

    // Prompts, and tokens fed again after a lost cache.
    let mut prompting = Vec::new();
    for j in (0..live.len()).filter(|&j| ok(j, &failed)) {
        let Some(w) = live[j].1.window.as_ref() else { continue };
        for (h, hyp) in w.hypotheses.iter().enumerate() {
            let Some(seq) = hyp.seq.as_ref() else { continue };
            let prompt_pass = w.stage == Stage::Prompt && h == 0;
            if !(prompt_pass || (w.stage == Stage::Decode && hyp.pending.len() > 1)) {
                continue;
            }
            let last = hyp.pending.len().saturating_sub(1);
            let sot = hyp.pending.iter().position(|&t| t == model.tokenizer().special().sot);
            let logits_at = match sot {
                Some(sot) if prompt_pass && w.no_speech_prob.is_none() => vec![sot, last],
                _ => vec![last],
            };
            prompting.push(Row { job: j, hyp: h, seq: seq.id(), tokens: hyp.pending.clone(), logits_at });
        }
    }
    match feed(model, store, &prompting) {
        Ok(logits) => {
            for (row, mut logits) in prompting.iter().zip(logits) {
                let job = &mut *live[row.job].1;
                let vocab = model.config().vocab_size;
                let mut attempt_starts = false;
                if let Some(w) = job.window.as_mut() {
                    if row.logits_at.len() == 2 {
                        w.no_speech_prob = Some(advance::no_speech_probability(model, &logits[..vocab]));
                    }
                    attempt_starts = w.stage == Stage::Prompt && w.hypotheses.len() == 1;
                    w.stage = Stage::Decode;
                }
                let last = logits.len() - vocab;
                let sampled = if attempt_starts {
                    advance::fork_for_sampling(store, model.store(), job)
                } else {
                    Ok(1)
                };
                match sampled {
                    Ok(1) => advance::choose(model, job, row.hyp, &mut logits[last..]),
                    // Each hypothesis draws its first token from the prompt's logits.
                    Ok(count) => {
                        (0..count).for_each(|h| advance::choose(model, job, h, &mut logits[last..].to_vec()))
                    }
                    Err(e) => failed.push((row.job, e)),
                }
            }
        }
        Err(e) => failed.extend(prompting.iter().map(|r| (r.job, e.clone()))),
    }
    failed.sort_by_key(|(j, _)| *j);
    failed.dedup_by_key(|(j, _)| *j);
    failed
}

/// Runs the encoder on the windows of `jobs` and writes their cross caches.
fn encode(
    model: &WhisperModel,
    store: &mut KvStore,
    live: &mut [(usize, &mut Transcription)],
    jobs: &[usize],
) -> Result<(), InferError> {
    let config = model.config();
    let mut mels = Vec::with_capacity(jobs.len() * config.n_mels * config.chunk_frames);
    for &j in jobs {
        if let Some(w) = live[j].1.window.as_ref() {
            mels.extend_from_slice(&w.mel);
        }
    }
    let cross = model.engine().encode(&mels, jobs.len(), config.chunk_frames)?;
    let shared = model.store();
    for (b, &j) in jobs.iter().enumerate() {
        let job = &mut *live[j].1;
        let prompt = if job.language_known { Some(advance::build_prompt(model, job)) } else { None };
        let Some(w) = job.window.as_mut() else { continue };
        let first = w
            .hypotheses
            .first_mut()
            .ok_or_else(|| InferError::Failed("a window has no hypothesis".into()))?;
        let id = match first.seq.as_ref() {
            Some(seq) => seq.id(),
            None => {
                let id = store.allocate();
                first.seq = Some(SequenceHandle::new(shared, id));
                id
            }
        };
        store.write_cross(id, &cross, b).map_err(InferError::Failed)?;
        store.truncate(id, 0);
        if !w.prompt.is_empty() {
            // The cache was lost mid-window: every hypothesis feeds its prompt and tokens again.
            for h in 1..w.hypotheses.len() {
                let fork =
                    store.fork(id).ok_or_else(|| InferError::Failed("the window's row vanished".into()))?;
                w.hypotheses[h].seq = Some(SequenceHandle::new(shared, fork));
            }
            let prompt = w.prompt.clone();
            for hyp in &mut w.hypotheses {
                hyp.pending = prompt.iter().chain(&hyp.generated).copied().collect();
                if hyp.done {
                    // Only its prompt matters now (for a retry at the next temperature).
                    hyp.pending.truncate(prompt.len());
                }
            }
            w.stage = if w.no_speech_prob.is_some() { Stage::Decode } else { Stage::Prompt };
        } else if let Some(prompt) = prompt {
            w.limit = advance::token_limit(model, prompt.len());
            first.pending = prompt.clone();
            w.prompt = prompt;
            w.stage = Stage::Prompt;
        } else {
            w.stage = Stage::Detect;
        }
    }
    Ok(())
}

/// The language is known: the prompt is built; `<|startoftranscript|>`'s position is
/// kept when the prompt starts with it, and its logits give the no-speech probability.
fn after_detection(
    model: &WhisperModel,
    store: &mut KvStore,
    job: &mut Transcription,
    seq: SequenceId,
    logits: &[f32],
) {
    advance::detect_language(model, job, logits);
    let prompt = advance::build_prompt(model, job);
    let limit = advance::token_limit(model, prompt.len());
    let no_speech = advance::no_speech_probability(model, logits);
    let Some(w) = job.window.as_mut() else { return };
    let Some(first) = w.hypotheses.first_mut() else { return };
    if prompt.first() == Some(&model.tokenizer().special().sot) {
        first.pending = prompt[1..].to_vec();
        w.no_speech_prob = Some(no_speech);
    } else {
        store.truncate(seq, 0);
        first.pending = prompt.clone();
    }
    w.prompt = prompt;
    w.limit = limit;
    w.stage = Stage::Prompt;
}

/// One decoder step for every live hypothesis of the decoding jobs.
fn step(
    model: &WhisperModel,
    store: &mut KvStore,
    live: &mut [(usize, &mut Transcription)],
) -> Vec<(usize, InferError)> {
    let mut rows = Vec::new();
    for (j, (_, job)) in live.iter().enumerate() {
        let Some(w) = job.window.as_ref().filter(|w| w.stage == Stage::Decode) else { continue };
        for (h, hyp) in w.hypotheses.iter().enumerate() {
            if let (false, Some(seq), [_]) = (hyp.done, hyp.seq.as_ref(), hyp.pending.as_slice()) {
                rows.push(Row {
                    job: j,
                    hyp: h,
                    seq: seq.id(),
                    tokens: hyp.pending.clone(),
                    logits_at: vec![0],
                });
            }
        }
    }
    match feed(model, store, &rows) {
        Ok(logits) => {
            for (row, mut logits) in rows.iter().zip(logits) {
                advance::choose(model, live[row.job].1, row.hyp, &mut logits);
            }
            Vec::new()
        }
        Err(e) => {
            let mut jobs: Vec<usize> = rows.iter().map(|r| r.job).collect();
            jobs.dedup();
            jobs.into_iter().map(|j| (j, e.clone())).collect()
        }
    }
}

/// One decoder run over `rows`: each feeds its tokens after its cached positions (which
/// grow by them) and gets the logits at `logits_at`, `vocab` values each, in order.
fn feed(model: &WhisperModel, store: &mut KvStore, rows: &[Row]) -> Result<Vec<Vec<f32>>, InferError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let config = model.config();
    let ids: Vec<SequenceId> = rows.iter().map(|r| r.seq).collect();
    let (range, order) = store.arrange(&ids).map_err(InferError::Failed)?;
    // Rows in the store's order.
    let rows: Vec<&Row> = order.iter().filter_map(|id| rows.iter().find(|r| r.seq == *id)).collect();
    let batch = rows.len();
    let n_new = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(1).max(1);
    let n_logits = rows.iter().map(|r| r.logits_at.len()).max().unwrap_or(1).max(1);
    let lengths: Vec<usize> = rows.iter().map(|r| store.len(r.seq)).collect();
    let needed = rows.iter().zip(&lengths).map(|(r, len)| len + r.tokens.len()).max().unwrap_or(0);
    if needed > config.n_text_ctx {
        return Err(InferError::Failed(format!(
            "{needed} positions exceed the model's {}",
            config.n_text_ctx
        )));
    }
    store.fit_width(needed);
    let n_past = store.width();
    let total = n_past + n_new;
    let mut tokens = vec![i64::from(model.tokenizer().special().eot); batch * n_new];
    let mut positions = vec![0i64; batch * n_new];
    let mut mask = vec![MASKED; batch * n_new * total];
    let mut logit_positions = vec![0i64; batch * n_logits];
    for (b, (row, &len)) in rows.iter().zip(&lengths).enumerate() {
        for q in 0..n_new {
            let real = q < row.tokens.len();
            let base = (b * n_new + q) * total;
            if real {
                tokens[b * n_new + q] = i64::from(row.tokens[q]);
                mask[base..base + len].fill(0.0);
                mask[base + n_past..base + n_past + q + 1].fill(0.0);
            } else {
                mask[base + n_past] = 0.0; // padding attends to something, and is ignored
            }
            positions[b * n_new + q] = (len + q).min(config.n_text_ctx - 1) as i64;
        }
        for k in 0..n_logits {
            let at = row.logits_at.get(k).or(row.logits_at.last()).copied().unwrap_or(0);
            logit_positions[b * n_logits + k] = at as i64;
        }
    }
    let layers = config.decoder_layers;
    let store_view = &*store;
    let past = |which: usize| (0..layers).map(|l| store_view.past(which, l, &range)).collect::<Vec<&[f32]>>();
    let cross =
        |which: usize| (0..layers).map(|l| store_view.cross(which, l, &range)).collect::<Vec<&[f32]>>();
    let (past_keys, past_values, cross_keys, cross_values) = (past(0), past(1), cross(0), cross(1));
    let input = DecoderInput {
        batch,
        n_new,
        n_past,
        n_logits,
        tokens: &tokens,
        positions: &positions,
        attention_mask: &mask,
        logit_positions: &logit_positions,
        past_keys: &past_keys,
        past_values: &past_values,
        cross_keys: &cross_keys,
        cross_values: &cross_values,
    };
    let output = model.engine().decode(&input)?;
    let vocab = config.vocab_size;
    if output.logits.len() != batch * n_logits * vocab {
        return Err(InferError::Failed(format!(
            "the decoder returned {} logits, not {batch} x {n_logits} x {vocab}",
            output.logits.len()
        )));
    }
    for (b, row) in rows.iter().enumerate() {
        store.append(row.seq, &output, b, n_new, row.tokens.len()).map_err(InferError::Failed)?;
    }
    // Back in the caller's order.
    let mut by_row: Vec<(SequenceId, Vec<f32>)> = rows
        .iter()
        .enumerate()
        .map(|(b, row)| {
            let start = b * n_logits * vocab;
            (row.seq, output.logits[start..start + row.logits_at.len() * vocab].to_vec())
        })
        .collect();
    Ok(ids
        .iter()
        .map(|id| {
            let at = by_row.iter().position(|(s, _)| s == id).unwrap_or(0);
            std::mem::take(&mut by_row[at].1)
        })
        .collect())
}
