//! Constrained ("guided") decoding: the text a request generates must match a JSON schema, a
//! regular expression or a Lark grammar. The grammar engine is `llguidance` (an Earley parser
//! walked over a trie of the vocabulary): before each token it answers which tokens may come
//! next, and the sampler only draws among those. The request names the guide as TensorRT-LLM's
//! backend does (`guided_decoding_guide_type`, `guided_decoding_guide`).
//!
//! Masks are computed off the decode step's critical path: a request's grammar is compiled and
//! its first mask computed on the request's own thread before it reaches the engine, and each
//! later mask on a helper thread while the decoder runs the step that needs it.

use std::sync::{Arc, OnceLock};

use llguidance::{
    api::{ParserLimits, TopLevelGrammar},
    toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie},
    Matcher, ParserFactory,
};

use super::stop::TokenBytes;
use crate::error::{Error, Result};

/// The guide types a request may name (TensorRT-LLM's, and `lark` for llguidance's own).
pub const GUIDE_TYPES: &[&str] = &["json", "json_schema", "regex", "lark"];

/// The longest guide a request may send (a schema or grammar), in bytes.
pub const MAX_GUIDE_BYTES: usize = 64 * 1024;

/// Builds guides over one model's vocabulary. The parser factory (the vocabulary's trie and
/// its precomputed slices) is built on first use, so models never asked for a guide pay
/// nothing at load.
pub struct Guides {
    text: Arc<TokenBytes>,
    vocab: usize,
    end_ids: Vec<u32>,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guides")
            .field("vocab", &self.vocab)
            .field("end_ids", &self.end_ids)
            .finish_non_exhaustive()
    }
}

impl Guides {
    /// Guides over `text` (what each token spells), `vocab` logits wide, ending on `end_ids`.
    pub fn new(text: Arc<TokenBytes>, vocab: usize, end_ids: &[i64]) -> Self {
        Self {
            text,
            vocab,
            end_ids: end_ids
                .iter()
                .filter_map(|&t| u32::try_from(t).ok())
                .collect(),
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        self.factory
            .get_or_init(|| {
                let eos = self.end_ids.first().copied().unwrap_or(0);
                let words: Vec<Vec<u8>> = (0..self.vocab as u32)
                    .map(|t| self.text.of(t).to_vec())
                    .collect();
                let trie = TokTrie::from(&TokRxInfo::new(self.vocab as u32, eos), &words)
                    .with_eos_tokens(&self.end_ids);
                let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("{e:#}"))?;
                factory.quiet();
                *factory.limits_mut() = ParserLimits {
                    // Errors name the grammar's fault, never the tokens generated so far.
                    verbose_errors: false,
                    ..ParserLimits::default()
                };
                Ok(factory)
            })
            .as_ref()
            .map_err(|e| Error::internal(format!("cannot build the grammar engine: {e}")))
    }

    /// Compiles a guide of `kind` (one of [`GUIDE_TYPES`]) and computes its first mask; a
    /// guide that does not compile is refused naming the input.
    pub fn compile(&self, kind: &str, guide: &str) -> Result<Guide> {
        let bad = |what: String| {
            Error::invalid(format!(
                "input 'guided_decoding_guide' ({kind}) is not valid: {what}"
            ))
        };
        if guide.len() > MAX_GUIDE_BYTES {
            return Err(bad(format!(
                "it is {} bytes, more than {MAX_GUIDE_BYTES}",
                guide.len()
            )));
        }
        let grammar = match kind {
            "json" => json_grammar(serde_json::json!({})),
            "json_schema" => {
                let schema: serde_json::Value =
                    serde_json::from_str(guide).map_err(|e| bad(format!("not JSON: {e}")))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(bad("a JSON schema is an object".into()));
                }
                json_grammar(schema)
            }
            "regex" => TopLevelGrammar::from_regex(guide),
            "lark" => TopLevelGrammar::from_lark(guide.to_owned()),
            other => {
                return Err(Error::invalid(format!(
                    "input 'guided_decoding_guide_type' is '{other}'; supported: {}",
                    GUIDE_TYPES.join(", ")
                )))
            }
        };
        let factory = self.factory()?;
        // The engine is third-party code fed request text: a panic in it fails this request.
        let matcher = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Matcher::new(factory.create_parser(grammar))
        }))
        .map_err(|_| bad("the grammar engine failed on it".into()))?;
        if let Some(e) = matcher.get_error() {
            return Err(bad(engine_message(&e)));
        }
        let mut guide = Guide {
            matcher,
            mask: None,
            end_ids: self.end_ids.clone(),
        };
        guide.prepare();
        match guide.mask {
            Some(Ok(_)) => Ok(guide),
            Some(Err(e)) => Err(bad(e.message)),
            None => Err(bad("no mask".into())),
        }
    }
}

/// The grammar engine's message for a client: the first lines, without the backtrace it adds
/// to the ones of a panic it caught, at most 500 characters.
fn engine_message(message: &str) -> String {
    let text = message
        .split("<backtrace>")
        .next()
        .unwrap_or_default()
        .trim();
    match text.char_indices().nth(500) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// A schema's grammar; JSON is written as Python's `json.dumps` writes it (", " and ": ", no
/// other whitespace) unless the schema's own `x-guidance` options say otherwise: a small
/// model given free whitespace may spend its tokens on it.
fn json_grammar(mut schema: serde_json::Value) -> TopLevelGrammar {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// One request's guide: its parser state and the mask for the next token.
pub struct Guide {
    matcher: Matcher,
    mask: Option<Result<SimpleVob>>,
    /// The model's end tokens: the only ones allowed once the guide is complete.
    end_ids: Vec<u32>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").finish_non_exhaustive()
    }
}

impl Guide {
    /// Computes the mask for the next token (the costly part), unless it is ready.
    pub fn prepare(&mut self) {
        if self.mask.is_some() {
            return;
        }
        let matcher = &mut self.matcher;
        let mask = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            matcher.compute_mask_or_eos()
        }));
        self.mask = Some(match mask {
            Ok(Ok(mask)) => Ok(mask),
            Ok(Err(e)) => Err(Error::invalid(format!(
                "guided decoding failed: {}",
                engine_message(&format!("{e:#}"))
            ))),
            Err(_) => Err(Error::internal(
                "guided decoding failed: the grammar engine panicked",
            )),
        });
    }

    /// Sets the logits of the tokens the guide does not allow next to -inf.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.prepare();
        match &self.mask {
            Some(Ok(mask)) => {
                // Tokens past the mask (logits wider than the vocabulary) are never allowed.
                let known = mask.len().min(logits.len());
                for (token, logit) in logits.iter_mut().enumerate() {
                    if token >= known || !mask.is_allowed(token as u32) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
                Ok(())
            }
            Some(Err(e)) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Whether `token` ends the text the guide allows (the model's end tokens, which a guide
    /// allows only where its grammar is complete).
    pub fn ends_on(&self, token: u32) -> bool {
        self.end_ids.contains(&token)
    }

    /// Moves the guide past `token`.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.mask = None;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| {
            Error::internal(format!(
                "guided decoding failed: {}",
                engine_message(&format!("{e:#}"))
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guides() -> Guides {
        let spellings = [
            "{", "}", "\"", "a", "b", ":", " ", ", ", "1", "2", "true", "false", "\"a\"", "<end>",
            "x", "[", "]", ": ",
        ];
        let mut text = TokenBytes::from_spellings(&spellings);
        text.clear(13);
        Guides::new(Arc::new(text), spellings.len(), &[13])
    }

    #[test]
    fn logits_wider_than_the_vocabulary_are_masked() {
        let g = guides();
        let mut guide = g.compile("regex", "(true|false)").unwrap();
        assert_eq!(allowed(&mut guide, 100), [10, 11]);
    }

    fn allowed(guide: &mut Guide, n: usize) -> Vec<usize> {
        let mut logits = vec![0.0; n];
        guide.apply(&mut logits).unwrap();
        (0..n).filter(|&i| logits[i].is_finite()).collect()
    }

    #[test]
    fn a_schema_allows_only_what_matches_it() {
        let g = guides();
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}"#;
        let mut guide = g.compile("json_schema", schema).unwrap();
        assert_eq!(allowed(&mut guide, 18), [0]);
        for token in [0, 12, 17] {
            guide.advance(token).unwrap();
        }
        // After {"a": only digits.
        assert_eq!(allowed(&mut guide, 18), [8, 9]);
        guide.advance(8).unwrap();
        assert!(allowed(&mut guide, 18).contains(&1));
        guide.advance(1).unwrap();
        // Complete: only the end token.
        assert_eq!(allowed(&mut guide, 18), [13]);
    }

    #[test]
    fn a_regex_guides_and_bad_guides_are_refused_naming_the_input() {
        let g = guides();
        let mut guide = g.compile("regex", "(true|false)").unwrap();
        assert_eq!(allowed(&mut guide, 18), [10, 11]);
        let e = g.compile("json_schema", "{not json").unwrap_err();
        assert!(e.message.contains("guided_decoding_guide"), "{}", e.message);
        let e = g.compile("ebnf_grammar", "root ::= x").unwrap_err();
        assert!(
            e.message.contains("guided_decoding_guide_type"),
            "{}",
            e.message
        );
        let e = g.compile("lark", "start: undefined_rule").unwrap_err();
        assert!(e.message.contains("lark"), "{}", e.message);
        // A panic the engine catches (an overflow on huge bounds) is a refusal without its
        // backtrace.
        let e = g
            .compile(
                "json_schema",
                r#"{"type":"integer","minimum":-1e300,"maximum":1e300}"#,
            )
            .map(|_| ())
            .err();
        if let Some(e) = e {
            assert!(!e.message.contains("backtrace"), "{}", e.message);
        }
    }
}
