//! OpenAI completion and chat requests ([`CompletionRequest`], read by serde), checked and
//! turned into a request for a text-generation model (inputs named as Triton's TensorRT-LLM
//! ensemble names them).

use std::borrow::Borrow;

use bytes::Bytes;
use serde_json::Value;

use super::{
    decode,
    invalid::Invalid,
    prompt_limit::PromptLimit,
    prompts::{self, Echo, PromptInput},
    structured::{self, Shape, CALL_CLOSE, CALL_OPEN},
    types::{
        CompletionRequest, Content, Listed, Logprobs, Message, Prompt, Role, Stop, TemplateMessage,
        ToolCall,
    },
};
use crate::{
    error::Error,
    inference::{InferRequest, ParamValue},
    names::split_adapter,
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, DataType, Tensor},
};

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
    /// Choices to generate per prompt (`n`): one sequence each, from the same request.
    pub n: usize,
    /// Completions' prompts (`prompt` as a list: `n` choices each, in order); empty for chats.
    pub prompts: Vec<PromptInput>,
    /// Completions' `echo`: each choice's text starts with its prompt.
    pub echo: bool,
    /// Whether the model scores the prompt (echo with logprobs, or echo of token ids, which
    /// the scores spell).
    pub scored_prompt: bool,
    /// Completions' `echo` with `max_tokens` 0: the prompt alone, nothing generated answered.
    pub prompt_only: bool,
    /// Whether to answer log-probabilities (`logprobs`), and how many alternatives per token.
    pub log_probs: Option<usize>,
    /// How to read the answer: text, or function calls.
    pub shape: Shape,
}

/// The most choices one request may ask for per prompt (`n`): each is a sequence of the
/// running batch.
pub const MAX_CHOICES: i64 = 16;

/// The most sequences (prompts × `n`) one request may start.
pub const MAX_SEQUENCES: usize = crate::limits::MAX_SEQUENCES_PER_REQUEST;

impl Parsed {
    /// How many choices the answer holds: `n` per prompt.
    pub fn choices(&self) -> usize {
        self.n * self.prompts.len().max(1)
    }

    /// Which prompt choice `index` answers.
    pub fn prompt_of(&self, index: usize) -> usize {
        index / self.n.max(1)
    }

    /// What choice `index`'s text starts with: its prompt, with `echo`.
    pub fn echo_for(&self, index: usize) -> Echo {
        match self.prompts.get(self.prompt_of(index)) {
            Some(PromptInput::Text(text)) if self.echo => Echo::Text(text.clone()),
            Some(PromptInput::Ids(_)) if self.echo => Echo::Spelled,
            _ => Echo::Nothing,
        }
    }

    /// The model's request for choice `index`: the same, for its prompt, with the seed moved
    /// on by the choice's place among its prompt's `n` when the request has one (so that
    /// seeded choices differ and repeat).
    pub fn request_for(&self, index: usize) -> InferRequest {
        let mut request = self.request.clone();
        if self.prompts.len() > 1 {
            if let Some(prompt) = self.prompts.get(self.prompt_of(index)) {
                request
                    .inputs
                    .retain(|t| t.name != "text_input" && t.name != "prompt_ids");
                request.inputs.push(prompt.tensor());
            }
        }
        let index = index % self.n.max(1);
        if index > 0 {
            if let Some(seed) = request.inputs.iter_mut().find(|t| t.name == "seed") {
                let base = seed
                    .data
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_le_bytes);
                seed.data = Bytes::from(base.wrapping_add(index as u64).to_le_bytes().to_vec());
            }
        }
        request
    }
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
    "logit_bias",
    "logprobs",
    // vLLM's extensions, which OpenAI clients send through `extra_body`.
    "top_k",
    "repetition_penalty",
    "ignore_eos",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
];
const COMPLETION: &[&str] = &["prompt", "echo", "best_of", "suffix"];
const CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Whether an endpoint takes a field; any other is refused by name, as vLLM does.
pub fn allowed(kind: Kind, key: &str) -> bool {
    COMMON.contains(&key)
        || match kind {
            Kind::Completion => COMPLETION.contains(&key),
            Kind::Chat => CHAT.contains(&key),
        }
}

/// `value` when it lies in `lo..=hi`, else an error naming the field.
fn in_bounds<T: PartialOrd + std::fmt::Display + Copy>(
    key: &str,
    value: Option<T>,
    lo: T,
    hi: T,
) -> Result<Option<T>, Invalid> {
    match value {
        Some(v) if !(v >= lo && v <= hi) => Err(Invalid::field(
            key,
            format!("'{key}' is {v}; it must be between {lo} and {hi}"),
        )),
        other => Ok(other),
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
fn content_text(i: usize, content: Option<Content>) -> Result<String, Invalid> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for part in parts.kept {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(t)) => text.push_str(&t),
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
        Some(Content::Other(other)) => Err(Invalid::field(
            "messages",
            format!("messages[{i}].content must be a string, got {other}"),
        )),
    }
}

/// An assistant message's calls as the model writes them (see [`structured`]).
fn calls_text(calls: &[ToolCall]) -> String {
    calls
        .iter()
        .map(|c| {
            let arguments: Value = serde_json::from_str(&c.function.arguments)
                .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
            let call = serde_json::json!({"name": c.function.name, "arguments": arguments});
            format!("{CALL_OPEN}{call}{CALL_CLOSE}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The chat's messages as the JSON list the chat-template stage reads; `system` (the tools'
/// description) ends the system message, or becomes one.
fn messages(
    list: Option<Listed<Message>>,
    system: Option<String>,
    mut limit: PromptLimit<'_>,
) -> Result<String, Invalid> {
    let Some(list) = list else {
        return Err(Invalid::field(
            "messages",
            "'messages' is required: a list of {\"role\", \"content\"} objects".into(),
        ));
    };
    let total = list.total;
    let Some(list) = list.whole() else {
        return Err(Invalid::field(
            "messages",
            format!(
                "'messages' holds {total} messages; at most {}",
                decode::LIST_KEPT
            ),
        ));
    };
    if list.is_empty() {
        return Err(Invalid::field("messages", "'messages' is empty".into()));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let role = match m.role {
            Role::Developer => Role::System,
            role => role,
        };
        let mut content = content_text(i, m.content)?;
        limit.count("messages", &format!("messages[{i}].content"), &content)?;
        if let Some(calls) = m.tool_calls.map(|c| c.kept).filter(|c| !c.is_empty()) {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&calls_text(&calls));
        }
        out.push(TemplateMessage { role, content });
    }
    if let Some(system) = system {
        limit.count("tools", "tools", &system)?;
        match out.first_mut() {
            Some(first) if first.role == Role::System => {
                first.content = format!("{}\n\n{system}", first.content);
            }
            _ => out.insert(
                0,
                TemplateMessage {
                    role: Role::System,
                    content: system,
                },
            ),
        }
    }
    if !out.iter().any(|m| m.role == Role::User) {
        return Err(Invalid::field(
            "messages",
            "'messages' holds no message with role 'user': a chat needs at least one user turn"
                .into(),
        ));
    }
    serde_json::to_string(&out)
        .map_err(|e| Error::internal(format!("cannot write the chat for the template: {e}")).into())
}

fn stop_strings(stop: Option<Stop>) -> Result<Vec<String>, Invalid> {
    match stop {
        None => Ok(Vec::new()),
        Some(Stop::One(s)) => Ok(vec![s]),
        Some(Stop::Many(items)) if items.total <= 4 => Ok(items.kept),
        Some(Stop::Many(_)) => Err(Invalid::field(
            "stop",
            "'stop' must be a string or a list of up to 4 strings".into(),
        )),
        Some(Stop::Other(other)) => Err(Invalid::field(
            "stop",
            format!("'stop' must be a string or a list of strings, got {other}"),
        )),
    }
}

/// The model a body names, once its fields are known to be the endpoint's: read without
/// decoding the rest, so that an unknown field or model is refused before anything large is.
pub fn model_named(kind: Kind, head: &decode::Head) -> Result<String, Invalid> {
    if let Some(key) = head.fields.iter().find(|k| !allowed(kind, k)) {
        return Err(Invalid::field(
            key,
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    match &head.model {
        Some(m) if !m.is_empty() => Ok(m.clone()),
        _ if head.fields.iter().any(|f| f == "model") && head.model.is_none() => {
            Err(Invalid::field("model", "'model' must be a string".into()))
        }
        _ => Err(Invalid::field("model", "'model' is required".into())),
    }
}

/// Checks an OpenAI request body (the bytes, read once into the wire type) and builds the
/// model's request; `lookup` finds the named model (the handler's target, or the reason the
/// caller cannot use it), asked before the body is decoded, and is answered with the request.
pub fn parse<T: Borrow<ModelConfig>>(
    kind: Kind,
    body: &[u8],
    lookup: impl FnOnce(&str) -> Result<T, Error>,
) -> Result<(T, Parsed), Invalid> {
    let model = model_named(kind, &decode::head(body)?)?;
    let target = lookup(&model)?;
    let req: CompletionRequest = decode::read(body)?;
    let parsed = from_request(kind, req, model, target.borrow())?;
    Ok((target, parsed))
}

/// [`parse`] of a request already in its wire type (one another endpoint built, as
/// `/v1/responses` builds a chat), for `model` (the name it asked for, perhaps
/// `model:adapter`) served by `config`.
pub fn from_request(
    kind: Kind,
    mut req: CompletionRequest,
    model: String,
    config: &ModelConfig,
) -> Result<Parsed, Invalid> {
    let structure = structured::structure(&mut req)?;
    let n = in_bounds("n", req.n, 1, MAX_CHOICES)?.unwrap_or(1);
    // best_of picks the best n of more candidates; equal to n it picks them all.
    match req.best_of {
        None => {}
        Some(b) if b == n => {}
        Some(b) => {
            return Err(Invalid::field(
                "best_of",
                format!("'best_of' is {b}; only best_of equal to n ({n}) is supported"),
            ))
        }
    }
    let log_probs = log_probs_asked(kind, &req)?;
    let mut score_prompt = log_probs.is_some() && req.echo == Some(true);
    if score_prompt && !scores_prompt(config) {
        return Err(Invalid::field(
            "echo",
            format!(
                "'echo' with 'logprobs' needs the prompt's log-probabilities, which model \
                 '{model}' does not answer (input 'return_prompt_log_probs')"
            ),
        ));
    }
    if log_probs.is_some() && !config.input.iter().any(|i| i.name == "return_log_probs") {
        return Err(Invalid::field(
            "logprobs",
            format!("model '{model}' does not report log-probabilities (input 'return_log_probs')"),
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(Invalid::field("suffix", "'suffix' is not supported".into()));
    }
    let stream = req.stream.unwrap_or(false);
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    // Completions' max_tokens 0 with echo answers the prompt alone (with logprobs, its
    // scores): one token is generated and not answered.
    let prompt_only =
        kind == Kind::Completion && req.echo == Some(true) && req.max_tokens == Some(0);
    let sampling = sampling_inputs(&req, prompt_only)?;
    let mut inputs = Vec::new();
    let mut prompt_list = Vec::new();
    let limit = PromptLimit::new(config)?;
    match kind {
        Kind::Chat => {
            let chat = messages(req.messages, structure.system, limit)?;
            inputs.push(strings("messages", &[chat.as_str()]));
        }
        Kind::Completion => {
            let (tensor, list, spell) = completion_prompts(
                req.prompt,
                n as usize,
                req.echo == Some(true),
                config,
                &model,
            )?;
            for (i, prompt) in list.iter().enumerate() {
                if let PromptInput::Text(text) = prompt {
                    // Each prompt is a sequence of its own: bounded alone.
                    let mut each = limit;
                    each.count("prompt", &format!("prompt[{i}]"), text)?;
                }
            }
            inputs.push(tensor);
            prompt_list = list;
            score_prompt |= spell;
        }
    }
    inputs.extend(sampling);
    if let Some(bias) = req.logit_bias.filter(|b| !b.is_empty()) {
        inputs.extend(logit_bias_inputs(bias, config, &model)?);
    }
    let stop = stop_strings(req.stop)?;
    if !stop.is_empty() {
        let stop: Vec<&str> = stop.iter().map(String::as_str).collect();
        inputs.push(strings("stop", &stop));
    }
    if req.ignore_eos == Some(true) {
        // TensorRT-LLM's end_id -1: no end token, exactly max_tokens.
        inputs.push(scalar(
            "end_id",
            DataType::Int32,
            (-1i32).to_le_bytes().to_vec(),
        ));
    }
    if let Some((guide_type, guide)) = &structure.guide {
        if !config
            .input
            .iter()
            .any(|i| i.name == "guided_decoding_guide_type")
        {
            let param = match (&structure.shape, kind) {
                (Shape::Text, _) => "response_format",
                _ => "tools",
            };
            return Err(Invalid::field(
                param,
                format!(
                    "model '{model}' does not take constrained decoding (input \
                     'guided_decoding_guide_type')"
                ),
            ));
        }
        inputs.push(strings("guided_decoding_guide_type", &[guide_type]));
        inputs.push(strings("guided_decoding_guide", &[guide.as_str()]));
    }
    inputs.push(scalar("stream", DataType::Bool, vec![u8::from(stream)]));
    if score_prompt {
        inputs.push(scalar("return_prompt_log_probs", DataType::Bool, vec![1]));
    }
    if let Some(k) = log_probs {
        inputs.push(scalar("return_log_probs", DataType::Bool, vec![1]));
        inputs.push(scalar(
            "top_logprobs",
            DataType::Int32,
            (k as i32).to_le_bytes().to_vec(),
        ));
    }
    // Only the inputs the model takes (a model without penalties simply has none).
    inputs.retain(|t| config.input.iter().any(|i| i.name == t.name));
    if !inputs
        .iter()
        .any(|t| matches!(t.name.as_str(), "messages" | "text_input" | "prompt_ids"))
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
    let mut request = InferRequest::new(config.name.clone(), None).with_inputs(inputs);
    // `model:adapter` (vLLM's LoRA model names): the model, with its adapter as a parameter.
    if let Some((_, adapter)) = split_adapter(&model).filter(|_| config.name != model) {
        request.parameters.insert(
            crate::inference::ADAPTER_PARAMETER.into(),
            ParamValue::String(adapter.to_owned()),
        );
    }
    let parsed = Parsed {
        request,
        model,
        stream,
        include_usage,
        n: n as usize,
        echo: req.echo == Some(true),
        scored_prompt: score_prompt,
        prompt_only,
        prompts: prompt_list,
        log_probs,
        shape: structure.shape,
    };
    Ok(parsed)
}

/// A completions request's prompts (the first as the model's input), and whether their tokens
/// must be spelled through the scored prompt (`echo` of token ids).
fn completion_prompts(
    prompt: Option<Prompt>,
    n: usize,
    echo: bool,
    config: &ModelConfig,
    model: &str,
) -> Result<(Tensor, Vec<PromptInput>, bool), Invalid> {
    let prompt_list = prompts::parse(prompt)?;
    if prompt_list.len() * n > MAX_SEQUENCES {
        return Err(Invalid::field(
            "n",
            format!(
                "{} prompts with 'n' {n} ask for {} sequences; one request may start at \
                 most {MAX_SEQUENCES}",
                prompt_list.len(),
                prompt_list.len() * n
            ),
        ));
    }
    let first = &prompt_list[0];
    if !config.input.iter().any(|i| i.name == first.input_name()) {
        return Err(Invalid::field(
            "prompt",
            format!(
                "model '{model}' does not take {} (input '{}')",
                match first {
                    PromptInput::Text(_) => "text prompts",
                    PromptInput::Ids(_) => "token-id prompts",
                },
                first.input_name()
            ),
        ));
    }
    let tensor = first.tensor();
    // Echoing token ids needs their spelling, which the scored prompt carries.
    let spell = echo && matches!(first, PromptInput::Ids(_));
    if spell && !scores_prompt(config) {
        return Err(Invalid::field(
            "echo",
            format!(
                "'echo' of a token-id prompt needs the prompt's tokens spelled, which model \
                 '{model}' does not answer (input 'return_prompt_log_probs')"
            ),
        ));
    }
    Ok((tensor, prompt_list, spell))
}

/// Whether the model answers a prompt's log-probabilities (and so its tokens' spelling).
fn scores_prompt(config: &ModelConfig) -> bool {
    config
        .input
        .iter()
        .any(|i| i.name == "return_prompt_log_probs")
}

/// The alternatives per token a request asks log-probabilities for, or `None`. Chat: `logprobs`
/// true and `top_logprobs` 0-20; completions: `logprobs` 0-5 (the chosen token's own always
/// comes).
fn log_probs_asked(kind: Kind, req: &CompletionRequest) -> Result<Option<usize>, Invalid> {
    let log_probs = match (kind, req.logprobs) {
        (_, None) | (Kind::Chat, Some(Logprobs::Flag(false))) => None,
        (Kind::Chat, Some(Logprobs::Flag(true))) => {
            Some(in_bounds("top_logprobs", req.top_logprobs, 0, 20)?.unwrap_or(0) as usize)
        }
        (Kind::Completion, Some(Logprobs::Count(k))) => {
            Some(in_bounds("logprobs", Some(k), 0, 5)?.unwrap_or(0) as usize)
        }
        (Kind::Chat, Some(Logprobs::Count(_))) => {
            return Err(Invalid::field(
                "logprobs",
                "'logprobs' must be true or false (top_logprobs says how many alternatives)".into(),
            ))
        }
        (Kind::Completion, Some(Logprobs::Flag(_))) => {
            return Err(Invalid::field(
                "logprobs",
                "'logprobs' must be a whole number between 0 and 5".into(),
            ))
        }
    };
    if kind == Kind::Chat && log_probs.is_none() && req.top_logprobs.is_some_and(|k| k != 0) {
        return Err(Invalid::field(
            "top_logprobs",
            "'top_logprobs' needs 'logprobs': true".into(),
        ));
    }
    Ok(log_probs)
}

/// The sampling inputs a request sets, by TensorRT-LLM's names (`max_tokens`, `temperature`,
/// `top_p`, `top_k`, `seed`, the penalties), each checked against its range.
fn sampling_inputs(req: &CompletionRequest, prompt_only: bool) -> Result<Vec<Tensor>, Invalid> {
    let mut inputs = Vec::new();
    let most = i64::from(i32::MAX);
    let max_tokens = match in_bounds("max_completion_tokens", req.max_completion_tokens, 1, most)? {
        Some(v) => Some(v),
        None if prompt_only => Some(1),
        None => in_bounds("max_tokens", req.max_tokens, 1, most)?,
    };
    if let Some(v) = max_tokens {
        inputs.push(scalar(
            "max_tokens",
            DataType::Int32,
            (v as i32).to_le_bytes().to_vec(),
        ));
    }
    // OpenAI samples at temperature 1 unless told otherwise.
    let temperature = in_bounds("temperature", req.temperature, 0.0, 2.0)?.unwrap_or(1.0);
    inputs.push(scalar(
        "temperature",
        DataType::Fp32,
        (temperature as f32).to_le_bytes().to_vec(),
    ));
    if let Some(v) = in_bounds("top_p", req.top_p, 0.0, 1.0)? {
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
    if let Some(v) = in_bounds("top_k", req.top_k, -1, most)? {
        // vLLM's -1 means every token, as 0 does here.
        inputs.push(scalar(
            "top_k",
            DataType::Int32,
            (v.max(0) as i32).to_le_bytes().to_vec(),
        ));
    }
    if let Some(v) = req.seed {
        inputs.push(scalar(
            "seed",
            DataType::Uint64,
            (v as u64).to_le_bytes().to_vec(),
        ));
    }
    for (key, value) in [
        ("frequency_penalty", req.frequency_penalty),
        ("presence_penalty", req.presence_penalty),
    ] {
        if let Some(v) = in_bounds(key, value, -2.0, 2.0)? {
            inputs.push(scalar(
                key,
                DataType::Fp32,
                (v as f32).to_le_bytes().to_vec(),
            ));
        }
    }
    let repetition = in_bounds(
        "repetition_penalty",
        req.repetition_penalty,
        f64::MIN_POSITIVE,
        100.0,
    )?;
    if let Some(v) = repetition {
        inputs.push(scalar(
            "repetition_penalty",
            DataType::Fp32,
            (v as f32).to_le_bytes().to_vec(),
        ));
    }
    Ok(inputs)
}

/// The `logit_bias` map as the model's `logit_bias_ids` / `logit_bias_values` inputs.
fn logit_bias_inputs(
    bias: std::collections::BTreeMap<String, f64>,
    config: &ModelConfig,
    model: &str,
) -> Result<Vec<Tensor>, Invalid> {
    let mut inputs = Vec::new();
    if !config.input.iter().any(|i| i.name == "logit_bias_ids") {
        return Err(Invalid::field(
            "logit_bias",
            format!("model '{model}' does not take 'logit_bias' (input 'logit_bias_ids')"),
        ));
    }
    let mut ids = Vec::new();
    let mut values = Vec::new();
    for (token, value) in bias {
        let id: i32 = token.parse().map_err(|_| {
            Invalid::field(
                "logit_bias",
                format!("'logit_bias' key '{token}' is not a token id"),
            )
        })?;
        in_bounds("logit_bias", Some(value), -100.0, 100.0)?;
        ids.extend_from_slice(&id.to_le_bytes());
        values.extend_from_slice(&(value as f32).to_le_bytes());
    }
    let n = ids.len() as i64 / 4;
    for (name, datatype, data) in [
        ("logit_bias_ids", DataType::Int32, ids),
        ("logit_bias_values", DataType::Fp32, values),
    ] {
        inputs.push(Tensor {
            name: name.to_owned(),
            datatype,
            shape: vec![1, n],
            data: Bytes::from(data),
        });
    }
    Ok(inputs)
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

#[cfg(test)]
mod tests;
