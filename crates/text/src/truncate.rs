//! A text far longer than the model reads is cut before it is tokenized, so a
//! 100,000-character input costs what its first few hundred words cost.
//!
//! The cut falls on whitespace: BERT's normalizer works per character and its
//! pre-tokenizer splits on whitespace and punctuation, so every word before the cut
//! tokenizes exactly as in the whole text. When the prefix already fills the model's
//! window, the tokens the model keeps are the same as the whole text's; otherwise the
//! prefix doubles until it does, or until it is the whole text.

use tokenizers::Tokenizer;

/// Bytes of text per token to try first: English averages about 4, so 8 covers most
/// texts in one step.
const FIRST_TRY_BYTES_PER_TOKEN: usize = 8;

/// The shortest whitespace-bounded prefix of `text` that tokenizes to at least
/// `max_tokens` tokens (special tokens included), or `text` itself.
pub fn tokenizer_prefix<'a>(tokenizer: &Tokenizer, text: &'a str, max_tokens: usize) -> &'a str {
    let mut budget = max_tokens.saturating_mul(FIRST_TRY_BYTES_PER_TOKEN).max(64);
    while budget < text.len() {
        let mut end = budget;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        if let Some(cut) = text[..end].rfind(char::is_whitespace) {
            let prefix = &text[..cut];
            match tokenizer.encode(prefix, true) {
                Ok(enc) if enc.len() >= max_tokens => return prefix,
                Ok(_) => {}
                Err(_) => return text,
            }
        }
        budget = budget.saturating_mul(2);
    }
    text
}
