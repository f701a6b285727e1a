//! Constrained ("guided") decoding: the text a request generates must match a JSON schema, a
//! regular expression or a Lark grammar. The grammar engine is `llguidance` (an Earley parser
//! walked over a trie of the vocabulary): before each token it answers which tokens may come
//! next, and the sampler only draws among those. The request names the guide as TensorRT-LLM's
//! backend does (`guided_decoding_guide_type`, `guided_decoding_guide`).
//!
//! Masks are computed off the decode step's critical path: a request's grammar is compiled and
//! its first mask computed before it reaches the engine, and each later mask on helper threads
//! while the decoder runs the step that needs it.
//!
//! A guide is the client's text fed to a recursive compiler, so it is bounded before it is
//! compiled: at most [`MAX_GUIDE_BYTES`], and at most [`MAX_GUIDE_RULES`] Lark rules or JSON
//! schema `$ref`s (what the compiler's recursion follows). It is then compiled on a thread of
//! its own whose stack ([`COMPILE_STACK_BYTES`]) holds many times what the deepest guide within
//! the bounds needs (about 32 MiB for a chain of 5,600 rules, measured in a debug build), at
//! most [`COMPILERS`] at once and within [`COMPILE_BUDGET`]; a guide over a bound is refused
//! naming the input. Only compilation recurses: stepping and dropping a compiled guide run in
//! a few hundred KiB of stack.

use std::{
    sync::{mpsc, Arc, Condvar, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use llguidance::{
    api::{ParserLimits, TopLevelGrammar},
    toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie},
    Matcher, ParserFactory,
};

use super::stop::TokenBytes;
use crate::error::{Error, Result};

pub mod steering;

/// The guide types a request may name (TensorRT-LLM's, and `lark` for llguidance's own).
pub const GUIDE_TYPES: &[&str] = &["json", "json_schema", "regex", "lark"];

pub use crate::limits::MAX_GUIDE_BYTES;

/// The most rules a Lark guide, or `$ref`s a JSON schema guide, may have: the compiler
/// recurses along chains of them.
pub const MAX_GUIDE_RULES: usize = 1000;

/// The stack of a thread that compiles a guide.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

/// Guides compiled at once, server-wide; a request waits for a turn within its budget.
pub const COMPILERS: usize = 2;

/// How long a guide may take to compile (its turn's wait included) before it is refused.
pub const COMPILE_BUDGET: Duration = Duration::from_secs(10);

/// Builds guides over one model's vocabulary. The parser factory (the vocabulary's trie and
/// its precomputed slices) is built on first use, so models never asked for a guide pay
/// nothing at load.
pub struct Guides {
    text: Arc<TokenBytes>,
    vocab: usize,
    end_ids: Vec<u32>,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
    /// What each token spells, classed for steering JSON answers to close.
    closing: OnceLock<Arc<steering::TokenClasses>>,
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
            closing: OnceLock::new(),
        }
    }

    fn token_classes(&self) -> Arc<steering::TokenClasses> {
        self.closing
            .get_or_init(|| {
                Arc::new(steering::TokenClasses::of(
                    (0..self.vocab as u32).map(|t| self.text.of(t)),
                ))
            })
            .clone()
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

    /// Compiles a guide of `kind` (one of [`GUIDE_TYPES`]) and computes its first mask, on a
    /// compiling thread within the bounds the module describes; a guide that does not compile
    /// or exceeds a bound is refused naming the input.
    pub fn compile(self: &Arc<Self>, kind: &str, guide: &str) -> Result<Guide> {
        if !GUIDE_TYPES.contains(&kind) {
            return Err(Error::invalid(format!(
                "input 'guided_decoding_guide_type' is '{kind}'; supported: {}",
                GUIDE_TYPES.join(", ")
            )));
        }
        let bad = |what: String| invalid_guide(kind, what);
        if guide.len() > MAX_GUIDE_BYTES {
            return Err(bad(format!(
                "it is {} bytes, more than {MAX_GUIDE_BYTES}",
                guide.len()
            )));
        }
        // For JSON guides: the tokens the shortest answer takes (steering starts that early).
        let mut shortest = 2;
        let grammar = match kind {
            "json" => json_grammar(steering::bounded_any_json()),
            "json_schema" => {
                let schema: serde_json::Value =
                    serde_json::from_str(guide).map_err(|e| bad(format!("not JSON: {e}")))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(bad("a JSON schema is an object".into()));
                }
                let refs = count_refs(&schema);
                if refs > MAX_GUIDE_RULES {
                    return Err(bad(format!(
                        "it has {refs} '$ref's, more than {MAX_GUIDE_RULES}"
                    )));
                }
                shortest = steering::shortest_answer_tokens(&schema);
                json_grammar(steering::bound_schema(schema))
            }
            "regex" => TopLevelGrammar::from_regex(guide),
            _ => {
                let rules = count_lark_rules(guide);
                if rules > MAX_GUIDE_RULES {
                    return Err(bad(format!(
                        "it has {rules} rules, more than {MAX_GUIDE_RULES}"
                    )));
                }
                // A grammar may embed JSON schemas (`%json { ... }`): their `$ref`s count too.
                let refs = guide.matches("\"$ref\"").count();
                if refs > MAX_GUIDE_RULES {
                    return Err(bad(format!(
                        "it has {refs} '$ref's, more than {MAX_GUIDE_RULES}"
                    )));
                }
                TopLevelGrammar::from_lark(guide.to_owned())
            }
        };
        let started = Instant::now();
        let Some(turn) = compilers().take(COMPILE_BUDGET) else {
            return Err(Error::unavailable(format!(
                "input 'guided_decoding_guide' ({kind}): the server is busy compiling other \
                 guides ({COMPILERS} at once); retry later"
            )));
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let this = self.clone();
        let owned_kind = kind.to_owned();
        std::thread::Builder::new()
            .name("guide-compile".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn(move || {
                // The turn is held until compiling ends, also past the budget: a slow guide
                // keeps its turn, so at most COMPILERS of them ever run.
                let _turn = turn;
                let _ = tx.send(this.compile_here(&owned_kind, grammar, shortest));
            })
            .map_err(|e| Error::internal(format!("cannot start compiling the guide: {e}")))?;
        let left = COMPILE_BUDGET.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(bad(format!(
                "compiling it took longer than {} s",
                COMPILE_BUDGET.as_secs()
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(bad("the grammar engine failed on it".into()))
            }
        }
    }

    /// Compiles `grammar` on this thread (one with a compiling thread's stack).
    fn compile_here(&self, kind: &str, grammar: TopLevelGrammar, shortest: usize) -> Result<Guide> {
        let bad = |what: String| invalid_guide(kind, what);
        let factory = self.factory()?;
        // The engine is third-party code fed request text: a panic in it fails this request.
        let matcher = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Matcher::new(factory.create_parser(grammar))
        }))
        .map_err(|_| bad("the grammar engine failed on it".into()))?;
        if let Some(e) = matcher.get_error() {
            return Err(bad(engine_message(&e)));
        }
        let steering = matches!(kind, "json" | "json_schema").then(|| Steering {
            classes: self.token_classes(),
            text: self.text.clone(),
            shape: Default::default(),
            shortest,
        });
        let mut guide = Guide {
            matcher,
            mask: None,
            end_ids: self.end_ids.clone(),
            steering,
        };
        guide.prepare();
        match guide.mask {
            Some(Ok(_)) => Ok(guide),
            Some(Err(e)) => Err(bad(e.message)),
            None => Err(bad("no mask".into())),
        }
    }
}

fn invalid_guide(kind: &str, what: String) -> Error {
    Error::invalid(format!(
        "input 'guided_decoding_guide' ({kind}) is not valid: {what}"
    ))
}

/// The turns to compile guides, server-wide.
fn compilers() -> &'static Turns {
    static TURNS: OnceLock<Turns> = OnceLock::new();
    TURNS.get_or_init(|| Turns {
        free: Mutex::new(COMPILERS),
        freed: Condvar::new(),
    })
}

/// A counting semaphore for threads (the compiling threads are not async).
struct Turns {
    free: Mutex<usize>,
    freed: Condvar,
}

/// A turn taken from [`Turns`]; dropping it gives it back.
struct Turn(&'static Turns);

impl Turns {
    /// Waits up to `wait` for a turn.
    fn take(&'static self, wait: Duration) -> Option<Turn> {
        let until = Instant::now() + wait;
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        while *free == 0 {
            let left = until.checked_duration_since(Instant::now())?;
            free = self
                .freed
                .wait_timeout(free, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *free -= 1;
        Some(Turn(self))
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.0.freed.notify_one();
    }
}

/// How many `$ref`s a schema holds (walked without recursion: the schema is client data).
fn count_refs(schema: &serde_json::Value) -> usize {
    let mut refs = 0;
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(map) => {
                refs += usize::from(map.contains_key("$ref"));
                stack.extend(map.values());
            }
            serde_json::Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    refs
}

/// How many rules and terminals a Lark grammar defines: lines that start with a name (after
/// `?` or `!`, with an optional `.priority`) and a colon.
fn count_lark_rules(grammar: &str) -> usize {
    grammar
        .lines()
        .filter(|line| {
            let line = line.trim_start().trim_start_matches(['?', '!']);
            let name = line
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(line.len());
            if name == 0 || line.as_bytes()[0].is_ascii_digit() {
                return false;
            }
            let rest = line[name..].trim_start();
            let rest = match rest.strip_prefix('.') {
                Some(p) => p.trim_start_matches(|c: char| c.is_ascii_digit() || c == '-'),
                None => rest,
            };
            rest.trim_start().starts_with(':')
        })
        .count()
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
    /// For JSON guides: what steers the answer to close before the token budget ends.
    steering: Option<Steering>,
}

/// A JSON guide's steering: the vocabulary's classes, what tokens spell, and where the
/// answer is.
struct Steering {
    classes: Arc<steering::TokenClasses>,
    text: Arc<TokenBytes>,
    shape: steering::JsonShape,
    /// Tokens the shortest answer the schema allows takes.
    shortest: usize,
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

    /// [`apply`](Self::apply), then, for a JSON guide with `remaining` tokens left of its
    /// budget, only the allowed tokens that close the answer soonest once that is about what
    /// closing takes (see [`steering`]).
    pub fn apply_within(&mut self, logits: &mut [f32], remaining: usize) -> Result<()> {
        self.apply(logits)?;
        if let Some(s) = &self.steering {
            steering::steer(&s.classes, &s.shape, s.shortest, remaining, logits);
        }
        Ok(())
    }

    /// Whether the text so far is a whole JSON answer nothing may extend: its object or
    /// array is closed and the grammar accepts it (the answer is complete even when the budget
    /// leaves no room for the end token).
    pub fn is_complete(&mut self) -> bool {
        self.steering.as_ref().is_some_and(|s| s.shape.closed())
            && self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether `token` ends the text the guide allows (the model's end tokens, which a guide
    /// allows only where its grammar is complete).
    pub fn ends_on(&self, token: u32) -> bool {
        self.end_ids.contains(&token)
    }

    /// Moves the guide past `token`.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.mask = None;
        if let Some(s) = &mut self.steering {
            s.shape.advance(s.text.of(token));
        }
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

    fn guides() -> Arc<Guides> {
        let spellings = [
            "{", "}", "\"", "a", "b", ":", " ", ", ", "1", "2", "true", "false", "\"a\"", "<end>",
            "x", "[", "]", ": ",
        ];
        let mut text = TokenBytes::from_spellings(&spellings);
        text.clear(13);
        Arc::new(Guides::new(Arc::new(text), spellings.len(), &[13]))
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

    /// A chain of `n` Lark rules, each calling the next.
    fn lark_chain(n: usize) -> String {
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g.push_str(&format!("r{i}: \"a\" r{} | \"b\"\n", i + 1));
        }
        g + &format!("r{n}: \"x\"\n")
    }

    /// A schema whose `$ref`s chain through `n` definitions.
    fn ref_chain(n: usize) -> String {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let next = format!("#/$defs/{}", i + 1);
            defs.insert(
                i.to_string(),
                serde_json::json!({"properties": {"a": {"$ref": next}}}),
            );
        }
        defs.insert(n.to_string(), serde_json::json!({"type": "integer"}));
        serde_json::json!({"$defs": defs, "$ref": "#/$defs/0"}).to_string()
    }

    #[test]
    fn recursive_guides_are_bounded_then_compiled_on_a_deep_stack() {
        let g = guides();
        // At the bound: compiled (on this test thread's small stack it would overflow).
        let chain = lark_chain(MAX_GUIDE_RULES - 2);
        assert_eq!(count_lark_rules(&chain), MAX_GUIDE_RULES);
        g.compile("lark", &chain).unwrap();
        let e = g.compile("lark", &lark_chain(MAX_GUIDE_RULES)).unwrap_err();
        assert!(
            e.message.contains("guided_decoding_guide")
                && e.message.contains("1002 rules, more than 1000"),
            "{}",
            e.message
        );
        let schema = ref_chain(MAX_GUIDE_RULES - 1);
        assert!(schema.len() < MAX_GUIDE_BYTES);
        g.compile("json_schema", &schema).unwrap();
        let e = g
            .compile("json_schema", &ref_chain(MAX_GUIDE_RULES + 1))
            .unwrap_err();
        assert!(
            e.message.contains("1002 '$ref's, more than 1000"),
            "{}",
            e.message
        );
    }

    #[test]
    fn schemas_embedded_in_a_lark_grammar_are_bounded_too() {
        let g = guides();
        let chain = ref_chain(MAX_GUIDE_RULES + 1);
        let grammar = format!("start: %json {chain}\n");
        let e = g.compile("lark", &grammar).unwrap_err();
        assert!(
            e.message.contains("'$ref's, more than 1000"),
            "{}",
            e.message
        );
    }

    #[test]
    fn bounded_schemas_compile_quickly() {
        let g = guides();
        let started = Instant::now();
        let open = r#"{"type": "object", "properties": {"x": {"type": "number"},
            "n": {"type": "integer"}, "s": {"type": "string"},
            "l": {"type": "array", "items": {"type": ["number", "null"]}}}}"#;
        g.compile("json_schema", open).unwrap();
        g.compile("json", "").unwrap();
        let object = steering::bounded_json_object().to_string();
        g.compile("json_schema", &object).unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn lark_rules_are_counted_by_their_definitions() {
        let grammar = "?start: item+\n!item.2: NAME \":\" VALUE\n  | \"x\"\n\
                       NAME: /[a-z]+/\n%import common.WS\n// a: comment\n";
        assert_eq!(count_lark_rules(grammar), 3);
    }
}
