//! OpenAI-compatible endpoints on the HTTP port, as Triton's OpenAI frontend offers them:
//! `GET /v1/models` (and `/v1/models/{model}`), `POST /v1/completions`,
//! `POST /v1/chat/completions` and `POST /v1/responses` (`responses.rs`), streamed
//! (server-sent events ending in `data: [DONE]`) or not, with `usage` and `finish_reason`;
//! and `POST /v1/embeddings` for models that answer an embedding (`embeddings.rs`).
//!
//! A model serves these when it takes a prompt (`text_input`) or a chat (`messages`) and
//! answers `text_output`, like the `smollm2` ensemble; sampling fields become its inputs by
//! TensorRT-LLM's names. Errors come in OpenAI's shape (`{"error": {"message", "type",
//! "param", "code"}}`); tenants' API keys are the OpenAI client's `api_key`.

mod choices;
pub mod decode;
pub mod embeddings;
mod errors;
mod invalid;
mod prompt_limit;
mod prompts;
pub mod request;
mod responses;
mod stream;
mod structured;
pub mod types;

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{
    body::Body,
    extract::{Path, State},
    http::HeaderMap,
    response::{sse::Sse, IntoResponse, Response},
    Extension, Json,
};
use futures::{StreamExt, TryStreamExt};

pub use self::errors::{error_response, render_error};
use self::{
    choices::{piece, ChunkHeader, Gathered},
    errors::invalid_response,
    invalid::Invalid,
    prompts::Echo,
    request::Kind,
    types::{ModelCard, ModelList, Usage},
};
use super::{
    body::{off_runtime, read_request_body},
    state::HttpState,
};
use crate::{
    error::Error,
    names::{split_adapter, AdapterName},
    scheduling::door::Door,
    tenancy::{Admission, Caller, ModelAction},
};

/// The OpenAI routes.
pub(crate) fn routes() -> axum::Router<HttpState> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
}

/// `POST /v1/responses`: OpenAI's Responses API over the chat path (`responses.rs`).
pub async fn responses(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    st.server
        .serve(&caller, |door| {
            responses::respond(&st, door, &headers, body)
        })
        .await
        .unwrap_or_else(invalid_response)
}

/// The request body within the caller's size quota, admitted under its quotas before
/// anything in it is decoded.
async fn read_admitted(
    st: &HttpState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<(bytes::Bytes, Admission), Error> {
    let body = read_request_body(st, caller, headers, body).await?;
    let admission = caller.admit(body.len())?;
    Ok((body, admission))
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

/// The models that generate text or embed it, as the caller may see them: the generation
/// models first (clients take `data[0]` to chat with), each followed by its LoRA adapters
/// (`model:adapter`), then the embedding models.
fn model_cards(st: &HttpState, caller: &Caller) -> Vec<ModelCard> {
    let created = now();
    let models = st.server.models();
    let mut listed: Vec<(bool, String, Option<String>)> = Vec::new();
    for m in models.loaded() {
        if !caller.may(ModelAction::See, &m.name) {
            continue;
        }
        if request::generates_text(&m.config) {
            listed.push((false, m.name.clone(), None));
            for adapter in models.adapter_names(&m.name) {
                listed.push((false, format!("{}:{adapter}", m.name), Some(m.name.clone())));
            }
        } else if embeddings::embedding_model(&m.config).is_some() {
            listed.push((true, m.name.clone(), None));
        }
    }
    listed.sort();
    listed
        .into_iter()
        .map(|(_, id, parent)| ModelCard {
            id,
            object: "model",
            created,
            owned_by: "wasmtron",
            parent,
        })
        .collect()
}

/// `GET /v1/models`: the models that generate text or embed it, as the caller may see them.
pub async fn models(State(st): State<HttpState>, Extension(caller): Extension<Caller>) -> Response {
    Json(ModelList {
        object: "list",
        data: model_cards(&st, &caller),
    })
    .into_response()
}

/// `GET /v1/models/{model}`: one model of that list, or 404 (`model_not_found`) as OpenAI
/// answers for a model that is not there or that the caller may not see.
pub async fn model(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    match model_cards(&st, &caller).into_iter().find(|m| m.id == id) {
        Some(card) => Json(card).into_response(),
        None => error_response(
            &Error::not_found(format!(
                "The model '{id}' does not exist or does not generate or embed text"
            )),
            Some("model"),
        ),
    }
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
/// `max_batch_size`, a few at a time.
pub async fn embeddings(
    State(st): State<HttpState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    st.server
        .serve(&caller, |door| embed(&st, door, &headers, body))
        .await
        .unwrap_or_else(invalid_response)
}

async fn embed(
    st: &HttpState,
    door: Door,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Invalid> {
    let (body, _admission) = read_admitted(st, door.caller(), headers, body).await?;
    let (target, parsed) = off_runtime(body.len(), move || {
        embeddings::parse(&body, |model| door.resolve(model, ""))
    })
    .await??;
    let runs = parsed
        .requests
        .iter()
        .cloned()
        .map(|request| st.server.infer_on(&target, request));
    let responses: Vec<_> = futures::stream::iter(runs)
        .buffered(embeddings::BATCHES_AT_ONCE)
        .try_collect()
        .await?;
    Ok(Json(embeddings::answer(&parsed, responses)?).into_response())
}

async fn complete(
    kind: Kind,
    st: HttpState,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    st.server
        .serve(&caller, |door| answer(kind, &st, door, &headers, body))
        .await
        .unwrap_or_else(invalid_response)
}

/// The model a request names, for the caller, when it generates text.
/// `model:adapter` (vLLM's names for a LoRA adapter) is the model, run with its adapter.
fn text_model(door: &Door, model: &str) -> Result<crate::scheduling::door::Target, Error> {
    let target = match door.resolve(model, "") {
        Ok(target) => target,
        Err(e) => match split_adapter(model) {
            Some((base, adapter)) => {
                AdapterName::parse(adapter)?;
                door.resolve(base, "").map_err(|_| e)?
            }
            None => return Err(e),
        },
    };
    if !request::generates_text(target.config()) {
        return Err(Error::not_found(format!(
            "model '{model}' does not generate text (it needs input 'text_input' or \
             'messages' and output 'text_output')"
        )));
    }
    Ok(target)
}

/// A completion or chat: streamed as server-sent events (accounted as answered once the
/// stream starts; its errors travel in-band), or gathered into one answer.
async fn answer(
    kind: Kind,
    st: &HttpState,
    door: Door,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Invalid> {
    let (body, mut admission) = read_admitted(st, door.caller(), headers, body).await?;
    let lookup = move |model: &str| text_model(&door, model);
    let (target, parsed) =
        off_runtime(body.len(), move || request::parse(kind, &body, lookup)).await??;
    // Each sequence the request starts counts against the tenant's concurrency quota.
    admission.widen(parsed.choices())?;
    // One sequence per choice (`n` per prompt), side by side in the running batch.
    let choices = parsed.choices();
    let streams = (0..choices)
        .map(|i| st.server.infer_stream_on(&target, parsed.request_for(i)))
        .collect();
    let mut items = choices::merge(streams);
    let answer = ChunkHeader {
        id: completion_id(kind),
        created: now(),
        model: parsed.model.clone(),
        kind,
        log_probs: parsed.log_probs.is_some(),
        shape: parsed.shape.clone(),
    };
    let echo: Vec<Echo> = (0..choices).map(|i| parsed.echo_for(i)).collect();
    if parsed.stream {
        let events = stream::events(
            items,
            admission,
            stream::Choices {
                echo,
                per_prompt: parsed.n,
                scored_prompt: parsed.scored_prompt,
                prompt_only: parsed.prompt_only,
            },
            parsed.include_usage,
            answer,
        );
        return Ok(Sse::new(events).into_response());
    }
    let mut gathered = vec![Gathered::default(); choices];
    // Each prompt's tokens count once, however many choices it has.
    let mut prompt = vec![0; parsed.prompts.len().max(1)];
    while let Some((index, item)) = items.recv().await {
        match item {
            Ok(response) => {
                let mut p = piece(&response);
                if parsed.prompt_only {
                    p = p.without_generation();
                }
                if let (Some(count), Some(slot)) =
                    (p.prompt_tokens, prompt.get_mut(parsed.prompt_of(index)))
                {
                    *slot = count;
                }
                if let Some(g) = gathered.get_mut(index) {
                    g.text.push_str(&p.text);
                    g.finish = p.finish.or(g.finish.take());
                    g.generated = p.generated_tokens.unwrap_or(g.generated);
                    // An echoed prompt's tokens come first, on the first response.
                    if !p.prompt.is_empty() {
                        g.spelled_prompt = choices::spell(&p.prompt);
                    }
                    g.tokens.extend(p.prompt);
                    g.tokens.extend(p.tokens);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    drop(admission);
    for (g, echo) in gathered.iter_mut().zip(&echo) {
        match echo {
            Echo::Text(prompt_text) => g.text.insert_str(0, prompt_text),
            Echo::Spelled => g.text.insert_str(0, &g.spelled_prompt),
            Echo::Nothing => {}
        }
    }
    let prompt = prompt.iter().sum();
    let generated = gathered.iter().map(|g| g.generated).sum();
    Ok(answer.whole(gathered, Usage::new(prompt, generated)))
}
