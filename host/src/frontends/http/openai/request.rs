//! OpenAI completion and chat requests, checked field by field and turned into a request for
//! a text-generation model (inputs named as Triton's TensorRT-LLM ensemble names them).

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::{
    error::Error,
    inference::InferRequest,
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, DataType, Tensor},
};

/// A request error with the field it is about (OpenAI's `param`).
#[derive(Debug)]
pub struct Invalid {
    /// What went wrong.
    pub error: Error,
    /// The request field, if one is at fault.
    pub param: Option<String>,
}

impl Invalid {
    fn field(param: &str, message: String) -> Self {
        Self {
            error: Error::invalid(message),
            param: Some(param.to_owned()),
        }
    }
}

impl From<Error> for Invalid {
    fn from(error: Error) -> Self {
        Self { error, param: None }
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`: a prompt.
    Completion,
    /// `/v1/chat/completions`: messages.
    Chat,
}

/// A checked request.
#[derive(Debug)]
pub struct Parsed {
    /// The model named.
    pub model: String,
    /// Whether to stream server-sent events.
    pub stream: bool,
    /// Whether the stream ends with a usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The inference request for the model.
    pub request: InferRequest,
}

/// Fields taken by both endpoints; any other field is refused by name.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "user",
    "logprobs",
    // vLLM's extensions, which OpenAI clients send through `extra_body`.
    "top_k",
    "repetition_penalty",
    "ignore_eos",
];
const COMPLETION: &[&str] = &["prompt", "echo", "best_of", "suffix"];
const CHAT: &[&str] = &["messages", "max_completion_tokens", "top_logprobs"];

fn number(body: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, Invalid> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if v.is_finite() && v >= lo && v <= hi {
                Ok(Some(v))
            } else {
                Err(Invalid::field(
                    key,
                    format!("'{key}' is {n}; it must be between {lo} and {hi}"),
                ))
            }
        }
        Some(other) => Err(Invalid::field(
            key,
            format!("'{key}' must be a number, got {other}"),
        )),
    }
}

fn integer(body: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, Invalid> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_i64().is_some_and(|v| v >= lo && v <= hi) => Ok(n.as_i64()),
        Some(other) => Err(Invalid::field(
            key,
            format!("'{key}' must be a whole number between {lo} and {hi}, got {other}"),
        )),
    }
}

fn flag(body: &Map<String, Value>, key: &str) -> Result<bool, Invalid> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(Invalid::field(
            key,
            format!("'{key}' must be true or false, got {other}"),
        )),
    }
}

fn scalar(name: &str, datatype: DataType, data: Vec<u8>) -> Tensor {
    Tensor {
        name: name.to_owned(),
        datatype,
        shape: vec![1, 1],
        data: Bytes::from(data),
    }
}

fn strings(name: &str, items: &[&str]) -> Tensor {
    let mut data = Vec::new();
    for s in items {
        push_bytes_element(&mut data, s.as_bytes());
    }
    Tensor {
        name: name.to_owned(),
        datatype: DataType::Bytes,
        shape: vec![1, items.len() as i64],
        data: Bytes::from(data),
    }
}

/// The text of a message's `content`: a string, or a list of parts of which the text ones count.
fn content_text(i: usize, content: &Value) -> Result<String, Invalid> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(Invalid::field(
                            "messages",
                            format!("messages[{i}].content: only text parts are supported"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        other => Err(Invalid::field(
            "messages",
            format!("messages[{i}].content must be a string, got {other}"),
        )),
    }
}

/// The chat's messages as the JSON list the chat-template stage reads.
fn messages(body: &Map<String, Value>) -> Result<String, Invalid> {
    let Some(Value::Array(list)) = body.get("messages") else {
        return Err(Invalid::field(
            "messages",
            "'messages' is required: a list of {\"role\", \"content\"} objects".into(),
        ));
    };
    if list.is_empty() {
        return Err(Invalid::field("messages", "'messages' is empty".into()));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| Invalid::field("messages", format!("messages[{i}] has no 'role'")))?;
        if !matches!(role, "system" | "developer" | "user" | "assistant") {
            return Err(Invalid::field(
                "messages",
                format!("messages[{i}].role is '{role}'; expected system, user or assistant"),
            ));
        }
        let content = content_text(i, m.get("content").unwrap_or(&Value::Null))?;
        let role = if role == "developer" { "system" } else { role };
        out.push(serde_json::json!({"role": role, "content": content}));
    }
    if !out.iter().any(|m| m["role"] == "user") {
        return Err(Invalid::field(
            "messages",
            "'messages' holds no message with role 'user': a chat needs at least one user turn"
                .into(),
        ));
    }
    Ok(Value::Array(out).to_string())
}

fn prompt(body: &Map<String, Value>) -> Result<String, Invalid> {
    match body.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(Invalid::field("prompt", "'prompt' is empty".into())),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] if !s.is_empty() => Ok(s.clone()),
            _ => Err(Invalid::field(
                "prompt",
                "'prompt' must be one non-empty string (one prompt per request; token lists are \
                 not supported)"
                    .into(),
            )),
        },
        None | Some(Value::Null) => Err(Invalid::field("prompt", "'prompt' is required".into())),
        Some(other) => Err(Invalid::field(
            "prompt",
            format!("'prompt' must be a string, got {other}"),
        )),
    }
}

/// Checks an OpenAI request body and builds the model's request; `config` is the model's.
pub fn parse(
    kind: Kind,
    body: &Value,
    lookup: impl Fn(&str) -> Result<ModelConfig, Error>,
) -> Result<Parsed, Invalid> {
    let Value::Object(body) = body else {
        return Err(Error::invalid("the request body must be a JSON object").into());
    };
    let allowed = |key: &str| {
        COMMON.contains(&key)
            || match kind {
                Kind::Completion => COMPLETION.contains(&key),
                Kind::Chat => CHAT.contains(&key),
            }
    };
    if let Some(key) = body.keys().find(|k| !allowed(k)) {
        return Err(Invalid::field(
            key,
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(Invalid::field("model", "'model' is required".into())),
    };
    let config = lookup(&model)?;
    if let Some(n) = integer(body, "n", 1, i64::MAX)? {
        if n != 1 {
            return Err(Invalid::field(
                "n",
                format!("'n' is {n}; only 1 is supported"),
            ));
        }
    }
    if let Some(best_of) = integer(body, "best_of", 1, i64::MAX)? {
        if best_of != 1 {
            return Err(Invalid::field(
                "best_of",
                format!("'best_of' is {best_of}; only 1 is supported"),
            ));
        }
    }
    // Accepted only when they ask for nothing.
    for unsupported in ["echo", "logprobs", "top_logprobs", "suffix"] {
        match body.get(unsupported) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
            Some(_) => {
                return Err(Invalid::field(
                    unsupported,
                    format!("'{unsupported}' is not supported"),
                ))
            }
        }
    }
    let stream = flag(body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => o
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        Some(other) => {
            return Err(Invalid::field(
                "stream_options",
                format!("'stream_options' must be an object, got {other}"),
            ))
        }
    };
    let mut inputs = Vec::new();
    match kind {
        Kind::Chat => inputs.push(strings("messages", &[messages(body)?.as_str()])),
        Kind::Completion => inputs.push(strings("text_input", &[prompt(body)?.as_str()])),
    }
    let max_tokens = match integer(body, "max_completion_tokens", 1, i64::from(i32::MAX))? {
        Some(v) => Some(v),
        None => integer(body, "max_tokens", 1, i64::from(i32::MAX))?,
    };
    if let Some(v) = max_tokens {
        inputs.push(scalar(
            "max_tokens",
            DataType::Int32,
            (v as i32).to_le_bytes().to_vec(),
        ));
    }
    // OpenAI samples at temperature 1 unless told otherwise.
    let temperature = number(body, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    inputs.push(scalar(
        "temperature",
        DataType::Fp32,
        (temperature as f32).to_le_bytes().to_vec(),
    ));
    if let Some(v) = number(body, "top_p", 0.0, 1.0)? {
        if v == 0.0 {
            return Err(Invalid::field(
                "top_p",
                "'top_p' is 0; it must be above 0".into(),
            ));
        }
        inputs.push(scalar(
            "top_p",
            DataType::Fp32,
            (v as f32).to_le_bytes().to_vec(),
        ));
    }
    if let Some(v) = integer(body, "top_k", -1, i64::from(i32::MAX))? {
        // vLLM's -1 means every token, as 0 does here.
        inputs.push(scalar(
            "top_k",
            DataType::Int32,
            (v.max(0) as i32).to_le_bytes().to_vec(),
        ));
    }
    if let Some(v) = integer(body, "seed", i64::MIN, i64::MAX)? {
        inputs.push(scalar(
            "seed",
            DataType::Uint64,
            (v as u64).to_le_bytes().to_vec(),
        ));
    }
    for key in ["frequency_penalty", "presence_penalty"] {
        if let Some(v) = number(body, key, -2.0, 2.0)? {
            inputs.push(scalar(
                key,
                DataType::Fp32,
                (v as f32).to_le_bytes().to_vec(),
            ));
        }
    }
    if let Some(v) = number(body, "repetition_penalty", f64::MIN_POSITIVE, 100.0)? {
        inputs.push(scalar(
            "repetition_penalty",
            DataType::Fp32,
            (v as f32).to_le_bytes().to_vec(),
        ));
    }
    let stop: Vec<&str> = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(items)) => {
            let texts: Option<Vec<&str>> = items.iter().map(Value::as_str).collect();
            match texts {
                Some(t) if t.len() <= 4 => t,
                _ => {
                    return Err(Invalid::field(
                        "stop",
                        "'stop' must be a string or a list of up to 4 strings".into(),
                    ))
                }
            }
        }
        Some(other) => {
            return Err(Invalid::field(
                "stop",
                format!("'stop' must be a string or a list of strings, got {other}"),
            ))
        }
    };
    if !stop.is_empty() {
        inputs.push(strings("stop", &stop));
    }
    if flag(body, "ignore_eos")? {
        // TensorRT-LLM's end_id -1: no end token, exactly max_tokens.
        inputs.push(scalar(
            "end_id",
            DataType::Int32,
            (-1i32).to_le_bytes().to_vec(),
        ));
    }
    inputs.push(scalar("stream", DataType::Bool, vec![u8::from(stream)]));
    // Only the inputs the model takes (a model without penalties simply has none).
    inputs.retain(|t| config.input.iter().any(|i| i.name == t.name));
    if !inputs
        .iter()
        .any(|t| t.name == "messages" || t.name == "text_input")
    {
        return Err(Invalid::field(
            if kind == Kind::Chat {
                "messages"
            } else {
                "prompt"
            },
            format!(
                "model '{model}' does not take {}",
                if kind == Kind::Chat {
                    "chats (input 'messages')"
                } else {
                    "prompts (input 'text_input')"
                }
            ),
        ));
    }
    Ok(Parsed {
        request: InferRequest::new(model.clone(), None).with_inputs(inputs),
        model,
        stream,
        include_usage,
    })
}

/// Whether a model serves text generation as the OpenAI endpoints call it: it takes a prompt
/// or a chat and answers `text_output`.
pub fn generates_text(config: &ModelConfig) -> bool {
    config
        .input
        .iter()
        .any(|i| i.name == "text_input" || i.name == "messages")
        && config.output.iter().any(|o| o.name == "text_output")
}
