//! What a stage may call on the host (`wasmtron:stage/host`): send a response (decoupled
//! stages), log, and run another model with its caller's rights.

use super::*;

/// Why the epoch callback stopped a guest whose batch was cancelled (told apart from a crash).
#[derive(Debug)]
pub(super) struct StageCancelled;

impl std::fmt::Display for StageCancelled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cancelled: nobody waits for the answer")
    }
}

impl std::error::Error for StageCancelled {}

impl wit::Host for StageState {}

impl wit_host::Host for StageState {
    fn respond(
        &mut self,
        request: u32,
        outputs: Vec<wit::Tensor>,
    ) -> std::result::Result<(), wit::Error> {
        let Some(respond) = self.respond.as_mut() else {
            return Err(to_wit_error(Error::invalid(format!(
                "model '{}' is not decoupled: it answers each request once, by returning from \
                 execute (set model_transaction_policy {{ decoupled: true }} to stream)",
                self.model
            ))));
        };
        respond(request, outputs.into_iter().map(from_wit_tensor).collect()).map_err(to_wit_error)
    }

    fn log(&mut self, level: wit_host::LogLevel, message: String) {
        let model = self.model.as_str();
        match level {
            wit_host::LogLevel::Error => tracing::error!(model, "{message}"),
            wit_host::LogLevel::Warn => tracing::warn!(model, "{message}"),
            wit_host::LogLevel::Info => tracing::info!(model, "{message}"),
            wit_host::LogLevel::Debug => tracing::debug!(model, "{message}"),
        }
    }

    fn infer(
        &mut self,
        model: String,
        version: Option<i64>,
        inputs: Vec<wit::Tensor>,
        requested_outputs: Vec<String>,
    ) -> std::result::Result<Vec<wit::Tensor>, wit::Error> {
        let Some(caller) = self.caller.clone() else {
            return Err(to_wit_error(Error::unsupported(
                "calling other models is not available in this context",
            )));
        };
        if self.single_instance && model == self.model {
            return Err(to_wit_error(Error::invalid(format!(
                "stage '{model}' calls itself but has a single instance, which is busy running \
                 the caller: the call could never be served (give it more instances with \
                 instance_group, or call another model)"
            ))));
        }
        // Traced as a child of the stage's execution, when that is traced (its timestamps).
        let trace = Trace(
            crate::trace_span!(parent: &tracing::Span::current(), "stage.call", model = %model),
            crate::inference::TraceLevel::TIMESTAMPS,
        );
        let request = InferRequest {
            reply_parameters: Default::default(),
            reschedule: Default::default(),
            model_name: model,
            model_version: version,
            id: String::new(),
            parameters: Default::default(),
            inputs: inputs.into_iter().map(from_wit_tensor).collect(),
            outputs: requested_outputs
                .into_iter()
                .map(|name| RequestedOutput {
                    name,
                    parameters: Default::default(),
                })
                .collect(),
            deadline: self.call_deadline,
            responses: None,
            step_durations: None,
            callers: self.callers.clone(),
            from_stage: true,
            trace,
            // Cancelled with the batch that makes the call.
            cancel: self
                .cancel
                .as_ref()
                .map_or_else(Default::default, Cancellation::child),
        };
        caller
            .infer(request)
            .map(|resp| resp.outputs.iter().map(to_wit_tensor).collect())
            .map_err(|e| {
                if e.code == Code::PermissionDenied && self.refused_call.is_none() {
                    self.refused_call = Some(e.clone());
                }
                to_wit_error(e)
            })
    }
}
