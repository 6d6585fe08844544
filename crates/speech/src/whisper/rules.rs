//! Which token comes next: faster-whisper's logit rules (CTranslate2's `SuppressTokens`,
//! `SuppressTokensBegin` and `ApplyTimestampRules`, in that order) and the choice —
//! the best token at temperature 0, a seeded sample above it.
//!
//! With timestamps, a window's text is framed by timestamp tokens in pairs
//! (`<|1.00|> words <|2.40|><|2.40|> more words <|4.00|>`): the first token must be a
//! timestamp no later than 1 s; after a lone timestamp only a timestamp or the end may
//! follow, after a pair only text; timestamps never go back; and where the timestamps
//! together are likelier than any single text token, a timestamp is forced.

use super::config::WhisperConfig;

/// The latest first timestamp, in timestamp steps (faster-whisper's
/// `max_initial_timestamp` of 1.0 s at 0.02 s a step).
pub const MAX_INITIAL_TIMESTAMP_INDEX: u32 = 50;

/// The rules of one model.
#[derive(Debug, Clone)]
pub struct LogitRules {
    suppress: Vec<u32>,
    suppress_blank: Vec<u32>,
    eot: u32,
    no_timestamps: u32,
    timestamp_begin: u32,
    vocab: usize,
}

/// A token and its log-probability under the processed distribution (at temperature 1,
/// whatever the temperature it was drawn at, as CTranslate2 scores it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub token: u32,
    pub logprob: f32,
}

impl LogitRules {
    pub fn new(config: &WhisperConfig) -> LogitRules {
        LogitRules {
            suppress: config.suppress_tokens.clone(),
            suppress_blank: config.suppress_blank.clone(),
            eot: config.tokens.eot,
            no_timestamps: config.tokens.no_timestamps,
            timestamp_begin: config.tokens.timestamp_begin,
            vocab: config.vocab_size,
        }
    }

    /// Applies the rules to one row of logits, in place, given the tokens generated so
    /// far in this window (not the prompt), then turns it into log-probabilities.
    pub fn apply(&self, logits: &mut [f32], generated: &[u32], timestamps: bool) {
        let begin = self.timestamp_begin as usize;
        let vocab = self.vocab.min(logits.len());
        let logits = &mut logits[..vocab];
        let disable = |logits: &mut [f32], ids: &[u32]| {
            for &id in ids {
                if let Some(x) = logits.get_mut(id as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        };
        disable(logits, &self.suppress);
        if generated.is_empty() {
            disable(logits, &self.suppress_blank);
        }
        if timestamps {
            disable(logits, &[self.no_timestamps]);
            let mut weigh_timestamps = false;
            match generated {
                [] => {
                    logits[..begin].fill(f32::NEG_INFINITY);
                    let latest = begin + MAX_INITIAL_TIMESTAMP_INDEX as usize + 1;
                    logits[latest.min(vocab)..].fill(f32::NEG_INFINITY);
                }
                [.., penultimate, last] if *last as usize >= begin && *penultimate as usize >= begin => {
                    logits[begin..].fill(f32::NEG_INFINITY);
                }
                [last] | [.., _, last] if *last as usize >= begin => {
                    // A lone first token counts as a closed pair (CTranslate2 takes the
                    // token before the first as the first itself).
                    if generated.len() == 1 {
                        logits[begin..].fill(f32::NEG_INFINITY);
                    } else {
                        logits[..self.eot as usize].fill(f32::NEG_INFINITY);
                        weigh_timestamps = true;
                    }
                }
                _ => weigh_timestamps = true,
            }
            if let Some(&last_timestamp) = generated.iter().rev().find(|&&t| t as usize >= begin) {
                logits[begin..(last_timestamp as usize).min(vocab)].fill(f32::NEG_INFINITY);
            }
            if weigh_timestamps {
                let mut logprobs = logits.to_vec();
                log_softmax(&mut logprobs);
                let text_best = logprobs[..begin].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if log_sum_exp(&logprobs[begin..]) > text_best {
                    logits[..begin].fill(f32::NEG_INFINITY);
                }
            }
        }
        log_softmax(logits);
    }

    /// The most likely token of processed log-probabilities.
    pub fn best(logprobs: &[f32]) -> Choice {
        let (token, logprob) = logprobs
            .iter()
            .copied()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, x)| if x > best.1 { (i, x) } else { best });
        Choice { token: token as u32, logprob }
    }

    /// A token drawn from `softmax(logprobs / temperature)`.
    pub fn sample(logprobs: &[f32], temperature: f32, rng: &mut SplitMix64) -> Choice {
        let peak = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logprobs.iter().map(|&x| f64::from((x - peak) / temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut target = rng.next_f64() * total;
        let mut token = 0;
        for (i, w) in weights.iter().enumerate() {
            if *w > 0.0 {
                token = i;
                if target < *w {
                    break;
                }
                target -= w;
            }
        }
        Choice { token: token as u32, logprob: logprobs[token] }
    }
}

/// `x - log(sum(exp(x)))`, in place; rows of `-inf` stay `-inf`.
pub fn log_softmax(x: &mut [f32]) {
    let total = log_sum_exp(x);
    x.iter_mut().for_each(|v| *v -= total);
}

pub fn log_sum_exp(x: &[f32]) -> f32 {
    let peak = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if peak == f32::NEG_INFINITY {
        return peak;
    }
    peak + x.iter().map(|&v| (v - peak).exp()).sum::<f32>().ln()
}

/// A small, seedable generator (SplitMix64): sampling at temperature > 0 must be
/// reproducible for a given request seed, and needs nothing better than this.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::whisper::config::tests::tiny_en;

    const B: u32 = 50363;
    const EOT: u32 = 50256;

    /// The choice after the rules, with `boost` added to the listed tokens' logits.
    fn choose(generated: &[u32], boost: &[(u32, f32)], timestamps: bool) -> u32 {
        let rules = LogitRules::new(&tiny_en());
        let mut logits = vec![0.0; 51864];
        for &(token, value) in boost {
            logits[token as usize] = value;
        }
        rules.apply(&mut logits, generated, timestamps);
        LogitRules::best(&logits).token
    }

    #[test]
    fn timestamps_come_in_pairs_and_never_go_back() {
        // The first token is a timestamp of at most 1 s, even when text is likelier.
        assert_eq!(choose(&[], &[(10, 9.0), (B + 60, 8.0), (B + 40, 7.0)], true), B + 40);
        // After a pair, text; after text and one timestamp, a timestamp or the end.
        assert_eq!(choose(&[B, 10, B + 20, B + 20], &[(B + 30, 9.0), (11, 1.0)], true), 11);
        assert_eq!(choose(&[B, 10, B + 20], &[(11, 9.0), (B + 30, 1.0)], true), B + 30);
        assert_eq!(choose(&[B, 10, B + 20], &[(11, 12.0), (EOT, 9.0)], true), EOT);
        // A lone first timestamp counts as a pair.
        assert_eq!(choose(&[B], &[(B + 5, 9.0), (11, 1.0)], true), 11);
        // No timestamp before the last one.
        assert_eq!(choose(&[B, 10, B + 20, B + 20, 11], &[(B + 5, 9.0), (B + 25, 1.0)], true), B + 25);
        // The timestamps' total probability above any text token forces a timestamp.
        let many: Vec<(u32, f32)> = (B + 30..B + 1000).map(|t| (t, 2.0)).chain([(11, 6.0)]).collect();
        assert!(choose(&[B, 10], &many, true) >= B + 30);
    }

    #[test]
    fn suppressed_tokens_never_come() {
        // The suppress list (1, 2, 7 in the test descriptor), blank and end at the start.
        assert_eq!(choose(&[10], &[(7, 9.0), (12, 1.0)], false), 12);
        assert_eq!(choose(&[], &[(220, 9.0), (EOT, 8.0), (12, 1.0)], false), 12);
        assert_eq!(choose(&[10], &[(EOT, 9.0), (12, 1.0)], false), EOT);
        // <|notimestamps|> is barred when timestamps are on.
        assert_eq!(choose(&[10], &[(50362, 12.0), (12, 9.0)], true), 12);
    }

    #[test]
    fn sampling_follows_the_temperature_and_the_seed() {
        let mut logprobs = vec![f32::NEG_INFINITY; 4];
        logprobs[1] = (0.7f32).ln();
        logprobs[3] = (0.3f32).ln();
        let draw = |temperature: f32, seed: u64| {
            let mut rng = SplitMix64::new(seed);
            (0..2000).filter(|_| LogitRules::sample(&logprobs, temperature, &mut rng).token == 3).count()
        };
        let at_one = draw(1.0, 7);
        assert!((500..700).contains(&at_one), "{at_one} of 2000 draws took the 30% token");
        assert!(draw(0.2, 7) < 50, "a low temperature sharpens the distribution");
        assert_eq!(draw(1.0, 7), at_one, "the same seed draws the same tokens");
        let choice = LogitRules::sample(&logprobs, 1.0, &mut SplitMix64::new(1));
        assert!(choice.token == 1 || choice.token == 3);
        assert_eq!(choice.logprob, logprobs[choice.token as usize], "scored at temperature 1");
    }
}
