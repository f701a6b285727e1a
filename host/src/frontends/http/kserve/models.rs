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
    frontends::http::{error::ApiResult, state::HttpState},
    repository::config::to_json,
    scheduling::views::{
        kv_cache_blocks, metadata_json, model_config, model_metadata, model_ready as ready_of,
        model_statistics, stats_json, EXTENSIONS, SERVER_VERSION,
    },
    tenancy::Caller,
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
    let m = model_metadata(&st.server, &caller, &model, &version)?;
    Ok(Json(metadata_json(&m)))
}

pub(crate) async fn model_ready(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<StatusCode> {
    let (model, version) = path_parts(&p);
    Ok(health(
        ready_of(&st.server, &caller, &model, &version).await?,
    ))
}

pub(crate) async fn config(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let (model, version) = path_parts(&p);
    Ok(Json(to_json(&model_config(
        &st.server, &caller, &model, &version,
    )?)))
}

pub(crate) async fn all_stats(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    Ok(Json(stats_json(model_statistics(
        &st.server, &caller, "", "",
    )?)))
}

pub(crate) async fn stats(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(p): Path<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let (model, version) = path_parts(&p);
    Ok(Json(stats_json(model_statistics(
        &st.server, &caller, &model, &version,
    )?)))
}

/// `GET /v2/models/<name>/kv_cache`: the blocks a generation model's prefix cache holds, as
/// its KV-cache events told them (`{"block_size": 16, "blocks": [hash, ...]}`).
pub(crate) async fn kv_cache(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(model): Path<String>,
) -> ApiResult<Json<Value>> {
    let (block_size, blocks) = kv_cache_blocks(&st.server, &caller, &model)?;
    Ok(Json(json!({ "block_size": block_size, "blocks": blocks })))
}
