//! A key/value cache that stays in place between decoder runs: per cache tensor one buffer
//! `[rows, kv_heads, columns, head_dim]` (FP32 or FP16, as the decoder declares its cache), bound through ONNX Runtime's IO binding as both
//! the past input and the present output of a decoder exported with
//! `past_present_share_buffer` (ONNX Runtime GenAI's layout: `GroupQueryAttention` reads each
//! row's length from the attention mask and writes the new tokens' keys and values at the end
//! of that row). A step therefore writes one column per row and copies nothing else.
//!
//! Rows are left-aligned: a row of `n` tokens holds them in its first `n` columns, and its
//! attention mask row is `n` ones then zeros. `columns` is fixed for the buffer's life; the
//! engine sizes it to the longest sequence it admits and moves rows into a new buffer only when
//! a longer one joins or when many rows left (see [`KvBuffer::resize`]).

use std::fmt::Debug;

use half::f16;
use ort::{
    memory::Allocator,
    session::{IoBinding, Session},
    value::{DynValue, PrimitiveTensorElementType, Tensor as OrtTensor},
};

use super::prefix::Values;
use crate::error::{Error, Result};
use crate::runtime::generation::lora::{LoraRun, MASK_INPUT};

/// An element a cache may hold.
pub trait CacheElement: PrimitiveTensorElementType + Copy + Debug + 'static {}
impl CacheElement for f32 {}
impl CacheElement for f16 {}

fn run_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("the decoder failed: {e}"))
}

/// The cache's names: `past_key_values.{i}.key|value` and their `present.{i}.*` twins.
#[derive(Debug, Clone)]
pub struct CacheNames {
    /// Past inputs, in cache order.
    pub inputs: Vec<String>,
    /// Present outputs, in the same order.
    pub outputs: Vec<String>,
}

/// One buffer set with its binding.
pub struct KvBuffer<T: CacheElement> {
    rows: usize,
    columns: usize,
    heads: usize,
    head_dim: usize,
    tensors: Vec<OrtTensor<T>>,
    binding: IoBinding,
    /// Logit positions per row of the last run: after a run the binding keeps its logits, of
    /// that shape, so a run answering another number of positions binds them afresh.
    logit_positions: Option<usize>,
    /// The adapter stack bound (its serial), rebound when the run's differs.
    bound_stack: Option<u64>,
}

impl<T: CacheElement> KvBuffer<T> {
    /// Allocates `rows` rows of `columns` columns and binds them as past and present of
    /// `session`. The contents start undefined: a row is only read up to its length.
    pub fn new(
        session: &Session,
        names: &CacheNames,
        rows: usize,
        columns: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let mut tensors = (0..names.inputs.len())
            .map(|_| allocate(rows, columns, heads, head_dim))
            .collect::<Result<Vec<_>>>()?;
        let binding = bind(session, names, &mut tensors)?;
        Ok(Self {
            rows,
            columns,
            heads,
            head_dim,
            tensors,
            binding,
            logit_positions: None,
            bound_stack: None,
        })
    }

    /// Moves into `rows` x `columns` buffers: `moves` are (old row, new row, tokens). One
    /// cache tensor at a time, each old one freed once copied, so that the move holds little
    /// more than the larger of the two sizes.
    pub fn resize(
        &mut self,
        session: &Session,
        names: &CacheNames,
        rows: usize,
        columns: usize,
        moves: &[(usize, usize, usize)],
    ) -> Result<()> {
        // The binding holds the old tensors: release it first.
        self.binding = session.create_binding().map_err(run_error)?;
        let (heads, dim) = (self.heads, self.head_dim);
        for old in self.tensors.iter_mut() {
            let mut new = allocate::<T>(rows, columns, heads, dim)?;
            {
                let (_, src) = old.extract_tensor();
                let (_, dst) = new.extract_tensor_mut();
                for &(from, to, len) in moves {
                    let len = len.min(columns).min(self.columns);
                    for h in 0..heads {
                        let s = (from * heads + h) * self.columns * dim;
                        let d = (to * heads + h) * columns * dim;
                        dst[d..d + len * dim].copy_from_slice(&src[s..s + len * dim]);
                    }
                }
            }
            *old = new;
        }
        self.rows = rows;
        self.columns = columns;
        self.binding = bind(session, names, &mut self.tensors)?;
        self.logit_positions = None;
        self.bound_stack = None;
        Ok(())
    }

    /// Its rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Its columns (the longest sequence a row may hold).
    pub fn columns(&self) -> usize {
        self.columns
    }

    /// Runs the decoder over every row: `ids` `[rows, width]` (right-padded) and the mask
    /// `[rows, total]` of each row's tokens, cached and new. Answers the logits. `memory`
    /// says whether the arena gives its free memory back at the end of the run, and whether
    /// the logits are written into memory of their own. `lora`: the rows' adapters, for a
    /// decoder that takes them.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        session: &mut Session,
        ids: Vec<i64>,
        width: usize,
        mask: Vec<i64>,
        all_logits: Option<bool>,
        memory: RunMemory,
        lora: Option<&LoraRun<'_>>,
    ) -> Result<DynValue> {
        let total = mask.len() / self.rows.max(1);
        if total > self.columns {
            return Err(run_error(format!(
                "{total} tokens do not fit a cache of {} columns",
                self.columns
            )));
        }
        let ids = OrtTensor::from_array(([self.rows, width], ids)).map_err(run_error)?;
        let mask = OrtTensor::from_array(([self.rows, total], mask)).map_err(run_error)?;
        self.binding
            .bind_input("input_ids", &ids)
            .map_err(run_error)?;
        self.binding
            .bind_input("attention_mask", &mask)
            .map_err(run_error)?;
        if let Some(all) = all_logits {
            self.binding
                .bind_input("all_logits", &switch(all)?)
                .map_err(run_error)?;
        }
        if let Some(lora) = lora {
            if self.bound_stack != Some(lora.stack.serial) {
                for (name, tensor) in &lora.stack.tensors {
                    self.binding.bind_input(name, tensor).map_err(run_error)?;
                }
                self.bound_stack = Some(lora.stack.serial);
            }
            self.binding
                .bind_input(MASK_INPUT, &lora.mask(self.rows)?)
                .map_err(run_error)?;
        }
        let positions = if all_logits == Some(true) { width } else { 1 };
        if let Some(vocab) = memory.own_logits {
            let logits = OrtTensor::<f32>::new(&Allocator::default(), [self.rows, width, vocab])
                .map_err(run_error)?;
            self.binding
                .bind_output("logits", logits)
                .map_err(run_error)?;
        } else if self.logit_positions.is_some_and(|p| p != positions) {
            self.binding
                .bind_output_to_device("logits", Allocator::default().memory_info())
                .map_err(run_error)?;
        }
        self.logit_positions = Some(positions);
        let options = memory.shrink.then(shrinking).transpose()?;
        let mut outputs = match &options {
            Some(options) => session.run_binding_with_options(&self.binding, options),
            None => session.run_binding(&self.binding),
        }
        .map_err(run_error)?;
        outputs
            .remove("logits")
            .ok_or_else(|| run_error("no output 'logits'"))
    }

    /// Copies the first `len` columns of row `from` of `source` into row `to`.
    pub fn copy_row(&mut self, to: usize, source: &KvBuffer<T>, from: usize, len: usize) {
        let (heads, dim) = (self.heads, self.head_dim);
        let len = len.min(self.columns).min(source.columns);
        for (dst, src) in self.tensors.iter_mut().zip(&source.tensors) {
            let (_, src) = src.extract_tensor();
            let (_, dst) = dst.extract_tensor_mut();
            for h in 0..heads {
                let s = (from * heads + h) * source.columns * dim;
                let d = (to * heads + h) * self.columns * dim;
                dst[d..d + len * dim].copy_from_slice(&src[s..s + len * dim]);
            }
        }
    }

    /// Row `row`'s first `len` columns, per cache tensor `[kv_heads, len, head_dim]`.
    pub fn row_values(&self, row: usize, len: usize) -> Vec<Vec<T>> {
        let (heads, dim) = (self.heads, self.head_dim);
        let len = len.min(self.columns);
        self.tensors
            .iter()
            .map(|t| {
                let (_, data) = t.extract_tensor();
                let mut out = Vec::with_capacity(heads * len * dim);
                for h in 0..heads {
                    let s = (row * heads + h) * self.columns * dim;
                    out.extend_from_slice(&data[s..s + len * dim]);
                }
                out
            })
            .collect()
    }

    /// Writes the first `len` columns of `values` (per cache tensor `[kv_heads, stored,
    /// head_dim]`) into row `row`.
    pub fn write_row(&mut self, row: usize, values: &[Vec<T>], stored: usize, len: usize) {
        let (heads, dim) = (self.heads, self.head_dim);
        let len = len.min(stored).min(self.columns);
        for (t, src) in self.tensors.iter_mut().zip(values) {
            let (_, dst) = t.extract_tensor_mut();
            for h in 0..heads {
                let s = h * stored * dim;
                let d = (row * heads + h) * self.columns * dim;
                dst[d..d + len * dim].copy_from_slice(&src[s..s + len * dim]);
            }
        }
    }
}

/// One uninitialised cache tensor.
fn allocate<T: CacheElement>(
    rows: usize,
    columns: usize,
    heads: usize,
    head_dim: usize,
) -> Result<OrtTensor<T>> {
    OrtTensor::<T>::new(&Allocator::default(), [rows, heads, columns, head_dim]).map_err(|e| {
        Error::unavailable(format!(
            "cannot allocate the key/value cache ({rows} x {columns} tokens): {e}"
        ))
    })
}

/// A binding of each of `tensors` as both its past and its present (ONNX Runtime sees one
/// buffer for both), and of the logits to host memory.
fn bind<T: CacheElement>(
    session: &Session,
    names: &CacheNames,
    tensors: &mut [OrtTensor<T>],
) -> Result<IoBinding> {
    let mut binding = session.create_binding().map_err(run_error)?;
    for ((input, output), tensor) in names.inputs.iter().zip(&names.outputs).zip(tensors) {
        binding.bind_input(input, tensor).map_err(run_error)?;
        binding.bind_output(output, tensor).map_err(run_error)?;
    }
    binding
        .bind_output_to_device("logits", Allocator::default().memory_info())
        .map_err(run_error)?;
    Ok(binding)
}

/// A buffer of either element type.
pub enum AnyBuffer {
    /// An FP32 cache.
    F32(KvBuffer<f32>),
    /// An FP16 cache.
    F16(KvBuffer<f16>),
}

/// Applies `$body` to the buffer inside `$buffer` whatever its type.
macro_rules! each {
    ($buffer:expr, $b:ident => $body:expr) => {
        match $buffer {
            AnyBuffer::F32($b) => $body,
            AnyBuffer::F16($b) => $body,
        }
    };
}

impl AnyBuffer {
    /// Allocates a buffer of FP16 (`half`) or FP32 elements (see [`KvBuffer::new`]).
    pub fn new(
        half: bool,
        session: &Session,
        names: &CacheNames,
        rows: usize,
        columns: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Ok(if half {
            AnyBuffer::F16(KvBuffer::new(
                session, names, rows, columns, heads, head_dim,
            )?)
        } else {
            AnyBuffer::F32(KvBuffer::new(
                session, names, rows, columns, heads, head_dim,
            )?)
        })
    }

    /// Its rows.
    pub fn rows(&self) -> usize {
        each!(self, b => b.rows())
    }

    /// Its columns.
    pub fn columns(&self) -> usize {
        each!(self, b => b.columns())
    }

    /// See [`KvBuffer::resize`].
    pub fn resize(
        &mut self,
        session: &Session,
        names: &CacheNames,
        rows: usize,
        columns: usize,
        moves: &[(usize, usize, usize)],
    ) -> Result<()> {
        each!(self, b => b.resize(session, names, rows, columns, moves))
    }

    /// See [`KvBuffer::run`].
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        session: &mut Session,
        ids: Vec<i64>,
        width: usize,
        mask: Vec<i64>,
        all_logits: Option<bool>,
        memory: RunMemory,
        lora: Option<&LoraRun<'_>>,
    ) -> Result<DynValue> {
        each!(self, b => b.run(session, ids, width, mask, all_logits, memory, lora))
    }

    /// See [`KvBuffer::copy_row`]; buffers of different types are refused.
    pub fn copy_row(
        &mut self,
        to: usize,
        source: &AnyBuffer,
        from: usize,
        len: usize,
    ) -> Result<()> {
        match (self, source) {
            (AnyBuffer::F32(d), AnyBuffer::F32(s)) => d.copy_row(to, s, from, len),
            (AnyBuffer::F16(d), AnyBuffer::F16(s)) => d.copy_row(to, s, from, len),
            _ => return Err(run_error("a prefill of another cache type")),
        }
        Ok(())
    }

    /// See [`KvBuffer::row_values`].
    pub fn row_values(&self, row: usize, len: usize) -> Values {
        match self {
            AnyBuffer::F32(b) => Values::F32(b.row_values(row, len)),
            AnyBuffer::F16(b) => Values::F16(b.row_values(row, len)),
        }
    }

    /// See [`KvBuffer::write_row`]; values of another type are refused.
    pub fn write_row(
        &mut self,
        row: usize,
        values: &Values,
        stored: usize,
        len: usize,
    ) -> Result<()> {
        match (self, values) {
            (AnyBuffer::F32(b), Values::F32(v)) => b.write_row(row, v, stored, len),
            (AnyBuffer::F16(b), Values::F16(v)) => b.write_row(row, v, stored, len),
            _ => return Err(run_error("a cached prefix of another cache type")),
        }
        Ok(())
    }
}

/// The attention mask `[rows, total]` of left-aligned rows of `lens` tokens (a row of 0
/// tokens gets one, so that every row attends to something).
pub fn mask(lens: &[usize], total: usize) -> Vec<i64> {
    let mut out = vec![0i64; lens.len() * total];
    for (r, &len) in lens.iter().enumerate() {
        out[r * total..r * total + len.clamp(1, total)].fill(1);
    }
    out
}

/// The decoder's `all_logits` input: 1 answers every position's logits, 0 the last one's.
pub fn switch(all: bool) -> Result<OrtTensor<i64>> {
    OrtTensor::from_array((Vec::<i64>::new(), vec![i64::from(all)])).map_err(run_error)
}

/// Where a run's large memory goes.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunMemory {
    /// The arena gives its free chunks back at the end of the run ([`shrinking`]).
    pub shrink: bool,
    /// The logits are written into a tensor of their own, `[rows, width, vocab]` of this
    /// vocabulary, freed with the logits (not kept by the arena).
    pub own_logits: Option<usize>,
}

/// Run options under which ONNX Runtime's CPU arena gives its free chunks back at the end of
/// the run: for a run whose activations dwarf a decode step's (a prompt scored whole, every
/// position's logits), and the run after it, which frees those logits' chunk.
pub fn shrinking() -> Result<ort::session::RunOptions> {
    let mut options = ort::session::RunOptions::new().map_err(run_error)?;
    options
        .set("memory.enable_memory_arena_shrinkage", "cpu:0")
        .map_err(run_error)?;
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_left_aligned_and_never_empty() {
        assert_eq!(mask(&[1, 3, 0], 3), vec![1, 0, 0, 1, 1, 1, 1, 0, 0]);
    }
}
