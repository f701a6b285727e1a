//! Inference (`/infer`, JSON and binary tensors, shared memory) and generate
//! (`/generate`, `/generate_stream`).

use std::collections::HashMap;

use axum::{
    body::Body,
    extract::{Path, State},
    http::{header, HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
    Extension, Json,
};
use serde_json::{json, Value};

use super::{codec, generate, path_parts};
use crate::{
    error::Error,
    frontends::{
        http::{
            body::{header_text, off_runtime, read_request_body},
            compression::{accepted_encoding, compress, encoders, PartsBody, LARGE_RESPONSE_BYTES},
            error::ApiResult,
            state::HttpState,
        },
        shared_memory::output_parameters,
    },
    inference::{InferRequest, InferResponse, Parameters, RequestedOutput},
    scheduling::door::{Door, Target},
    tenancy::{Admission, Caller},
};

/// An encoded response and the content encoding it was compressed with.
type Encoded = (codec::EncodedResponse, Option<&'static str>);

/// Encodes a response, compressed as the client accepts.
fn encode_and_compress(
    accept: Option<&'static str>,
    parameters: &Parameters,
    requested: &[RequestedOutput],
    response: &InferResponse,
) -> Result<Encoded, Error> {
    let mut encoded = codec::encode_response(parameters, requested, response)?;
    if let Some(encoding) = accept {
        if let Some(body) = compress(encoding, &encoded.parts) {
            encoded.parts = vec![body];
            return Ok((encoded, Some(encoding)));
        }
    }
    Ok((encoded, None))
}

/// [`encode_and_compress`], on a blocking thread when the response is large.
async fn encode_for(
    tenant: Option<&str>,
    headers: &HeaderMap,
    parameters: Parameters,
    requested: Vec<RequestedOutput>,
    response: InferResponse,
) -> Result<Encoded, Error> {
    let accept = accepted_encoding(headers);
    // Outputs written to shared memory are not encoded: they do not count.
    let size: usize = response
        .outputs
        .iter()
        .filter(|t| output_parameters(&requested, &t.name, 0).is_none())
        .map(|t| t.data.len())
        .sum();
    if size < LARGE_RESPONSE_BYTES {
        return encode_and_compress(accept, &parameters, &requested, &response);
    }
    let _permit = encoders(tenant)
        .acquire_owned()
        .await
        .map_err(|e| Error::internal(format!("cannot encode the response: {e}")))?;
    tokio::task::spawn_blocking(move || {
        encode_and_compress(accept, &parameters, &requested, &response)
    })
    .await
    .map_err(|e| Error::internal(format!("encoding the response failed: {e}")))?
}

pub(crate) async fn infer(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    st.server
        .serve(&caller, |door| run_infer(&st, door, &p, &headers, body))
        .await
}

async fn run_infer(
    st: &HttpState,
    door: Door,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let received = std::time::Instant::now();
    let (model, version) = path_parts(p);
    // An unknown model is named before the body is read (Triton's order), and the body is
    // admitted under the caller's quotas before anything in it is decoded.
    let target = door.resolve(&model, &version)?;
    let caller = door.caller();
    let version = Some(target.version());
    let body = read_request_body(st, caller, headers, body).await?;
    let _admission = caller.admit(body.len())?;
    let json_length = match headers.get(codec::HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    Error::invalid("Inference-Header-Content-Length must be a non-negative integer")
                })?,
        ),
    };
    let config = (json_length == Some(0)).then(|| target.config().clone());
    let (memory, who, max, limits) = (
        st.shared_memory.clone(),
        caller.clone(),
        st.max_input_size,
        *st.server.limits(),
    );
    let name = model.clone();
    let (mut request, inputs_held) = off_runtime(body.len(), move || {
        let reader = memory.reader(&who, max);
        let decoded = {
            let shared = |input: &str, params: &Parameters| reader.input(input, params);
            codec::decode_request(
                &name,
                version,
                body,
                json_length,
                config.as_ref(),
                &limits,
                &shared,
            )
        };
        decoded.map(|request| (request, reader.into_held()))
    })
    .await??;
    request.trace = st
        .tracing
        .request_span(&model, "http", &|name| header_text(headers, name));
    // The request's span lasts until its answer is encoded.
    let trace = request.trace.clone();
    trace.mark_at("HTTP_RECV_START", received);
    trace.mark("HTTP_RECV_END");
    let parameters = request.parameters.clone();
    let requested = request.outputs.clone();
    // The request's regions stay registered until its outputs are written (as on Triton).
    let mut held = st.shared_memory.check_outputs(caller, &requested)?;
    held.extend(inputs_held);
    let response = st.server.infer_on(&target, request).await?;
    trace.mark("HTTP_SEND_START");
    st.shared_memory
        .write_outputs(caller, &requested, &response)?;
    drop(held);
    let (encoded, encoding) =
        encode_for(caller.tenant(), headers, parameters, requested, response).await?;
    trace.mark("HTTP_SEND_END");
    let mut resp = Response::new(Body::new(PartsBody::new(encoded.parts)));
    let h = resp.headers_mut();
    match encoded.json_length {
        Some(len) => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(codec::HEADER_LENGTH, HeaderValue::from(len));
        }
        None => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
    }
    if let Some(enc) = encoding {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(enc));
    }
    Ok(resp)
}

/// Decodes a generate request for the model named in the path.
async fn generate_request(
    st: &HttpState,
    door: Door,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
    one_response: bool,
) -> Result<(Target, InferRequest, Admission), Error> {
    let (model, version) = path_parts(p);
    // As for `infer`: the model and the quotas before the body is decoded.
    let target = door.resolve(&model, &version)?;
    let caller = door.caller();
    let body = read_request_body(st, caller, headers, body).await?;
    let admission = caller.admit(body.len())?;
    let (for_request, name, version) = (
        target.config().clone(),
        model.clone(),
        Some(target.version()),
    );
    let mut request = off_runtime(body.len(), move || {
        generate::to_request(&for_request, &name, version, &body)
    })
    .await??;
    generate::default_stream(target.config(), &mut request, !one_response);
    request.trace = st
        .tracing
        .request_span(&model, "http", &|name| header_text(headers, name));
    Ok((target, request, admission))
}

/// `…/generate`: exactly one response, as JSON.
pub(crate) async fn generate(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    st.server
        .serve(&caller, |door| run_generate(&st, door, &p, &headers, body))
        .await
}

async fn run_generate(
    st: &HttpState,
    door: Door,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let (target, request, _admission) = generate_request(st, door, p, headers, body, true).await?;
    let model = request.model_name.clone();
    let mut items = st.server.infer_stream_on(&target, request);
    let mut responses = Vec::new();
    while let Some(item) = items.recv().await {
        responses.push(item?);
    }
    match responses.as_slice() {
        [one] => Ok(Json(generate::to_json(one))),
        other => Err(Error::invalid(format!(
            "generate: model '{model}' sent {} responses; use generate_stream to receive them all",
            other.len()
        ))
        .into()),
    }
}

/// `…/generate_stream`: every response as a server-sent event, errors in-band.
pub(crate) async fn generate_stream(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    use axum::response::sse::{Event, Sse};
    // Accounted as a success once the stream starts; its errors travel in-band.
    let (target, request, admission) = st
        .server
        .serve(&caller, |door| {
            generate_request(&st, door, &p, &headers, body, false)
        })
        .await?;
    let items = st.server.infer_stream_on(&target, request);
    // The admission rides along until the last event is sent.
    let events = futures::stream::unfold((items, admission), |(mut items, admission)| async move {
        let item = items.recv().await?;
        let data = match item {
            Ok(resp) => generate::to_json(&resp),
            Err(err) => json!({"error": err.message}),
        };
        Some((
            Ok::<_, std::convert::Infallible>(Event::default().data(data.to_string())),
            (items, admission),
        ))
    });
    // Triton's content type, which its clients and tests compare exactly.
    let mut response = Sse::new(events).into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(response)
}
