//! One decoding attempt of a window at one temperature, and faster-whisper's verdict on
//! it (`generate_with_fallback`).
//!
//! At temperature 0 an attempt is one greedy hypothesis; above it, `best_of` sampled
//! hypotheses, of which the one with the best length-normalised log-probability counts.
//! An attempt fails when its text is too repetitive (gzip compression ratio above the
//! threshold) or too unlikely (average log-probability below it) — unless the window
//! looks silent (no-speech probability above its threshold), when the unlikely text is
//! accepted and the window is skipped later. After the last temperature the best attempt
//! whose compression ratio passed (else the best of all) is kept.

use std::io::Write;

use flate2::{write::ZlibEncoder, Compression};

use super::kv_cache::SequenceHandle;

/// A hypothesis being decoded: its sequence in the model's cache and its tokens so far.
#[derive(Debug)]
pub struct Hypothesis {
    /// `None` until the window is encoded (or after the cache was lost).
    pub seq: Option<SequenceHandle>,
    /// Tokens sampled in this window, the end-of-text included once drawn.
    pub generated: Vec<u32>,
    /// Tokens to feed to the decoder next (the prompt, then each sampled token).
    pub pending: Vec<u32>,
    pub sum_logprob: f64,
    pub done: bool,
}

impl Hypothesis {
    pub fn new(pending: Vec<u32>) -> Hypothesis {
        Hypothesis { seq: None, generated: Vec::new(), pending, sum_logprob: 0.0, done: false }
    }
}

/// A finished attempt, judged.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Without the end-of-text token.
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f64,
    pub compression_ratio: f64,
}

/// The thresholds of the verdict (faster-whisper's defaults in `Default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub compression_ratio: Option<f64>,
    pub log_prob: Option<f64>,
    pub no_speech: Option<f64>,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { compression_ratio: Some(2.4), log_prob: Some(-1.0), no_speech: Some(0.6) }
    }
}

/// The best hypothesis of a finished attempt, as CTranslate2 ranks them: by summed
/// log-probability over length (end-of-text excluded from the length, included in the sum).
pub fn best_hypothesis(hypotheses: &[Hypothesis], eot: u32) -> Option<(Vec<u32>, f64)> {
    hypotheses
        .iter()
        .map(|h| {
            let tokens: Vec<u32> = h.generated.iter().copied().filter(|&t| t != eot).collect();
            let score = h.sum_logprob / tokens.len().max(1) as f64;
            (tokens, h.sum_logprob, score)
        })
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .map(|(tokens, sum, _)| {
            let avg = sum / (tokens.len() + 1) as f64;
            (tokens, avg)
        })
}

/// `len(text) / len(zlib(text))` of the stripped text, as faster-whisper measures repetition.
pub fn compression_ratio(text: &str) -> f64 {
    let bytes = text.as_bytes();
    let mut encoder = ZlibEncoder::new(Vec::new(), Compression::default());
    let compressed = encoder.write_all(bytes).and_then(|()| encoder.finish()).map_or(1, |c| c.len());
    bytes.len() as f64 / compressed.max(1) as f64
}

/// Whether an attempt must be retried at the next temperature.
pub fn needs_fallback(outcome: &Outcome, no_speech_prob: f64, t: &Thresholds) -> bool {
    let too_repetitive = t.compression_ratio.is_some_and(|max| outcome.compression_ratio > max);
    let too_unlikely = t.log_prob.is_some_and(|min| outcome.avg_logprob < min);
    let silent = t.no_speech.is_some_and(|max| no_speech_prob > max) && too_unlikely;
    (too_repetitive || too_unlikely) && !silent
}

/// The attempt kept after every temperature failed: the likeliest of those that were not
/// too repetitive, else of all; reported at the last temperature tried.
pub fn last_resort(attempts: &[Outcome], t: &Thresholds, last_temperature: f32) -> Option<Outcome> {
    let passing: Vec<&Outcome> = attempts
        .iter()
        .filter(|o| t.compression_ratio.is_none_or(|max| o.compression_ratio <= max))
        .collect();
    let pool: Vec<&Outcome> = if passing.is_empty() { attempts.iter().collect() } else { passing };
    pool.into_iter()
        .max_by(|a, b| a.avg_logprob.total_cmp(&b.avg_logprob))
        .map(|o| Outcome { temperature: last_temperature, ..o.clone() })
}

/// Whether a window whose decoding was kept is skipped as silence.
pub fn is_silent(outcome: &Outcome, no_speech_prob: f64, t: &Thresholds) -> bool {
    let Some(max) = t.no_speech else { return false };
    no_speech_prob > max && t.log_prob.is_none_or(|min| outcome.avg_logprob <= min)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn outcome(avg_logprob: f64, compression_ratio: f64) -> Outcome {
        Outcome { tokens: vec![1], temperature: 0.0, avg_logprob, compression_ratio }
    }

    #[test]
    fn the_verdict_follows_faster_whisper() {
        let t = Thresholds::default();
        assert!(!needs_fallback(&outcome(-0.3, 1.5), 0.1, &t));
        assert!(needs_fallback(&outcome(-0.3, 2.5), 0.1, &t), "repetitive");
        assert!(needs_fallback(&outcome(-1.2, 1.5), 0.1, &t), "unlikely");
        assert!(!needs_fallback(&outcome(-1.2, 1.5), 0.9, &t), "unlikely but silent");
        assert!(needs_fallback(&outcome(-1.2, 2.5), 0.5, &t), "repetitive, not silent enough");
        let off = Thresholds { compression_ratio: None, log_prob: None, no_speech: None };
        assert!(!needs_fallback(&outcome(-9.0, 9.0), 0.9, &off));

        assert!(is_silent(&outcome(-1.2, 1.0), 0.7, &t));
        assert!(!is_silent(&outcome(-0.5, 1.0), 0.7, &t), "likely text is kept despite no-speech");
        assert!(!is_silent(&outcome(-1.2, 1.0), 0.5, &t));
    }

    #[test]
    fn the_last_resort_prefers_attempts_that_were_not_repetitive() {
        let t = Thresholds::default();
        let attempts = [outcome(-0.5, 3.0), outcome(-1.5, 2.0), outcome(-1.2, 2.1)];
        let kept = last_resort(&attempts, &t, 1.0).unwrap();
        assert_eq!((kept.avg_logprob, kept.temperature), (-1.2, 1.0));
        let all_repetitive = [outcome(-0.5, 3.0), outcome(-0.2, 4.0)];
        assert_eq!(last_resort(&all_repetitive, &t, 1.0).unwrap().avg_logprob, -0.2);
    }

    #[test]
    fn repetition_shows_in_the_compression_ratio() {
        assert!(compression_ratio(&"the same words again ".repeat(20)) > 2.4);
        assert!(compression_ratio("Ever tried. Ever failed. No matter. Try again.") < 1.5);
        assert_eq!(compression_ratio(""), 0.0);
    }

    #[test]
    fn hypotheses_rank_by_length_normalised_log_probability() {
        let h = |generated: Vec<u32>, sum_logprob: f64| Hypothesis {
            seq: None,
            generated,
            pending: vec![],
            sum_logprob,
            done: true,
        };
        let eot = 50256;
        // -3 over 3 tokens beats -2.5 over 2.
        let (tokens, avg) =
            best_hypothesis(&[h(vec![1, 2, eot], -2.5), h(vec![3, 4, 5, eot], -3.0)], eot).unwrap();
        assert_eq!(tokens, vec![3, 4, 5]);
        assert!((avg - -0.75).abs() < 1e-12);
    }
}
