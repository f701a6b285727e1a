//! A streamed completion as server-sent events: per choice a role chunk first (chat) or the
//! echoed prompt (completions), a chunk per piece of text, one with the finish reason; then
//! the usage chunk if asked, then `[DONE]`. An error ends the stream with an error event.

use std::collections::VecDeque;

use axum::response::sse::Event;
use tokio::sync::mpsc;

use super::{
    choices::{event, piece, spell, ChunkHeader},
    errors::{error_body, error_type, param_of},
    prompts::Echo,
    request::Kind,
    structured::{Reader, Said},
    types::{TokenLogprob, Usage},
};
use crate::{
    error::Result, frontends::http::error::status_for, inference::InferResponse, tenancy::Admission,
};

/// What the stream has said so far.
struct State {
    items: mpsc::Receiver<(usize, Result<InferResponse>)>,
    _admission: Admission,
    pending: VecDeque<Event>,
    done: bool,
    /// Per prompt: its tokens.
    prompt: Vec<i64>,
    /// Choices per prompt.
    per_prompt: usize,
    generated: Vec<i64>,
    /// Bytes of text answered per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    answer: ChunkHeader,
    include_usage: bool,
    /// Per choice: its text read as content or calls.
    readers: Vec<Reader>,
    /// Per choice: the echo still to send with the prompt's scored tokens.
    scored_echo: Vec<Echo>,
    /// Whether nothing generated is answered.
    prompt_only: bool,
}

impl State {
    /// Queues what choice `index` said: content (with its tokens' log-probabilities) or calls.
    fn say(&mut self, index: usize, said: Option<Said>, tokens: &[TokenLogprob]) {
        match said {
            Some(Said::Text(text)) => {
                let offset = self.offsets.get(index).copied().unwrap_or(0);
                if let Some(o) = self.offsets.get_mut(index) {
                    *o += text.len();
                }
                let c = self.answer.chunk_with(
                    index,
                    Some(text),
                    None,
                    self.include_usage,
                    tokens,
                    offset,
                );
                self.pending.push_back(c);
            }
            Some(Said::Calls(calls)) => {
                let c = self.answer.calls_chunk(index, calls, self.include_usage);
                self.pending.push_back(c);
            }
            None => {}
        }
    }
}

/// The choices of a streamed answer.
pub struct Choices {
    /// Per choice: what it starts with (completions' `echo`).
    pub echo: Vec<Echo>,
    /// Choices per prompt (`n`): choice `i` answers prompt `i / per_prompt`.
    pub per_prompt: usize,
    /// Whether the model scores the prompt: then the echo chunk waits for the first response,
    /// which carries the prompt's tokens (their log-probabilities, their spelling).
    pub scored_prompt: bool,
    /// Completions' `echo` with `max_tokens` 0: nothing generated is answered.
    pub prompt_only: bool,
}

/// The events of a streamed completion.
pub fn events(
    items: mpsc::Receiver<(usize, Result<InferResponse>)>,
    admission: Admission,
    choices: Choices,
    include_usage: bool,
    answer: ChunkHeader,
) -> impl futures::Stream<Item = std::result::Result<Event, std::convert::Infallible>> {
    let mut pending = VecDeque::new();
    let n = choices.echo.len();
    let per_prompt = choices.per_prompt.max(1);
    let mut scored_echo = vec![Echo::Nothing; n];
    for (index, echo) in choices.echo.into_iter().enumerate() {
        match (answer.kind, echo) {
            (Kind::Chat, _) => pending.push_back(answer.chunk(index, None, None, include_usage)),
            (Kind::Completion, Echo::Nothing) => {}
            (Kind::Completion, echo) if choices.scored_prompt => scored_echo[index] = echo,
            (Kind::Completion, Echo::Text(prompt)) => {
                pending.push_back(answer.chunk(index, Some(prompt), None, include_usage))
            }
            // Only a scored prompt is spelled.
            (Kind::Completion, Echo::Spelled) => {}
        }
    }
    let state = State {
        items,
        _admission: admission,
        pending,
        done: false,
        prompt: vec![0; n.div_ceil(per_prompt).max(1)],
        per_prompt,
        generated: vec![0; n],
        offsets: vec![0; n],
        readers: (0..n).map(|_| Reader::new(answer.shape.clone())).collect(),
        scored_echo,
        prompt_only: choices.prompt_only,
        answer,
        include_usage,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            match s.items.recv().await {
                Some((index, Ok(response))) => {
                    let mut p = piece(&response);
                    if s.prompt_only {
                        p = p.without_generation();
                    }
                    if let (Some(count), Some(slot)) =
                        (p.prompt_tokens, s.prompt.get_mut(index / s.per_prompt))
                    {
                        *slot = count;
                    }
                    if let (Some(g), Some(count)) = (s.generated.get_mut(index), p.generated_tokens)
                    {
                        *g = count;
                    }
                    let echo = s.scored_echo.get_mut(index).map(std::mem::take);
                    let echoed = match echo {
                        Some(Echo::Text(prompt)) => Some(prompt),
                        Some(Echo::Spelled) => Some(spell(&p.prompt)),
                        _ => None,
                    };
                    if let Some(text) = echoed {
                        s.say(index, Some(Said::Text(text)), &p.prompt);
                    }
                    if !p.text.is_empty() || !p.tokens.is_empty() {
                        let said = match s.readers.get_mut(index) {
                            Some(reader) if !p.text.is_empty() => reader.push(p.text),
                            _ => Some(Said::Text(p.text)),
                        };
                        s.say(index, said, &p.tokens);
                    }
                    if let Some(finish) = p.finish {
                        let (said, finish) = match s.readers.get_mut(index) {
                            Some(reader) => (reader.finish(), reader.finish_reason(finish)),
                            None => (None, finish),
                        };
                        s.say(index, said, &[]);
                        let c = s.answer.chunk(index, None, Some(finish), s.include_usage);
                        s.pending.push_back(c);
                    }
                }
                Some((_, Err(e))) => {
                    let kind = error_type(status_for(e.code));
                    let body = error_body(&e, kind, param_of(&e), None);
                    s.pending.push_back(event(&body));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.done = true;
                }
                None => {
                    if s.include_usage {
                        let usage = Usage::new(s.prompt.iter().sum(), s.generated.iter().sum());
                        s.pending.push_back(s.answer.usage_chunk(usage));
                    }
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.done = true;
                }
            }
        }
    })
}
