//! `ModelStreamInfer`: the responses of each request on a stream, in order, 0..N per request
//! for decoupled models, errors in-band as Triton sends them.

use std::{pin::Pin, sync::Arc};

use futures::{Stream, StreamExt};
use tonic::Status;

use crate::frontends::{on_behalf_of, shared_memory::SystemSharedMemory, trace::Tracing};
use crate::{
    error::Error,
    inference::{ParamValue, Parameters},
    scheduling::server::Server,
    tenancy::Caller,
};

use super::*;
use super::{
    codec::{decode_request, encode_response, params_to_proto},
    unary::known_model,
};

pub(super) type StreamResult =
    Pin<Box<dyn Stream<Item = Result<ModelStreamInferResponse, Status>> + Send>>;

pub(super) fn stream_error(id: String, err: Error) -> ModelStreamInferResponse {
    ModelStreamInferResponse {
        error_message: err.message,
        infer_response: Some(ModelInferResponse {
            id,
            ..Default::default()
        }),
    }
}

/// The responses of one request on a `ModelStreamInfer` stream. For decoupled models each
/// response says `triton_final_response: false`, and with the request parameter
/// `triton_enable_empty_final_response` an empty response with `triton_final_response: true`
/// marks the end, as Triton does.
pub(super) fn stream_one(
    server: Arc<Server>,
    shm: Arc<SystemSharedMemory>,
    max_bytes: usize,
    tracing: &Tracing,
    context: &TraceContext,
    caller: &Caller,
    req: ModelInferRequest,
) -> futures::stream::BoxStream<'static, Result<ModelStreamInferResponse, Status>> {
    let id = req.id.clone();
    let reader = shm.reader(caller, max_bytes);
    let shared = |input: &str, params: &Parameters| reader.input(input, params);
    let decoded = known_model(&server, &req)
        .and_then(|()| decode_request(req, &shared))
        .and_then(|r| shm.check_outputs(caller, &r.outputs).map(|()| r));
    let mut request = match decoded {
        Ok(r) => r,
        Err(err) => return futures::stream::once(async move { Ok(stream_error(id, err)) }).boxed(),
    };
    on_behalf_of(caller, &mut request);
    request.trace = tracing.request_span(&request.model_name, "grpc", &|k| context.get(k));
    let decoupled = server
        .models()
        .get(&request.model_name, request.model_version)
        .is_ok_and(|m| crate::runtime::is_decoupled(&m.config));
    let empty_final = matches!(
        request.parameters.get("triton_enable_empty_final_response"),
        Some(ParamValue::Bool(true))
    );
    let final_flag = |last: bool| {
        let mut p = Parameters::new();
        p.insert("triton_final_response".into(), ParamValue::Bool(last));
        params_to_proto(&p)
    };
    let (model, version) = (request.model_name.clone(), request.model_version);
    let final_id = id.clone();
    let requested = request.outputs.clone();
    let caller = caller.clone();
    let items = server.infer_stream(request);
    let responses = tokio_stream_from(items).map(move |item| {
        let item = item.and_then(|resp| {
            shm.write_outputs(&caller, &requested, &resp)?;
            Ok(resp)
        });
        Ok(match item {
            Ok(resp) => {
                let mut resp = encode_response(resp, &requested);
                if decoupled {
                    resp.parameters.extend(final_flag(false));
                }
                ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(resp),
                }
            }
            Err(err) => stream_error(id.clone(), err),
        })
    });
    let end = (decoupled && empty_final).then(|| {
        Ok(ModelStreamInferResponse {
            error_message: String::new(),
            infer_response: Some(ModelInferResponse {
                model_name: model,
                model_version: version.map(|v| v.to_string()).unwrap_or_default(),
                id: final_id,
                parameters: final_flag(true),
                ..Default::default()
            }),
        })
    });
    responses.chain(futures::stream::iter(end)).boxed()
}

/// A tokio receiver as a stream.
fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
