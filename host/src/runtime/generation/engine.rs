//! The generation loop: one thread per model owns the decoder session and the running batch.
//!
//! In-flight (continuous) batching: between two decode steps, waiting requests that fit the
//! cache budget join (their prompts prefilled together in one run, left-padded), and
//! sequences that finished or whose client left are dropped, so a short request started after
//! a long one finishes first. Each decode step runs every sequence of the batch one token
//! further in one ONNX Runtime run.

use std::{
    borrow::Cow,
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        mpsc, Arc,
    },
    time::Instant,
};

use ort::{
    session::{Session, SessionInputValue},
    value::{DynValue, Tensor as OrtTensor},
};

use super::{
    guided::Guide,
    kv_cache::{self, RowSource, Source},
    prefix_cache::{self, Hit, PrefixCache},
    sampling::{Sampler, SamplingParams},
    stats::GenerationStats,
    stop::StopStrings,
    token_rules::TokenRules,
};
use crate::error::{Error, Result};

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
}

/// A request handed to the engine.
pub struct Submission {
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
    /// Whether each step carries its tokens' log-probabilities.
    pub log_probs: bool,
    /// How many likeliest alternatives each step reports per token (0: none).
    pub top_log_probs: usize,
    /// Where the steps go; a closed receiver cancels the sequence.
    pub steps: mpsc::Sender<Result<Step>>,
    /// Set by the caller when its client went away.
    pub cancelled: Arc<AtomicBool>,
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
}

/// Samples a row's next token from its logits (masked by its guide, if it has one) and moves
/// the guide past it.
fn sample(row: &mut Row, logits: &mut [f32]) -> Result<u32> {
    if let Some(guide) = &mut row.sub.guide {
        guide.apply(logits)?;
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
        let prefixes = PrefixCache::new(limits.prefix_cache_tokens);
        let mut worker = Worker {
            prefixes,
            input_names: (0..spec.layers)
                .flat_map(|i| {
                    [
                        format!("past_key_values.{i}.key"),
                        format!("past_key_values.{i}.value"),
                    ]
                })
                .collect(),
            output_names: (0..spec.layers)
                .flat_map(|i| [format!("present.{i}.key"), format!("present.{i}.value")])
                .collect(),
            session,
            spec,
            limits,
            stats: stats.clone(),
            rows: Vec::new(),
            cache: Vec::new(),
            columns: 0,
            waiting: VecDeque::new(),
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
    spec: DecoderSpec,
    limits: EngineLimits,
    stats: Arc<GenerationStats>,
    input_names: Vec<String>,
    output_names: Vec<String>,
    rows: Vec<Row>,
    /// `present.*` of the last run, in `input_names` order: [rows, kv_heads, columns, head_dim].
    cache: Vec<DynValue>,
    columns: usize,
    waiting: VecDeque<Submission>,
    /// Recent prompts' caches.
    prefixes: PrefixCache,
}

fn run_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("the decoder failed: {e}"))
}

impl Worker {
    fn run(&mut self, submissions: mpsc::Receiver<Submission>) {
        loop {
            if self.rows.is_empty() && self.waiting.is_empty() {
                match submissions.recv() {
                    Ok(s) => self.waiting.push_back(s),
                    Err(_) => return,
                }
            } else if self.rows.is_empty() {
                // Only requests that do not fit yet (a cache budget below one of them cannot
                // happen: load refuses it): look again for deadlines and cancellations.
                match submissions.recv_timeout(std::time::Duration::from_millis(10)) {
                    Ok(s) => self.waiting.push_back(s),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(s) = submissions.try_recv() {
                self.waiting.push_back(s);
            }
            let now = Instant::now();
            self.waiting.retain(|s| {
                let gone = s.cancelled.load(Relaxed);
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
            let admitted = self.admit();
            self.stats.waiting.store(self.waiting.len() as i64, Relaxed);
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
                    self.cache.clear();
                    self.columns = 0;
                }
            }
            self.stats.running.store(self.rows.len() as i64, Relaxed);
            self.stats
                .cache_used_tokens
                .store((self.rows.len() * self.columns) as i64, Relaxed);
        }
    }

    /// Takes waiting requests, oldest first, while the batch with them stays within the
    /// limits: rows, and rows x the longest final length within the cache budget.
    fn admit(&mut self) -> Vec<Submission> {
        let mut admitted: Vec<Submission> = Vec::new();
        let mut longest = self
            .rows
            .iter()
            .map(|r| r.sub.final_len())
            .max()
            .unwrap_or(0);
        let mut prefill = 0;
        while let Some(next) = self.waiting.front() {
            let rows = self.rows.len() + admitted.len() + 1;
            let longest_with = longest.max(next.final_len());
            if rows > self.limits.max_rows || rows * longest_with > self.limits.cache_tokens {
                break;
            }
            prefill += next.prompt.len();
            if !admitted.is_empty() && prefill > self.limits.max_prefill_tokens {
                break;
            }
            longest = longest_with;
            admitted.extend(self.waiting.pop_front());
        }
        admitted
    }

    fn drop_cancelled(&mut self) {
        let before = self.rows.len();
        let keep: Vec<bool> = self
            .rows
            .iter()
            .map(|r| !r.sub.cancelled.load(Relaxed))
            .collect();
        if keep.iter().all(|&k| k) {
            return;
        }
        self.stats.finished_cancelled.fetch_add(
            (before - keep.iter().filter(|&&k| k).count()) as u64,
            Relaxed,
        );
        if let Err(e) = self.retain(&keep) {
            tracing::error!("{e}");
        }
    }

    /// Prefills `new` and adds the sequences that go on to the batch. Prompts that share a
    /// cached prefix each run alone after it (their pasts differ); the others run together.
    fn prefill(&mut self, new: Vec<Submission>) -> Result<()> {
        let mut together: Vec<Submission> = Vec::new();
        let mut later = VecDeque::new();
        let mut groups: Vec<(Vec<Submission>, Option<Hit>)> = Vec::new();
        for s in new {
            if !self.prefixes.enabled() {
                together.push(s);
                continue;
            }
            self.stats
                .prefix_cache_queries
                .fetch_add(s.prompt.len() as u64, Relaxed);
            match self.prefixes.lookup(&s.namespace, &s.prompt) {
                Some(hit) => {
                    self.stats
                        .prefix_cache_hits
                        .fetch_add(hit.tokens as u64, Relaxed);
                    groups.push((vec![s], Some(hit)));
                }
                // A prompt sharing its beginning with one prefilled now (the choices of `n`,
                // a burst on one system prompt) runs after it, from its cache.
                None if together.iter().any(|t| shares_prefix(t, &s)) => later.push_back(s),
                None => together.push(s),
            }
        }
        if !together.is_empty() {
            groups.insert(0, (together, None));
        }
        let mut presents: Vec<(Vec<DynValue>, usize)> = Vec::new();
        let mut joining: Vec<RowSource> = Vec::new();
        let mut rows: Vec<Row> = Vec::new();
        let mut failed = None;
        let mut groups: VecDeque<_> = groups.into();
        while let Some((subs, hit)) = groups.pop_front().or_else(|| {
            let s = later.pop_front()?;
            let hit = self.prefixes.lookup(&s.namespace, &s.prompt);
            if let Some(h) = &hit {
                self.stats
                    .prefix_cache_hits
                    .fetch_add(h.tokens as u64, Relaxed);
            }
            Some((vec![s], hit))
        }) {
            match self.prefill_group(subs, hit.as_ref()) {
                Ok((joined, group_presents, columns)) => {
                    let tensor = presents.len() + 1;
                    for (row, r) in joined {
                        joining.push(RowSource {
                            tensor,
                            row,
                            len: r.len,
                        });
                        rows.push(r);
                    }
                    presents.push((group_presents, columns));
                }
                Err(e) => failed = Some(e),
            }
        }
        if !rows.is_empty() {
            // The batch: the running rows (from the cache) then the joining ones.
            let mut sources: Vec<RowSource> = self
                .rows
                .iter()
                .enumerate()
                .map(|(i, row)| RowSource {
                    tensor: 0,
                    row: i,
                    len: row.len,
                })
                .collect();
            sources.extend(joining);
            let columns = sources.iter().map(|s| s.len).max().unwrap_or(0);
            let others: Vec<(&[DynValue], usize)> =
                presents.iter().map(|(p, c)| (p.as_slice(), *c)).collect();
            self.cache = self.rebuild(&others, &sources, columns)?;
            self.columns = columns;
            self.rows.extend(rows);
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs the prompts of `new` in one decoder run (left-padded; after the cached prefix
    /// `hit` when there is one, for a single prompt), keeps their caches for later prompts,
    /// samples their first tokens. Returns the sequences that go on (with their rows in the
    /// run), the run's presents and their columns.
    #[allow(clippy::type_complexity)]
    fn prefill_group(
        &mut self,
        new: Vec<Submission>,
        hit: Option<&Hit>,
    ) -> Result<(Vec<(usize, Row)>, Vec<DynValue>, usize)> {
        let n = new.len();
        let past_len = hit.map_or(0, |h| h.tokens);
        let width = new
            .iter()
            .map(|s| s.prompt.len() - past_len)
            .max()
            .unwrap_or(0);
        let mut ids = vec![self.limits.pad_id; n * width];
        let mut positions = vec![0i64; n * width];
        let lens: Vec<usize> = new.iter().map(|s| s.prompt.len()).collect();
        for (r, s) in new.iter().enumerate() {
            let tail = &s.prompt[past_len..];
            let start = r * width + width - tail.len();
            ids[start..start + tail.len()].copy_from_slice(tail);
            for (j, p) in positions[start..start + tail.len()].iter_mut().enumerate() {
                *p = (past_len + j) as i64;
            }
        }
        let columns = past_len + width;
        let mask = kv_cache::mask(&lens, columns);
        let spec = &self.spec;
        let past: Vec<DynValue> = (0..self.input_names.len())
            .map(|i| {
                let data = match hit {
                    Some(h) => prefix_cache::leading(
                        &h.entry.tensors[i],
                        spec.kv_heads,
                        h.entry.len(),
                        spec.head_dim,
                        past_len,
                    ),
                    None => Vec::new(),
                };
                OrtTensor::<f32>::from_array(([n, spec.kv_heads, past_len, spec.head_dim], data))
                    .map(|t| t.into_dyn())
                    .map_err(run_error)
            })
            .collect::<Result<_>>()?;
        let result = self.run_decoder([n, width], ids, positions, mask, &past);
        drop(past);
        let (logits, presents) = match result {
            Ok(v) => v,
            Err(e) => {
                for s in new {
                    let _ = s.steps.send(Err(e.clone()));
                }
                return Err(e);
            }
        };
        self.stats
            .prompt_tokens
            .fetch_add((lens.iter().sum::<usize>() - n * past_len) as u64, Relaxed);
        self.keep_prefixes(&new, &presents, columns)?;
        let (shape, values) = logits.try_extract_tensor::<f32>().map_err(run_error)?;
        // Optimum's exports answer every position's logits; ours only the last position's.
        let positions = shape.get(1).map_or(1, |&p| p.max(1) as usize);
        let vocab = values.len() / (n * positions).max(1);
        let mut joining = Vec::new();
        for (r, mut sub) in new.into_iter().enumerate() {
            let at = (r * positions + positions - 1) * vocab;
            let mut row_logits = values[at..at + vocab].to_vec();
            let rules = std::mem::take(&mut sub.rules);
            let mut row = Row {
                sampler: Sampler::new(sub.sampling.clone())
                    .with_rules(rules)
                    .with_log_probs(sub.log_probs)
                    .with_top_log_probs(sub.top_log_probs),
                pending_log_probs: VecDeque::new(),
                len: sub.prompt.len(),
                next: 0,
                generated: Vec::new(),
                last_token_at: Instant::now(),
                sub,
            };
            let token = match sample(&mut row, &mut row_logits) {
                Ok(token) => token,
                Err(e) => {
                    let _ = row.sub.steps.send(Err(e));
                    continue;
                }
            };
            self.stats
                .time_to_first_token
                .observe(row.sub.arrived.elapsed());
            if self.emit(&mut row, token) {
                joining.push((r, row));
            }
        }
        Ok((joining, presents, columns))
    }

    /// Keeps the caches of the prompts just prefilled (rows of `presents`, right-aligned in
    /// `columns`) that the prefix cache wants.
    fn keep_prefixes(
        &mut self,
        new: &[Submission],
        presents: &[DynValue],
        columns: usize,
    ) -> Result<()> {
        let spec = &self.spec;
        for (r, s) in new.iter().enumerate() {
            if !self.prefixes.wants(&s.namespace, &s.prompt) {
                continue;
            }
            let tensors = presents
                .iter()
                .map(|p| {
                    let (_, data) = p.try_extract_tensor::<f32>().map_err(run_error)?;
                    Ok(prefix_cache::trailing(
                        data,
                        r,
                        spec.kv_heads,
                        columns,
                        spec.head_dim,
                        s.prompt.len(),
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            self.prefixes.insert(&s.namespace, &s.prompt, tensors);
        }
        self.stats
            .prefix_cache_tokens
            .store(self.prefixes.used_tokens() as i64, Relaxed);
        Ok(())
    }

    /// New cache tensors from the current cache (source 0) and `others` (sources 1.., each
    /// with its columns), rows as `rows` says.
    fn rebuild(
        &self,
        others: &[(&[DynValue], usize)],
        rows: &[RowSource],
        columns: usize,
    ) -> Result<Vec<DynValue>> {
        let spec = &self.spec;
        let mut out = Vec::with_capacity(self.input_names.len());
        for i in 0..self.input_names.len() {
            let mut sources = Vec::new();
            let tensors = std::iter::once((self.cache.get(i), self.columns))
                .chain(others.iter().map(|(t, c)| (t.get(i), *c)));
            for (tensor, cols) in tensors {
                let data = match tensor {
                    Some(t) => t.try_extract_tensor::<f32>().map_err(run_error)?.1,
                    None => &[],
                };
                sources.push(Source {
                    data,
                    columns: cols,
                });
            }
            let data = kv_cache::relayout(&sources, rows, spec.kv_heads, spec.head_dim, columns);
            let shape = [rows.len(), spec.kv_heads, columns, spec.head_dim];
            out.push(
                OrtTensor::<f32>::from_array((shape, data))
                    .map_err(run_error)?
                    .into_dyn(),
            );
        }
        Ok(out)
    }

    /// Keeps the rows marked in `keep`, dropping columns no kept row uses.
    fn retain(&mut self, keep: &[bool]) -> Result<()> {
        let mut kept_rows = Vec::new();
        let mut sources = Vec::new();
        for (i, (row, &k)) in std::mem::take(&mut self.rows)
            .into_iter()
            .zip(keep)
            .enumerate()
        {
            if k {
                sources.push(RowSource {
                    tensor: 0,
                    row: i,
                    len: row.len,
                });
                kept_rows.push(row);
            }
        }
        let columns = sources.iter().map(|s| s.len).max().unwrap_or(0);
        self.cache = if kept_rows.is_empty() {
            Vec::new()
        } else {
            self.rebuild(&[], &sources, columns)?
        };
        self.columns = columns;
        self.rows = kept_rows;
        Ok(())
    }

    /// One token further for every row.
    fn decode(&mut self) -> Result<()> {
        let b = self.rows.len();
        let ids: Vec<i64> = self.rows.iter().map(|r| r.next).collect();
        let positions: Vec<i64> = self.rows.iter().map(|r| r.len as i64).collect();
        let lens: Vec<usize> = self.rows.iter().map(|r| r.len + 1).collect();
        let mask = kv_cache::mask(&lens, self.columns + 1);
        let cache = std::mem::take(&mut self.cache);
        let mut rows = std::mem::take(&mut self.rows);
        let mut guides: Vec<&mut Guide> = rows
            .iter_mut()
            .filter_map(|r| r.sub.guide.as_mut())
            .collect();
        let result = if guides.is_empty() {
            self.run_decoder([b, 1], ids, positions, mask, &cache)
        } else {
            // The guides' next masks are computed while the decoder runs the step.
            std::thread::scope(|scope| {
                let helper = std::thread::Builder::new()
                    .name("guided-masks".into())
                    .spawn_scoped(scope, || guides.iter_mut().for_each(|g| g.prepare()));
                let result = self.run_decoder([b, 1], ids, positions, mask, &cache);
                if let Ok(helper) = helper {
                    let _ = helper.join();
                }
                result
            })
        };
        self.rows = rows;
        let (logits, presents) = result?;
        drop(cache);
        self.cache = presents;
        self.columns += 1;
        let (_, values) = logits.try_extract_tensor::<f32>().map_err(run_error)?;
        let vocab = values.len() / b.max(1);
        let mut keep = vec![true; b];
        let mut rows = std::mem::take(&mut self.rows);
        for (r, row) in rows.iter_mut().enumerate() {
            row.len += 1;
            row.generated.push(row.next);
            let mut row_logits = values[r * vocab..(r + 1) * vocab].to_vec();
            let token = match sample(row, &mut row_logits) {
                Ok(token) => token,
                Err(e) => {
                    let _ = row.sub.steps.send(Err(e));
                    keep[r] = false;
                    continue;
                }
            };
            self.stats
                .inter_token_latency
                .observe(row.last_token_at.elapsed());
            row.last_token_at = Instant::now();
            keep[r] = self.emit(row, token);
        }
        self.rows = rows;
        if keep.iter().any(|k| !k) {
            self.retain(&keep)?;
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
            };
            row.sub.steps.send(Ok(step)).is_ok()
        };
        if !delivered {
            row.sub.cancelled.store(true, Relaxed);
            self.stats.finished_cancelled.fetch_add(1, Relaxed);
        }
        delivered && finish.is_none()
    }

    /// One decoder run: (logits, presents in cache order).
    fn run_decoder(
        &mut self,
        shape: [usize; 2],
        ids: Vec<i64>,
        positions: Vec<i64>,
        mask: Vec<i64>,
        past: &[DynValue],
    ) -> Result<(DynValue, Vec<DynValue>)> {
        let mask_shape = [shape[0], mask.len() / shape[0].max(1)];
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> = vec![
            (
                "input_ids".into(),
                OrtTensor::from_array((shape, ids))
                    .map_err(run_error)?
                    .into(),
            ),
            (
                "attention_mask".into(),
                OrtTensor::from_array((mask_shape, mask))
                    .map_err(run_error)?
                    .into(),
            ),
        ];
        if self.spec.position_ids {
            inputs.push((
                "position_ids".into(),
                OrtTensor::from_array((shape, positions))
                    .map_err(run_error)?
                    .into(),
            ));
        }
        for (name, value) in self.input_names.iter().zip(past) {
            inputs.push((name.as_str().into(), value.into()));
        }
        let mut outputs = self.session.run(inputs).map_err(run_error)?;
        let logits = outputs
            .remove("logits")
            .ok_or_else(|| run_error("no output 'logits'"))?;
        let presents = self
            .output_names
            .iter()
            .map(|name| {
                outputs
                    .remove(name)
                    .ok_or_else(|| run_error(format!("no output '{name}'")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((logits, presents))
    }
}
