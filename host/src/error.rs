//! The error every request path returns: a Triton status code and a message a person can act on.

use std::fmt;

/// Triton's status codes; the frontends map them to HTTP statuses and gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The request is malformed or does not fit the model (HTTP 400, gRPC INVALID_ARGUMENT).
    InvalidArg,
    /// Unknown model, version, tensor or route (HTTP 404, gRPC NOT_FOUND).
    NotFound,
    /// The model or server cannot take the request now (HTTP 503, gRPC UNAVAILABLE).
    Unavailable,
    /// A feature the server does not offer (HTTP 501, gRPC UNIMPLEMENTED).
    Unsupported,
    /// Something already exists (HTTP 400, gRPC ALREADY_EXISTS).
    AlreadyExists,
    /// The request was cancelled (HTTP 400, gRPC CANCELLED).
    Cancelled,
    /// A failure inside the server or a backend (HTTP 500, gRPC INTERNAL).
    Internal,
    /// A backend failure it did not classify (Triton's `UNKNOWN`: HTTP 500, gRPC UNKNOWN).
    Unknown,
    /// No valid API key (HTTP 401, gRPC UNAUTHENTICATED).
    Unauthenticated,
    /// The caller's tenant may not do this (HTTP 403, gRPC PERMISSION_DENIED).
    PermissionDenied,
    /// The caller's tenant is over a quota (HTTP 429, gRPC RESOURCE_EXHAUSTED).
    ResourceExhausted,
}

/// A request-level error: what went wrong, with the code that classifies it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Error {
    /// Classification used for the HTTP status and gRPC code.
    pub code: Code,
    /// Human-readable explanation naming the model, tensor or field at fault.
    pub message: String,
    /// The request field (input tensor or parameter) the error is about, when one is at
    /// fault: a frontend names it in its own terms (OpenAI's `param`) without reading the
    /// message.
    pub field: Option<String>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error {
    /// An error with the given code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            field: None,
        }
    }
    /// The same error, about request field `field`.
    #[must_use]
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
    /// The same error (code and field) with `context` before its message: where it happened.
    #[must_use]
    pub fn within(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
    /// A malformed or unfitting request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArg, message)
    }
    /// Something named in the request does not exist.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    /// The server cannot serve the request right now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }
    /// A feature that is not offered.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(Code::Unsupported, message)
    }
    /// An internal failure.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
    /// A missing or unknown API key.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }
    /// Something the caller's tenant may not do.
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, message)
    }
    /// Over a tenant's quota.
    pub fn resource_exhausted(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, message)
    }
}

/// Result alias for request paths.
pub type Result<T, E = Error> = std::result::Result<T, E>;
