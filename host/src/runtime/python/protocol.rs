//! The frames the Python backend's host and guest exchange through `_host.call`: one byte
//! naming what is asked ([`Op`]), then a header length (u32, little-endian), a JSON header, and
//! the tensors' bytes one after another (the header gives each its offset and size). The
//! guest's half is `guest/triton_python_backend_utils.py`; numpy arrays are made over the
//! bytes without a copy.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    error::{Error, Result},
    inference::{ParamValue, Parameters},
    tensor::{DataType, Tensor},
};

/// What a guest frame asks for (its first byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The next batch's requests, once there is one; nothing when the loop is to end.
    Next,
    /// The answers to the current batch, one per request (or none for a decoupled model).
    Responses,
    /// One response on a decoupled request's stream.
    Send,
    /// A call into another model (BLS), answered when it completes.
    Infer,
    /// A call into another model started now, its answer taken later with `Wait`.
    Start,
    /// The answer of a call started with `Start`.
    Wait,
    /// A call into a decoupled model whose responses the model reads one at a time.
    StreamOpen,
    /// The next response of a call opened with `StreamOpen` (none: it has ended).
    StreamNext,
    /// Cancels a call opened with `StreamOpen`.
    StreamCancel,
    /// A log line.
    Log,
    /// Whether a request of the batch was cancelled.
    Cancelled,
    /// `model.py` raised during `initialize` or `finalize`: the message.
    Failed,
    /// The configuration `auto_complete_config` returned, as JSON.
    Completed,
    /// A custom metric's registration or update (`pb_utils.MetricFamily`, `Metric`).
    Metric,
    /// The model loading API: whether a model is ready, a load, an unload
    /// (`pb_utils.is_model_ready`, `load_model`, `unload_model`).
    Repository,
    /// Background mode: waits (up to the milliseconds given, `-1`: no limit) for something
    /// to do, and says what: `{"batches", "closing", "calls"}`.
    Events,
    /// Background mode: the batch (by the id [`Op::Next`] gave it) that the frames after this
    /// one belong to.
    Select,
    /// The answer of a call started with `Start` if it has come, else nothing (the call is
    /// then awaited: [`Op::Events`] says when an awaited call has its answer).
    Poll,
    /// The next response of a call opened with `StreamOpen` if it has come, else nothing.
    StreamPoll,
}

impl Op {
    /// The op of a frame's first byte.
    pub fn of(byte: u8) -> Option<Self> {
        Some(match byte {
            b'N' => Self::Next,
            b'R' => Self::Responses,
            b'S' => Self::Send,
            b'I' => Self::Infer,
            b'A' => Self::Start,
            b'W' => Self::Wait,
            b'O' => Self::StreamOpen,
            b'X' => Self::StreamNext,
            b'Z' => Self::StreamCancel,
            b'L' => Self::Log,
            b'C' => Self::Cancelled,
            b'F' => Self::Failed,
            b'K' => Self::Completed,
            b'M' => Self::Metric,
            b'P' => Self::Repository,
            b'E' => Self::Events,
            b'B' => Self::Select,
            b'Q' => Self::Poll,
            b'Y' => Self::StreamPoll,
            _ => return None,
        })
    }
}

/// A tensor in a header: its bytes are `size` bytes at `offset` of the frame's data.
#[derive(Debug, Serialize, Deserialize)]
pub struct TensorHeader {
    /// The tensor's name.
    pub name: String,
    /// Triton's name of its type (`FP32`, `BYTES`).
    pub datatype: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Where its bytes start in the data.
    pub offset: usize,
    /// How many bytes it has.
    pub size: usize,
}

/// An error a model returned: Triton's `TritonError` code name and message.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorHeader {
    /// The message.
    pub message: String,
    /// `INVALID_ARG`, `NOT_FOUND`, `UNAVAILABLE`, `UNSUPPORTED`, `ALREADY_EXISTS`,
    /// `CANCELLED`, `INTERNAL` or `UNKNOWN`.
    #[serde(default)]
    pub code: String,
}

/// One response: outputs or an error.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ResponseHeader {
    /// Its output tensors.
    #[serde(default)]
    pub outputs: Vec<TensorHeader>,
    /// The error, if it is one.
    #[serde(default)]
    pub error: Option<ErrorHeader>,
    /// Response parameters.
    #[serde(default)]
    pub parameters: BTreeMap<String, serde_json::Value>,
    /// The model released the request to run again in a later batch
    /// (`TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reschedule: bool,
}

/// One request of a batch, as the guest sees it (what is empty or zero is left out: the
/// guest parses this header for every request).
#[derive(Debug, Serialize)]
pub struct RequestHeader {
    /// The request's id.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// Its sequence's correlation id (0 outside sequences).
    #[serde(skip_serializing_if = "is_zero")]
    pub correlation_id: serde_json::Value,
    /// Sequence flags: 1 start, 2 end.
    #[serde(skip_serializing_if = "is_no_flag")]
    pub flags: u32,
    /// Its parameters.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, serde_json::Value>,
    /// The outputs it asks for.
    pub outputs: Vec<String>,
    /// Its inputs.
    pub inputs: Vec<TensorHeader>,
}

fn is_zero(v: &serde_json::Value) -> bool {
    v.as_u64() == Some(0)
}

fn is_no_flag(flags: &u32) -> bool {
    *flags == 0
}

/// A call into another model that the guest makes (Triton's BLS `InferenceRequest`).
#[derive(Debug, Deserialize)]
pub struct CallHeader {
    /// The model called.
    pub model: String,
    /// Its version; -1 or absent: the policy's choice.
    #[serde(default)]
    pub version: i64,
    /// The request id.
    #[serde(default)]
    pub id: String,
    /// The outputs asked for; empty: all.
    #[serde(default)]
    pub outputs: Vec<String>,
    /// The inputs.
    #[serde(default)]
    pub inputs: Vec<TensorHeader>,
    /// Request parameters.
    #[serde(default)]
    pub parameters: BTreeMap<String, serde_json::Value>,
    /// The call's timeout in microseconds (0: none beyond the caller's own).
    #[serde(default)]
    pub timeout_us: u64,
    /// Sequence correlation id.
    #[serde(default)]
    pub correlation_id: serde_json::Value,
    /// Sequence flags.
    #[serde(default)]
    pub flags: u32,
    /// The model called is decoupled: every response it sends is wanted.
    #[serde(default)]
    pub decoupled: bool,
}

/// Builds frames: a JSON header and the tensors' bytes.
#[derive(Default)]
pub struct FrameWriter {
    data: Vec<u8>,
}

impl FrameWriter {
    /// Appends a tensor's bytes and returns its header.
    pub fn tensor(&mut self, t: &Tensor) -> TensorHeader {
        let offset = self.data.len();
        self.data.extend_from_slice(&t.data);
        TensorHeader {
            name: t.name.clone(),
            datatype: t.datatype.wire_name().to_owned(),
            shape: t.shape.clone(),
            offset,
            size: t.data.len(),
        }
    }

    /// The frame: header length, header, data.
    pub fn finish(self, header: &impl Serialize) -> Vec<u8> {
        let header = serde_json::to_vec(header).unwrap_or_else(|_| b"{}".to_vec());
        let mut out = Vec::with_capacity(4 + header.len() + self.data.len());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&self.data);
        out
    }
}

/// A frame read back: its header and its data.
pub struct Frame<'a, H> {
    /// The header.
    pub header: H,
    data: &'a [u8],
}

impl<'a, H: serde::de::DeserializeOwned> Frame<'a, H> {
    /// Splits and parses a frame's body (after the op byte).
    pub fn parse(body: &'a [u8]) -> Result<Self> {
        let bad = |what: &str| {
            Error::internal(format!("the Python guest sent a malformed frame: {what}"))
        };
        let len = body
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| bad("no header length"))?;
        let header = body.get(4..4 + len).ok_or_else(|| bad("short header"))?;
        let header = serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
        Ok(Self {
            header,
            data: &body[4 + len..],
        })
    }
}

impl<H> Frame<'_, H> {
    /// The tensor a header describes, its bytes copied out of the frame.
    pub fn tensor(&self, t: &TensorHeader) -> Result<Tensor> {
        let datatype = DataType::from_wire(&t.datatype).ok_or_else(|| {
            Error::invalid(format!(
                "tensor '{}' has datatype '{}', which Triton does not have",
                t.name, t.datatype
            ))
        })?;
        let data = self
            .data
            .get(t.offset..t.offset.saturating_add(t.size))
            .ok_or_else(|| {
                Error::internal(format!(
                    "the Python guest sent tensor '{}' past the end of its frame",
                    t.name
                ))
            })?;
        Ok(Tensor {
            name: t.name.clone(),
            datatype,
            shape: t.shape.clone(),
            data: bytes::Bytes::copy_from_slice(data),
        })
    }
}

/// Request parameters as JSON values, as `InferenceRequest.parameters()` gives them.
pub fn parameters_to_json(parameters: &Parameters) -> BTreeMap<String, serde_json::Value> {
    parameters
        .iter()
        .map(|(k, v)| {
            let v = match v {
                ParamValue::Bool(b) => serde_json::Value::from(*b),
                ParamValue::Int(i) => serde_json::Value::from(*i),
                ParamValue::Uint(u) => serde_json::Value::from(*u),
                ParamValue::Double(d) => serde_json::Value::from(*d),
                ParamValue::String(s) => serde_json::Value::from(s.clone()),
            };
            (k.clone(), v)
        })
        .collect()
}

/// JSON parameters back as request parameters: booleans, integers, numbers and strings; a
/// value of another kind is an error naming the key.
pub fn parameters_from_json(json: &BTreeMap<String, serde_json::Value>) -> Result<Parameters> {
    json.iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::Bool(b) => ParamValue::Bool(*b),
                serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                    (Some(i), _) => ParamValue::Int(i),
                    (None, Some(u)) => ParamValue::Uint(u),
                    _ => ParamValue::Double(n.as_f64().unwrap_or_default()),
                },
                serde_json::Value::String(s) => ParamValue::String(s.clone()),
                _ => {
                    return Err(Error::invalid(format!(
                        "parameter '{k}' must be a bool, an integer, a number or a string"
                    )))
                }
            };
            Ok((k.clone(), v))
        })
        .collect()
}

/// A short answer: `0` then a JSON value, or `1` then an error message.
pub fn answer(result: Result<serde_json::Value>) -> Vec<u8> {
    match result {
        Ok(v) => {
            let mut out = vec![0];
            out.extend_from_slice(v.to_string().as_bytes());
            out
        }
        Err(e) => error_answer(&e),
    }
}

/// An error answer: `1`, then the code name and message as JSON.
pub fn error_answer(e: &Error) -> Vec<u8> {
    let mut out = vec![1];
    let body = serde_json::json!({"code": triton_code(e), "message": e.message});
    out.extend_from_slice(body.to_string().as_bytes());
    out
}

/// Triton's `TritonError` code name for an error.
pub fn triton_code(e: &Error) -> &'static str {
    use crate::error::Code;
    match e.code {
        Code::InvalidArg => "INVALID_ARG",
        Code::NotFound => "NOT_FOUND",
        Code::Unavailable | Code::ResourceExhausted => "UNAVAILABLE",
        Code::Unsupported => "UNSUPPORTED",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::Cancelled => "CANCELLED",
        Code::Internal => "INTERNAL",
        Code::Unknown => "UNKNOWN",
        Code::Unauthenticated | Code::PermissionDenied => "INVALID_ARG",
    }
}

/// An error from a `TritonError` code name and message (names it does not know: internal).
pub fn from_triton_code(code: &str, message: String) -> Error {
    use crate::error::Code;
    let code = match code {
        "INVALID_ARG" => Code::InvalidArg,
        "NOT_FOUND" => Code::NotFound,
        "UNAVAILABLE" => Code::Unavailable,
        "UNSUPPORTED" => Code::Unsupported,
        "ALREADY_EXISTS" => Code::AlreadyExists,
        "CANCELLED" => Code::Cancelled,
        "UNKNOWN" => Code::Unknown,
        _ => Code::Internal,
    };
    Error::new(code, message)
}
