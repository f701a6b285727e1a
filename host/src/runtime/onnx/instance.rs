//! One instance: a session that runs batches (padding, reshapes, timings).

use std::{sync::Arc, time::Instant};

use ort::{session::Session, value::DynValue};

use crate::runtime::{
    backend::{ExecTimings, ModelInstance},
    batch,
    buckets::ShapeBuckets,
    ragged::RaggedBatching,
    staging::Staging,
};
use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::ModelConfig,
    tensor::{DataType, Tensor},
};

use super::*;

/// One execution instance: an ONNX Runtime session, or one per batch bucket.
pub(super) struct OnnxInstance {
    pub(super) name: String,
    /// One session, or one per batch bucket in bucket order.
    pub(super) sessions: Vec<Session>,
    /// The host memory inputs are gathered into and outputs land in.
    pub(super) staging: Staging,
    pub(super) output_types: Vec<(String, DataType)>,
    pub(super) shapes: Reshapes,
    pub(super) buckets: Option<Arc<ShapeBuckets>>,
    /// Ragged inputs, batch inputs and batch outputs, when the model has them.
    pub(super) ragged: Option<Arc<RaggedBatching>>,
    /// Run options the configuration sets (`memory.enable_memory_arena_shrinkage`).
    pub(super) run_options: Option<Arc<ort::session::RunOptions>>,
}

/// The shape one execution runs at: rows padded to a batch bucket, variable dimensions to
/// the padded sequence length.
pub(super) struct Padding {
    /// Real rows of the batch.
    pub(super) rows: usize,
    /// Rows the execution runs with.
    pub(super) padded_rows: usize,
    /// The padded length of the variable dimensions, when they are padded.
    pub(super) sequence: Option<i64>,
    /// Which session runs it.
    pub(super) session: usize,
}

/// The `reshape` settings of a model's tensors: inputs are handed to ONNX Runtime in their
/// reshaped form, outputs come back to their declared dims. A model's scalar tensors (no
/// dimensions, declared with dims of 1s in a model that does not batch) are reshaped the same
/// way, as Triton's ONNX Runtime backend does: to `[]` going in, to the declared dims coming out.
#[derive(Clone, Default)]
pub(super) struct Reshapes {
    pub(super) batching: bool,
    /// Input name → the shape the model takes, and the declared dims.
    pub(super) inputs: Vec<(String, Vec<i64>, Vec<i64>)>,
    /// Output name → the declared dims, and the shape the model gives.
    pub(super) outputs: Vec<(String, Vec<i64>, Vec<i64>)>,
}

impl Reshapes {
    pub(super) fn of(config: &ModelConfig, inputs: &[Signature], outputs: &[Signature]) -> Self {
        let batching = config.max_batch_size > 0;
        let scalar = |model: &[Signature], name: &str| {
            !batching && model.iter().any(|s| s.name == name && s.shape.is_empty())
        };
        Self {
            batching,
            inputs: config
                .input
                .iter()
                .filter_map(|i| match &i.reshape {
                    Some(r) => Some((i.name.clone(), r.shape.clone(), i.dims.clone())),
                    None if scalar(inputs, &i.name) => {
                        Some((i.name.clone(), Vec::new(), i.dims.clone()))
                    }
                    None => None,
                })
                .collect(),
            outputs: config
                .output
                .iter()
                .filter_map(|o| match &o.reshape {
                    Some(r) => Some((o.name.clone(), o.dims.clone(), r.shape.clone())),
                    None if scalar(outputs, &o.name) => {
                        Some((o.name.clone(), o.dims.clone(), Vec::new()))
                    }
                    None => None,
                })
                .collect(),
        }
    }

    /// The shape the model takes `name` in, for a tensor of `shape` (batch dimension
    /// included when batching), when it is reshaped.
    pub(super) fn input(&self, name: &str, shape: &[i64]) -> Option<Vec<i64>> {
        let (_, reshape, dims) = self.inputs.iter().find(|(n, ..)| n == name)?;
        let skip = usize::from(self.batching);
        Some(carry_variable(dims, shape.get(skip..)?, reshape))
    }

    /// Gives an output its declared dims back (they hold the same elements).
    pub(super) fn output(&self, tensor: &mut Tensor) {
        if let Some((_, dims, reshape)) = self.outputs.iter().find(|(n, ..)| *n == tensor.name) {
            let skip = usize::from(self.batching);
            let rows = tensor.shape.first().copied().filter(|_| self.batching);
            let given = tensor.shape.get(skip..).unwrap_or_default();
            let dims = carry_variable(reshape, given, dims);
            tensor.shape = rows.into_iter().chain(dims).collect();
        }
    }
}

/// `to` with its variable (-1) dimensions filled, in order, from the sizes `actual` has where
/// `from` is variable: how Triton carries a tensor's variable sizes through `reshape` (dims
/// `[2, -1]` reshaped to `[-1, 2]` takes `[2, 5]` to `[5, 2]`).
fn carry_variable(from: &[i64], actual: &[i64], to: &[i64]) -> Vec<i64> {
    let mut sizes = from
        .iter()
        .zip(actual)
        .filter(|(&f, _)| f == -1)
        .map(|(_, &a)| a);
    to.iter()
        .map(|&d| {
            if d == -1 {
                sizes.next().unwrap_or(-1)
            } else {
                d
            }
        })
        .collect()
}

impl OnnxInstance {
    /// How a batch of `requests` is padded (no padding without buckets).
    pub(super) fn padding(&self, requests: &[&InferRequest]) -> Padding {
        let rows = if self.shapes.batching {
            requests.iter().map(|r| batch::rows(r)).sum()
        } else {
            1
        };
        let Some(b) = self.buckets.as_deref() else {
            return Padding {
                rows,
                padded_rows: rows,
                sequence: None,
                session: 0,
            };
        };
        let padded_rows = if self.shapes.batching {
            b.batch_size(rows)
        } else {
            rows
        };
        // The batch's requests agree on their padded shape (the scheduler batches so).
        let sequence = requests
            .first()
            .and_then(|r| b.sequence_of(r))
            .map(|len| b.padded_len(len));
        let session = if self.sessions.len() > 1 {
            b.bucket_index(rows).min(self.sessions.len() - 1)
        } else {
            0
        };
        Padding {
            rows,
            padded_rows,
            sequence,
            session,
        }
    }

    /// Builds one ONNX Runtime input per model input from `requests` (several requests are
    /// concatenated along the batch dimension, and padded, while being copied in), runs the
    /// session and collects `outputs` for the real rows.
    pub(super) fn run(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
        padding: &Padding,
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let start = Instant::now();
        let Some(first) = requests.first() else {
            return Err(Error::internal("no request to run"));
        };
        // Batch inputs, made for this batch (ragged batching), are handed over with the rest.
        let made = match &self.ragged {
            Some(r) => r.make_batch_inputs(requests)?,
            None => Vec::new(),
        };
        let mut values: Vec<(&str, DynValue)> = Vec::with_capacity(first.inputs.len() + made.len());
        for (i, tensor) in first.inputs.iter().enumerate() {
            let parts: Vec<&Tensor> = requests.iter().filter_map(|r| r.inputs.get(i)).collect();
            if self
                .ragged
                .as_ref()
                .is_some_and(|r| r.is_ragged(&tensor.name))
            {
                let whole = RaggedBatching::concatenate(&parts)?;
                let shape = whole.shape.clone();
                let value = to_ort_value(&[&whole], shape, None, false, self.staging.allocator())?;
                values.push((tensor.name.as_str(), value));
                continue;
            }
            let mut shape = match &self.buckets {
                Some(b) => b.padded_shape(&tensor.name, &tensor.shape, padding.sequence),
                None => tensor.shape.clone(),
            };
            if self.shapes.batching {
                if let Some(rows) = shape.first_mut() {
                    *rows = padding.padded_rows as i64;
                }
            }
            let reshape = self.shapes.input(&tensor.name, &shape);
            let value = to_ort_value(
                &parts,
                shape,
                reshape.as_deref(),
                self.shapes.batching,
                self.staging.allocator(),
            )?;
            values.push((tensor.name.as_str(), value));
        }
        for tensor in &made {
            let value = to_ort_value(
                &[tensor],
                tensor.shape.clone(),
                None,
                false,
                self.staging.allocator(),
            )?;
            values.push((tensor.name.as_str(), value));
        }
        let prepared = Instant::now();
        let session = self
            .sessions
            .get_mut(padding.session)
            .ok_or_else(|| Error::internal("no session for this batch size"))?;
        let results = self
            .staging
            .run(session, values, outputs, self.run_options.as_deref())?;
        let ran = Instant::now();
        let mut tensors = Vec::with_capacity(outputs.len());
        for (name, value) in outputs.iter().zip(results) {
            let mut tensor = from_ort_value(name, value)?;
            if padding.padded_rows > padding.rows {
                tensor = batch::first_rows(&self.name, tensor, padding.rows)?;
            }
            self.shapes.output(&mut tensor);
            if let Some((_, want)) = self.output_types.iter().find(|(n, _)| n == name) {
                if *want != tensor.datatype {
                    return Err(Error::internal(format!(
                        "output '{name}' is {} but the configuration declares {}",
                        tensor.datatype, want
                    )));
                }
            }
            tensors.push(tensor);
        }
        let timings = ExecTimings {
            compute_input: prepared - start,
            compute_infer: ran - prepared,
            compute_output: ran.elapsed(),
            padded_rows: (padding.padded_rows - padding.rows) as u64,
        };
        Ok((tensors, timings))
    }

    /// Cuts a request's outputs back from the padded sequence length to its own.
    pub(super) fn unpad(
        &self,
        request: &InferRequest,
        outputs: &mut [Tensor],
        padding: &Padding,
    ) -> Result<()> {
        match (&self.buckets, padding.sequence) {
            (Some(b), Some(padded)) => match b.sequence_of(request) {
                Some(len) => b.crop_outputs(outputs, len, padded),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

impl ModelInstance for OnnxInstance {
    /// Like the default, but each request's inputs are copied once, straight into ONNX
    /// Runtime's tensors (padded there), instead of into a merged request first.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let _span = crate::trace_span!(parent: &tracing::Span::current(), "onnx.run").entered();
        let padding = self.padding(requests);
        let (tensors, timings) = match self.run(requests, outputs, &padding) {
            Ok(ran) => ran,
            Err(e) => return (vec![Err(e); requests.len()], ExecTimings::default()),
        };
        let rows: Vec<usize> = requests.iter().map(|r| batch::rows(r)).collect();
        let parts = if let Some(ragged) = &self.ragged {
            match ragged.split(&self.name, tensors, requests, &rows) {
                Ok(parts) => parts,
                Err(e) => return (vec![Err(e); requests.len()], timings),
            }
        } else if let [_] = requests {
            vec![tensors]
        } else {
            match batch::split(&self.name, tensors, &rows) {
                Ok(parts) => parts,
                Err(e) => return (vec![Err(e); requests.len()], timings),
            }
        };
        let results = requests
            .iter()
            .zip(parts)
            .map(|(request, mut tensors)| {
                self.unpad(request, &mut tensors, &padding)?;
                Ok(tensors)
            })
            .collect();
        (results, timings)
    }
}

pub(super) fn ort_error(name: &str, e: ort::Error) -> Error {
    Error::internal(format!("cannot hand tensor '{name}' to ONNX Runtime: {e}"))
}
