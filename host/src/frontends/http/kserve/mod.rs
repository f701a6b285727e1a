//! KServe v2 over HTTP: health, metadata, inference (JSON and binary), generate, model
//! configuration, statistics, and the administrative APIs (shared memory, trace settings,
//! repository control), with Triton's routes, `{"error": ...}` bodies and status codes.

pub mod codec;
pub mod generate;
mod json_data;

mod admin;
mod infer;
mod models;

use std::collections::HashMap;

use axum::{
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde_json::json;

use super::{error::ApiError, state::HttpState};
use crate::error::Error;

/// Every KServe route, with the fallbacks for unknown paths and methods.
pub(crate) fn routes() -> Router<HttpState> {
    use admin::*;
    use infer::*;
    use models::*;
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
        .route("/v2/models/{model}/kv_cache", get(models::kv_cache))
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
        .route("/v2/logging", get(log_settings).post(update_log_settings))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
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

pub(crate) fn health(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    }
}

pub(crate) fn path_parts(p: &HashMap<String, String>) -> (String, String) {
    (
        p.get("model").cloned().unwrap_or_default(),
        p.get("version").cloned().unwrap_or_default(),
    )
}
