//! The administrative APIs: system and CUDA shared memory, trace and log settings, and the
//! model repository (index, load, unload).

use std::collections::HashMap;

use axum::{
    body::Body,
    extract::{Path, State},
    http::HeaderMap,
    Extension, Json,
};
use base64::Engine;
use serde_json::{json, Value};

use super::path_parts;
use crate::{
    error::Error,
    frontends::{
        http::{
            body::{optional_json, read_body},
            error::ApiResult,
            state::HttpState,
        },
        logging::{self, Setting},
        shared_memory::{Kind as MemoryKind, Location, RegionStatus},
    },
    names::ModelName,
    scheduling::model_manager::LoadOverride,
    tenancy::{Caller, ModelAction},
};

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
pub(crate) async fn shm_status<const CUDA: bool>(
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
pub(crate) async fn shm_register(
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
pub(crate) async fn shm_unregister<const CUDA: bool>(
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
pub(crate) async fn cuda_register(
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

/// `GET /v2/logging`: the log's settings, for administrators.
pub(crate) async fn log_settings(Extension(caller): Extension<Caller>) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    Ok(log_json())
}

/// `POST /v2/logging` with `{"log_info": false, "log_verbose_level": 1, ...}`: changes the
/// settings given (all or none) and answers with all of them.
pub(crate) async fn update_log_settings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    let body = read_body(&st, &headers, body).await?;
    let Value::Object(fields) = optional_json(&body)? else {
        return Err(Error::invalid("log settings must be a JSON object").into());
    };
    let mut changes = Vec::with_capacity(fields.len());
    for (key, value) in fields {
        let setting = match value {
            // As on Triton, a setting sent as null is left as it is.
            Value::Null => continue,
            Value::Bool(b) => Setting::Bool(b),
            Value::String(s) => Setting::Text(s),
            Value::Number(n) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => Setting::Uint(n),
                None => {
                    return Err(Error::invalid(format!(
                        "log setting '{key}': {n} is not an unsigned 32-bit integer"
                    ))
                    .into())
                }
            },
            other => {
                return Err(Error::invalid(format!(
                    "log setting '{key}': {other} is not a boolean, a number or a string"
                ))
                .into())
            }
        };
        changes.push((key, setting));
    }
    logging::levels().update(&changes)?;
    Ok(log_json())
}

fn log_json() -> Json<Value> {
    Json(Value::Object(
        logging::levels()
            .settings()
            .into_iter()
            .map(|(name, value)| {
                let value = match value {
                    Setting::Bool(b) => json!(b),
                    Setting::Uint(n) => json!(n),
                    Setting::Text(t) => json!(t),
                };
                (name.to_owned(), value)
            })
            .collect(),
    ))
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
pub(crate) async fn trace_settings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    let model = p.as_ref().and_then(|p| p.get("model")).map(String::as_str);
    let model = crate::frontends::trace::model_of(&st.server, model)?;
    Ok(settings_json(st.tracing.settings(model)))
}

/// `POST /v2[/models/<model>]/trace/setting` with `{"trace_level": ["TIMESTAMPS"],
/// "trace_rate": "1", ...}`; `null` clears a model's setting.
pub(crate) async fn update_trace_settings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    p: Option<Path<HashMap<String, String>>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require_admin("the trace and logging APIs")?;
    let model = p.as_ref().and_then(|p| p.get("model")).map(String::as_str);
    let model = crate::frontends::trace::model_of(&st.server, model)?;
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

pub(crate) async fn index(
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

pub(crate) async fn load(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    st.server.check_model_control()?;
    let (model, _) = path_parts(&p);
    ModelName::parse(&model)?;
    caller.require(ModelAction::Load, st.server.models().rights_name(&model))?;
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
    let adapter = st.server.models().adapter_ref(&model).is_some();
    if !overrides.files.is_empty() && overrides.config_json.is_none() && !adapter {
        return Err(Error::invalid(format!(
            "failed to load '{model}': 'file:' parameters need a 'config' parameter as well"
        ))
        .into());
    }
    st.server.models().check_load(&caller, &model, &overrides)?;
    st.server.models().load(&model, overrides).await?;
    Ok(Json(json!({})))
}

pub(crate) async fn unload(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    st.server.check_model_control()?;
    let (model, _) = path_parts(&p);
    caller.require(ModelAction::Load, st.server.models().rights_name(&model))?;
    let body = read_body(&st, &headers, body).await?;
    let request = optional_json(&body)?;
    let unload_dependents = request["parameters"]["unload_dependents"].as_bool() == Some(true);
    st.server
        .models()
        .check_unload(&caller, &model, unload_dependents)?;
    st.server.models().unload(&model, unload_dependents).await?;
    Ok(Json(json!({})))
}
