//! `POST /v1/responses`: OpenAI's Responses API over the same generation path as chat: the
//! `input` (a string, or messages whose content is text) after the `instructions` as the
//! system message, `max_output_tokens`, `temperature`, `top_p`, `text.format` (text, any JSON
//! object, or JSON valid under a schema); answered whole (`object: "response"`, its
//! `output` one assistant message of `output_text`) or streamed as the Responses events
//! (`response.created` … `response.output_text.delta` … `response.completed`). Nothing is
//! stored: `previous_response_id` and tools are refused by name, as is any unknown field.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::{
    body::Body,
    http::HeaderMap,
    response::{
        sse::{Event, Sse},
        IntoResponse, Response,
    },
    Json,
};
use serde::{
    de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor},
    Deserialize, Serialize,
};
use serde_json::{json, value::RawValue, Map, Value};
use tokio::sync::mpsc;

use super::{
    choices::{merge, piece},
    decode::{self, Listed},
    now, read_admitted,
    request::{self, Kind},
    text_model,
    types::{CompletionRequest, Content, JsonSchemaFormat, Message, ResponseFormat, Role},
    Invalid,
};
use crate::{
    error::{Error, Result},
    frontends::http::{body::off_runtime, state::HttpState},
    inference::InferResponse,
    scheduling::door::Door,
    tenancy::Admission,
};

/// The Responses request, as far as it is served (anything else is refused by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponsesRequest {
    model: String,
    input: Input,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    text: Option<TextOptions>,
    #[serde(default)]
    metadata: Option<Metadata>,
    /// Nothing is stored whatever it says (`store` is reported false).
    #[serde(default)]
    #[allow(dead_code)]
    store: Option<bool>,
    #[serde(default)]
    user: Option<String>,
    /// Accepted only when it asks for no continuation.
    #[serde(default)]
    previous_response_id: Option<String>,
    /// Only whether it is empty matters: read without keeping more than one entry.
    #[serde(default)]
    tools: Option<Listed<IgnoredAny, 1>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    truncation: Option<String>,
}

/// `input`: a string, or message items read one by one (at most `LIST_KEPT` kept, the rest
/// counted, never buffered whole).
#[derive(Debug)]
enum Input {
    Text(String),
    Items(Listed<InputItem>),
}

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Input;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of messages")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Input, E> {
                Ok(Input::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Input, E> {
                Ok(Input::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> std::result::Result<Input, A::Error> {
                decode::read_listed(seq, Vec::new()).map(Input::Items)
            }
        }
        d.deserialize_any(V)
    }
}

/// `metadata`: at most 16 string pairs, as OpenAI takes it (read pair by pair).
#[derive(Debug, Default, Clone)]
struct Metadata(Map<String, Value>);

const METADATA_KEYS: usize = 16;

impl<'de> Deserialize<'de> for Metadata {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Metadata;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of at most 16 strings")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Metadata, A::Error> {
                let mut out = Map::new();
                while let Some((k, v)) = map.next_entry::<String, String>()? {
                    if out.len() == METADATA_KEYS {
                        return Err(de::Error::custom(format!("at most {METADATA_KEYS} keys")));
                    }
                    out.insert(k, Value::String(v));
                }
                Ok(Metadata(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputItem {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    role: String,
    content: ItemContent,
}

/// A message's `content`: a string or parts, read one by one like `input`.
#[derive(Debug)]
enum ItemContent {
    Text(String),
    Parts(Listed<ContentPart>),
}

impl<'de> Deserialize<'de> for ItemContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ItemContent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<ItemContent, E> {
                Ok(ItemContent::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<ItemContent, E> {
                Ok(ItemContent::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                seq: A,
            ) -> std::result::Result<ItemContent, A::Error> {
                decode::read_listed(seq, Vec::new()).map(ItemContent::Parts)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextOptions {
    #[serde(default)]
    format: Option<TextFormat>,
    /// Accepted; this server has one verbosity.
    #[serde(default)]
    #[allow(dead_code)]
    verbosity: Option<String>,
}

/// `text.format`: its type, and for `json_schema` the schema kept as sent (never parsed here).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct TextFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schema: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

fn field(name: &str, message: String) -> Invalid {
    Invalid {
        error: Error::invalid(message),
        param: Some(name.to_owned()),
    }
}

impl ResponsesRequest {
    /// The same request as a chat completion's body, its texts counted against `limit`.
    /// What this server does not serve, refused by name.
    fn refuse_unserved(&self) -> std::result::Result<(), Invalid> {
        if self.previous_response_id.is_some() {
            return Err(field(
                "previous_response_id",
                "'previous_response_id': responses are not stored here; send the whole \
                 conversation in 'input'"
                    .into(),
            ));
        }
        if self.tools.as_ref().is_some_and(|t| t.total > 0) {
            return Err(field(
                "tools",
                "'tools': tools are served on /v1/chat/completions, not on /v1/responses".into(),
            ));
        }
        if let Some(choice) = &self.tool_choice {
            if choice != "none" && choice != "auto" {
                return Err(field(
                    "tool_choice",
                    format!("'tool_choice' is {choice}; without tools only 'none' or 'auto'"),
                ));
            }
        }
        if let Some(t) = self.truncation.as_deref().filter(|t| *t != "disabled") {
            return Err(field(
                "truncation",
                format!("'truncation' is '{t}'; only 'disabled' is supported"),
            ));
        }
        Ok(())
    }

    /// The chat request this asks for, in chat's wire type (nothing written out as JSON and
    /// read again); the model's bound on prompt characters (`limit`) holds as the text is
    /// taken.
    fn into_chat(
        self,
        mut limit: super::prompt_limit::PromptLimit<'_>,
    ) -> std::result::Result<CompletionRequest, Invalid> {
        self.refuse_unserved()?;
        let mut messages = Vec::new();
        let message = |role, text| Message {
            role,
            content: Some(Content::Text(text)),
            tool_calls: None,
        };
        if let Some(instructions) = self.instructions {
            limit.count("instructions", "instructions", &instructions)?;
            messages.push(message(Role::System, instructions));
        }
        match self.input {
            Input::Text(text) => {
                limit.count("input", "input", &text)?;
                messages.push(message(Role::User, text))
            }
            Input::Items(items) => {
                if items.total > items.kept.len() {
                    return Err(field(
                        "input",
                        format!(
                            "'input' holds {} items; at most {}",
                            items.total,
                            decode::LIST_KEPT
                        ),
                    ));
                }
                for (i, item) in items.kept.into_iter().enumerate() {
                    let (role, text) = item.into_message(i)?;
                    limit.count("input", &format!("input[{i}].content"), &text)?;
                    messages.push(message(role, text));
                }
            }
        }
        let response_format = match self.text.and_then(|t| t.format) {
            Some(format) => Some(response_format(format)?),
            None => None,
        };
        Ok(CompletionRequest {
            model: Some(self.model),
            messages: Some(Listed {
                total: messages.len(),
                kept: messages,
            }),
            stream: self.stream,
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            user: self.user,
            response_format,
            ..Default::default()
        })
    }
}

impl InputItem {
    /// Input item `i` as a chat message's role and text: a message whose parts are text.
    fn into_message(self, i: usize) -> std::result::Result<(Role, String), Invalid> {
        if let Some(kind) = self.kind.as_deref().filter(|k| *k != "message") {
            return Err(field(
                "input",
                format!("'input[{i}].type' is '{kind}'; only 'message' items are served"),
            ));
        }
        let role = match self.role.as_str() {
            "developer" | "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(field(
                    "input",
                    format!(
                        "'input[{i}].role' is '{other}'; expected user, assistant, system or \
                         developer"
                    ),
                ))
            }
        };
        let parts = match self.content {
            ItemContent::Text(t) => return Ok((role, t)),
            ItemContent::Parts(parts) => parts,
        };
        if parts.total > parts.kept.len() {
            return Err(field(
                "input",
                format!(
                    "'input[{i}].content' holds {} parts; at most {}",
                    parts.total,
                    decode::LIST_KEPT
                ),
            ));
        }
        let mut text = String::new();
        for (j, part) in parts.kept.iter().enumerate() {
            match (part.kind.as_str(), &part.text) {
                ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                (kind, _) => {
                    return Err(field(
                        "input",
                        format!(
                            "'input[{i}].content[{j}].type' is '{kind}'; only text parts are \
                             served"
                        ),
                    ))
                }
            }
        }
        Ok((role, text))
    }
}

/// `text.format` as chat's `response_format`: the schema's fields sit beside `type` here.
fn response_format(format: TextFormat) -> std::result::Result<ResponseFormat, Invalid> {
    match format.kind.as_str() {
        "text" | "json_object" => Ok(ResponseFormat {
            kind: format.kind,
            json_schema: None,
        }),
        "json_schema" => Ok(ResponseFormat {
            kind: format.kind,
            json_schema: Some(JsonSchemaFormat {
                name: format.name.unwrap_or_default(),
                description: format.description,
                schema: format.schema,
                strict: format.strict,
            }),
        }),
        other => Err(field(
            "text",
            format!(
                "'text.format.type' is '{other}'; expected 'text', 'json_object' or \
                 'json_schema'"
            ),
        )),
    }
}

fn next_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}_{:x}{:x}",
        now(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// What the answer reports of the request and of itself.
struct Shape {
    id: String,
    message_id: String,
    created_at: u64,
    model: String,
    echo: Value,
}

impl Shape {
    fn of(req: &ResponsesRequest) -> Self {
        // Echoed as sent (the body is within the HTTP body limit; the schema's own bound is
        // checked as the chat is parsed, right after).
        let format = req
            .text
            .as_ref()
            .and_then(|t| t.format.as_ref())
            .and_then(|f| serde_json::to_value(f).ok())
            .unwrap_or_else(|| json!({"type": "text"}));
        Self {
            id: next_id("resp"),
            message_id: next_id("msg"),
            created_at: now(),
            model: req.model.clone(),
            echo: json!({
                "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature.unwrap_or(1.0),
                "top_p": req.top_p.unwrap_or(1.0),
                "metadata": req.metadata.clone().unwrap_or_default().0,
                "user": req.user,
                "text": {"format": format},
                "tools": [],
                "tool_choice": "auto",
                "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
                "truncation": "disabled",
                "store": false,
                "previous_response_id": null,
                "reasoning": null,
                "error": null,
            }),
        }
    }

    fn message(&self, text: &str, status: &str) -> Value {
        json!({
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": if text.is_empty() && status == "in_progress" {
                json!([])
            } else {
                json!([{"type": "output_text", "text": text, "annotations": []}])
            },
        })
    }

    /// The response object: in progress (no output yet), or done with `text`.
    fn response(&self, done: Option<(&str, &str, i64, i64)>) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "in_progress",
            "incomplete_details": null,
            "output": [],
            "usage": null,
        });
        if let Some((text, finish, input, output)) = done {
            let cut = finish == "length";
            r["status"] = json!(if cut { "incomplete" } else { "completed" });
            if cut {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["output"] = json!([self.message(text, if cut { "incomplete" } else { "completed" })]);
            r["usage"] = json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
            });
        }
        if let (Some(r), Some(echo)) = (r.as_object_mut(), self.echo.as_object()) {
            for (k, v) in echo {
                r.insert(k.clone(), v.clone());
            }
        }
        r
    }
}

/// `POST /v1/responses` for one caller, through its door.
pub(super) async fn respond(
    st: &HttpState,
    door: Door,
    headers: &HeaderMap,
    body: Body,
) -> std::result::Result<Response, Invalid> {
    let (body, admission) = read_admitted(st, door.caller(), headers, body).await?;
    let (target, parsed, shape, stream) = off_runtime(body.len(), move || {
        let req: ResponsesRequest = decode::read(&body)?;
        // The model first: its bound on prompts holds before any text is copied.
        let target = text_model(&door, &req.model)?;
        let limit = super::prompt_limit::PromptLimit::new(target.config())?;
        let shape = Shape::of(&req);
        let stream = req.stream.unwrap_or(false);
        let model = req.model.clone();
        let chat = req.into_chat(limit)?;
        let parsed = request::from_request(Kind::Chat, chat, model, target.config())?;
        Ok::<_, Invalid>((target, parsed, shape, stream))
    })
    .await??;
    let items = merge(vec![st
        .server
        .infer_stream_on(&target, parsed.request_for(0))]);
    if stream {
        return Ok(Sse::new(events(items, admission, shape)).into_response());
    }
    let (text, finish, input, output) = gather(items).await?;
    drop(admission);
    Ok(Json(shape.response(Some((&text, &finish, input, output)))).into_response())
}

/// The whole answer: its text, finish reason and token counts.
async fn gather(
    mut items: mpsc::Receiver<(usize, Result<InferResponse>)>,
) -> Result<(String, String, i64, i64)> {
    let (mut text, mut finish, mut input, mut output) = (String::new(), None, 0, 0);
    while let Some((_, item)) = items.recv().await {
        let p = piece(&item?);
        text.push_str(&p.text);
        finish = p.finish.or(finish);
        input = p.prompt_tokens.unwrap_or(input);
        output = p.generated_tokens.unwrap_or(output);
    }
    Ok((text, finish.unwrap_or_else(|| "stop".into()), input, output))
}

/// The Responses API's events for one answer, each with its `sequence_number`.
fn events(
    items: mpsc::Receiver<(usize, Result<InferResponse>)>,
    admission: Admission,
    shape: Shape,
) -> impl futures::Stream<Item = std::result::Result<Event, std::convert::Infallible>> {
    struct Streaming {
        items: mpsc::Receiver<(usize, Result<InferResponse>)>,
        _admission: Admission,
        shape: Shape,
        sequence: u64,
        text: String,
        finish: Option<String>,
        input: i64,
        output: i64,
        pending: std::collections::VecDeque<Event>,
        started: bool,
        done: bool,
    }
    impl Streaming {
        fn push(&mut self, kind: &str, mut data: Value) {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
            self.pending
                .push_back(Event::default().event(kind).data(data.to_string()));
        }
        fn start(&mut self) {
            let r = self.shape.response(None);
            self.push("response.created", json!({"response": r.clone()}));
            self.push("response.in_progress", json!({"response": r}));
            let item = self.shape.message("", "in_progress");
            self.push(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            self.push(
                "response.content_part.added",
                json!({"item_id": self.shape.message_id, "output_index": 0,
                       "content_index": 0, "part": part}),
            );
        }
        fn finish(&mut self) {
            let finish = self.finish.clone().unwrap_or_else(|| "stop".into());
            let text = self.text.clone();
            let id = self.shape.message_id.clone();
            self.push(
                "response.output_text.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text}),
            );
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            self.push(
                "response.content_part.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "part": part}),
            );
            let r = self
                .shape
                .response(Some((&text, &finish, self.input, self.output)));
            let item = r["output"][0].clone();
            self.push(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            );
            let kind = if finish == "length" {
                "response.incomplete"
            } else {
                "response.completed"
            };
            self.push(kind, json!({"response": r}));
        }
    }
    let state = Streaming {
        items,
        _admission: admission,
        shape,
        sequence: 0,
        text: String::new(),
        finish: None,
        input: 0,
        output: 0,
        pending: Default::default(),
        started: false,
        done: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(e) = s.pending.pop_front() {
                return Some((Ok(e), s));
            }
            if s.done {
                return None;
            }
            if !s.started {
                s.started = true;
                s.start();
                continue;
            }
            match s.items.recv().await {
                Some((_, Ok(response))) => {
                    let p = piece(&response);
                    s.finish = p.finish.or(s.finish.take());
                    s.input = p.prompt_tokens.unwrap_or(s.input);
                    s.output = p.generated_tokens.unwrap_or(s.output);
                    if !p.text.is_empty() {
                        s.text.push_str(&p.text);
                        let id = s.shape.message_id.clone();
                        s.push(
                            "response.output_text.delta",
                            json!({"item_id": id, "output_index": 0, "content_index": 0,
                                   "delta": p.text}),
                        );
                    }
                }
                Some((_, Err(e))) => {
                    s.push(
                        "error",
                        json!({"code": format!("{:?}", e.code), "message": e.message,
                               "param": null}),
                    );
                    s.done = true;
                }
                None => {
                    s.finish();
                    s.done = true;
                }
            }
        }
    })
}
