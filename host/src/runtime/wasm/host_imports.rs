//! What a stage may call on the host (`wasmtron:stage/host`): send a response (decoupled
//! stages), log, and run another model with its caller's rights.

use super::*;

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
        let caller = guest_calls::caller_of(self.caller.as_ref()).map_err(to_wit_error)?;
        let batch = guest_calls::CallingBatch {
            model: &self.model,
            kind: guest_calls::GuestKind::Stage,
            single_instance: self.single_instance,
            deadline: self.call_deadline,
            callers: &self.callers,
            cancel: self.cancel.as_ref(),
        };
        let request = batch
            .request(guest_calls::Call {
                model,
                version,
                id: String::new(),
                parameters: Default::default(),
                inputs: inputs.into_iter().map(from_wit_tensor).collect(),
                outputs: requested_outputs,
                deadline: None,
            })
            .map_err(to_wit_error)?;
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
