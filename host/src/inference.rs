//! Protocol-neutral inference requests and responses: what a frontend decodes into and what the
//! scheduler hands back.

use std::collections::BTreeMap;

use crate::tensor::Tensor;

/// A request or response parameter value.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    /// Boolean.
    Bool(bool),
    /// Signed integer.
    Int(i64),
    /// Unsigned integer (gRPC `uint64_param`).
    Uint(u64),
    /// Floating point.
    Double(f64),
    /// String.
    String(String),
}

impl ParamValue {
    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            ParamValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
    /// The value as an integer, if it is one (or an unsigned one that fits).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            ParamValue::Int(i) => Some(*i),
            ParamValue::Uint(u) => i64::try_from(*u).ok(),
            _ => None,
        }
    }
}

/// Named parameters, ordered for stable output.
pub type Parameters = BTreeMap<String, ParamValue>;

/// An output the client asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    /// Output tensor name.
    pub name: String,
    /// Per-output parameters (e.g. `binary_data`).
    pub parameters: Parameters,
}

/// One inference request, already decoded from the wire.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferRequest {
    /// Target model.
    pub model_name: String,
    /// Requested version; `None` lets the version policy choose (the highest loaded).
    pub model_version: Option<i64>,
    /// Client-chosen id, echoed in the response.
    pub id: String,
    /// Request-level parameters.
    pub parameters: Parameters,
    /// Input tensors.
    pub inputs: Vec<Tensor>,
    /// Requested outputs; empty means all.
    pub outputs: Vec<RequestedOutput>,
    /// When the request stops being worth running: a request still queued at its deadline is
    /// answered with an error instead of executed. Set for calls from a stage (the caller's
    /// own deadline), so that work nobody waits for any more is dropped.
    pub deadline: Option<std::time::Instant>,
}

/// The result of a successful inference.
#[derive(Debug, Clone, PartialEq)]
pub struct InferResponse {
    /// Model that served the request.
    pub model_name: String,
    /// Version that served the request.
    pub model_version: i64,
    /// The request's id.
    pub id: String,
    /// Response-level parameters.
    pub parameters: Parameters,
    /// Output tensors, in the order requested (or the model's order when all were requested).
    pub outputs: Vec<Tensor>,
}
