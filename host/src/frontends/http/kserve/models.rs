//! Health, server and model metadata, model configuration and statistics.

use std::collections::HashMap;

use axum::{
    extract::{Path, State},
    http::StatusCode,
    Extension, Json,
};
use serde_json::{json, Value};

use super::{health, path_parts};
use crate::{
    frontends::{
        http::{error::ApiResult, state::HttpState},
        model_config, model_metadata, model_statistics, parse_version, EXTENSIONS, SERVER_VERSION,
    },
    proto::inference::{ModelStatistics, StatisticDuration},
    repository::config::to_json,
    tenancy::{Caller, ModelAction},
};

pub(crate) async fn live(State(st): State<HttpState>) -> StatusCode {
    health(st.server.is_live())
}

pub(crate) async fn ready(State(st): State<HttpState>) -> StatusCode {
    health(st.server.is_ready())
}

pub(crate) async fn server_metadata(State(st): State<HttpState>) -> Json<Value> {
    Json(json!({"name": st.server.id(), "version": SERVER_VERSION, "extensions": EXTENSIONS}))
}

pub(crate) async fn metadata(
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

pub(crate) async fn model_ready(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<StatusCode> {
    let (model, version) = path_parts(&p);
    caller.require(ModelAction::See, &model)?;
    let version = parse_version(&model, &version)?;
    Ok(health(st.server.models().is_ready(&model, version)))
}

pub(crate) async fn config(
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
                "response_stats": s.response_stats.iter().map(|(index, r)| (index.clone(), json!({
                    "compute_infer": duration_json(&r.compute_infer),
                    "compute_output": duration_json(&r.compute_output),
                    "success": duration_json(&r.success),
                    "fail": duration_json(&r.fail),
                    "empty_response": duration_json(&r.empty_response),
                    "cancel": duration_json(&r.cancel),
                }))).collect::<serde_json::Map<String, Value>>(),
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

pub(crate) async fn all_stats(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    let mut stats = model_statistics(&st.server, "", "")?;
    stats.retain(|s| caller.may(ModelAction::See, &s.name));
    Ok(Json(stats_json(stats)))
}

pub(crate) async fn stats(
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
