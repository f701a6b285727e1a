//! Where the running batch's key/value cache lives, for the two decoder layouts the engine runs:
//!
//! - **Growing** (Hugging Face Optimum's export): the decoder takes the past and answers a new
//!   present one column longer; rows are right-aligned ([`cache`]) and the batch's
//!   cache is rebuilt whenever rows join or leave.
//! - **Shared** (ONNX Runtime GenAI's `past_present_share_buffer` export): one preallocated
//!   FP16 buffer per cache tensor, bound as past and present ([`buffer`]); a step
//!   writes one column per row in place, rows keep their slot while they run, a joining row is
//!   copied into a free slot, and the buffer is reallocated only when it must grow or has
//!   become mostly empty.
//!
//! Either way the engine sees rows by *slot*: the row of the decoder's batch that holds a
//! sequence (for the growing layout, its index in the batch).

use std::borrow::Cow;

use ort::{
    session::{Session, SessionInputValue},
    value::{DynValue, Tensor as OrtTensor},
};

pub mod buffer;
pub mod cache;
pub mod events;
pub mod prefix;

use self::{
    buffer::{AnyBuffer, CacheNames, RunMemory},
    cache::{RowSource, Source},
    prefix::{Hit, Values},
};
use crate::error::{Error, Result};
use crate::runtime::generation::lora::LoraRun;

fn run_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("the decoder failed: {e}"))
}

/// The cache's shape.
#[derive(Debug, Clone)]
pub struct CacheShape {
    /// Key/value heads.
    pub kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Whether the decoder takes `position_ids` (growing layout only).
    pub position_ids: bool,
    /// Whether the cache is FP16 (else FP32).
    pub half: bool,
    /// Whether the decoder takes `all_logits` (0: the last position's logits, 1: every one's).
    pub all_logits: bool,
    /// Rows the batch holds at most.
    pub max_rows: usize,
    /// The logits' width, when the decoder's signature fixes it.
    pub vocab: Option<usize>,
}

/// A sequence of the batch as the store needs it.
#[derive(Debug, Clone, Copy)]
pub struct Seq {
    /// Its slot.
    pub slot: usize,
    /// Tokens in the cache.
    pub len: usize,
    /// Tokens it may reach (prompt plus its token limit).
    pub final_len: usize,
}

/// The cache of prompts just prefilled, before they join the batch.
pub enum Part {
    /// Presents `[n, heads, columns, head_dim]`, right-aligned.
    Growing(Vec<DynValue>, usize),
    /// A buffer of `n` left-aligned rows.
    Shared(Box<AnyBuffer>),
}

/// A prefill's result.
pub struct Prefilled {
    /// Logits `[n, positions, vocab]`.
    pub logits: DynValue,
    /// The prompts' cache.
    pub part: Part,
}

/// Rows of one part that join the batch: (row in the part, tokens, final length).
pub type Joining = (Part, Vec<(usize, usize, usize)>);

/// The running batch's cache.
pub enum KvStore {
    /// Optimum's layout.
    Growing {
        /// Its shape.
        shape: CacheShape,
        /// Names of the past inputs and present outputs.
        names: CacheNames,
        /// `present.*` of the last run, in input order: `[rows, kv_heads, columns, head_dim]`.
        cache: Vec<DynValue>,
        /// Its columns.
        columns: usize,
    },
    /// ONNX Runtime GenAI's shared-buffer layout.
    Shared {
        /// Its shape.
        shape: CacheShape,
        /// Names of the past inputs and present outputs.
        names: CacheNames,
        /// The buffer, while rows run.
        buffer: Option<Box<AnyBuffer>>,
    },
}

impl KvStore {
    /// An empty store; `shared` picks the layout.
    pub fn new(shared: bool, shape: CacheShape, names: CacheNames) -> Self {
        if shared {
            KvStore::Shared {
                shape,
                names,
                buffer: None,
            }
        } else {
            KvStore::Growing {
                shape,
                names,
                cache: Vec::new(),
                columns: 0,
            }
        }
    }

    /// Tokens of cache held (rows x columns).
    pub fn held_tokens(&self) -> usize {
        match self {
            KvStore::Growing { cache, columns, .. } => {
                let rows = cache
                    .first()
                    .and_then(|t| t.shape().first().copied())
                    .unwrap_or(0);
                rows.max(0) as usize * columns
            }
            KvStore::Shared { buffer, .. } => buffer.as_ref().map_or(0, |b| b.rows() * b.columns()),
        }
    }

    /// Rows of the decoder's batch while `running` sequences run: the buffer's (which may
    /// hold free rows) or `running`.
    pub fn batch_rows(&self, running: usize) -> usize {
        match self {
            KvStore::Shared {
                buffer: Some(b), ..
            } => b.rows().max(1),
            _ => running.max(1),
        }
    }

    /// Columns of the shared layout's buffer (a row's tokens, cached and run, fit in them);
    /// none in the growing layout or before the buffer exists.
    pub fn shared_columns(&self) -> Option<usize> {
        match self {
            KvStore::Shared {
                buffer: Some(b), ..
            } => Some(b.columns()),
            _ => None,
        }
    }

    /// Drops everything (after a failed step).
    pub fn clear(&mut self) {
        match self {
            KvStore::Growing { cache, columns, .. } => {
                cache.clear();
                *columns = 0;
            }
            KvStore::Shared { buffer, .. } => *buffer = None,
        }
    }

    /// Runs `prompts` (after the cached prefix `hit`, for a single prompt) in one decoder run;
    /// with `all`, asks for every position's logits (from decoders that take `all_logits`).
    /// `lora`: the prompts' adapters (by prompt), for a decoder that takes them.
    pub fn prefill(
        &mut self,
        session: &mut Session,
        prompts: &[&[i64]],
        hit: Option<&Hit>,
        pad_id: i64,
        all: bool,
        lora: Option<&LoraRun<'_>>,
    ) -> Result<Prefilled> {
        let n = prompts.len();
        let past_len = hit.map_or(0, |h| h.tokens);
        let width = prompts
            .iter()
            .map(|p| p.len() - past_len)
            .max()
            .unwrap_or(0);
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let columns = past_len + width;
        let mut ids = vec![pad_id; n * width];
        match self {
            KvStore::Growing { shape, names, .. } => {
                // Left-padded: every prompt ends at the last column.
                let mut positions = vec![0i64; n * width];
                for (r, p) in prompts.iter().enumerate() {
                    let tail = &p[past_len..];
                    let start = r * width + width - tail.len();
                    ids[start..start + tail.len()].copy_from_slice(tail);
                    for (j, q) in positions[start..start + tail.len()].iter_mut().enumerate() {
                        *q = (past_len + j) as i64;
                    }
                }
                let mask = cache::mask(&lens, columns);
                let past = (0..names.inputs.len())
                    .map(|i| {
                        let data = match hit.map(|h| (h, &h.entry.values)) {
                            Some((h, Values::F32(tensors))) => prefix::leading(
                                &tensors[i],
                                shape.kv_heads,
                                h.entry.len(),
                                shape.head_dim,
                                past_len,
                            ),
                            Some(_) => {
                                return Err(run_error("a cached prefix of another cache type"))
                            }
                            None => Vec::new(),
                        };
                        OrtTensor::<f32>::from_array((
                            [n, shape.kv_heads, past_len, shape.head_dim],
                            data,
                        ))
                        .map(|t| t.into_dyn())
                        .map_err(run_error)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (logits, presents) = run_growing(
                    session,
                    shape,
                    names,
                    [n, width],
                    ids,
                    positions,
                    mask,
                    &past,
                    all,
                    all,
                )?;
                Ok(Prefilled {
                    logits,
                    part: Part::Growing(presents, columns),
                })
            }
            KvStore::Shared { shape, names, .. } => {
                // Right-padded: every prompt starts at column 0.
                for (r, p) in prompts.iter().enumerate() {
                    let tail = &p[past_len..];
                    ids[r * width..r * width + tail.len()].copy_from_slice(tail);
                }
                let mut buffer = AnyBuffer::new(
                    shape.half,
                    session,
                    names,
                    n,
                    columns,
                    shape.kv_heads,
                    shape.head_dim,
                )?;
                if let Some(h) = hit {
                    buffer.write_row(0, &h.entry.values, h.entry.len(), past_len)?;
                }
                let mask = buffer::mask(&lens, columns);
                // Every position's logits (a scored prompt: `[1, tokens, vocab]`, hundreds of
                // MiB) go to memory of their own, freed with them, not to the arena.
                let own_logits = shape.vocab.filter(|_| all && shape.all_logits);
                let logits = buffer.run(
                    session,
                    ids,
                    width,
                    mask,
                    shape.all_logits.then_some(all),
                    RunMemory {
                        shrink: all,
                        own_logits,
                    },
                    lora,
                )?;
                Ok(Prefilled {
                    logits,
                    part: Part::Shared(Box::new(buffer)),
                })
            }
        }
    }

    /// Where row `r`'s last prompt token is among a prefill's `positions` logits.
    pub fn last_position(&self, positions: usize, prompt_len: usize, past_len: usize) -> usize {
        match self {
            KvStore::Growing { .. } => positions - 1,
            KvStore::Shared { .. } => (prompt_len - past_len).saturating_sub(1).min(positions - 1),
        }
    }

    /// Where the logits after prompt token `i` are among the `positions` (every position of
    /// the run, `all` asked of [`KvStore::prefill`] with no cached prefix) of a row holding
    /// `prompt_len` tokens: rows are left-padded in the growing layout, right-padded in the
    /// shared one.
    pub fn prompt_position(&self, positions: usize, prompt_len: usize, i: usize) -> usize {
        match self {
            KvStore::Growing { .. } => positions.saturating_sub(prompt_len) + i,
            KvStore::Shared { .. } => i,
        }
    }

    /// Row `r` of a prefilled part's first `len` tokens, for the prefix cache.
    pub fn prefix_values(&self, part: &Part, r: usize, len: usize) -> Result<Values> {
        let (kv_heads, head_dim) = match self {
            KvStore::Growing { shape, .. } | KvStore::Shared { shape, .. } => {
                (shape.kv_heads, shape.head_dim)
            }
        };
        match part {
            Part::Growing(presents, columns) => presents
                .iter()
                .map(|p| {
                    let (_, data) = p.try_extract_tensor::<f32>().map_err(run_error)?;
                    Ok(prefix::trailing(data, r, kv_heads, *columns, head_dim, len))
                })
                .collect::<Result<Vec<_>>>()
                .map(Values::F32),
            Part::Shared(buffer) => Ok(buffer.row_values(r, len)),
        }
    }

    /// Adds rows to the batch: `running` (the batch now) keep their order, then the rows of
    /// `joining`. Answers every row's slot from now on, running rows first.
    pub fn join(
        &mut self,
        session: &Session,
        running: &[Seq],
        joining: Vec<Joining>,
    ) -> Result<Vec<usize>> {
        match self {
            KvStore::Growing {
                shape,
                cache,
                columns,
                ..
            } => {
                let mut sources = in_cache(running);
                let mut others = Vec::new();
                for (t, (part, rows)) in joining.into_iter().enumerate() {
                    let Part::Growing(presents, cols) = part else {
                        return Err(run_error("a prefill of another cache type"));
                    };
                    sources.extend(rows.iter().map(|&(row, len, _)| RowSource {
                        tensor: t + 1,
                        row,
                        len,
                    }));
                    others.push((presents, cols));
                }
                let new_columns = sources.iter().map(|s| s.len).max().unwrap_or(0);
                let others: Vec<(&[DynValue], usize)> =
                    others.iter().map(|(p, c)| (p.as_slice(), *c)).collect();
                *cache = rebuild(shape, cache, *columns, &others, &sources, new_columns)?;
                *columns = new_columns;
                Ok((0..sources.len()).collect())
            }
            KvStore::Shared {
                shape,
                names,
                buffer,
            } => {
                let joining_rows: usize = joining.iter().map(|(_, rows)| rows.len()).sum();
                let rows = running.len() + joining_rows;
                let longest = running
                    .iter()
                    .map(|s| s.final_len.max(s.len))
                    .chain(
                        joining
                            .iter()
                            .flat_map(|(_, r)| r.iter().map(|&(_, len, fin)| fin.max(len))),
                    )
                    .max()
                    .unwrap_or(1);
                let mut slots: Vec<usize> = running.iter().map(|s| s.slot).collect();
                let fits = buffer
                    .as_ref()
                    .is_some_and(|b| b.rows() >= rows && b.columns() >= longest);
                if !fits {
                    // Grow: rows doubling (within the batch's limit) so that a burst of
                    // arrivals moves the cache a few times, not once per arrival; columns
                    // to the longest sequence (in steps of 8).
                    let old_rows = buffer.as_ref().map_or(0, |b| b.rows());
                    let new_rows = rows.max((2 * old_rows).min(shape.max_rows)).max(1);
                    let old_columns = buffer.as_ref().map_or(0, |b| b.columns());
                    let new_columns = longest.max(old_columns).div_ceil(8) * 8;
                    let moves = to_front(running);
                    match buffer.as_mut() {
                        Some(old) => old.resize(session, names, new_rows, new_columns, &moves)?,
                        None => {
                            *buffer = Some(Box::new(AnyBuffer::new(
                                shape.half,
                                session,
                                names,
                                new_rows,
                                new_columns,
                                shape.kv_heads,
                                shape.head_dim,
                            )?))
                        }
                    }
                    tracing::debug!(
                        rows = new_rows,
                        columns = new_columns,
                        moved = running.len(),
                        "key/value buffer grown"
                    );
                    slots = (0..running.len()).collect();
                    crate::runtime::heap::release_freed();
                }
                let Some(buffer) = buffer.as_mut() else {
                    return Err(run_error("no key/value buffer"));
                };
                let mut taken = vec![false; buffer.rows()];
                for &s in &slots {
                    taken[s] = true;
                }
                let mut free = (0..buffer.rows()).filter(|&s| !taken[s]);
                for (part, rows) in joining {
                    let Part::Shared(source) = part else {
                        return Err(run_error("a prefill of another cache type"));
                    };
                    for (row, len, _) in rows {
                        let slot = free
                            .next()
                            .ok_or_else(|| run_error("no free row in the key/value buffer"))?;
                        buffer.copy_row(slot, &source, row, len)?;
                        slots.push(slot);
                    }
                }
                Ok(slots)
            }
        }
    }

    /// Keeps the rows `kept` (in batch order) and answers their slots from now on.
    pub fn retain(&mut self, session: &Session, kept: &[Seq]) -> Result<Vec<usize>> {
        match self {
            KvStore::Growing {
                shape,
                cache,
                columns,
                ..
            } => {
                let sources = in_cache(kept);
                let new_columns = sources.iter().map(|s| s.len).max().unwrap_or(0);
                *cache = if kept.is_empty() {
                    Vec::new()
                } else {
                    rebuild(shape, cache, *columns, &[], &sources, new_columns)?
                };
                *columns = new_columns;
                Ok((0..kept.len()).collect())
            }
            KvStore::Shared {
                shape,
                names,
                buffer,
            } => {
                let Some(old) = buffer.as_ref() else {
                    return Ok(Vec::new());
                };
                if kept.is_empty() {
                    *buffer = None;
                    crate::runtime::heap::release_freed();
                    return Ok(Vec::new());
                }
                // Moved into a smaller buffer once at most a quarter of its rows run, so that
                // memory follows the load down without moving rows at every departure.
                if kept.len() * 4 > old.rows() || old.rows() <= 4 {
                    return Ok(kept.iter().map(|s| s.slot).collect());
                }
                let longest = kept
                    .iter()
                    .map(|s| s.final_len.max(s.len))
                    .max()
                    .unwrap_or(1);
                let moves = to_front(kept);
                let rows = (kept.len() * 2).min(shape.max_rows);
                let columns = longest.div_ceil(8) * 8;
                if let Some(old) = buffer.as_mut() {
                    old.resize(session, names, rows, columns, &moves)?;
                }
                tracing::debug!(rows, columns, moved = kept.len(), "key/value buffer shrunk");
                crate::runtime::heap::release_freed();
                Ok((0..kept.len()).collect())
            }
        }
    }

    /// One token further for each of `seqs` (`next` is its token not yet in the cache), and
    /// with it the row's draft (`drafts`, by the same index; the shared layout only), which
    /// the run puts in the cache after `next`. Answers logits by slot: `[rows, 1, vocab]`, or
    /// `[rows, width, vocab]` when drafts run (`width` is 1 + the longest draft; position `j`
    /// of a row scores the token after its `j`th draft token). With `shrink`, ONNX Runtime's
    /// arena gives its free memory back at the end of the step (after a scored prompt, see
    /// [`buffer::shrinking`]). `lora`: the adapters by slot, for a decoder that takes them.
    pub fn decode(
        &mut self,
        session: &mut Session,
        seqs: &[(Seq, i64)],
        drafts: &[Vec<i64>],
        pad_id: i64,
        shrink: bool,
        lora: Option<&LoraRun<'_>>,
    ) -> Result<DynValue> {
        match self {
            KvStore::Growing {
                shape,
                names,
                cache,
                columns,
            } => {
                if drafts.iter().any(|d| !d.is_empty()) {
                    return Err(run_error("a growing cache runs no drafts"));
                }
                let b = seqs.len();
                let ids: Vec<i64> = seqs.iter().map(|(_, next)| *next).collect();
                let positions: Vec<i64> = seqs.iter().map(|(s, _)| s.len as i64).collect();
                let lens: Vec<usize> = seqs.iter().map(|(s, _)| s.len + 1).collect();
                let mask = cache::mask(&lens, *columns + 1);
                let past = std::mem::take(cache);
                let (logits, presents) = run_growing(
                    session,
                    shape,
                    names,
                    [b, 1],
                    ids,
                    positions,
                    mask,
                    &past,
                    false,
                    shrink,
                )?;
                drop(past);
                *cache = presents;
                *columns += 1;
                Ok(logits)
            }
            KvStore::Shared { buffer, shape, .. } => {
                let Some(buffer) = buffer.as_mut() else {
                    return Err(run_error("no key/value buffer"));
                };
                let rows = buffer.rows();
                let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
                if width > 1 && !shape.all_logits {
                    return Err(run_error("drafts need a decoder that takes all_logits"));
                }
                let mut ids = vec![pad_id; rows * width];
                // A free row runs pad tokens from its first column: one token needs no room
                // (length 0), more do.
                let mut lens = vec![if width > 1 { width } else { 0 }; rows];
                for (i, (s, next)) in seqs.iter().enumerate() {
                    let at = s.slot * width;
                    ids[at] = *next;
                    if let Some(draft) = drafts.get(i) {
                        ids[at + 1..at + 1 + draft.len()].copy_from_slice(draft);
                    }
                    lens[s.slot] = s.len + width;
                }
                let total = lens.iter().copied().max().unwrap_or(1).max(1);
                let mask = buffer::mask(&lens, total);
                buffer.run(
                    session,
                    ids,
                    width,
                    mask,
                    shape.all_logits.then_some(width > 1),
                    RunMemory {
                        shrink,
                        own_logits: None,
                    },
                    lora,
                )
            }
        }
    }
}

/// Where `seqs` are in the current growing cache (source 0).
fn in_cache(seqs: &[Seq]) -> Vec<RowSource> {
    seqs.iter()
        .map(|s| RowSource {
            tensor: 0,
            row: s.slot,
            len: s.len,
        })
        .collect()
}

/// Moves that put `seqs` in the first rows of a new buffer, in order: (old row, new row,
/// tokens).
fn to_front(seqs: &[Seq]) -> Vec<(usize, usize, usize)> {
    seqs.iter()
        .enumerate()
        .map(|(i, s)| (s.slot, i, s.len))
        .collect()
}

/// New cache tensors from `cache` (source 0, `columns` wide) and `others` (sources 1..),
/// rows as `rows` says.
fn rebuild(
    shape: &CacheShape,
    cache: &[DynValue],
    columns: usize,
    others: &[(&[DynValue], usize)],
    rows: &[RowSource],
    new_columns: usize,
) -> Result<Vec<DynValue>> {
    let tensors = cache.len().max(others.first().map_or(0, |(t, _)| t.len()));
    let mut out = Vec::with_capacity(tensors);
    for i in 0..tensors {
        let mut sources = Vec::new();
        let all = std::iter::once((cache.get(i), columns))
            .chain(others.iter().map(|(t, c)| (t.get(i), *c)));
        for (tensor, cols) in all {
            let data = match tensor {
                Some(t) => t.try_extract_tensor::<f32>().map_err(run_error)?.1,
                None => &[],
            };
            sources.push(Source {
                data,
                columns: cols,
            });
        }
        let data = cache::relayout(&sources, rows, shape.kv_heads, shape.head_dim, new_columns);
        let dims = [rows.len(), shape.kv_heads, new_columns, shape.head_dim];
        out.push(
            OrtTensor::<f32>::from_array((dims, data))
                .map_err(run_error)?
                .into_dyn(),
        );
    }
    Ok(out)
}

/// One run of a growing-layout decoder: (logits, presents in cache order).
#[allow(clippy::too_many_arguments)]
fn run_growing(
    session: &mut Session,
    shape: &CacheShape,
    names: &CacheNames,
    dims: [usize; 2],
    ids: Vec<i64>,
    positions: Vec<i64>,
    mask: Vec<i64>,
    past: &[DynValue],
    all: bool,
    shrink: bool,
) -> Result<(DynValue, Vec<DynValue>)> {
    let mask_shape = [dims[0], mask.len() / dims[0].max(1)];
    let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> = vec![
        (
            "input_ids".into(),
            OrtTensor::from_array((dims, ids))
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
    if shape.position_ids {
        inputs.push((
            "position_ids".into(),
            OrtTensor::from_array((dims, positions))
                .map_err(run_error)?
                .into(),
        ));
    }
    if shape.all_logits {
        inputs.push(("all_logits".into(), buffer::switch(all)?.into()));
    }
    for (name, value) in names.inputs.iter().zip(past) {
        inputs.push((name.as_str().into(), value.into()));
    }
    let options = shrink.then(buffer::shrinking).transpose()?;
    let mut outputs = match &options {
        Some(options) => session.run_with_options(inputs, options),
        None => session.run(inputs),
    }
    .map_err(run_error)?;
    let logits = outputs
        .remove("logits")
        .ok_or_else(|| run_error("no output 'logits'"))?;
    let presents = names
        .outputs
        .iter()
        .map(|name| {
            outputs
                .remove(name)
                .ok_or_else(|| run_error(format!("no output '{name}'")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((logits, presents))
}
