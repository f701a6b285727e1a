//! KServe v2 over HTTP (axum): health, metadata, inference (JSON and binary), model
//! configuration, statistics and repository control, with Triton's routes, `{"error": ...}`
//! bodies and status codes.

pub mod codec;
pub mod generate;

use std::{collections::HashMap, io::Read, sync::Arc};

use axum::{
    body::Body,
    extract::{DefaultBodyLimit, Path, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{any, get, post},
    Extension, Json, Router,
};
use base64::Engine;
use bytes::Bytes;
use serde_json::{json, Value};

use super::{
    check_load, check_unload, model_config, model_metadata, model_statistics, on_behalf_of,
    parse_version,
    restricted::{ApiGroup, Restrictions},
    shared_memory::{
        output_parameters, Kind as MemoryKind, Location, RegionStatus, SystemSharedMemory,
    },
    trace::Tracing,
    EXTENSIONS, SERVER_NAME, SERVER_VERSION,
};
use crate::{
    error::{Code, Error},
    inference::{InferRequest, InferResponse, Parameters, RequestedOutput},
    names::ModelName,
    proto::inference::{ModelStatistics, StatisticDuration},
    repository::config::to_json,
    scheduling::{model_manager::LoadOverride, server::Server},
    tenancy::{Admission, Caller, ModelAction, Tenancy},
};

/// State shared by the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    /// The server core.
    pub server: Arc<Server>,
    /// Largest request body accepted, before and after decompression.
    pub max_input_size: usize,
    /// Tenants and their keys; `None` serves everyone (single-tenant).
    pub tenancy: Option<Arc<Tenancy>>,
    /// API groups that need a shared-secret header (`--http-restricted-api`).
    pub restrictions: Arc<Restrictions>,
    /// Registered system shared-memory regions (shared with the gRPC frontend).
    pub shared_memory: Arc<SystemSharedMemory>,
    /// Which requests are traced (shared with the gRPC frontend).
    pub tracing: Arc<Tracing>,
}

/// An error rendered as Triton does: a status code and `{"error": "..."}`.
pub struct ApiError(pub Error);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError(e)
    }
}

/// The HTTP status for an error code.
pub fn status_for(code: Code) -> StatusCode {
    match code {
        Code::InvalidArg | Code::AlreadyExists | Code::Cancelled => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unsupported => StatusCode::NOT_IMPLEMENTED,
        Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            status_for(self.0.code),
            Json(json!({ "error": self.0.message })),
        )
            .into_response();
        if self.0.code == Code::Unauthenticated {
            let challenge = HeaderValue::from_static("Bearer");
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

/// Checks the restricted API groups' headers, finds who sent a request (its API key) and
/// hands the [`Caller`] to the handlers; health probes need no key, so that orchestrators can
/// check the server.
async fn authenticate(
    State(st): State<HttpState>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(group) = ApiGroup::of_http_path(request.uri().path()) {
        let headers = request.headers();
        if let Err(e) = st.restrictions.check(group, |name| {
            headers.get(name).and_then(|v| v.to_str().ok())
        }) {
            if request.uri().path().starts_with("/v1/") {
                return super::openai::error_response(&e, None);
            }
            return ApiError(e).into_response();
        }
    }
    let caller = match &st.tenancy {
        Some(tenancy) if !request.uri().path().starts_with("/v2/health/") => {
            let key = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            match tenancy.authenticate(key) {
                Ok(caller) => caller,
                Err(e) if request.uri().path().starts_with("/v1/") => {
                    return super::openai::error_response(&e, None)
                }
                Err(e) => return ApiError(e).into_response(),
            }
        }
        _ => Caller::Anyone,
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}

type ApiResult<T> = Result<T, ApiError>;

/// Builds the router with every route.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{model}", get(metadata))
        .route("/v2/models/{model}/versions/{version}", get(metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route(
            "/v2/models/{model}/versions/{version}/ready",
            get(model_ready),
        )
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer))
        .route("/v2/models/{model}/generate", post(generate))
        .route(
            "/v2/models/{model}/versions/{version}/generate",
            post(generate),
        )
        .route("/v2/models/{model}/generate_stream", post(generate_stream))
        .route(
            "/v2/models/{model}/versions/{version}/generate_stream",
            post(generate_stream),
        )
        .route("/v2/models/{model}/config", get(config))
        .route("/v2/models/{model}/versions/{version}/config", get(config))
        .route("/v2/models/{model}/stats", get(stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(stats))
        .route("/v2/repository/index", post(index))
        .route("/v2/repository/{repository}/index", post(index))
        .route("/v2/repository/models/{model}/load", post(load))
        .route(
            "/v2/repository/{repository}/models/{model}/load",
            post(load),
        )
        .route("/v2/repository/models/{model}/unload", post(unload))
        .route(
            "/v2/repository/{repository}/models/{model}/unload",
            post(unload),
        )
        .route("/v2/systemsharedmemory/status", get(shm_status::<false>))
        .route(
            "/v2/systemsharedmemory/region/{region}/status",
            get(shm_status::<false>),
        )
        .route(
            "/v2/systemsharedmemory/region/{region}/register",
            post(shm_register),
        )
        .route(
            "/v2/systemsharedmemory/unregister",
            post(shm_unregister::<false>),
        )
        .route(
            "/v2/systemsharedmemory/region/{region}/unregister",
            post(shm_unregister::<false>),
        )
        .route("/v2/cudasharedmemory/status", get(shm_status::<true>))
        .route(
            "/v2/cudasharedmemory/region/{region}/status",
            get(shm_status::<true>),
        )
        .route(
            "/v2/cudasharedmemory/region/{region}/register",
            post(cuda_register),
        )
        .route(
            "/v2/cudasharedmemory/unregister",
            post(shm_unregister::<true>),
        )
        .route(
            "/v2/cudasharedmemory/region/{region}/unregister",
            post(shm_unregister::<true>),
        )
        .route(
            "/v2/trace/setting",
            get(trace_settings).post(update_trace_settings),
        )
        .route(
            "/v2/models/{model}/trace/setting",
            get(trace_settings).post(update_trace_settings),
        )
        .route("/v2/logging", any(admin_unsupported))
        .route("/v1/models", get(super::openai::models))
        .route("/v1/completions", post(super::openai::completions))
        .route(
            "/v1/chat/completions",
            post(super::openai::chat_completions),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are read with our own limit so that oversize requests get a JSON error.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate,
        ))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError(Error::not_found("Not Found"))
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(json!({"error": "Method Not Allowed"})),
    )
        .into_response()
}

/// The region a shared-memory route names, if it names one.
fn region_name(p: &Option<Path<HashMap<String, String>>>) -> Option<&str> {
    p.as_ref()?.get("region").map(String::as_str)
}

fn region_json(r: RegionStatus) -> Value {
    match r.location {
        Location::System { key, offset } => {
            json!({"name": r.name, "key": key, "offset": offset, "byte_size": r.byte_size})
        }
        Location::Cuda { device_id } => {
            json!({"name": r.name, "device_id": device_id, "byte_size": r.byte_size})
        }
    }
}

fn regions_json(regions: Vec<RegionStatus>) -> Json<Value> {
    Json(Value::Array(regions.into_iter().map(region_json).collect()))
}

/// System (`CUDA` false) or CUDA shared memory, for the handlers shared by the two.
fn memory_kind(cuda: bool) -> MemoryKind {
    if cuda {
        MemoryKind::Cuda
    } else {
        MemoryKind::System
    }
}

/// `GET /v2/{system,cuda}sharedmemory[/region/<name>]/status`: the caller's regions.
async fn shm_status<const CUDA: bool>(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
) -> ApiResult<Json<Value>> {
    let regions = st
        .shared_memory
        .status(&caller, memory_kind(CUDA), region_name(&p))?;
    Ok(regions_json(regions))
}

/// `POST /v2/systemsharedmemory/region/<name>/register` with `{"key", "offset", "byte_size"}`.
async fn shm_register(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let name = p.get("region").cloned().unwrap_or_default();
    let body = read_body(&st, &headers, body).await?;
    let request = optional_json(&body)?;
    let key = request["key"].as_str().ok_or_else(|| {
        Error::invalid(format!(
            "registering shared memory region '{name}': 'key' (a string) is required"
        ))
    })?;
    let number = |field: &str, required: bool| -> Result<u64, Error> {
        match &request[field] {
            Value::Null if !required => Ok(0),
            v => v.as_u64().ok_or_else(|| {
                Error::invalid(format!(
                    "registering shared memory region '{name}': '{field}' must be a non-negative integer"
                ))
            }),
        }
    };
    let (offset, byte_size) = (number("offset", false)?, number("byte_size", true)?);
    st.shared_memory
        .register(&caller, &name, key, offset, byte_size)?;
    Ok(Json(json!({})))
}

/// `POST /v2/{system,cuda}sharedmemory[/region/<name>]/unregister`.
async fn shm_unregister<const CUDA: bool>(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
) -> ApiResult<Json<Value>> {
    st.shared_memory
        .unregister(&caller, memory_kind(CUDA), region_name(&p))?;
    Ok(Json(json!({})))
}

/// `POST /v2/cudasharedmemory/region/<name>/register` with
/// `{"raw_handle": {"b64": ...}, "device_id", "byte_size"}`.
async fn cuda_register(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let name = p.get("region").cloned().unwrap_or_default();
    let body = read_body(&st, &headers, body).await?;
    let request = optional_json(&body)?;
    let field = |what: &str| {
        Error::invalid(format!(
            "registering CUDA shared memory region '{name}': {what}"
        ))
    };
    let handle = request["raw_handle"]["b64"]
        .as_str()
        .ok_or_else(|| field("'raw_handle' must be {\"b64\": <base64 string>}"))?;
    let handle = base64::engine::general_purpose::STANDARD
        .decode(handle)
        .map_err(|e| field(&format!("'raw_handle' is not valid base64: {e}")))?;
    let device_id = request["device_id"]
        .as_i64()
        .ok_or_else(|| field("'device_id' must be an integer"))?;
    let byte_size = request["byte_size"]
        .as_u64()
        .ok_or_else(|| field("'byte_size' must be a non-negative integer"))?;
    st.shared_memory
        .register_cuda(&caller, &name, &handle, device_id, byte_size)?;
    Ok(Json(json!({})))
}

/// Log settings: for administrators, and not offered yet.
async fn admin_unsupported(Extension(caller): Extension<Caller>) -> ApiError {
    match caller.require_admin("the trace and logging APIs") {
        Err(e) => ApiError(e),
        Ok(()) => ApiError(Error::unsupported(
            "this extension (logging) is not supported by this server",
        )),
    }
}

fn settings_json(settings: std::collections::BTreeMap<String, Vec<String>>) -> Json<Value> {
    // Triton's shapes: trace_level is a list, the others single strings.
    Json(Value::Object(
        settings
            .into_iter()
            .map(|(k, v)| {
                let value = if k == "trace_level" {
                    json!(v)
                } else {
                    json!(v.into_iter().next().unwrap_or_default())
                };
                (k, value)
            })
            .collect(),
    ))
}

/// `GET /v2[/models/<model>]/trace/setting`: for administrators.
async fn trace_settings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    let model = p.as_ref().and_then(|p| p.get("model")).map(String::as_str);
    Ok(settings_json(st.tracing.settings(model)))
}

/// `POST /v2[/models/<model>]/trace/setting` with `{"trace_level": ["TIMESTAMPS"],
/// "trace_rate": "1", ...}`; `null` clears a model's setting.
async fn update_trace_settings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    let model = p.as_ref().and_then(|p| p.get("model")).map(String::as_str);
    let body = read_body(&st, &headers, body).await?;
    let Value::Object(fields) = optional_json(&body)? else {
        return Err(Error::invalid("trace settings must be a JSON object").into());
    };
    let mut changes = std::collections::BTreeMap::new();
    for (key, value) in fields {
        let value = match value {
            Value::Null => None,
            Value::String(s) => Some(vec![s]),
            Value::Number(n) => Some(vec![n.to_string()]),
            Value::Array(items) => Some(
                items
                    .into_iter()
                    .map(|v| match v {
                        Value::String(s) => s,
                        other => other.to_string(),
                    })
                    .collect(),
            ),
            other => {
                return Err(Error::invalid(format!(
                    "trace setting '{key}': {other} is not a string, a list or null"
                ))
                .into())
            }
        };
        changes.insert(key, value);
    }
    Ok(settings_json(st.tracing.update(model, changes)?))
}

fn health(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    }
}

async fn live(State(st): State<HttpState>) -> StatusCode {
    health(st.server.is_live())
}

async fn ready(State(st): State<HttpState>) -> StatusCode {
    health(st.server.is_ready())
}

async fn server_metadata() -> Json<Value> {
    Json(json!({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS}))
}

fn path_parts(p: &HashMap<String, String>) -> (String, String) {
    (
        p.get("model").cloned().unwrap_or_default(),
        p.get("version").cloned().unwrap_or_default(),
    )
}

async fn metadata(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let (model, version) = path_parts(&p);
    caller.require(ModelAction::See, &model)?;
    let m = model_metadata(&st.server, &model, &version)?;
    let tensors =
        |ts: &[crate::proto::inference::model_metadata_response::TensorMetadata]| -> Vec<Value> {
            ts.iter()
                .map(|t| json!({"name": t.name, "datatype": t.datatype, "shape": t.shape}))
                .collect()
        };
    Ok(Json(json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
    })))
}

async fn model_ready(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<StatusCode> {
    let (model, version) = path_parts(&p);
    caller.require(ModelAction::See, &model)?;
    let version = parse_version(&model, &version)?;
    Ok(health(st.server.models().is_ready(&model, version)))
}

async fn config(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let (model, version) = path_parts(&p);
    caller.require(ModelAction::See, &model)?;
    Ok(Json(to_json(&model_config(&st.server, &model, &version)?)))
}

fn duration_json(d: &Option<StatisticDuration>) -> Value {
    let d = d.unwrap_or_default();
    json!({"count": d.count, "ns": d.ns})
}

/// The statistics extension's JSON (`GET /v2/models/<m>/stats`), also what the in-process
/// Python API returns.
pub fn stats_json(stats: Vec<ModelStatistics>) -> Value {
    let models: Vec<Value> = stats
        .into_iter()
        .map(|s| {
            let i = s.inference_stats.unwrap_or_default();
            json!({
                "name": s.name,
                "version": s.version,
                "last_inference": s.last_inference,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": duration_json(&i.success),
                    "fail": duration_json(&i.fail),
                    "queue": duration_json(&i.queue),
                    "compute_input": duration_json(&i.compute_input),
                    "compute_infer": duration_json(&i.compute_infer),
                    "compute_output": duration_json(&i.compute_output),
                    "cache_hit": duration_json(&i.cache_hit),
                    "cache_miss": duration_json(&i.cache_miss),
                },
                "response_stats": {},
                "batch_stats": s.batch_stats.iter().map(|b| json!({
                    "batch_size": b.batch_size,
                    "compute_input": duration_json(&b.compute_input),
                    "compute_infer": duration_json(&b.compute_infer),
                    "compute_output": duration_json(&b.compute_output),
                })).collect::<Vec<_>>(),
                "memory_usage": [],
                "warmup": duration_json(&s.warmup),
            })
        })
        .collect();
    json!({ "model_stats": models })
}

async fn all_stats(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    let mut stats = model_statistics(&st.server, "", "")?;
    stats.retain(|s| caller.may(ModelAction::See, &s.name));
    Ok(Json(stats_json(stats)))
}

async fn stats(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let (model, version) = path_parts(&p);
    caller.require(ModelAction::See, &model)?;
    Ok(Json(stats_json(model_statistics(
        &st.server, &model, &version,
    )?)))
}

/// Reads a body up to the size limit, then undoes `Content-Encoding: gzip|deflate`.
pub(crate) async fn read_body(
    st: &HttpState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Error> {
    let limit = st.max_input_size;
    let raw = axum::body::to_bytes(body, limit).await.map_err(|_| {
        Error::invalid(format!(
            "request body is larger than the maximum input size of {limit} bytes (--http-max-input-size)"
        ))
    })?;
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase());
    let mut out = Vec::new();
    let read = match encoding.as_deref() {
        None | Some("") | Some("identity") => return Ok(raw),
        Some("gzip") => flate2::read::GzDecoder::new(&raw[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut out),
        Some("deflate") => flate2::read::ZlibDecoder::new(&raw[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut out),
        Some(other) => {
            return Err(Error::unsupported(format!(
                "unsupported Content-Encoding '{other}' (supported: gzip, deflate)"
            )))
        }
    };
    read.map_err(|e| {
        Error::invalid(format!(
            "cannot decompress the request body ({}): {e}",
            encoding.as_deref().unwrap_or_default()
        ))
    })?;
    if out.len() > limit {
        return Err(Error::invalid(format!(
            "decompressed request body is larger than the maximum input size of {limit} bytes (--http-max-input-size)"
        )));
    }
    Ok(out.into())
}

/// A request header as text, if present and printable.
fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name)?.to_str().ok().map(str::to_owned)
}

/// The content encoding of our responses the client accepts (`Accept-Encoding`), if any.
fn accepted_encoding(headers: &HeaderMap) -> Option<&'static str> {
    let accept = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())?
        .to_ascii_lowercase();
    if accept.contains("gzip") {
        Some("gzip")
    } else if accept.contains("deflate") {
        Some("deflate")
    } else {
        None
    }
}

/// `parts` compressed as `encoding` ("gzip" or "deflate"); `None` if that fails.
fn compress(encoding: &str, parts: &[Bytes]) -> Option<Bytes> {
    use std::io::Write;
    let level = flate2::Compression::fast();
    let len: usize = parts.iter().map(Bytes::len).sum();
    let out = Vec::with_capacity(len / 4 + 64);
    let out = if encoding == "gzip" {
        let mut enc = flate2::write::GzEncoder::new(out, level);
        parts.iter().try_for_each(|p| enc.write_all(p)).ok()?;
        enc.finish().ok()?
    } else {
        let mut enc = flate2::write::ZlibEncoder::new(out, level);
        parts.iter().try_for_each(|p| enc.write_all(p)).ok()?;
        enc.finish().ok()?
    };
    Some(out.into())
}

/// Responses whose tensors hold more bytes than this are encoded and compressed off the
/// async runtime: compressing (or writing as JSON) hundreds of kilobytes holds a runtime
/// thread for a millisecond or more, and every connection that thread serves, whoever's it
/// is, waits that long.
const LARGE_RESPONSE_BYTES: usize = 64 << 10;

/// Large responses a tenant may have encoded at once: half the cores (at least one) with
/// tenants, every core without. Each tenant has its own permits, so a tenant whose flood of
/// large answers waits here never makes another tenant's answer wait behind it.
fn encoders(tenant: Option<&str>) -> Arc<tokio::sync::Semaphore> {
    static ENCODERS: std::sync::OnceLock<
        std::sync::Mutex<HashMap<Option<String>, Arc<tokio::sync::Semaphore>>>,
    > = std::sync::OnceLock::new();
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let permits = if tenant.is_some() {
        (cores / 2).max(1)
    } else {
        cores
    };
    let mut all = ENCODERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.entry(tenant.map(str::to_owned))
        .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(permits)))
        .clone()
}

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

/// A body sent as it was encoded, in parts, with its exact length (so that it goes out with
/// `Content-Length`, not chunked).
struct PartsBody {
    parts: std::collections::VecDeque<Bytes>,
    remaining: u64,
}

impl PartsBody {
    fn new(parts: Vec<Bytes>) -> Self {
        let remaining = parts.iter().map(|p| p.len() as u64).sum();
        Self {
            parts: parts.into(),
            remaining,
        }
    }
}

impl http_body::Body for PartsBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let next = self.parts.pop_front();
        if let Some(part) = &next {
            self.remaining -= part.len() as u64;
        }
        std::task::Poll::Ready(next.map(|part| Ok(http_body::Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.remaining)
    }
}

/// How a request ended, for the per-tenant accounting.
fn outcome<T>(result: &ApiResult<T>) -> Result<(), Code> {
    result.as_ref().map(|_| ()).map_err(|e| e.0.code)
}

async fn infer(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let track = super::track(&st.server, &caller, &path_parts(&p).0);
    let result = run_infer(&st, &caller, &p, &headers, body).await;
    track.finish(outcome(&result));
    result
}

async fn run_infer(
    st: &HttpState,
    caller: &Caller,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let (model, version) = path_parts(p);
    caller.require(ModelAction::Infer, &model)?;
    let version = parse_version(&model, &version)?;
    let body = read_body(st, headers, body).await?;
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
    // An unknown model is named before anything in the body is (Triton's order).
    let target = st.server.models().get(&model, version)?;
    let config = (json_length == Some(0)).then_some(&target.config);
    let reader = st.shared_memory.reader(caller, st.max_input_size);
    let shared = |input: &str, params: &Parameters| reader.input(input, params);
    let mut request = codec::decode_request(
        &model,
        version,
        body,
        json_length,
        config,
        st.server.limits(),
        &shared,
    )?;
    drop(target);
    on_behalf_of(caller, &mut request);
    request.trace = st
        .tracing
        .request_span(&model, "http", &|name| header_text(headers, name));
    // The request's span lasts until its answer is encoded.
    let _trace = request.trace.clone();
    let parameters = request.parameters.clone();
    let requested = request.outputs.clone();
    st.shared_memory.check_outputs(caller, &requested)?;
    let response = st.server.infer(request).await?;
    st.shared_memory
        .write_outputs(caller, &requested, &response)?;
    let (encoded, encoding) =
        encode_for(caller.tenant(), headers, parameters, requested, response).await?;
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
    caller: &Caller,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(InferRequest, Admission), Error> {
    let (model, version) = path_parts(p);
    caller.require(ModelAction::Infer, &model)?;
    let version = parse_version(&model, &version)?;
    let body = read_body(st, headers, body).await?;
    let admission = caller.admit(body.len())?;
    let config = st.server.models().get(&model, version)?.config.clone();
    let json: Value = serde_json::from_slice(&body)
        .map_err(|e| Error::invalid(format!("generate: the body is not valid JSON: {e}")))?;
    let mut request = generate::to_request(&config, &model, version, json)?;
    on_behalf_of(caller, &mut request);
    request.trace = st
        .tracing
        .request_span(&model, "http", &|name| header_text(headers, name));
    Ok((request, admission))
}

/// `…/generate`: exactly one response, as JSON.
async fn generate(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let track = super::track(&st.server, &caller, &path_parts(&p).0);
    let result = run_generate(&st, &caller, &p, &headers, body).await;
    track.finish(outcome(&result));
    result
}

async fn run_generate(
    st: &HttpState,
    caller: &Caller,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let (request, _admission) = generate_request(st, caller, p, headers, body).await?;
    let model = request.model_name.clone();
    let mut items = st.server.infer_stream(request);
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
async fn generate_stream(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    use axum::response::sse::{Event, Sse};
    // Accounted as a success once the stream starts; its errors travel in-band.
    let track = super::track(&st.server, &caller, &path_parts(&p).0);
    let started = generate_request(&st, &caller, &p, &headers, body).await;
    track.finish(started.as_ref().map(|_| ()).map_err(|e| e.code));
    let (request, admission) = started?;
    let items = st.server.infer_stream(request);
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
    Ok(Sse::new(events).into_response())
}

fn optional_json(body: &Bytes) -> Result<Value, Error> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(body)
        .map_err(|e| Error::invalid(format!("failed to parse the request JSON buffer: {e}")))
}

async fn index(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let body = read_body(&st, &headers, body).await?;
    let ready = optional_json(&body)?
        .get("ready")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let entries: Vec<Value> = st
        .server
        .models()
        .index(ready)
        .into_iter()
        .filter(|e| caller.may(ModelAction::See, &e.name))
        .map(|e| {
            let mut v = json!({"name": e.name, "state": e.state.as_str()});
            if let Some(version) = e.version {
                v["version"] = json!(version.to_string());
            }
            if !e.reason.is_empty() {
                v["reason"] = json!(e.reason);
            }
            v
        })
        .collect();
    Ok(Json(Value::Array(entries)))
}

async fn load(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    st.server.check_model_control()?;
    let (model, _) = path_parts(&p);
    ModelName::parse(&model)?;
    caller.require(ModelAction::Load, &model)?;
    let body = read_body(&st, &headers, body).await?;
    let request = optional_json(&body)?;
    let mut overrides = LoadOverride::default();
    if let Some(params) = request.get("parameters").and_then(Value::as_object) {
        for (key, value) in params {
            if key == "config" {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                overrides.config_json = Some(text);
            } else if let Some(path) = key.strip_prefix("file:") {
                let encoded = value.as_str().ok_or_else(|| {
                    Error::invalid(format!("load parameter '{key}' must be a base64 string"))
                })?;
                let content = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|e| {
                        Error::invalid(format!("load parameter '{key}' is not valid base64: {e}"))
                    })?;
                overrides.add_file(path, content)?;
            }
        }
    }
    if !overrides.files.is_empty() && overrides.config_json.is_none() {
        return Err(Error::invalid(format!(
            "failed to load '{model}': 'file:' parameters need a 'config' parameter as well"
        ))
        .into());
    }
    check_load(&st.server, &caller, &model, &overrides)?;
    st.server.models().load(&model, overrides).await?;
    Ok(Json(json!({})))
}

async fn unload(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    st.server.check_model_control()?;
    let (model, _) = path_parts(&p);
    caller.require(ModelAction::Load, &model)?;
    let body = read_body(&st, &headers, body).await?;
    let request = optional_json(&body)?;
    let unload_dependents = request["parameters"]["unload_dependents"].as_bool() == Some(true);
    check_unload(&caller, &model, unload_dependents)?;
    st.server.models().unload(&model, unload_dependents).await?;
    Ok(Json(json!({})))
}
