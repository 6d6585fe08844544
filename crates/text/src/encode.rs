//! Texts (or the caller's token ids) to the token ids an encoder runs, and the
//! micro-batches it runs them in.

use snooze_core::{EmbedInput, Embeddings, InferError};
use std::sync::Arc;

use snooze_core::kept::Kept;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::{truncate::tokenizer_prefix, SentenceLayout};

/// Padded tokens per forward pass, for short inputs, where the engine frees a pass's
/// activations after it (Candle).
pub const TOKENS_PER_PASS: usize = 8192;

/// Attention-score elements per forward pass (`sequences × heads × len²`), for long
/// inputs: engines keep a few score-sized tensors alive per layer, and at 32 × 256
/// tokens and 12 heads one of them is 100 MiB. 4 Mi elements (16 MiB per tensor)
/// still runs 5 sequences of 256 tokens at once.
pub const ATTENTION_PER_PASS: usize = 4 << 20;

/// Tokenizers by file and truncation length, shared by the models that load them.
static TOKENIZERS: Kept<Tokenizer> = Kept::new();

/// A model's tokenizer, set to truncate to the model's limit and never to pad:
/// padding is done per micro-batch, to its longest sequence, with an attention mask.
pub struct TextEncoder {
    tokenizer: Arc<Tokenizer>,
    max_seq_len: usize,
    vocab_size: usize,
}

impl TextEncoder {
    pub fn load(layout: &SentenceLayout) -> Result<TextEncoder, String> {
        let path = layout.tokenizer_path();
        let failed = |e: &dyn std::fmt::Display| format!("cannot load {}: {e}", path.display());
        // Parsed once and kept between loads while memory allows (`snooze_core::kept`):
        // the parse is most of a reload's time.
        let tokenizer = TOKENIZERS.get_or_parse(&path, layout.max_seq_len as u64, || {
            let mut tokenizer = Tokenizer::from_file(&path).map_err(|e| failed(&e))?;
            tokenizer.with_padding(None);
            tokenizer
                .with_truncation(Some(TruncationParams {
                    direction: TruncationDirection::Right,
                    max_length: layout.max_seq_len,
                    strategy: TruncationStrategy::LongestFirst,
                    stride: 0,
                }))
                .map_err(|e| failed(&e))?;
            Ok::<_, String>(tokenizer)
        })?;
        Ok(TextEncoder { tokenizer, max_seq_len: layout.max_seq_len, vocab_size: layout.encoder.vocab_size })
    }

    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Token ids of each input, truncated to `max_seq_len`; an empty sequence or an id
    /// outside the vocabulary is the caller's error, named by its index.
    pub fn token_ids(&self, input: &EmbedInput) -> Result<Vec<Vec<u32>>, InferError> {
        let seqs: Vec<Vec<u32>> = match input {
            // The tokenizer truncates (keeping its special tokens) and does not pad.
            EmbedInput::Texts(texts) => {
                let texts: Vec<&str> =
                    texts.iter().map(|t| tokenizer_prefix(&self.tokenizer, t, self.max_seq_len)).collect();
                let encodings = self
                    .tokenizer
                    .encode_batch(texts, true)
                    .map_err(|e| InferError::InvalidInput(format!("cannot tokenize the input: {e}")))?;
                encodings.into_iter().map(|e| e.get_ids().to_vec()).collect()
            }
            // Ids are the caller's own tokenization, special tokens included: used as given,
            // cut to the first `max_seq_len`.
            EmbedInput::TokenIds(ids) => {
                for (i, seq) in ids.iter().enumerate() {
                    if let Some(&bad) = seq.iter().find(|&&id| id as usize >= self.vocab_size) {
                        return Err(InferError::InvalidInput(format!(
                            "input {i} holds token id {bad}, outside the model's vocabulary of {} tokens",
                            self.vocab_size
                        )));
                    }
                }
                ids.iter().map(|s| s[..s.len().min(self.max_seq_len)].to_vec()).collect()
            }
        };
        if let Some(i) = seqs.iter().position(Vec::is_empty) {
            return Err(InferError::InvalidInput(format!("input {i} has no tokens")));
        }
        Ok(seqs)
    }
}

impl TextEncoder {
    /// Embeds `input`: its token ids run through `forward` in passes of similar length
    /// (see [`passes`]), one vector per sequence, back in input order with the tokens
    /// each consumed. `forward` gets the sequences of one pass, longest first.
    pub fn embed(
        &self,
        input: &EmbedInput,
        heads: usize,
        tokens_per_pass: usize,
        mut forward: impl FnMut(&[&[u32]]) -> Result<Vec<Vec<f32>>, InferError>,
    ) -> Result<Embeddings, InferError> {
        let seqs = self.token_ids(input)?;
        let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
        let mut vectors = vec![Vec::new(); seqs.len()];
        for pass in passes(&lengths, heads, tokens_per_pass) {
            let batch: Vec<&[u32]> = pass.iter().map(|&i| seqs[i].as_slice()).collect();
            for (&i, v) in pass.iter().zip(forward(&batch)?) {
                vectors[i] = v;
            }
        }
        Ok(Embeddings::new(vectors, lengths))
    }
}

/// What a forward pass costs beyond its padded tokens, in tokens: launching it, the
/// runtime's per-pass bookkeeping and thread wake-ups. Measured with all-MiniLM-L6-v2 on
/// ONNX Runtime (2 cores), requests of 1 to 32 sentences of 6-15 words: 16 tokens took
/// the fp32 model from 1.54 s to 1.40 s for all 32 requests (int8 0.52 -> 0.49 s); 0 made
/// passes of a sequence or two (no faster than one pass), 48 and 128 came between.
pub const PASS_COST_TOKENS: usize = 16;

/// Splits sequences of `lengths` into forward passes of similar length, longest first:
/// each pass pads to its longest sequence, so a request of short and long texts in one
/// pass spends most of its compute on padding. The split is the one of least cost — the
/// padded tokens of every pass plus [`PASS_COST_TOKENS`] per pass — over the sequences
/// sorted by length, within the caps that bound a pass's activations however large the
/// request (`tokens_per_pass`, and [`ATTENTION_PER_PASS`] over `heads`). Each pass lists
/// indices into `lengths`; its first sequence is its longest.
pub fn passes(lengths: &[usize], heads: usize, tokens_per_pass: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let n = order.len();
    // best[j]: the least cost of the first j sequences in order; cut[j]: where the last
    // pass of that split starts. A pass order[i..j] pads to lengths[order[i]].
    let mut best = vec![usize::MAX; n + 1];
    let mut cut = vec![0; n + 1];
    best[0] = 0;
    for i in 0..n {
        let longest = lengths[order[i]].max(1);
        let by_tokens = tokens_per_pass / longest;
        let by_attention = ATTENTION_PER_PASS / (heads.max(1) * longest * longest);
        let most = by_tokens.min(by_attention).clamp(1, n - i);
        for j in i + 1..=i + most {
            let cost = best[i].saturating_add(PASS_COST_TOKENS + (j - i) * longest);
            // On a tie the later cut wins: earlier passes as full as the caps let them.
            if cost <= best[j] {
                best[j] = cost;
                cut[j] = i;
            }
        }
    }
    let mut passes = Vec::new();
    let mut j = n;
    while j > 0 {
        passes.push(order[cut[j]..j].to_vec());
        j = cut[j];
    }
    passes.reverse();
    passes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_cover_every_sequence_once_longest_first() {
        let lengths = [3, 256, 10, 256, 7, 256, 256, 256, 256, 1];
        let p = passes(&lengths, 12, TOKENS_PER_PASS);
        let mut seen: Vec<usize> = p.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        for pass in &p {
            let first = lengths[pass[0]];
            assert!(pass.iter().all(|&i| lengths[i] <= first));
            // The attention cap: 12 heads × 256² × 5 sequences fits, 6 do not.
            assert!(pass.len() * 12 * first * first <= ATTENTION_PER_PASS || pass.len() == 1);
        }
        assert_eq!(p[0].len(), 5);
        // Short sequences share one pass.
        assert_eq!(passes(&[4; 100], 12, TOKENS_PER_PASS), vec![(0..100).collect::<Vec<_>>()]);
        assert!(passes(&[], 12, TOKENS_PER_PASS).is_empty());
        // A smaller token cap makes more, smaller passes.
        assert_eq!(passes(&[4; 100], 12, 40).len(), 10);
    }

    #[test]
    fn passes_split_where_padding_costs_more_than_a_pass() {
        // 16 sentences of 40 tokens and 16 of 8: one pass pads all 32 to 40 (1280 tokens),
        // two passes run 640 + 128 tokens and one more pass.
        let lengths: Vec<usize> = (0..32).map(|i| if i % 2 == 0 { 40 } else { 8 }).collect();
        let p = passes(&lengths, 12, TOKENS_PER_PASS);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].iter().all(|&i| lengths[i] == 40) && p[1].iter().all(|&i| lengths[i] == 8));
        // Lengths close together stay in one pass: a pass costs more than their padding.
        assert_eq!(passes(&[12, 11, 12, 10, 11], 12, TOKENS_PER_PASS).len(), 1);
        // The split is the cheapest: no single cut of a sorted run does better.
        let lengths = [
            20, 19, 19, 18, 18, 18, 17, 17, 16, 16, 16, 15, 15, 14, 14, 14, 13, 13, 12, 12, 12, 11, 11, 11,
            10, 10, 10, 9, 9, 9, 8, 8,
        ];
        let cost =
            |p: &[Vec<usize>]| p.iter().map(|q| PASS_COST_TOKENS + q.len() * lengths[q[0]]).sum::<usize>();
        let best = cost(&passes(&lengths, 12, TOKENS_PER_PASS));
        for k in 1..lengths.len() {
            let two = vec![(0..k).collect::<Vec<_>>(), (k..lengths.len()).collect()];
            assert!(best <= cost(&two), "cut at {k}");
        }
        assert!(best < cost(&[(0..lengths.len()).collect()]), "padding 32 sentences to 20 tokens costs more");
    }
}
