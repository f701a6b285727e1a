//! The generation loop: one thread per model owns the decoder session and the running batch.
//!
//! In-flight (continuous) batching: between two decode steps, waiting requests that fit the
//! cache budget join (their prompts prefilled together in one run, left-padded), and
//! sequences that finished or whose client left are dropped, so a short request started after
//! a long one finishes first. Each decode step runs every sequence of the batch one token
//! further in one ONNX Runtime run.
//!
//! The rows are shared among *parties* (a tenant, or one client request when there are no
//! tenants): while a party waits, no other party keeps more than its fair share of the rows
//! (the rows divided by the parties' weights). A party over its share that holds a row a
//! waiting party needs is preempted: its newest sequence leaves the batch, keeping what it
//! generated, and comes back later by prefilling its prompt and tokens again (vLLM's
//! recompute preemption). One request of many sequences, or one tenant's flood, thus cannot
//! hold the batch while others wait.

use std::{
    collections::VecDeque,
    sync::{atomic::Ordering::Relaxed, mpsc, Arc},
    time::Instant,
};

use ort::session::Session;

mod admission;
mod decode;
mod prefill;

use super::{
    guided::Guide,
    kv::{
        buffer::CacheNames,
        prefix::{self as prefix_cache, Hit, PrefixCache},
        CacheShape, Joining, KvStore, Part, Prefilled, Seq,
    },
    lora::{Adapter, Signature, Stacks},
    sampling::{self, PromptLogProbs, Sampler, SamplingParams},
    speculation::NgramConfig,
    stats::GenerationStats,
    stop::StopStrings,
    token_rules::TokenRules,
};
use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
};

/// The decoder's signature, read from the model file.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    /// Decoder layers (pairs of `past_key_values.{i}.key|value`).
    pub layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Whether the model takes `position_ids`.
    pub position_ids: bool,
    /// Whether past and present share one preallocated buffer (ONNX Runtime GenAI's
    /// `past_present_share_buffer` layout) instead of the present growing by a column.
    pub shared_buffer: bool,
    /// Whether the cache is FP16 (else FP32).
    pub half: bool,
    /// Whether the decoder takes `all_logits` (every position's logits on request).
    pub all_logits: bool,
    /// Whether a prefill can answer every position's logits (on request, or always as
    /// Optimum's exports do): what scoring a prompt needs.
    pub prompt_logits: bool,
    /// The logits' width, when the decoder's signature fixes it.
    pub vocab: Option<usize>,
}

/// Limits of the running batch.
#[derive(Debug, Clone)]
pub struct EngineLimits {
    /// Sequences in the batch at most.
    pub max_rows: usize,
    /// Tokens the cache may hold: rows x longest sequence (prompt plus its token limit).
    pub cache_tokens: usize,
    /// Token that pads prompts (never attended to).
    pub pad_id: i64,
    /// Prompt tokens prefilled between two decode steps at most (one prompt always goes):
    /// a burst of arrivals is prefilled a few at a time, so that the first of them answer
    /// early and the running sequences keep stepping.
    pub max_prefill_tokens: usize,
    /// Tokens of recent prompts kept for prefix caching (0: none).
    pub prefix_cache_tokens: usize,
    /// Where the prefix cache's changes are told as vLLM's KV-cache events, if anywhere.
    pub kv_events: Option<crate::runtime::generation::kv::events::KvEvents>,
    /// N-gram speculative decoding, if configured.
    pub speculation: Option<NgramConfig>,
    /// The decoder's adapter inputs, when it takes LoRA adapters.
    pub lora: Option<Signature>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end token or a stop string.
    Stop,
    /// Its token limit or the context.
    Length,
}

impl Finish {
    /// The name OpenAI's and vLLM's APIs use.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine sends a request's caller: new tokens, and with the last of them why it
/// finished.
#[derive(Debug)]
pub struct Step {
    /// Tokens generated since the previous step (none when it ends on an end token).
    pub tokens: Vec<u32>,
    /// Set on the last step.
    pub finish: Option<Finish>,
    /// The natural-log probability of each of `tokens`, when the request asked for them.
    pub log_probs: Vec<f32>,
    /// For each of `tokens`, the likeliest tokens at its step with their log-probabilities,
    /// when the request asked for them.
    pub top: Vec<Vec<(u32, f32)>>,
    /// On the first step, when the request asked: how likely the model found each prompt
    /// token.
    pub prompt: Option<PromptLogProbs>,
}

/// Who a sequence runs for, as the engine shares its rows: a tenant, or one client request.
#[derive(Debug, Clone, PartialEq)]
pub struct Party {
    /// The tenant's name, or an id of the client request.
    pub key: String,
    /// Its share relative to the others' (a tenant's weight; 1 otherwise).
    pub weight: f64,
}

/// A request handed to the engine.
pub struct Submission {
    /// Whom it runs for.
    pub party: Party,
    /// Prompt tokens.
    pub prompt: Vec<i64>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence (not emitted).
    pub end_ids: Vec<i64>,
    /// Text that ends the sequence, if asked for.
    pub stop: Option<StopStrings>,
    /// Which tokens may come (banned words, a least length).
    pub rules: TokenRules,
    /// The grammar the text must follow, its first mask ready.
    pub guide: Option<Guide>,
    /// Whose cached prefixes the prompt may reuse (and where its own cache is kept).
    pub namespace: String,
    /// The LoRA adapter it runs with, if any.
    pub adapter: Option<Arc<Adapter>>,
    /// Whether each step carries its tokens' log-probabilities.
    pub log_probs: bool,
    /// How many likeliest alternatives each step reports per token (0: none).
    pub top_log_probs: usize,
    /// Whether the first step carries the prompt's log-probabilities (the prompt is then
    /// prefilled whole, alone, without the prefix cache).
    pub prompt_log_probs: bool,
    /// Where the steps go; a closed receiver cancels the sequence.
    pub steps: mpsc::Sender<Result<Step>>,
    /// Cancelled when nobody waits for the sequence any more (its client went away, its
    /// instance gave up on it).
    pub cancel: Cancellation,
    /// When the request arrived (for time to first token).
    pub arrived: Instant,
    /// Past this, a request still waiting for room in the cache is refused (the request's
    /// `timeout` parameter, as queue policies read it).
    pub deadline: Option<Instant>,
}

impl Submission {
    fn final_len(&self) -> usize {
        self.prompt.len() + self.max_tokens
    }
}

/// A sequence of the running batch.
struct Row {
    sub: Submission,
    /// Its row in the decoder's batch (the cache's slot).
    slot: usize,
    sampler: Sampler,
    generated: Vec<i64>,
    /// Tokens in the cache.
    len: usize,
    /// The last sampled token, not yet in the cache.
    next: i64,
    last_token_at: Instant,
    /// Log-probabilities (and alternatives) of the tokens sampled and not yet answered (held
    /// for a stop string).
    pending_log_probs: VecDeque<(f32, Vec<(u32, f32)>)>,
    /// The prompt's log-probabilities, until the first step carries them.
    prompt_log_probs: Option<PromptLogProbs>,
    /// N-gram drafts in a row of which greedy decoding took no token, and the steps to wait
    /// before the next draft (doubling with each such draft, up to 8): text that does not
    /// quote its context is not slowed by drafts that keep failing.
    draft_misses: u32,
    draft_wait: u32,
}

impl Row {
    fn seq(&self) -> Seq {
        Seq {
            slot: self.slot,
            len: self.len,
            final_len: self.sub.final_len(),
        }
    }
}

/// Samples a row's next token from its logits (masked by its guide, if it has one) and moves
/// the guide past it. A panic while doing so fails this row alone.
fn sample(row: &mut Row, logits: &mut [f32]) -> Result<u32> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sample_unguarded(row, logits)
    }))
    .unwrap_or_else(|_| Err(Error::internal("sampling the next token failed")))
}

fn sample_unguarded(row: &mut Row, logits: &mut [f32]) -> Result<u32> {
    if let Some(guide) = &mut row.sub.guide {
        // The token budget left after this one: a JSON guide steers to close within it.
        let remaining = row.sub.max_tokens.saturating_sub(row.generated.len() + 1);
        guide.apply_within(logits, remaining)?;
    }
    let token = row.sampler.sample(logits, &row.sub.prompt, &row.generated);
    if let Some(guide) = &mut row.sub.guide {
        guide.advance(token)?;
    }
    Ok(token)
}

/// Whether two prompts begin with enough of the same tokens, in the same namespace, for one
/// to reuse the other's cache.
fn shares_prefix(a: &Submission, b: &Submission) -> bool {
    let common = a
        .prompt
        .iter()
        .zip(&b.prompt)
        .take_while(|(x, y)| x == y)
        .count();
    a.namespace == b.namespace
        && common >= prefix_cache::MIN_PREFIX_TOKENS
        && b.prompt.len() > prefix_cache::MIN_PREFIX_TOKENS
}

/// The sending side of the engine, shared by the model's instances.
pub struct Engine {
    submit: std::sync::Mutex<mpsc::Sender<Submission>>,
    /// Its counters.
    pub stats: Arc<GenerationStats>,
}

impl Engine {
    /// Starts the engine thread for `session`. It ends when the engine is dropped and its
    /// last sequence finished.
    pub fn start(
        model: &str,
        session: Session,
        spec: DecoderSpec,
        limits: EngineLimits,
        stats: Arc<GenerationStats>,
    ) -> Result<Self> {
        let (submit, submissions) = mpsc::channel();
        let mut prefixes = PrefixCache::new(limits.prefix_cache_tokens);
        if let Some(events) = &limits.kv_events {
            prefixes = prefixes.with_block_events(events.block_size);
            *stats.lock_kv_blocks() = prefixes.blocks();
        }
        let names = CacheNames {
            inputs: (0..spec.layers)
                .flat_map(|i| {
                    [
                        format!("past_key_values.{i}.key"),
                        format!("past_key_values.{i}.value"),
                    ]
                })
                .collect(),
            outputs: (0..spec.layers)
                .flat_map(|i| [format!("present.{i}.key"), format!("present.{i}.value")])
                .collect(),
        };
        let shape = CacheShape {
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            position_ids: spec.position_ids,
            all_logits: spec.all_logits,
            half: spec.half,
            vocab: spec.vocab,
            max_rows: limits.max_rows,
        };
        let mut worker = Worker {
            stacks: limits.lora.clone().map(Stacks::new),
            prefixes,
            store: KvStore::new(spec.shared_buffer, shape, names),
            session,
            limits,
            stats: stats.clone(),
            rows: Vec::new(),
            waiting: VecDeque::new(),
            shrink_next: false,
            preempted: VecDeque::new(),
        };
        std::thread::Builder::new()
            .name(format!("{model}-generate"))
            .spawn(move || worker.run(submissions))
            .map_err(|e| {
                Error::internal(format!(
                    "cannot start the generation loop of '{model}': {e}"
                ))
            })?;
        Ok(Self {
            submit: std::sync::Mutex::new(submit),
            stats,
        })
    }

    /// Hands a request to the loop.
    pub fn submit(&self, submission: Submission) -> Result<()> {
        self.submit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send(submission)
            .map_err(|_| Error::unavailable("the generation loop has stopped"))
    }
}

struct Worker {
    session: Session,
    limits: EngineLimits,
    stats: Arc<GenerationStats>,
    rows: Vec<Row>,
    /// The running rows' keys and values.
    store: KvStore,
    waiting: VecDeque<Submission>,
    /// Whether the next decode step gives ONNX Runtime's free arena memory back: a prompt was
    /// just scored whole (its every-position logits and activations must not stay cached).
    shrink_next: bool,
    /// Sequences taken out of the batch for a party below its share, oldest first: they keep
    /// what they generated and rejoin by prefilling it again.
    preempted: VecDeque<Row>,
    /// Recent prompts' caches.
    prefixes: PrefixCache,
    /// The adapter inputs bound, for a decoder that takes adapters.
    stacks: Option<Stacks>,
}

fn run_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("the decoder failed: {e}"))
}

impl Worker {
    /// The loop: one [`Worker::step`] after another until the engine is dropped. A panic in
    /// a step (a fault of ours) fails the sequences of the batch, never the engine: the model
    /// keeps serving.
    fn run(&mut self, submissions: mpsc::Receiver<Submission>) {
        loop {
            let step =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step(&submissions)));
            match step {
                Ok(true) => {}
                Ok(false) => {
                    // The model goes: so do its blocks.
                    self.prefixes.clear();
                    self.publish_kv_events();
                    return;
                }
                Err(_) => {
                    let e = Error::internal("the generation loop failed on this batch");
                    tracing::error!("{}", e.message);
                    for row in self.rows.drain(..).chain(self.preempted.drain(..)) {
                        let _ = row.sub.steps.send(Err(e.clone()));
                    }
                    self.store.clear();
                }
            }
        }
    }

    /// Tells the prefix cache's changes since the last call (KV-cache events), and keeps
    /// the blocks it holds for the model's statistics.
    fn publish_kv_events(&mut self) {
        let Some(sink) = self.limits.kv_events.as_ref().map(|e| e.sink.clone()) else {
            return;
        };
        let events = self.prefixes.take_events();
        if events.is_empty() {
            return;
        }
        *self.stats.lock_kv_blocks() = self.prefixes.blocks();
        sink(crate::runtime::generation::kv::events::KvEventBatch::now(
            events,
        ));
    }

    /// Takes what arrived, admits what fits, prefills it and runs one decode step; false once
    /// the engine is dropped.
    fn step(&mut self, submissions: &mpsc::Receiver<Submission>) -> bool {
        {
            if self.rows.is_empty() && self.waiting.is_empty() && self.preempted.is_empty() {
                match submissions.recv() {
                    Ok(s) => self.waiting.push_back(s),
                    Err(_) => return false,
                }
            } else if self.rows.is_empty() {
                // Only requests that do not fit yet (a cache budget below one of them cannot
                // happen: load refuses it): look again for deadlines and cancellations.
                match submissions.recv_timeout(std::time::Duration::from_millis(10)) {
                    Ok(s) => self.waiting.push_back(s),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return false,
                }
            }
            while let Ok(s) = submissions.try_recv() {
                self.waiting.push_back(s);
            }
            let now = Instant::now();
            self.waiting.retain(|s| {
                let gone = s.cancel.is_cancelled();
                if gone {
                    self.stats.finished_cancelled.fetch_add(1, Relaxed);
                    return false;
                }
                if s.deadline.is_some_and(|d| now >= d) {
                    let _ = s.steps.send(Err(Error::unavailable(format!(
                        "the request timed out waiting for room in the key/value cache after {} ms \
                         (kv_cache_max_tokens is {} tokens; its timeout parameter)",
                        now.duration_since(s.arrived).as_millis(),
                        self.limits.cache_tokens
                    ))));
                    return false;
                }
                true
            });
            let (admitted, resumed) = self.admit();
            self.stats
                .waiting
                .store((self.waiting.len() + self.preempted.len()) as i64, Relaxed);
            if !resumed.is_empty() {
                if let Err(e) = self.resume(resumed) {
                    tracing::error!("{e}");
                }
            }
            if !admitted.is_empty() {
                if let Err(e) = self.prefill(admitted) {
                    tracing::error!("{e}");
                }
            }
            self.drop_cancelled();
            if !self.rows.is_empty() {
                if let Err(e) = self.decode() {
                    tracing::error!("{e}");
                    for row in self.rows.drain(..) {
                        let _ = row.sub.steps.send(Err(e.clone()));
                    }
                    self.store.clear();
                }
            }
            self.stats.running.store(self.rows.len() as i64, Relaxed);
            if self.stacks.is_some() {
                self.report_adapters();
            }
            self.stats
                .cache_used_tokens
                .store(self.store.held_tokens() as i64, Relaxed);
        }
        true
    }

    /// Tells which adapters the running and the waiting sequences use.
    fn report_adapters(&self) {
        fn names<'a>(adapters: impl Iterator<Item = &'a Option<Arc<Adapter>>>) -> String {
            let mut names: Vec<&str> = adapters.flatten().map(|a| a.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.join(",")
        }
        let running = names(self.rows.iter().map(|r| &r.sub.adapter));
        let waiting = names(
            self.waiting
                .iter()
                .map(|s| &s.adapter)
                .chain(self.preempted.iter().map(|r| &r.sub.adapter)),
        );
        self.stats.set_lora_use(running, waiting);
    }

    /// Keeps the rows marked in `keep`.
    fn retain(&mut self, keep: &[bool]) -> Result<()> {
        let kept: Vec<Row> = std::mem::take(&mut self.rows)
            .into_iter()
            .zip(keep)
            .filter_map(|(row, &k)| k.then_some(row))
            .collect();
        let seqs: Vec<Seq> = kept.iter().map(Row::seq).collect();
        self.rows = kept;
        let slots = self.store.retain(&self.session, &seqs)?;
        for (row, slot) in self.rows.iter_mut().zip(slots) {
            row.slot = slot;
        }
        Ok(())
    }

    /// Hands `token` to the row's caller, or ends the row; false when the row is done.
    fn emit(&self, row: &mut Row, token: u32) -> bool {
        let generated = row.generated.len() + 1;
        let token_id = i64::from(token);
        let guide_ends = row.sub.guide.as_ref().is_some_and(|g| g.ends_on(token));
        let (tokens, finish) = if row.sub.end_ids.contains(&token_id) || guide_ends {
            // Tokens held back for a stop string that never came are answered.
            let held = row
                .sub
                .stop
                .as_mut()
                .map_or_else(Vec::new, |s| s.flush(Vec::new()));
            (held, Some(Finish::Stop))
        } else {
            self.stats.generation_tokens.fetch_add(1, Relaxed);
            if row.sub.log_probs || row.sub.top_log_probs > 0 {
                let top = row.sampler.last_top().to_vec();
                row.pending_log_probs
                    .push_back((row.sampler.last_log_prob(), top));
            }
            let mut finish = (generated >= row.sub.max_tokens).then_some(Finish::Length);
            // A guided answer that is whole with its last token stopped, not was cut.
            if finish.is_some() && row.sub.guide.as_mut().is_some_and(|g| g.is_complete()) {
                finish = Some(Finish::Stop);
            }
            let mut tokens = vec![token];
            if let Some(stop) = &mut row.sub.stop {
                match stop.push(token) {
                    super::stop::Verdict::Go(ready) => tokens = ready,
                    super::stop::Verdict::Stop(ready) => {
                        tokens = ready;
                        finish = Some(Finish::Stop);
                    }
                }
                if finish == Some(Finish::Length) {
                    tokens = stop.flush(tokens);
                }
            }
            (tokens, finish)
        };
        match finish {
            Some(Finish::Stop) => self.stats.finished_stop.fetch_add(1, Relaxed),
            Some(Finish::Length) => self.stats.finished_length.fetch_add(1, Relaxed),
            None => 0,
        };
        row.next = token_id;
        let delivered = if tokens.is_empty() && finish.is_none() {
            true
        } else {
            let n = tokens.len().min(row.pending_log_probs.len());
            let (log_probs, top) = row.pending_log_probs.drain(..n).unzip();
            let step = Step {
                tokens,
                finish,
                log_probs,
                top,
                prompt: row.prompt_log_probs.take(),
            };
            row.sub.steps.send(Ok(step)).is_ok()
        };
        if !delivered {
            row.sub.cancel.cancel();
            self.stats.finished_cancelled.fetch_add(1, Relaxed);
        }
        delivered && finish.is_none()
    }
}
