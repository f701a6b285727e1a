//! OpenAI's wire types for `/v1/models`, `/v1/completions` and `/v1/chat/completions`: what a
//! client sends and what we answer, apart from the handlers. serde reads and writes them;
//! `request.rs` checks the values and turns them into a model's request.

use serde::{Deserialize, Serialize};
use serde_json::{value::RawValue, Value};

pub use super::decode::{Listed, Shape, StringOrList, TextsOrIds};

/// A `/v1/completions` or `/v1/chat/completions` body. One type serves both endpoints: which
/// fields an endpoint takes is checked by name before the body is read into this, so a field
/// of the other endpoint never gets here. Read straight from the body's bytes
/// ([`super::decode`]): lists keep at most what is served, and schemas stay as their text
/// until their size is checked.
#[derive(Debug, Default, Deserialize)]
pub struct CompletionRequest {
    /// The model to run.
    pub model: Option<String>,
    /// Completions: the prompt.
    pub prompt: Option<Prompt>,
    /// Chat: the conversation so far.
    pub messages: Option<Listed<Message>>,
    /// The most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Chat: the newer name of `max_tokens` (wins when both are given).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature, 0 to 2 (OpenAI's default 1).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, above 0 up to 1.
    pub top_p: Option<f64>,
    /// Choices to generate.
    pub n: Option<i64>,
    /// Completions: candidates to pick the best of.
    pub best_of: Option<i64>,
    /// Answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Text that ends the completion.
    pub stop: Option<Stop>,
    /// Seed for sampling.
    pub seed: Option<i64>,
    /// Penalty on tokens by how often they appeared, -2 to 2.
    pub frequency_penalty: Option<f64>,
    /// Penalty on tokens that appeared at all, -2 to 2.
    pub presence_penalty: Option<f64>,
    /// The end user, for the caller's own records.
    pub user: Option<String>,
    /// Biases (-100 to 100) added to tokens' logits, by token id.
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Log-probabilities: a flag in chat, a count in completions.
    pub logprobs: Option<Logprobs>,
    /// Chat: how many alternatives per token to report.
    pub top_logprobs: Option<i64>,
    /// Completions: answer the prompt too.
    pub echo: Option<bool>,
    /// Completions: text after the completion.
    pub suffix: Option<String>,
    /// vLLM's extension: sample among the k likeliest tokens (-1 or 0: all).
    pub top_k: Option<i64>,
    /// vLLM's extension: multiplicative repetition penalty, above 0.
    pub repetition_penalty: Option<f64>,
    /// vLLM's extension: generate exactly `max_tokens`, ignoring the end token.
    pub ignore_eos: Option<bool>,
    /// The answer's format: text, any JSON object, or JSON valid under a schema.
    pub response_format: Option<ResponseFormat>,
    /// Chat: functions the model may call.
    pub tools: Option<Vec<Tool>>,
    /// Chat: whether and which function to call (`none`, `auto`, `required`, or one by name).
    pub tool_choice: Option<ToolChoice>,
    /// Chat: several calls in one answer (always allowed here).
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's extension: JSON valid under this schema (an object, or the schema as a string).
    pub guided_json: Option<Box<RawValue>>,
    /// vLLM's extension: text matching this regular expression.
    pub guided_regex: Option<String>,
    /// vLLM's extension: exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
}

/// `response_format`: `{"type": "text"}` (the default), `{"type": "json_object"}` (any JSON
/// object) or `{"type": "json_schema", "json_schema": {...}}` (JSON valid under its schema).
/// A struct rather than a tagged enum: serde buffers a tagged enum's whole content first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// With `json_schema`: the schema and its name.
    #[serde(default)]
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    /// The format's name.
    pub name: String,
    /// What it is for.
    #[serde(default)]
    pub description: Option<String>,
    /// The JSON schema (any JSON when absent), as sent.
    #[serde(default)]
    pub schema: Option<Box<RawValue>>,
    /// Follow the schema exactly (constrained decoding always does).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

/// A function the model may call.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object of anything when absent), as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Box<RawValue>>,
    /// Follow the schema exactly (constrained decoding always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": …}}`.
    Named {
        /// Always `function`.
        #[serde(rename = "type")]
        kind: String,
        /// Which function.
        function: NamedFunction,
    },
}

/// The function a named `tool_choice` names.
#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// A call the model made, in an answer or in a message sent back.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ToolCall {
    /// `call_…`, which the tool's answer refers to.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// A function call: its name and its arguments as JSON text.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct FunctionCall {
    /// The function.
    pub name: String,
    /// Its arguments, a JSON object written as text.
    pub arguments: String,
}

/// A piece of a call in a streamed chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the answer.
    pub index: u32,
    /// Set in the call's first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in the call's first piece.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first piece) and more of the arguments.
    pub function: FunctionCallDelta,
}

/// A piece of a function call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallDelta {
    /// The function, in the call's first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More of the arguments' text.
    pub arguments: String,
}

/// A completion's `prompt`: a text, a list of texts, token ids or a list of token-id lists.
pub type Prompt = TextsOrIds;

/// `logprobs`: chat's flag or completions' count of alternatives.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat: report them or not.
    Flag(bool),
    /// Completions: how many alternatives per token.
    Count(i64),
}

impl Logprobs {
    /// Whether any are asked for.
    pub fn wanted(self) -> bool {
        match self {
            Self::Flag(b) => b,
            Self::Count(n) => n > 0,
        }
    }
}

/// `stop`: one string or a list.
pub type Stop = StringOrList;

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// End the stream with a chunk holding `usage`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// OpenAI's newer name for system instructions.
    Developer,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A function's answer to a call.
    Tool,
}

/// One chat message (fields beyond these, such as `name`, are accepted and ignored).
#[derive(Debug, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// What it says.
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant message's calls, sent back with the tools' answers.
    #[serde(default)]
    pub tool_calls: Option<Listed<ToolCall>>,
}

/// A message's `content`: a string or a list of parts (read by [`super::decode`]).
#[derive(Debug)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts, of which only text ones are served.
    Parts(Listed<ContentPart>),
    /// Anything else, refused by name.
    Other(Shape),
}

/// One part of a message's content.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// `text`, `image_url`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A chat message as the chat-template stage reads it.
#[derive(Debug, Serialize)]
pub struct TemplateMessage {
    /// `system`, `user` or `assistant`.
    pub role: Role,
    /// The text.
    pub content: String,
}

/// A completion answer, whole or as one streamed chunk; `C` is the kind of choice.
#[derive(Debug, Serialize)]
pub struct Completion<C> {
    /// `cmpl-…` or `chatcmpl-…`, the same in every chunk of a stream.
    pub id: String,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model named by the request.
    pub model: String,
    /// The choices (empty in a stream's usage chunk).
    pub choices: Vec<C>,
    /// Token counts: always in a whole answer; in a stream only when asked, null until the
    /// last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One answered token with its log-probability and the likeliest tokens at its step (chat).
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    /// What it spells (invalid UTF-8 replaced; `bytes` has it exactly).
    pub token: String,
    /// Its natural-log probability.
    pub logprob: f32,
    /// What it spells, as bytes.
    pub bytes: Vec<u8>,
    /// The likeliest tokens at its step, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative at a step.
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    /// What it spells.
    pub token: String,
    /// Its natural-log probability.
    pub logprob: f32,
    /// What it spells, as bytes.
    pub bytes: Vec<u8>,
}

/// A chat choice's `logprobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// The answered tokens.
    pub content: Vec<TokenLogprob>,
    /// Always null.
    pub refusal: Option<Value>,
}

/// A completions choice's `logprobs` (the legacy shape).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TextLogprobs {
    /// The answered tokens.
    pub tokens: Vec<String>,
    /// Their log-probabilities (null for an echoed prompt's first token, which nothing
    /// precedes).
    pub token_logprobs: Vec<Option<f32>>,
    /// Per token, the likeliest tokens at its step (null for that first token).
    pub top_logprobs: Vec<Option<std::collections::BTreeMap<String, f32>>>,
    /// Where each token starts in the choice's text.
    pub text_offset: Vec<usize>,
}

/// A completions choice (whole or streamed).
#[derive(Debug, Serialize)]
pub struct TextChoice {
    /// Which choice.
    pub index: u32,
    /// The text.
    pub text: String,
    /// When asked for.
    pub logprobs: Option<TextLogprobs>,
    /// `stop` or `length` on the last piece.
    pub finish_reason: Option<String>,
}

/// A chat choice of a whole answer.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    /// Which choice.
    pub index: u32,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// When asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: Option<String>,
}

/// The assistant's answer in a whole chat completion.
#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: Role,
    /// The text (null when the answer is calls).
    pub content: Option<String>,
    /// The functions it calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A chat choice of a streamed chunk.
#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    /// Which choice.
    pub index: u32,
    /// What this chunk adds.
    pub delta: Delta,
    /// When asked for: this chunk's tokens.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last chunk of the choice.
    pub finish_reason: Option<String>,
}

/// What a streamed chat chunk adds: the role first, then text.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New calls, or more of their arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: i64,
    /// Tokens generated.
    pub completion_tokens: i64,
    /// Both.
    pub total_tokens: i64,
}

impl Usage {
    /// Counts from the prompt's and the completion's tokens.
    pub fn new(prompt_tokens: i64, completion_tokens: i64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A `/v1/embeddings` body.
#[derive(Debug, Default, Deserialize)]
pub struct EmbeddingRequest {
    /// The embedding model.
    pub model: Option<String>,
    /// The text, or texts, to embed (token ids are read to be refused by name).
    pub input: Option<TextsOrIds>,
    /// `float` (default) or `base64`.
    pub encoding_format: Option<String>,
    /// The vectors' length, where the model allows it.
    pub dimensions: Option<i64>,
    /// The end user, for the caller's own records.
    pub user: Option<String>,
}

/// The `/v1/embeddings` answer.
#[derive(Debug, Serialize)]
pub struct EmbeddingList {
    /// Always `list`.
    pub object: &'static str,
    /// One vector per input, in order.
    pub data: Vec<Embedding>,
    /// The model named.
    pub model: String,
    /// Tokens read.
    pub usage: EmbeddingUsage,
}

/// One input's vector.
#[derive(Debug, Serialize)]
pub struct Embedding {
    /// Always `embedding`.
    pub object: &'static str,
    /// Which input.
    pub index: usize,
    /// The vector.
    pub embedding: EmbeddingVector,
}

/// A vector as floats or as base64 of little-endian float32.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// `encoding_format: float`.
    Float(Vec<f32>),
    /// `encoding_format: base64`.
    Base64(String),
}

/// Tokens an embeddings request read (0 when the model does not count them).
#[derive(Debug, Serialize)]
pub struct EmbeddingUsage {
    /// Tokens in the inputs.
    pub prompt_tokens: i64,
    /// The same.
    pub total_tokens: i64,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelCard>,
}

/// One model in `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelCard {
    /// Its name.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Always `wasmtron`.
    pub owned_by: &'static str,
    /// For a LoRA adapter (`model:adapter`), the model it adapts (as vLLM lists adapters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// An error as OpenAI answers it.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// The error.
    pub error: ErrorDetail<'a>,
}

/// What went wrong.
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    /// For a person.
    pub message: &'a str,
    /// `invalid_request_error`, `permission_error`, `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<&'a str>,
    /// A code a program can branch on (`model_not_found`, `invalid_api_key`, …).
    pub code: Option<&'static str>,
}

/// Read by the same rules as the other lists ([`super::decode`]).
impl<'de> serde::Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
        use std::fmt;

        use super::decode::{read_listed, Element, LIST_KEPT};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
                read_listed::<A, ContentPart, LIST_KEPT>(seq, Vec::new()).map(Content::Parts)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Content, E> {
                Ok(Content::Other(Element::Int(v).shape()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Content, E> {
                Ok(Content::Other(Element::Uint(v).shape()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Content, E> {
                Ok(Content::Other(Element::Float(v).shape()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Content, E> {
                Ok(Content::Other(Element::Bool(v).shape()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Content, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Content::Other(Element::Object.shape()))
            }
        }
        d.deserialize_any(V)
    }
}
