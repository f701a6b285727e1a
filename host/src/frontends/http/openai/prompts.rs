//! Completions' `prompt`: one text, a list of texts, token ids or a list of token-id lists (as
//! OpenAI's API and vLLM take them), each answered as if asked alone; and what `echo` puts
//! before a choice's text.

use bytes::Bytes;

use super::{
    decode::{TokenIds, MAX_TOKEN_IDS},
    invalid::Invalid,
    types::Prompt,
};
use crate::tensor::{push_bytes_element, DataType, Tensor};

/// The most prompts one completions request may list.
pub const MAX_PROMPTS: usize = 32;

/// One prompt of a completions request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, tokenized by the model (input `text_input`).
    Text(String),
    /// Token ids, as they are (input `prompt_ids`).
    Ids(Vec<i32>),
}

impl PromptInput {
    /// The model input that carries it.
    pub fn input_name(&self) -> &'static str {
        match self {
            PromptInput::Text(_) => "text_input",
            PromptInput::Ids(_) => "prompt_ids",
        }
    }

    /// It as the model's input tensor.
    pub fn tensor(&self) -> Tensor {
        match self {
            PromptInput::Text(text) => {
                let mut data = Vec::new();
                push_bytes_element(&mut data, text.as_bytes());
                Tensor {
                    name: self.input_name().to_owned(),
                    datatype: DataType::Bytes,
                    shape: vec![1, 1],
                    data: Bytes::from(data),
                }
            }
            PromptInput::Ids(ids) => Tensor {
                name: self.input_name().to_owned(),
                datatype: DataType::Int32,
                shape: vec![1, ids.len() as i64],
                data: Bytes::from(ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>()),
            },
        }
    }
}

/// What a choice's text starts with (completions' `echo`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Echo {
    /// Nothing: no `echo`.
    #[default]
    Nothing,
    /// The prompt's text.
    Text(String),
    /// The prompt's tokens as the model spells them (a token-id prompt; the model scores the
    /// prompt to answer them).
    Spelled,
}

/// The prompts of `prompt`: one string, or a list of up to [`MAX_PROMPTS`] strings, or token
/// ids, or a list of up to [`MAX_PROMPTS`] token-id lists (none empty).
pub fn parse(prompt: Option<Prompt>) -> Result<Vec<PromptInput>, Invalid> {
    let bad = |message: String| Invalid::field("prompt", message);
    let listed = |n: usize| {
        if n == 0 || n > MAX_PROMPTS {
            Err(bad(format!(
                "'prompt' lists {n} prompts; it must list 1 to {MAX_PROMPTS}"
            )))
        } else {
            Ok(())
        }
    };
    match prompt {
        Some(Prompt::Text(s)) if !s.is_empty() => Ok(vec![PromptInput::Text(s)]),
        Some(Prompt::Text(_)) => Err(bad("'prompt' is empty".into())),
        Some(Prompt::Texts(items)) => {
            listed(items.total)?;
            if let Some(i) = items.kept.iter().position(String::is_empty) {
                return Err(bad(format!("'prompt' item {i} is empty")));
            }
            Ok(items.kept.into_iter().map(PromptInput::Text).collect())
        }
        Some(Prompt::IdLists(lists)) => {
            listed(lists.total)?;
            lists
                .kept
                .into_iter()
                .enumerate()
                .map(|(i, ids)| token_ids(ids, &format!("'prompt' item {i}")))
                .collect()
        }
        Some(Prompt::Ids(ids)) => Ok(vec![token_ids(ids, "'prompt'")?]),
        Some(Prompt::Mixed {
            at,
            found,
            expected,
        }) => Err(bad(format!(
            "'prompt' item {at} is {found}, not {expected}: a list of prompts holds only \
             strings or only token-id lists"
        ))),
        None => Err(bad("'prompt' is required".into())),
        Some(Prompt::Other(other)) => Err(bad(format!(
            "'prompt' must be a string, a list of strings or token ids, got {other}"
        ))),
    }
}

/// A list of token ids (whole numbers from 0 to 2^31 - 1; the model checks its vocabulary).
fn token_ids(ids: TokenIds, what: &str) -> Result<PromptInput, Invalid> {
    match ids {
        TokenIds::Ids(ids) if ids.is_empty() => {
            Err(Invalid::field("prompt", format!("{what} is empty")))
        }
        TokenIds::Ids(ids) => Ok(PromptInput::Ids(ids)),
        TokenIds::Bad(j, v) => Err(Invalid::field(
            "prompt",
            format!("{what} must be strings or token ids: element {j} is {v}, not a token id"),
        )),
        TokenIds::TooMany(n) => Err(Invalid::field(
            "prompt",
            format!("{what} holds {n} token ids; at most {MAX_TOKEN_IDS}"),
        )),
    }
}
