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
        let mut worker = Worker {
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

    /// Runs the prompts of `new` together (left-padded), samples their first tokens and
    /// adds the sequences that go on to the batch.
    fn prefill(&mut self, new: Vec<Submission>) -> Result<()> {
        let n = new.len();
        let width = new.iter().map(|s| s.prompt.len()).max().unwrap_or(0);
        let mut ids = vec![self.limits.pad_id; n * width];
        let mut positions = vec![0i64; n * width];
        let lens: Vec<usize> = new.iter().map(|s| s.prompt.len()).collect();
        for (r, s) in new.iter().enumerate() {
            let start = r * width + width - s.prompt.len();
            ids[start..start + s.prompt.len()].copy_from_slice(&s.prompt);
            for (j, p) in positions[start..start + s.prompt.len()]
                .iter_mut()
                .enumerate()
            {
                *p = j as i64;
            }
        }
        let mask = kv_cache::mask(&lens, width);
        let spec = &self.spec;
        let empty: Vec<DynValue> = (0..self.input_names.len())
            .map(|_| {
                OrtTensor::<f32>::from_array(([n, spec.kv_heads, 0, spec.head_dim], Vec::new()))
                    .map(|t| t.into_dyn())
                    .map_err(run_error)
            })
            .collect::<Result<_>>()?;
        let result = self.run_decoder([n, width], ids, positions, mask, &empty);
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
            .fetch_add(lens.iter().sum::<usize>() as u64, Relaxed);
        let (_, values) = logits.try_extract_tensor::<f32>().map_err(run_error)?;
        let vocab = values.len() / (n * width).max(1);
        let mut joining = Vec::new();
        for (r, mut sub) in new.into_iter().enumerate() {
            let at = (r * width + width - 1) * vocab;
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
        if joining.is_empty() {
            return Ok(());
        }
        // The batch: the running rows (from the cache) then the joining ones (from this run).
        let mut sources_rows: Vec<RowSource> = self
            .rows
            .iter()
            .enumerate()
            .map(|(i, row)| RowSource {
                tensor: 0,
                row: i,
                len: row.len,
            })
            .collect();
        sources_rows.extend(joining.iter().map(|(r, row)| RowSource {
            tensor: 1,
            row: *r,
            len: row.len,
        }));
        let columns = sources_rows.iter().map(|s| s.len).max().unwrap_or(0);
        self.cache = self.rebuild(&presents, width, &sources_rows, columns)?;
        self.columns = columns;
        self.rows.extend(joining.into_iter().map(|(_, row)| row));
        Ok(())
    }

    /// New cache tensors from the current cache (source 0) and `other` (source 1, of
    /// `other_columns`), rows as `rows` says.
    fn rebuild(
        &self,
        other: &[DynValue],
        other_columns: usize,
        rows: &[RowSource],
        columns: usize,
    ) -> Result<Vec<DynValue>> {
        let spec = &self.spec;
        let mut out = Vec::with_capacity(self.input_names.len());
        for i in 0..self.input_names.len() {
            let mut sources = Vec::new();
            for (tensor, cols) in [
                (self.cache.get(i), self.columns),
                (other.get(i), other_columns),
            ] {
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
            self.rebuild(&[], 0, &sources, columns)?
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
