//! `ModelInfer`: one request, one response.

use crate::frontends::{shared_memory::SystemSharedMemory, trace::Tracing};
use crate::{
    error::Error,
    inference::Parameters,
    scheduling::{door::Target, server::Server},
};

use super::codec::{decode_request, encode_response};
use super::*;

pub(super) async fn infer_one(
    server: &Server,
    shm: &SystemSharedMemory,
    max_bytes: usize,
    tracing: &Tracing,
    context: &TraceContext,
    target: Target,
    req: ModelInferRequest,
) -> Result<ModelInferResponse, Error> {
    let received = std::time::Instant::now();
    let caller = target.caller();
    let reader = shm.reader(caller, max_bytes);
    let decoded = {
        let shared = |input: &str, params: &Parameters| reader.input(input, params);
        decode_request(req, &shared)
    };
    let inputs_held = reader.into_held();
    let mut request = decoded?;
    request.trace = tracing.request_span(&request.model_name, "grpc", &|k| context.get(k));
    let trace = request.trace.clone();
    // The message was read before this handler ran: waiting for it ends as it starts.
    trace.mark_at("GRPC_WAITREAD_START", received);
    trace.mark_at("GRPC_WAITREAD_END", received);
    let requested = request.outputs.clone();
    // The request's regions stay registered until its outputs are written (as on Triton).
    let mut held = shm.check_outputs(caller, &requested)?;
    held.extend(inputs_held);
    let response = server.infer_on(&target, request).await?;
    trace.mark("GRPC_SEND_START");
    shm.write_outputs(caller, &requested, &response)?;
    drop(held);
    let encoded = encode_response(response, &requested);
    trace.mark("GRPC_SEND_END");
    Ok(encoded)
}
