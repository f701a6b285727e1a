//! OpenAI-compatible endpoints on the HTTP port, as Triton's OpenAI frontend offers them:
//! `GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions`, streamed
//! (server-sent events ending in `data: [DONE]`) or not, with `usage` and `finish_reason`.
//!
//! A model serves these when it takes a prompt (`text_input`) or a chat (`messages`) and
//! answers `text_output`, like the `smollm2` ensemble; sampling fields become its inputs by
//! TensorRT-LLM's names. Errors come in OpenAI's shape (`{"error": {"message", "type",
//! "param", "code"}}`); tenants' API keys are the OpenAI client's `api_key`.

pub mod embeddings;
pub mod request;
pub mod types;

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{
        sse::{Event, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use serde::Serialize;
use serde_json::Value;

use self::{
    request::{Invalid, Kind},
    types::{
        AssistantMessage, ChatChoice, ChunkChoice, Completion, Delta, ErrorBody, ErrorDetail,
        ModelCard, ModelList, Role, TextChoice, Usage,
    },
};
use super::{body::read_body, error::status_for, state::HttpState};
use crate::{
    error::{Code, Error},
    inference::InferResponse,
    tenancy::{Caller, ModelAction},
    tensor::{bytes_elements, DataType, Tensor},
};

/// The OpenAI routes.
pub(crate) fn routes() -> axum::Router<HttpState> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
}

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
        Code::Internal | Code::Unavailable => ("server_error", None),
        _ => ("invalid_request_error", None),
    };
    (
        status_for(error.code),
        Json(error_body(error, kind, param, code)),
    )
        .into_response()
}

fn error_body<'a>(
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

/// The request field a generation model's message is about, when it names one.
fn param_of(message: &str) -> Option<&'static str> {
    if message.contains("'max_tokens'") {
        Some("max_tokens")
    } else if message.contains("the prompt") || message.contains("'text_input'") {
        Some("prompt")
    } else if message.contains("'messages'") {
        Some("messages")
    } else {
        None
    }
}

fn invalid_response(e: Invalid) -> Response {
    let param = e.param.as_deref().or_else(|| param_of(&e.error.message));
    error_response(&e.error, param)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn completion_id(kind: Kind) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    format!("{prefix}-{:x}{n:x}", now())
}

/// `GET /v1/models`: the models that generate text, as the caller may see them.
pub async fn models(State(st): State<HttpState>, Extension(caller): Extension<Caller>) -> Response {
    let created = now();
    let data = st
        .server
        .models()
        .loaded()
        .into_iter()
        .filter(|m| {
            (request::generates_text(&m.config) || embeddings::embedding_model(&m.config).is_some())
                && caller.may(ModelAction::See, &m.name)
        })
        .map(|m| ModelCard {
            id: m.name.clone(),
            object: "model",
            created,
            owned_by: "wasmtron",
        })
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
    .into_response()
}

/// `POST /v1/completions`.
pub async fn completions(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    complete(Kind::Completion, st, caller, headers, body).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    complete(Kind::Chat, st, caller, headers, body).await
}

/// `POST /v1/embeddings`: the texts' vectors from an embedding model, in batches of its
/// `max_batch_size` run side by side.
pub async fn embeddings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&e, None),
    };
    let json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(
                &Error::invalid(format!("the request body is not valid JSON: {e}")),
                None,
            )
        }
    };
    let lookup = |model: &str| {
        caller.require(ModelAction::Infer, model)?;
        Ok(st.server.models().get(model, None)?.config.clone())
    };
    let parsed = match embeddings::parse(&json, lookup) {
        Ok(p) => p,
        Err(e) => return invalid_response(e),
    };
    let _admission = match caller.admit(body.len()) {
        Ok(a) => a,
        Err(e) => return error_response(&e, None),
    };
    let track = crate::frontends::track(&st.server, &caller, &parsed.model);
    let runs = parsed.requests.iter().cloned().map(|mut request| {
        crate::frontends::on_behalf_of(&caller, &mut request);
        st.server.infer(request)
    });
    let responses: Result<Vec<_>, Error> =
        futures::future::join_all(runs).await.into_iter().collect();
    let answer = responses.and_then(|r| embeddings::answer(&parsed, r));
    track.finish(answer.as_ref().map(|_| ()).map_err(|e| e.code));
    match answer {
        Ok(list) => Json(list).into_response(),
        Err(e) => error_response(&e, None),
    }
}

/// What one response of the model says.
#[derive(Debug, Default)]
struct Piece {
    text: String,
    finish: Option<String>,
    prompt_tokens: Option<i64>,
    generated_tokens: Option<i64>,
}

fn first_string(t: &Tensor) -> String {
    bytes_elements(&t.data)
        .next()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

fn first_int(t: &Tensor) -> Option<i64> {
    match t.datatype {
        DataType::Int32 => t
            .data
            .get(..4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        DataType::Int64 => t
            .data
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(i64::from_le_bytes),
        _ => None,
    }
}

fn piece(response: &InferResponse) -> Piece {
    let mut p = Piece::default();
    for t in &response.outputs {
        match t.name.as_str() {
            "text_output" => p.text = first_string(t),
            "finish_reason" => p.finish = Some(first_string(t)).filter(|s| !s.is_empty()),
            "prompt_tokens" => p.prompt_tokens = first_int(t),
            "generated_tokens" => p.generated_tokens = first_int(t),
            _ => {}
        }
    }
    p
}

async fn complete(
    kind: Kind,
    st: HttpState,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&e, None),
    };
    let json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(
                &Error::invalid(format!("the request body is not valid JSON: {e}")),
                None,
            )
        }
    };
    let lookup = |model: &str| {
        caller.require(ModelAction::Infer, model)?;
        let config = st.server.models().get(model, None)?.config.clone();
        if !request::generates_text(&config) {
            return Err(Error::not_found(format!(
                "model '{model}' does not generate text (it needs input 'text_input' or \
                 'messages' and output 'text_output')"
            )));
        }
        Ok(config)
    };
    let mut parsed = match request::parse(kind, &json, lookup) {
        Ok(p) => p,
        Err(e) => return invalid_response(e),
    };
    let admission = match caller.admit(body.len()) {
        Ok(a) => a,
        Err(e) => return error_response(&e, None),
    };
    let track = crate::frontends::track(&st.server, &caller, &parsed.model);
    crate::frontends::on_behalf_of(&caller, &mut parsed.request);
    let mut items = st.server.infer_stream(parsed.request);
    let id = completion_id(kind);
    let created = now();
    let model = parsed.model;
    if !parsed.stream {
        let (mut text, mut finish, mut prompt, mut generated) = (String::new(), None, 0, 0);
        while let Some(item) = items.recv().await {
            match item {
                Ok(response) => {
                    let p = piece(&response);
                    text.push_str(&p.text);
                    finish = p.finish.or(finish);
                    prompt = p.prompt_tokens.unwrap_or(prompt);
                    generated = p.generated_tokens.unwrap_or(generated);
                }
                Err(e) => {
                    track.finish(Err(e.code));
                    return invalid_response(e.into());
                }
            }
        }
        track.finish(Ok(()));
        drop(admission);
        let finish = Some(finish.unwrap_or_else(|| "stop".into()));
        let usage = Some(Some(Usage::new(prompt, generated)));
        let answer = Answer { id, created, model };
        return match kind {
            Kind::Chat => Json(answer.whole(
                "chat.completion",
                ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: Role::Assistant,
                        content: text,
                    },
                    logprobs: None,
                    finish_reason: finish,
                },
                usage,
            ))
            .into_response(),
            Kind::Completion => Json(answer.whole(
                "text_completion",
                TextChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason: finish,
                },
                usage,
            ))
            .into_response(),
        };
    }
    track.finish(Ok(()));
    let answer = Answer { id, created, model };
    let events = stream_events(items, admission, kind, parsed.include_usage, answer);
    Sse::new(events).into_response()
}

/// What every chunk of one answer repeats.
struct Answer {
    id: String,
    created: u64,
    model: String,
}

impl Answer {
    fn whole<C>(
        &self,
        object: &'static str,
        choice: C,
        usage: Option<Option<Usage>>,
    ) -> Completion<C> {
        Completion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: vec![choice],
            usage,
        }
    }

    /// A streamed chunk: text and/or a finish reason, or (with neither) chat's opening role
    /// chunk; `usage` is null in every chunk when the client asked for it, absent otherwise.
    fn chunk(
        &self,
        kind: Kind,
        text: Option<String>,
        finish: Option<String>,
        include_usage: bool,
    ) -> Event {
        let usage = include_usage.then_some(None);
        match kind {
            Kind::Chat => {
                let delta = match (&text, &finish) {
                    (None, None) => Delta {
                        role: Some(Role::Assistant),
                        content: Some(String::new()),
                    },
                    _ => Delta {
                        role: None,
                        content: text,
                    },
                };
                let choice = ChunkChoice {
                    index: 0,
                    delta,
                    logprobs: None,
                    finish_reason: finish,
                };
                event(&self.whole("chat.completion.chunk", choice, usage))
            }
            Kind::Completion => {
                let choice = TextChoice {
                    index: 0,
                    text: text.unwrap_or_default(),
                    logprobs: None,
                    finish_reason: finish,
                };
                event(&self.whole("text_completion", choice, usage))
            }
        }
    }

    /// The last chunk of a stream that asked for usage: no choices, the counts.
    fn usage_chunk(&self, kind: Kind, usage: Usage) -> Event {
        let object = match kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        event(&Completion::<TextChoice> {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: Vec::new(),
            usage: Some(Some(usage)),
        })
    }
}

/// A server-sent event carrying `value` as JSON.
fn event(value: &impl Serialize) -> Event {
    Event::default().json_data(value).unwrap_or_else(|e| {
        let message = format!("cannot write a chunk: {e}");
        let body = ErrorBody {
            error: ErrorDetail {
                message: &message,
                kind: "server_error",
                param: None,
                code: None,
            },
        };
        Event::default().data(serde_json::to_string(&body).unwrap_or_default())
    })
}

/// The server-sent events of a streamed completion: a role chunk first (chat), a chunk per
/// piece of text, one with the finish reason, the usage chunk if asked, then `[DONE]`. An
/// error ends the stream with an error event.
fn stream_events(
    items: tokio::sync::mpsc::Receiver<crate::error::Result<InferResponse>>,
    admission: crate::tenancy::Admission,
    kind: Kind,
    include_usage: bool,
    answer: Answer,
) -> impl futures::Stream<Item = Result<Event, std::convert::Infallible>> {
    struct State {
        items: tokio::sync::mpsc::Receiver<crate::error::Result<InferResponse>>,
        _admission: crate::tenancy::Admission,
        pending: std::collections::VecDeque<Event>,
        started: bool,
        done: bool,
        prompt: i64,
        generated: i64,
        answer: Answer,
    }
    let state = State {
        items,
        _admission: admission,
        pending: Default::default(),
        started: false,
        done: false,
        prompt: 0,
        generated: 0,
        answer,
    };
    futures::stream::unfold(state, move |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            if !s.started {
                s.started = true;
                if kind == Kind::Chat {
                    let role = s.answer.chunk(kind, None, None, include_usage);
                    s.pending.push_back(role);
                    continue;
                }
            }
            match s.items.recv().await {
                Some(Ok(response)) => {
                    let p = piece(&response);
                    s.prompt = p.prompt_tokens.unwrap_or(s.prompt);
                    s.generated = p.generated_tokens.unwrap_or(s.generated);
                    if !p.text.is_empty() {
                        let c = s.answer.chunk(kind, Some(p.text), None, include_usage);
                        s.pending.push_back(c);
                    }
                    if let Some(finish) = p.finish {
                        let c = s.answer.chunk(kind, None, Some(finish), include_usage);
                        s.pending.push_back(c);
                    }
                }
                Some(Err(e)) => {
                    let kind = error_type(status_for(e.code));
                    let body = error_body(&e, kind, param_of(&e.message), None);
                    s.pending.push_back(event(&body));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.done = true;
                }
                None => {
                    if include_usage {
                        let usage = Usage::new(s.prompt, s.generated);
                        s.pending.push_back(s.answer.usage_chunk(kind, usage));
                    }
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.done = true;
                }
            }
        }
    })
}

fn error_type(status: StatusCode) -> &'static str {
    if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    }
}
