//! N-gram (prompt-lookup) speculative decoding, vLLM's `ngram` method.
//!
//! Before a decode step, a greedy sequence whose last tokens (an n-gram of `prompt_lookup_min`
//! to `prompt_lookup_max` tokens) already occurred earlier in its prompt or answer is given the
//! tokens that followed that occurrence as a *draft*. The step then runs the sequence's next
//! token and its draft in one decoder run (every position's logits), and keeps the draft's
//! tokens for as long as each is the one greedy decoding picks after the ones before: the
//! answer is token for token the one decoding without a draft gives, and a step yields one to
//! `1 + num_speculative_tokens` tokens for about the cost of one (a decode step is bound by
//! reading the weights, not by the tokens it runs). Code edits, summaries that quote and
//! extraction answer mostly with text already in the prompt.
//!
//! Drafts run while one sequence runs (in a key/value buffer of one row): ONNX Runtime's
//! `GroupQueryAttention` takes several new tokens after a cached past for a batch of one only,
//! and that is where they pay — a batch of many rows already gets many tokens out of each
//! reading of the weights.
//!
//! Configured as vLLM's `--speculative-config`, in the decoder's `config.pbtxt`:
//! `parameters { key: "speculative_config" value { string_value:
//! "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}" } }`.

use serde::Deserialize;

use crate::error::{Error, Result};

/// vLLM's `speculative_config` for the `ngram` method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramConfig {
    /// Draft tokens proposed per step at most (`num_speculative_tokens`).
    pub tokens: usize,
    /// The longest n-gram looked up (`prompt_lookup_max`).
    pub lookup_max: usize,
    /// The shortest n-gram looked up (`prompt_lookup_min`).
    pub lookup_min: usize,
}

/// The JSON as vLLM takes it; unknown fields are refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    method: Option<String>,
    /// vLLM's older spelling of the method: `"model": "[ngram]"`.
    model: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
}

/// The most draft tokens a step takes: more costs a long run for drafts that rarely all hold.
const MAX_DRAFT_TOKENS: usize = 16;

impl NgramConfig {
    /// Reads vLLM's `speculative_config` JSON (parameter of model `model`): the `ngram` method,
    /// `num_speculative_tokens` (required), `prompt_lookup_max` / `prompt_lookup_min` (5 and 5
    /// when both are absent, either one from the other when one is, as vLLM does).
    pub fn parse(model: &str, json: &str) -> Result<Self> {
        let invalid = |why: String| {
            Error::invalid(format!(
                "model '{model}': parameter 'speculative_config': {why}"
            ))
        };
        let raw: Raw = serde_json::from_str(json).map_err(|e| invalid(e.to_string()))?;
        let method = raw.method.or(raw.model).unwrap_or_default();
        if !matches!(method.as_str(), "ngram" | "[ngram]") {
            return Err(invalid(format!(
                "method \"{method}\" is not one this server runs (\"ngram\": prompt lookup)"
            )));
        }
        let tokens = raw
            .num_speculative_tokens
            .ok_or_else(|| invalid("num_speculative_tokens is required".into()))?;
        if tokens == 0 || tokens > MAX_DRAFT_TOKENS {
            return Err(invalid(format!(
                "num_speculative_tokens is {tokens}; it must be 1 to {MAX_DRAFT_TOKENS}"
            )));
        }
        let (lookup_min, lookup_max) = match (raw.prompt_lookup_min, raw.prompt_lookup_max) {
            (None, None) => (5, 5),
            (Some(min), None) => (min, min),
            (None, Some(max)) => (max, max),
            (Some(min), Some(max)) => (min, max),
        };
        if lookup_min < 1 {
            return Err(invalid(format!(
                "prompt_lookup_min is {lookup_min}; it must be at least 1"
            )));
        }
        if lookup_max < lookup_min {
            return Err(invalid(format!(
                "prompt_lookup_max ({lookup_max}) is below prompt_lookup_min ({lookup_min})"
            )));
        }
        Ok(Self {
            tokens,
            lookup_max,
            lookup_min,
        })
    }

    /// The draft for a sequence whose tokens so far are `context` (prompt, answer, and the
    /// token about to be run), at most `limit` tokens: what followed the most recent earlier
    /// occurrence of the longest n-gram (`lookup_max` down to `lookup_min` tokens) that ends
    /// the context. Empty when there is none.
    pub fn propose(&self, context: &[i64], limit: usize) -> Vec<i64> {
        let limit = limit.min(self.tokens);
        let len = context.len();
        if limit == 0 {
            return Vec::new();
        }
        for n in (self.lookup_min..=self.lookup_max.min(len.saturating_sub(1))).rev() {
            let tail = &context[len - n..];
            // The latest start before the tail itself: the nearest text is the likeliest to
            // go on the same way.
            let found = (0..len - n).rev().find(|&i| &context[i..i + n] == tail);
            if let Some(start) = found {
                let from = start + n;
                let to = (from + limit).min(len);
                return context[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tokens: usize, min: usize, max: usize) -> NgramConfig {
        NgramConfig {
            tokens,
            lookup_max: max,
            lookup_min: min,
        }
    }

    #[test]
    fn a_repeated_ngram_proposes_what_followed_it() {
        let c = config(3, 2, 3);
        // ... 1 2 3 4 5 6 ... 2 3 -> 4 5 6
        assert_eq!(
            c.propose(&[9, 1, 2, 3, 4, 5, 6, 7, 2, 3], 10),
            vec![4, 5, 6]
        );
        // Capped by the limit (the tokens a sequence may still generate).
        assert_eq!(c.propose(&[9, 1, 2, 3, 4, 5, 6, 7, 2, 3], 1), vec![4]);
        // Nothing repeats: no draft.
        assert!(c.propose(&[1, 2, 3, 4, 5], 10).is_empty());
        // A match near the end proposes only the tokens there are.
        assert_eq!(c.propose(&[5, 6, 7, 5, 6], 10), vec![7, 5, 6]);
    }

    #[test]
    fn the_longest_ngram_and_its_latest_occurrence_win() {
        let c = config(2, 1, 3);
        // "3" alone last occurred before 8; "2 3" before 4: the longer match wins.
        let ctx = [1, 2, 3, 4, 0, 3, 8, 2, 3];
        assert_eq!(c.propose(&ctx, 10), vec![4, 0]);
        // Two occurrences of "1 2": the later one's continuation.
        let c = config(1, 2, 2);
        assert_eq!(c.propose(&[1, 2, 5, 1, 2, 6, 1, 2], 10), vec![6]);
        // Shorter than lookup_min: nothing.
        let c = config(3, 3, 3);
        assert!(c.propose(&[1, 2, 1, 2], 10).is_empty());
    }

    #[test]
    fn vllm_json_is_read_and_checked() {
        let c = NgramConfig::parse(
            "m",
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}"#,
        )
        .unwrap();
        assert_eq!(c, config(4, 3, 3));
        let c =
            NgramConfig::parse("m", r#"{"method": "ngram", "num_speculative_tokens": 2}"#).unwrap();
        assert_eq!(c, config(2, 5, 5));
        let c = NgramConfig::parse(
            "m",
            r#"{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}"#,
        )
        .unwrap();
        assert_eq!(c, config(2, 1, 4));
        for (json, says) in [
            (
                r#"{"method": "eagle", "num_speculative_tokens": 2}"#,
                "eagle",
            ),
            (r#"{"method": "ngram"}"#, "num_speculative_tokens"),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}"#,
                "draft_tp",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#,
                "prompt_lookup_max",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 0}"#,
                "num_speculative_tokens",
            ),
        ] {
            let e = NgramConfig::parse("m", json).unwrap_err();
            assert!(e.message.contains(says), "{json}: {}", e.message);
            assert!(e.message.contains("speculative_config"), "{}", e.message);
        }
    }
}
