//! The tensors the sequence batcher adds to a request of a sequence: the control inputs the
//! model declares (START, END, READY, CORRID) and the implicit states, and the next states
//! taken out of the model's answer.

use std::path::Path;

use bytes::Bytes;

use super::{SequenceFlags, SequenceId};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    repository::sequence::{Control, ControlKind, InitialState, SequenceSpec, State},
    tensor::{element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// What a row of a sequence batch says through the control inputs.
pub(super) struct Controls<'a> {
    pub id: &'a SequenceId,
    pub start: bool,
    pub end: bool,
    /// False on a filler row (a slot with nothing to run).
    pub ready: bool,
}

impl<'a> Controls<'a> {
    /// A request of a sequence.
    pub fn of(flags: &'a SequenceFlags) -> Self {
        Self {
            id: &flags.id,
            start: flags.start,
            end: flags.end,
            ready: true,
        }
    }
}

/// The correlation ID a filler row carries: the model may not read anything of a row whose
/// READY is false, and Triton sends zero there.
pub(super) const FILLER_ID: SequenceId = SequenceId::Number(0);

/// A model's sequence settings, with what it needs to build the added tensors.
pub(super) struct Injector {
    pub model: String,
    pub spec: SequenceSpec,
    pub batching: bool,
    /// The first value of each state, shaped for one request.
    pub initial: Vec<Tensor>,
}

impl Injector {
    /// Reads the initial states (files from `model_dir/initial_state/`).
    pub fn new(model: &str, spec: SequenceSpec, batching: bool, model_dir: &Path) -> Result<Self> {
        let initial = spec
            .states
            .iter()
            .map(|state| initial_state(model, state, batching, model_dir))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            model: model.to_owned(),
            spec,
            batching,
            initial,
        })
    }

    /// The error for a request of a sequence that is not live; `hint` says more.
    pub fn not_started(&self, id: &SequenceId, hint: &str) -> Error {
        Error::invalid(format!(
            "inference request for sequence {id} to model '{}' must specify the START flag \
             on the first request of the sequence (parameter 'sequence_start'){hint}",
            self.model
        ))
    }

    /// Why a released sequence's ID is refused, for [`Self::not_started`].
    pub fn released_hint(&self) -> String {
        format!(
            " (it was released after {} ms without a request: max_sequence_idle_microseconds)",
            self.spec.max_idle.as_millis()
        )
    }

    /// `outputs` with every state output the client did not ask for added (taken out again
    /// by [`Self::take_states`]); also returns how many the client asked for.
    pub fn with_state_outputs(&self, mut outputs: Vec<String>) -> (Vec<String>, usize) {
        let requested = outputs.len();
        for state in &self.spec.states {
            if !outputs.contains(&state.output) {
                outputs.push(state.output.clone());
            }
        }
        (outputs, requested)
    }

    /// Adds the control inputs and the states (`None`: the initial ones) to a request.
    pub fn inject(
        &self,
        request: &mut InferRequest,
        controls: &Controls<'_>,
        states: Option<&[Tensor]>,
    ) -> Result<()> {
        self.add_controls(request, controls)?;
        let states = states.unwrap_or(&self.initial);
        request.inputs.extend(states.iter().cloned());
        Ok(())
    }

    /// The next states from a response (renamed to the state inputs); the state outputs the
    /// client did not ask for (those past `requested`) are taken out of it.
    pub fn take_states(
        &self,
        response: &mut InferResponse,
        requested: usize,
    ) -> Result<Vec<Tensor>> {
        let mut next = Vec::with_capacity(self.spec.states.len());
        for state in &self.spec.states {
            let found = response.outputs.iter().position(|t| t.name == state.output);
            let Some(index) = found else {
                return Err(Error::internal(format!(
                    "model '{}' did not return its state output '{}'",
                    self.model, state.output
                )));
            };
            let tensor = if index >= requested {
                response.outputs.remove(index)
            } else {
                response.outputs[index].clone()
            };
            next.push(Tensor {
                name: state.input.clone(),
                ..tensor
            });
        }
        Ok(next)
    }

    fn add_controls(&self, request: &mut InferRequest, controls: &Controls<'_>) -> Result<()> {
        let shape = if self.batching { vec![1, 1] } else { vec![1] };
        for control in &self.spec.controls {
            let data = match control.kind {
                ControlKind::Start => flag(control, controls.start),
                ControlKind::End => flag(control, controls.end),
                ControlKind::Ready => flag(control, controls.ready),
                ControlKind::CorrelationId => self.correlation_id(control, controls.id)?,
            };
            request.inputs.push(Tensor {
                name: control.name.clone(),
                datatype: control.datatype,
                shape: shape.clone(),
                data,
            });
        }
        Ok(())
    }

    fn correlation_id(&self, control: &Control, id: &SequenceId) -> Result<Bytes> {
        let number = match id {
            SequenceId::Number(n) => *n,
            SequenceId::Text(s) if control.datatype == DataType::Bytes => {
                let mut out = Vec::new();
                push_bytes_element(&mut out, s.as_bytes());
                return Ok(out.into());
            }
            SequenceId::Text(_) => {
                return Err(Error::invalid(format!(
                    "inference request for sequence {id} to model '{}': the model's \
                     correlation ID input '{}' is {}, so sequence_id must be an integer",
                    self.model,
                    control.name,
                    control.datatype.config_name()
                )))
            }
        };
        let too_big = || {
            Error::invalid(format!(
                "inference request for sequence {id} to model '{}': the ID does not fit the \
                 model's correlation ID input '{}' ({})",
                self.model,
                control.name,
                control.datatype.config_name()
            ))
        };
        let bytes = match control.datatype {
            DataType::Uint64 => number.to_le_bytes().to_vec(),
            DataType::Int64 => i64::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            DataType::Uint32 => u32::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            DataType::Int32 => i32::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            _ => {
                let mut out = Vec::new();
                push_bytes_element(&mut out, number.to_string().as_bytes());
                out
            }
        };
        Ok(bytes.into())
    }
}

fn flag(control: &Control, on: bool) -> Bytes {
    match &control.false_true {
        Some([off, true_value]) => Bytes::copy_from_slice(if on { true_value } else { off }),
        None => Bytes::new(),
    }
}

/// The first value of `state` for one request: `[1, dims]` for batching models.
fn initial_state(model: &str, state: &State, batching: bool, model_dir: &Path) -> Result<Tensor> {
    let mut shape = state.initial_dims.clone();
    if batching {
        shape.insert(0, 1);
    }
    let count = element_count(&shape).unwrap_or(0);
    let data: Bytes = match (&state.initial, state.datatype.element_size()) {
        (InitialState::Zeros, Some(size)) => vec![0u8; count * size].into(),
        // BYTES zeros: empty strings, each a zero length prefix.
        (InitialState::Zeros, None) => vec![0u8; count * 4].into(),
        (InitialState::File(file), _) => {
            let path = model_dir.join("initial_state").join(file);
            std::fs::read(&path)
                .map_err(|e| {
                    Error::invalid(format!(
                        "model '{model}': cannot read the initial state of '{}' from '{}': {e}",
                        state.input,
                        path.display()
                    ))
                })?
                .into()
        }
    };
    let tensor = Tensor {
        name: state.input.clone(),
        datatype: state.datatype,
        shape,
        data,
    };
    tensor.validate_size().map_err(|e| {
        Error::invalid(format!(
            "model '{model}': the initial state of '{}' does not fit {} {}: {}",
            state.input,
            state.datatype.config_name(),
            shape_string(&state.initial_dims),
            e.message
        ))
    })?;
    Ok(tensor)
}
