//! The choices of one completion: the model's responses read as text pieces, the `n`
//! sequences of a request merged into one channel tagged by choice, and the answer's chunks
//! (whole or streamed) built from the wire types.

use axum::response::sse::Event;
use serde::Serialize;
use tokio::sync::mpsc;

use super::{
    request::Kind,
    structured::{self, Shape},
    types::{
        AssistantMessage, ChatChoice, ChatLogprobs, ChunkChoice, Completion, Delta, ErrorBody,
        ErrorDetail, Role, TextChoice, TextLogprobs, TokenLogprob, ToolCallDelta, TopLogprob,
        Usage,
    },
};
use crate::{
    error::Result,
    inference::InferResponse,
    tensor::{bytes_elements, DataType, Tensor},
};

/// What one response of the model says.
#[derive(Debug, Default)]
pub struct Piece {
    /// New text.
    pub text: String,
    /// `stop` or `length` on the last response.
    pub finish: Option<String>,
    /// Tokens in the prompt.
    pub prompt_tokens: Option<i64>,
    /// Tokens generated so far.
    pub generated_tokens: Option<i64>,
    /// This response's tokens with their log-probabilities, when asked for.
    pub tokens: Vec<TokenLogprob>,
    /// The prompt's tokens with theirs (echo with logprobs, on the first response; the first
    /// token's log-probability is NaN: nothing precedes it).
    pub prompt: Vec<TokenLogprob>,
}

impl Piece {
    /// What a prompt-only answer (completions' `echo` with `max_tokens` 0) keeps: the
    /// prompt's scores and the end, none of the generated text.
    pub fn without_generation(mut self) -> Self {
        self.text.clear();
        self.tokens.clear();
        self.generated_tokens = self.generated_tokens.map(|_| 0);
        self.finish = self.finish.map(|_| "length".into());
        self
    }
}

fn floats(t: &Tensor) -> Vec<f32> {
    if t.datatype != DataType::Fp32 {
        return Vec::new();
    }
    t.data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// JSON has no infinity: a token that cannot come is reported at -9999, as vLLM does.
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// The tokens of a response from its `output_log_probs`, `output_tokens`, `top_tokens` and
/// `top_log_probs` (rows of equal length per token; padding has -inf and is left out), or with
/// `prompt_` before each name, its prompt's tokens (the first one's log-probability NaN).
fn token_logprobs(response: &InferResponse, prompt: bool) -> Vec<TokenLogprob> {
    let find = |name: &str| {
        let name = if prompt {
            format!("prompt_{name}")
        } else {
            name.to_owned()
        };
        response.outputs.iter().find(|t| t.name == name)
    };
    let (lps, spellings) = match prompt {
        true => (find("log_probs"), find("token_texts")),
        false => (find("output_log_probs"), find("output_tokens")),
    };
    let (Some(lps), Some(spellings)) = (lps, spellings) else {
        return Vec::new();
    };
    let lps = floats(lps);
    let spellings: Vec<&[u8]> = bytes_elements(&spellings.data).collect();
    let top_lps = find("top_log_probs").map(floats).unwrap_or_default();
    let top_spellings: Vec<&[u8]> = find("top_tokens")
        .map(|t| bytes_elements(&t.data).collect())
        .unwrap_or_default();
    let k = if lps.is_empty() {
        0
    } else {
        top_lps.len() / lps.len()
    };
    lps.iter()
        .zip(spellings)
        .enumerate()
        .map(|(i, (&logprob, bytes))| TokenLogprob {
            token: String::from_utf8_lossy(bytes).into_owned(),
            logprob: if logprob.is_nan() {
                logprob
            } else {
                finite(logprob)
            },
            bytes: bytes.to_vec(),
            top_logprobs: (i * k..(i + 1) * k)
                .filter_map(|j| {
                    let (&l, b) = (top_lps.get(j)?, top_spellings.get(j)?);
                    l.is_finite().then(|| TopLogprob {
                        token: String::from_utf8_lossy(b).into_owned(),
                        logprob: l,
                        bytes: b.to_vec(),
                    })
                })
                .collect(),
        })
        .collect()
}

/// What `tokens` spell together (bytes joined before they are read as UTF-8, so that a
/// character split between tokens stays whole).
pub fn spell(tokens: &[TokenLogprob]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|t| t.bytes.iter().copied())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Completions' legacy shape of `tokens`, with text offsets from `offset` on.
fn text_logprobs(tokens: &[TokenLogprob], mut offset: usize) -> TextLogprobs {
    let mut out = TextLogprobs::default();
    for t in tokens {
        out.tokens.push(t.token.clone());
        // NaN: an echoed prompt's first token, which nothing precedes.
        let scored = !t.logprob.is_nan();
        out.token_logprobs.push(scored.then_some(t.logprob));
        out.top_logprobs.push(scored.then(|| {
            t.top_logprobs
                .iter()
                .map(|a| (a.token.clone(), a.logprob))
                .collect()
        }));
        out.text_offset.push(offset);
        offset += t.token.len();
    }
    out
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

/// The text, finish reason and token counts of one response.
pub fn piece(response: &InferResponse) -> Piece {
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
    p.tokens = token_logprobs(response, false);
    p.prompt = token_logprobs(response, true);
    p
}

/// The responses of every choice's sequence on one channel, tagged by choice index. Dropping
/// the receiver drops every sequence's at once (which cancels them), also while none of them
/// has anything to send (a long answer that is not streamed).
pub fn merge(
    streams: Vec<mpsc::Receiver<Result<InferResponse>>>,
) -> mpsc::Receiver<(usize, Result<InferResponse>)> {
    let (tx, rx) = mpsc::channel(16 * streams.len().max(1));
    for (index, mut items) in streams.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    item = items.recv() => {
                        let Some(item) = item else { break };
                        if tx.send((index, item)).await.is_err() {
                            break;
                        }
                    }
                    () = tx.closed() => break,
                }
            }
        });
    }
    rx
}

/// One choice of a whole answer, put together from its pieces.
#[derive(Debug, Default, Clone)]
pub struct Gathered {
    /// All its text.
    pub text: String,
    /// Why it ended.
    pub finish: Option<String>,
    /// Tokens it generated.
    pub generated: i64,
    /// Its tokens with log-probabilities, when asked for.
    pub tokens: Vec<TokenLogprob>,
    /// Its prompt as the model spells it, when the prompt was scored.
    pub spelled_prompt: String,
}

/// What every chunk of one answer repeats.
pub struct ChunkHeader {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model named by the request.
    pub model: String,
    /// Which endpoint.
    pub kind: Kind,
    /// Whether choices carry `logprobs`.
    pub log_probs: bool,
    /// How the text is read: content, or function calls.
    pub shape: Shape,
}

impl ChunkHeader {
    fn completion<C>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Option<Usage>>,
    ) -> Completion<C> {
        Completion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// The whole answer (not streamed) as JSON.
    pub fn whole(&self, choices: Vec<Gathered>, usage: Usage) -> axum::response::Response {
        use axum::{response::IntoResponse, Json};
        let finish = |g: &Gathered| Some(g.finish.clone().unwrap_or_else(|| "stop".into()));
        let usage = Some(Some(usage));
        match self.kind {
            Kind::Chat => {
                let choices = choices
                    .iter()
                    .enumerate()
                    .map(|(i, g)| {
                        let (content, tool_calls) = structured::read_answer(&self.shape, &g.text);
                        let finish_reason = finish(g).map(|f| {
                            structured::finish_reason(&self.shape, !tool_calls.is_empty(), f)
                        });
                        ChatChoice {
                            index: i as u32,
                            message: AssistantMessage {
                                role: Role::Assistant,
                                content,
                                tool_calls,
                            },
                            logprobs: self.log_probs.then(|| ChatLogprobs {
                                content: g.tokens.clone(),
                                refusal: None,
                            }),
                            finish_reason,
                        }
                    })
                    .collect();
                Json(self.completion("chat.completion", choices, usage)).into_response()
            }
            Kind::Completion => {
                let choices = choices
                    .iter()
                    .enumerate()
                    .map(|(i, g)| TextChoice {
                        index: i as u32,
                        text: g.text.clone(),
                        logprobs: self.log_probs.then(|| text_logprobs(&g.tokens, 0)),
                        finish_reason: finish(g),
                    })
                    .collect();
                Json(self.completion("text_completion", choices, usage)).into_response()
            }
        }
    }

    /// A streamed chunk of choice `index`: text and/or a finish reason, or (with neither)
    /// chat's opening role chunk; `usage` is null in every chunk when the client asked for
    /// it, absent otherwise.
    pub fn chunk(
        &self,
        index: usize,
        text: Option<String>,
        finish: Option<String>,
        include_usage: bool,
    ) -> Event {
        self.chunk_with(index, text, finish, include_usage, &[], 0)
    }

    /// [`Answer::chunk`] with the tokens the text came from (`offset`: where the text starts
    /// in the choice's, for completions' `text_offset`).
    pub fn chunk_with(
        &self,
        index: usize,
        text: Option<String>,
        finish: Option<String>,
        include_usage: bool,
        tokens: &[TokenLogprob],
        offset: usize,
    ) -> Event {
        let usage = include_usage.then_some(None);
        let index = index as u32;
        match self.kind {
            Kind::Chat => {
                let delta = match (&text, &finish) {
                    (None, None) => Delta {
                        role: Some(Role::Assistant),
                        content: Some(String::new()),
                        tool_calls: None,
                    },
                    _ => Delta {
                        role: None,
                        content: text,
                        tool_calls: None,
                    },
                };
                let logprobs = (self.log_probs && !tokens.is_empty()).then(|| ChatLogprobs {
                    content: tokens.to_vec(),
                    refusal: None,
                });
                let choice = ChunkChoice {
                    index,
                    delta,
                    logprobs,
                    finish_reason: finish,
                };
                event(&self.completion("chat.completion.chunk", vec![choice], usage))
            }
            Kind::Completion => {
                let logprobs =
                    (self.log_probs && !tokens.is_empty()).then(|| text_logprobs(tokens, offset));
                let choice = TextChoice {
                    index,
                    text: text.unwrap_or_default(),
                    logprobs,
                    finish_reason: finish,
                };
                event(&self.completion("text_completion", vec![choice], usage))
            }
        }
    }

    /// A chat chunk of choice `index` with new calls or more of their arguments.
    pub fn calls_chunk(
        &self,
        index: usize,
        calls: Vec<ToolCallDelta>,
        include_usage: bool,
    ) -> Event {
        let choice = ChunkChoice {
            index: index as u32,
            delta: Delta {
                role: None,
                content: None,
                tool_calls: Some(calls),
            },
            logprobs: None,
            finish_reason: None,
        };
        let usage = include_usage.then_some(None);
        event(&self.completion("chat.completion.chunk", vec![choice], usage))
    }

    /// The last chunk of a stream that asked for usage: no choices, the counts.
    pub fn usage_chunk(&self, usage: Usage) -> Event {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        event(&self.completion::<TextChoice>(object, Vec::new(), Some(Some(usage))))
    }
}

/// A server-sent event carrying `value` as JSON.
pub fn event(value: &impl Serialize) -> Event {
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
