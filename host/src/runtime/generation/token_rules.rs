//! Rules on which token may come next, applied to the logits before sampling: biases added to
//! chosen tokens (OpenAI's `logit_bias`), words that must not be generated (TensorRT-LLM's
//! `bad_words`) and a least number of tokens before an end token may end the sequence
//! (`min_length`).

use std::sync::Arc;

use super::stop::TokenBytes;

/// A request's rules; the default allows every token.
#[derive(Debug, Default)]
pub struct TokenRules {
    /// End tokens, held back until `min_tokens` tokens have been generated.
    pub end_ids: Vec<i64>,
    /// Tokens to generate before an end token may come.
    pub min_tokens: usize,
    /// Words not to generate.
    pub banned: Option<BannedWords>,
    /// Added to the logits of these tokens (-100 bans a token, 100 all but forces it).
    pub bias: Vec<(u32, f32)>,
}

impl TokenRules {
    /// Masks (sets to -inf) the logits of tokens the rules forbid after `generated`.
    pub fn apply(&self, logits: &mut [f32], generated: &[i64]) {
        for &(token, bias) in &self.bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        if generated.len() < self.min_tokens {
            for &t in &self.end_ids {
                mask(logits, t);
            }
        }
        if let Some(banned) = &self.banned {
            banned.apply(logits, generated);
        }
    }
}

fn mask(logits: &mut [f32], token: i64) {
    if let Some(l) = usize::try_from(token).ok().and_then(|i| logits.get_mut(i)) {
        *l = f32::NEG_INFINITY;
    }
}

/// Words the sequence must not spell. Matched on text, so a word is banned however it is
/// split into tokens: a token is refused when it would complete a banned word begun by the
/// tokens before it, or spells one whole.
#[derive(Debug)]
pub struct BannedWords {
    words: Vec<Vec<u8>>,
    text: Arc<TokenBytes>,
    /// Tokens that spell a banned word somewhere inside them.
    always: Vec<u32>,
    /// `completing[w][j - 1]`: tokens that begin with word `w` from its byte `j` on.
    completing: Vec<Vec<Vec<u32>>>,
    /// The longest word, in bytes.
    longest: usize,
}

impl BannedWords {
    /// The rules for `words` (empty ones mean nothing) over the model's vocabulary; `None`
    /// when no word is left.
    pub fn new(words: Vec<String>, text: Arc<TokenBytes>) -> Option<Self> {
        let words: Vec<Vec<u8>> = words
            .into_iter()
            .filter(|w| !w.is_empty())
            .map(String::into_bytes)
            .collect();
        if words.is_empty() {
            return None;
        }
        let mut always = Vec::new();
        let mut completing: Vec<Vec<Vec<u32>>> = words
            .iter()
            .map(|w| vec![Vec::new(); w.len() - 1])
            .collect();
        for (token, spelling) in text.iter() {
            for (w, word) in words.iter().enumerate() {
                if spelling.windows(word.len()).any(|s| s == word.as_slice()) {
                    always.push(token);
                    continue;
                }
                for j in 1..word.len() {
                    if spelling.starts_with(&word[j..]) {
                        completing[w][j - 1].push(token);
                    }
                }
            }
        }
        let longest = words.iter().map(Vec::len).max().unwrap_or(0);
        Some(Self {
            words,
            text,
            always,
            completing,
            longest,
        })
    }

    fn apply(&self, logits: &mut [f32], generated: &[i64]) {
        for &t in &self.always {
            mask(logits, i64::from(t));
        }
        // The end of the text so far, as long as a word could reach back.
        let mut tail: Vec<u8> = Vec::new();
        for &t in generated.iter().rev() {
            if tail.len() >= self.longest {
                break;
            }
            let spelling = u32::try_from(t).map_or(&[][..], |t| self.text.of(t));
            tail.splice(0..0, spelling.iter().copied());
        }
        for (w, word) in self.words.iter().enumerate() {
            for j in 1..word.len() {
                if tail.ends_with(&word[..j]) {
                    for &t in &self.completing[w][j - 1] {
                        mask(logits, i64::from(t));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Arc<TokenBytes> {
        Arc::new(TokenBytes::from_spellings(&[
            "Par", "is", " Paris", "London", "i", "s", "<end>",
        ]))
    }

    fn allowed(rules: &TokenRules, generated: &[i64]) -> Vec<usize> {
        let mut logits = vec![0.0; 7];
        rules.apply(&mut logits, generated);
        (0..7).filter(|&i| logits[i].is_finite()).collect()
    }

    #[test]
    fn a_banned_word_is_refused_however_it_is_split() {
        let rules = TokenRules {
            banned: BannedWords::new(vec!["Paris".into(), String::new()], vocab()),
            ..Default::default()
        };
        // " Paris" spells it whole; after "Par", "is" would complete it, and after "Par"+"i",
        // "s" would.
        assert_eq!(allowed(&rules, &[]), [0, 1, 3, 4, 5, 6]);
        assert_eq!(allowed(&rules, &[0]), [0, 3, 4, 5, 6]);
        assert_eq!(allowed(&rules, &[0, 4]), [0, 1, 3, 4, 6]);
        assert_eq!(allowed(&rules, &[3]), [0, 1, 3, 4, 5, 6]);
    }

    #[test]
    fn biases_move_the_chosen_tokens() {
        let rules = TokenRules {
            bias: vec![(2, 5.0), (3, -100.0), (99, 1.0)],
            ..Default::default()
        };
        let mut logits = vec![0.0; 7];
        rules.apply(&mut logits, &[]);
        assert_eq!(logits, [0.0, 0.0, 5.0, -100.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn empty_words_ban_nothing() {
        assert!(BannedWords::new(vec![String::new()], vocab()).is_none());
    }

    #[test]
    fn end_tokens_wait_for_the_least_length() {
        let rules = TokenRules {
            end_ids: vec![6],
            min_tokens: 2,
            ..Default::default()
        };
        assert!(!allowed(&rules, &[1]).contains(&6));
        assert!(allowed(&rules, &[1, 1]).contains(&6));
    }
}
