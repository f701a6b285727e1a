//! Errors as OpenAI's API answers them: `{"error": {"message", "type", "param", "code"}}` with
//! the status of the error's code, the field at fault named when it is known.

use axum::{
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};

use super::{
    invalid::Invalid,
    types::{ErrorBody, ErrorDetail},
};
use crate::{
    error::{Code, Error},
    frontends::http::error::status_for,
};

/// An error in OpenAI's shape, with no field named (the authentication layer's refusals).
pub fn render_error(error: &Error) -> Response {
    error_response(error, None)
}

/// An error as OpenAI's API answers it.
pub fn error_response(error: &Error, param: Option<&str>) -> Response {
    let (kind, code) = match error.code {
        Code::NotFound => ("invalid_request_error", Some("model_not_found")),
        Code::Unauthenticated => ("invalid_request_error", Some("invalid_api_key")),
        Code::PermissionDenied => ("permission_error", None),
        Code::ResourceExhausted => ("rate_limit_error", Some("rate_limit_exceeded")),
        Code::Internal | Code::Unknown | Code::Unavailable => ("server_error", None),
        _ => ("invalid_request_error", None),
    };
    (
        status_for(error.code),
        Json(error_body(error, kind, param, code)),
    )
        .into_response()
}

pub(super) fn error_body<'a>(
    error: &'a Error,
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'static str>,
) -> ErrorBody<'a> {
    ErrorBody {
        error: ErrorDetail {
            message: &error.message,
            kind,
            param,
            code,
        },
    }
}

/// OpenAI's name for the request field an error is about, from the field the model named
/// (its input tensors and parameters, by TensorRT-LLM's names or ours).
pub(super) fn param_of(error: &Error) -> Option<&str> {
    Some(match error.field.as_deref()? {
        "text_input" | "input_ids" | "prompt_ids" => "prompt",
        "request_output_len" => "max_tokens",
        other => other,
    })
}

pub(super) fn invalid_response(e: Invalid) -> Response {
    let param = e.param.as_deref().or_else(|| param_of(&e.error));
    error_response(&e.error, param)
}

pub(super) fn error_type(status: StatusCode) -> &'static str {
    if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    }
}
