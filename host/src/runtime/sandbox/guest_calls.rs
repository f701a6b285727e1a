//! A guest's calls to other models (a stage's `infer`, a `model.py`'s BLS requests), made the
//! same way by every backend that runs guest code: the call runs with the rights of the
//! callers the calling batch runs for, within the batch's deadline (or sooner), is cancelled
//! with the batch, is traced under the batch's execution, and a model with one instance may
//! not call itself (that instance is busy running the caller).

use std::{sync::Arc, time::Instant};

use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
    inference::{Parameters, RequestedOutput, Trace, TraceLevel},
    runtime::backend::ModelCaller,
    tenancy::Caller,
    tensor::Tensor,
};

/// Which kind of guest calls: how messages name it and the trace span its calls get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestKind {
    /// A Wasm stage (spans `stage.call`).
    Stage,
    /// A `model.py` (spans `python.call`).
    PythonModel,
}

/// The execution a call is made from: what the call inherits.
pub struct CallingBatch<'a> {
    /// The calling model.
    pub model: &'a str,
    /// What it is.
    pub kind: GuestKind,
    /// It has one instance (busy running the caller).
    pub single_instance: bool,
    /// The batch's deadline, if any: its calls end by then.
    pub deadline: Option<Instant>,
    /// The callers the batch runs for: the call needs every one's right.
    pub callers: &'a [Caller],
    /// The batch's cancellation: its calls are cancelled with it.
    pub cancel: Option<&'a Cancellation>,
}

/// The model a guest calls and what it sends.
pub struct Call {
    /// The called model.
    pub model: String,
    /// Its version; `None`: the policy's.
    pub version: Option<i64>,
    /// The request's id.
    pub id: String,
    /// The request's parameters.
    pub parameters: Parameters,
    /// Its inputs.
    pub inputs: Vec<Tensor>,
    /// The outputs asked for (all, when empty).
    pub outputs: Vec<String>,
    /// A deadline of the call's own (a BLS request's timeout); the sooner one applies.
    pub deadline: Option<Instant>,
}

/// How guest code reaches other models, or an error saying it cannot here (a stage run
/// outside a server).
pub fn caller_of(caller: Option<&Arc<dyn ModelCaller>>) -> Result<Arc<dyn ModelCaller>> {
    caller
        .cloned()
        .ok_or_else(|| Error::unsupported("calling other models is not available in this context"))
}

impl CallingBatch<'_> {
    /// The request `call` becomes, or why it may not be made.
    pub fn request(&self, call: Call) -> Result<crate::inference::InferRequest> {
        if self.single_instance && call.model == self.model {
            let who = match self.kind {
                GuestKind::Stage => "stage",
                GuestKind::PythonModel => "model",
            };
            return Err(Error::invalid(format!(
                "{who} '{}' calls itself but has a single instance, which is busy running the \
                 caller: the call could never be served (give it more instances with \
                 instance_group, or call another model)",
                self.model
            )));
        }
        let deadline = match (self.deadline, call.deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Traced as a child of the calling execution, when that is traced (its timestamps).
        let parent = tracing::Span::current();
        let span = match self.kind {
            GuestKind::Stage => {
                crate::trace_span!(parent: &parent, "stage.call", model = %call.model)
            }
            GuestKind::PythonModel => {
                crate::trace_span!(parent: &parent, "python.call", model = %call.model)
            }
        };
        Ok(crate::inference::InferRequest {
            reply_parameters: Default::default(),
            reschedule: Default::default(),
            sequence_queued: Default::default(),
            model_name: call.model,
            model_version: call.version,
            id: call.id,
            parameters: call.parameters,
            inputs: call.inputs,
            outputs: call
                .outputs
                .into_iter()
                .map(|name| RequestedOutput {
                    name,
                    parameters: Default::default(),
                })
                .collect(),
            deadline,
            responses: None,
            step_durations: None,
            callers: self.callers.to_vec(),
            from_stage: true,
            trace: Trace(span, TraceLevel::TIMESTAMPS),
            cancel: self
                .cancel
                .map_or_else(Default::default, Cancellation::child),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(model: &str) -> Call {
        Call {
            model: model.into(),
            version: None,
            id: String::new(),
            parameters: Default::default(),
            inputs: Vec::new(),
            outputs: vec!["y".into()],
            deadline: None,
        }
    }

    #[test]
    fn a_call_inherits_the_batch_and_a_lone_instance_may_not_call_itself() {
        let cancel = Cancellation::default();
        let soon = Instant::now() + std::time::Duration::from_secs(5);
        let batch = CallingBatch {
            model: "m",
            kind: GuestKind::Stage,
            single_instance: true,
            deadline: Some(soon),
            callers: &[],
            cancel: Some(&cancel),
        };
        let e = batch.request(call("m")).unwrap_err();
        assert!(
            e.message.contains("stage 'm' calls itself"),
            "{}",
            e.message
        );
        let mut other = call("n");
        other.deadline = Some(soon + std::time::Duration::from_secs(5));
        let request = batch.request(other).unwrap();
        assert_eq!(request.deadline, Some(soon), "the sooner deadline applies");
        assert!(request.from_stage);
        assert!(!request.cancel.is_cancelled());
        cancel.cancel();
        assert!(request.cancel.is_cancelled(), "cancelled with the batch");
    }
}
