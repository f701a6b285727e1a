//! Python functions bound as models (`Server.bind`, PyTriton's shape): each execution
//! instance holds one callable and runs it with the GIL held, on the model's worker thread, so
//! the server's scheduler and dynamic batcher drive it like any model. The callable is the
//! package's `_call_bound` wrapper around the user's function: tensors go in and come out as
//! `(name, datatype, shape, bytes)` tuples, and a raised exception comes back as
//! `(status, message)` with its traceback, which fails that execution's requests only.

use std::time::Instant;

use pyo3::prelude::*;
use wasmtron::{
    error::{Code, Error, Result},
    inference::InferRequest,
    runtime::{ExecTimings, ModelInstance},
    tensor::{DataType, Tensor},
};

/// One instance of a bound function.
pub struct BoundFunction {
    /// The model's name, for messages.
    pub model: String,
    /// `_call_bound(inputs, output_names) -> list of tensors | (status, message)`.
    pub call: Py<PyAny>,
    /// The declared outputs and their datatypes.
    pub outputs: Vec<(String, DataType)>,
}

/// What the wrapper hands back: outputs, or a failure with its status name.
#[derive(FromPyObject)]
enum Answer {
    Outputs(Vec<(String, String, Vec<i64>, Vec<u8>)>),
    Failed((String, String)),
}

impl BoundFunction {
    fn failure(&self, status: &str, message: &str) -> Error {
        let code = match status {
            "INVALID_ARGUMENT" => Code::InvalidArg,
            "NOT_FOUND" => Code::NotFound,
            "UNAVAILABLE" => Code::Unavailable,
            "UNSUPPORTED" => Code::Unsupported,
            _ => Code::Internal,
        };
        Error::new(
            code,
            format!(
                "model '{}': the bound function raised {message}",
                self.model
            ),
        )
    }

    /// The function's outputs as tensors, checked against the configuration.
    fn tensors(
        &self,
        outputs: Vec<(String, String, Vec<i64>, Vec<u8>)>,
        wanted: &[String],
    ) -> Result<Vec<Tensor>> {
        let mut by_name: Vec<Option<Tensor>> = vec![None; wanted.len()];
        for (name, datatype, shape, data) in outputs {
            let Some(at) = wanted.iter().position(|w| *w == name) else {
                continue;
            };
            let datatype = DataType::from_wire(&datatype).ok_or_else(|| {
                Error::internal(format!(
                    "model '{}': output '{name}' has unknown datatype '{datatype}'",
                    self.model
                ))
            })?;
            if let Some((_, declared)) = self.outputs.iter().find(|(n, _)| *n == name) {
                if *declared != datatype {
                    return Err(Error::internal(format!(
                        "model '{}': the bound function returned output '{name}' as {datatype}, \
                         but the model declares {declared}",
                        self.model
                    )));
                }
            }
            by_name[at] = Some(Tensor {
                name,
                datatype,
                shape,
                data: data.into(),
            });
        }
        wanted
            .iter()
            .zip(by_name)
            .map(|(name, tensor)| {
                tensor.ok_or_else(|| {
                    Error::internal(format!(
                        "model '{}': the bound function returned no output '{name}'",
                        self.model
                    ))
                })
            })
            .collect()
    }
}

impl BoundFunction {
    /// Runs one request (or the rows of several, merged) through the bound function.
    fn run(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let start = Instant::now();
        let answer = Python::attach(|py| -> PyResult<Answer> {
            // Lent without a copy, as outputs are (BYTES: copied into `bytes`).
            let inputs = request
                .inputs
                .iter()
                .map(|t| {
                    let data = crate::tensor_data(py, t.datatype, t.data.clone())?;
                    Ok((
                        t.name.as_str(),
                        t.datatype.wire_name(),
                        t.shape.as_slice(),
                        data,
                    ))
                })
                .collect::<PyResult<Vec<_>>>()?;
            self.call
                .bind(py)
                .call1((inputs, outputs.to_vec()))?
                .extract()
        })
        .map_err(|e| {
            Error::internal(format!(
                "model '{}': calling the bound function failed: {e}",
                self.model
            ))
        })?;
        let ran = start.elapsed();
        let tensors = match answer {
            Answer::Outputs(list) => self.tensors(list, outputs)?,
            Answer::Failed((status, message)) => return Err(self.failure(&status, &message)),
        };
        let timings = ExecTimings {
            compute_infer: ran,
            ..Default::default()
        };
        Ok((tensors, timings))
    }
}

impl ModelInstance for BoundFunction {
    /// Several requests run as one, merged along the batch dimension and cut back (one
    /// request runs as it is).
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        wasmtron::runtime::batch::execute_merged(requests, outputs, |r, o| self.run(r, o))
    }
}
