//! Errors of the HTTP frontends: the status code of each error code, and KServe's rendering
//! (`{"error": "..."}`). The OpenAI routes render the same errors in OpenAI's shape
//! (`openai::error_response`); the authentication layer takes the renderer of the routes it
//! guards.

use axum::{
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde_json::json;

use crate::error::{Code, Error};

/// An error rendered as Triton does: a status code and `{"error": "..."}`.
pub struct ApiError(pub Error);

impl AsRef<Error> for ApiError {
    fn as_ref(&self) -> &Error {
        &self.0
    }
}

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
        Code::Internal | Code::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
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

pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// Renders an error in one protocol's shape (KServe's or OpenAI's).
pub type RenderError = fn(&Error) -> Response;

/// KServe's rendering of an error.
pub fn kserve_error(error: &Error) -> Response {
    ApiError(error.clone()).into_response()
}
