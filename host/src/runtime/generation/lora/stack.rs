//! The adapter inputs of one run: the adapters its rows use, side by side.

use std::sync::Arc;

use ort::value::Tensor as OrtTensor;

use super::{peft::next_id, Adapter, Signature};
use crate::error::{Error, Result};

/// The adapter inputs for one set of adapters: each adapter's columns side by side.
pub struct Stack {
    /// Unique per build: a buffer rebinds the inputs when the stack changes.
    pub serial: u64,
    /// The adapters' ids, in column order.
    ids: Vec<u64>,
    /// Each adapter's first column, in the same order.
    starts: Vec<usize>,
    /// Columns (at least one: an empty stack is one column of zeros).
    pub columns: usize,
    /// (input name, value) for every `lora.{i}.{p}.a|b`.
    pub tensors: Vec<(String, OrtTensor<f32>)>,
}

fn run_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("the decoder's adapters: {e}"))
}

impl Stack {
    /// The inputs for `adapters` (distinct, in the order given).
    pub fn build(signature: &Signature, adapters: &[Arc<Adapter>]) -> Result<Self> {
        let mut starts = Vec::with_capacity(adapters.len());
        let mut columns = 0;
        for a in adapters {
            starts.push(columns);
            columns += a.rank;
        }
        let columns = columns.max(1);
        let mut tensors = Vec::with_capacity(signature.projections.len() * 2);
        for (index, p) in signature.projections.iter().enumerate() {
            let mut a_all = vec![0f32; p.fan_in * columns];
            let mut b_all = vec![0f32; columns * p.fan_out];
            for (adapter, &start) in adapters.iter().zip(&starts) {
                let Some(w) = adapter.weights.get(index).and_then(Option::as_ref) else {
                    continue;
                };
                for i in 0..p.fan_in {
                    let row = &w.a[i * w.rank..(i + 1) * w.rank];
                    a_all[i * columns + start..i * columns + start + w.rank].copy_from_slice(row);
                }
                let at = start * p.fan_out;
                b_all[at..at + w.rank * p.fan_out].copy_from_slice(&w.b);
            }
            tensors.push((
                p.input_a(),
                OrtTensor::from_array(([p.fan_in, columns], a_all)).map_err(run_error)?,
            ));
            tensors.push((
                p.input_b(),
                OrtTensor::from_array(([columns, p.fan_out], b_all)).map_err(run_error)?,
            ));
        }
        Ok(Self {
            serial: next_id(),
            ids: adapters.iter().map(|a| a.id).collect(),
            starts,
            columns,
            tensors,
        })
    }

    /// Whether it holds exactly these adapters (by id, in order).
    pub fn holds(&self, ids: &[u64]) -> bool {
        self.ids == ids
    }

    /// `lora_mask` `[rows.len(), 1, columns]`: each row's adapter's columns set.
    pub fn mask(&self, rows: &[Option<&Adapter>]) -> Vec<f32> {
        let mut out = vec![0f32; rows.len() * self.columns];
        for (r, adapter) in rows.iter().enumerate() {
            let Some(adapter) = adapter else { continue };
            if let Some(k) = self.ids.iter().position(|&id| id == adapter.id) {
                let at = r * self.columns + self.starts[k];
                out[at..at + adapter.rank].fill(1.0);
            }
        }
        out
    }
}

/// What a run binds for its rows' adapters.
pub struct LoraRun<'a> {
    /// The adapter inputs.
    pub stack: &'a Stack,
    /// Each row's adapter, by row of the run (rows past the end have none).
    pub rows: Vec<Option<&'a Adapter>>,
}

impl LoraRun<'_> {
    /// `lora_mask` for a run of `rows` rows.
    pub fn mask(&self, rows: usize) -> Result<OrtTensor<f32>> {
        let mut per_row = self.rows.clone();
        per_row.resize(rows, None);
        let data = self.stack.mask(&per_row);
        OrtTensor::from_array(([rows, 1, self.stack.columns], data)).map_err(run_error)
    }
}

/// The stack the engine binds, rebuilt when the set of adapters its rows use changes.
pub struct Stacks {
    signature: Signature,
    current: Option<Stack>,
}

impl Stacks {
    /// For a decoder of `signature`.
    pub fn new(signature: Signature) -> Self {
        Self {
            signature,
            current: None,
        }
    }

    /// The inputs for rows running `adapters` (by row; `None` for the base model).
    pub fn run<'a>(&'a mut self, adapters: &[Option<&'a Arc<Adapter>>]) -> Result<LoraRun<'a>> {
        let mut distinct: Vec<&Arc<Adapter>> = Vec::new();
        for a in adapters.iter().flatten() {
            if !distinct.iter().any(|d| d.id == a.id) {
                distinct.push(a);
            }
        }
        distinct.sort_by_key(|a| a.id);
        let ids: Vec<u64> = distinct.iter().map(|a| a.id).collect();
        if !self.current.as_ref().is_some_and(|s| s.holds(&ids)) {
            let owned: Vec<Arc<Adapter>> = distinct.iter().map(|a| Arc::clone(a)).collect();
            self.current = Some(Stack::build(&self.signature, &owned)?);
        }
        let stack = self
            .current
            .as_ref()
            .ok_or_else(|| run_error("no adapter stack"))?;
        Ok(LoraRun {
            stack,
            rows: adapters.iter().map(|a| a.map(|a| a.as_ref())).collect(),
        })
    }
}
