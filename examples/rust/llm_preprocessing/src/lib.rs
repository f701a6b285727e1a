//! A chat or a prompt → token ids, the first step of a text-generation ensemble (TensorRT-LLM's
//! `preprocessing` model, in Wasm).
//!
//! * `messages` (a JSON list of `{"role": ..., "content": ...}`) is rendered with the model's
//!   chat template (`chat_template.jinja` beside the tokenizer, the Jinja template Hugging Face's
//!   `apply_chat_template` renders) with `add_generation_prompt` set, then tokenized;
//! * `text_input` is tokenized as it is (the special tokens it spells, such as `<|im_start|>`,
//!   become their ids);
//! * `prompt_ids` (INT32, a prompt already tokenized: OpenAI's token-list prompts) are passed
//!   on as they are, once checked against the vocabulary.
//!
//! Output: `input_ids` INT32 [1, n]. Errors name the field: an empty prompt, text that is not
//! UTF-8, messages that are not such a list or hold no user turn.

use minijinja::{context, Environment};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use wasmtron_guest::{
    export_stage, read_model_file, Config, Error, Request, Result, Stage, Tensor,
};

struct Preprocessing {
    tokenizer: Tokenizer,
    template: Option<Environment<'static>>,
    bos: String,
    eos: String,
}

/// One chat message.
#[derive(Debug, Deserialize, Serialize)]
struct Message {
    role: String,
    content: String,
}

impl Stage for Preprocessing {
    fn init(config: &Config) -> Result<Self> {
        let file = config
            .parameter("tokenizer_file")
            .unwrap_or("tokenizer.json");
        let tokenizer = Tokenizer::from_bytes(read_model_file(file)?)
            .map_err(|e| Error::invalid(format!("'{file}' is not a tokenizer.json: {e}")))?;
        let template_file = config
            .parameter("chat_template_file")
            .unwrap_or("chat_template.jinja");
        let template = match read_model_file(template_file) {
            Ok(bytes) => {
                let source = String::from_utf8(bytes)
                    .map_err(|_| Error::invalid(format!("'{template_file}' is not UTF-8")))?;
                let mut env = Environment::new();
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function(
                    "raise_exception",
                    |message: String| -> std::result::Result<String, minijinja::Error> {
                        Err(minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            message,
                        ))
                    },
                );
                env.add_template_owned("chat", source)
                    .map_err(|e| Error::invalid(format!("'{template_file}': {e}")))?;
                Some(env)
            }
            Err(_) => None,
        };
        let special = |key: &str, default: &str| -> String {
            config.parameter(key).unwrap_or(default).to_owned()
        };
        Ok(Self {
            tokenizer,
            template,
            bos: special("bos_token", ""),
            eos: special("eos_token", ""),
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        if let Ok(ids) = request.input("prompt_ids") {
            let ids = ids
                .to_i32()
                .map_err(|_| Error::invalid("'prompt_ids' must be INT32 token ids"))?;
            if ids.is_empty() {
                return Err(Error::invalid(
                    "'prompt_ids' is empty: the prompt needs a token",
                ));
            }
            let vocab = self.tokenizer.get_vocab_size(true);
            if let Some((i, id)) = ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id < 0 || id as usize >= vocab)
            {
                return Err(Error::invalid(format!(
                    "'prompt_ids' item {i} is {id}; token ids run from 0 to {}",
                    vocab - 1
                )));
            }
            return request.select(vec![Tensor::from_i32(
                "input_ids",
                &[1, ids.len() as i64],
                &ids,
            )]);
        }
        let text = if let Ok(messages) = request.input("messages") {
            let json = single_string(messages, "messages")?;
            let messages: Vec<Message> = serde_json::from_str(json).map_err(|e| {
                Error::invalid(format!(
                    "'messages' must be a JSON list of {{\"role\", \"content\"}} objects: {e}"
                ))
            })?;
            if !messages.iter().any(|m| m.role == "user") {
                return Err(Error::invalid(
                    "'messages' holds no message with role 'user': a chat needs at least one user turn",
                ));
            }
            let Some(env) = &self.template else {
                return Err(Error::invalid(
                    "'messages' needs the model's chat template (chat_template.jinja beside the tokenizer)",
                ));
            };
            let template = env
                .get_template("chat")
                .map_err(|e| Error::internal(format!("chat template: {e}")))?;
            template
                .render(context! {
                    messages => messages,
                    add_generation_prompt => true,
                    bos_token => self.bos,
                    eos_token => self.eos,
                })
                .map_err(|e| Error::invalid(format!("'messages': the chat template failed: {e}")))?
        } else {
            let input = request.input("text_input").map_err(|_| {
                Error::invalid(
                    "send 'text_input' (a prompt), 'messages' (a chat) or 'prompt_ids' (token ids)",
                )
            })?;
            single_string(input, "text_input")?.to_owned()
        };
        if text.is_empty() {
            return Err(Error::invalid(
                "'text_input' is empty: the prompt needs some text",
            ));
        }
        let encoding = self
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| Error::invalid(format!("cannot tokenize the prompt: {e}")))?;
        let ids: Vec<i32> = encoding.get_ids().iter().map(|&t| t as i32).collect();
        request.select(vec![Tensor::from_i32(
            "input_ids",
            &[1, ids.len() as i64],
            &ids,
        )])
    }
}

/// The one string of a BYTES input of shape [1] or [1, 1], as UTF-8.
fn single_string<'a>(tensor: &'a Tensor, name: &str) -> Result<&'a str> {
    let items = tensor.bytes_elements()?;
    let [one] = items.as_slice() else {
        return Err(Error::invalid(format!(
            "'{name}' must hold one string, holds {}",
            items.len()
        )));
    };
    std::str::from_utf8(one).map_err(|e| Error::invalid(format!("'{name}' is not UTF-8: {e}")))
}

export_stage!(Preprocessing);
