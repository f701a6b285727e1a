//! Generated token ids → text, the last step of a text-generation ensemble (TensorRT-LLM's
//! `postprocessing` model, in Wasm), incremental and stateless.
//!
//! Each response of the generation model carries its new tokens (`output_ids`) and up to 8
//! tokens generated before them (`context_ids`). The text of a response is what decoding
//! `context + new` adds to decoding `context` alone, each without a trailing incomplete
//! character (decoders show one as U+FFFD): so a character split across tokens comes out whole
//! with the token that completes it, never half of it, and the texts of all responses add up to
//! the decoded answer. Special tokens (end of turn) spell nothing.

use tokenizers::Tokenizer;
use wasmtron_guest::{
    export_stage, read_model_file, Config, Error, Request, Result, Stage, Tensor,
};

struct Postprocessing {
    tokenizer: Tokenizer,
    /// The shape of `text_output`: `[1, 1]` (a row of one string), or `[1]` when the
    /// `text_output_shape` parameter is `flat`, as TensorRT-LLM's postprocessing answers it.
    shape: &'static [i64],
}

const INCOMPLETE: char = '\u{FFFD}';

impl Postprocessing {
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|e| Error::invalid(format!("cannot decode the tokens: {e}")))?;
        while text.ends_with(INCOMPLETE) {
            text.pop();
        }
        Ok(text)
    }
}

fn ids(request: &Request, name: &str) -> Result<Vec<u32>> {
    let Ok(t) = request.input(name) else {
        return Ok(Vec::new());
    };
    t.to_i32()?
        .into_iter()
        .map(|v| u32::try_from(v).map_err(|_| Error::invalid(format!("'{name}' holds token {v}"))))
        .collect()
}

impl Stage for Postprocessing {
    fn init(config: &Config) -> Result<Self> {
        let file = config
            .parameter("tokenizer_file")
            .unwrap_or("tokenizer.json");
        let tokenizer = Tokenizer::from_bytes(read_model_file(file)?)
            .map_err(|e| Error::invalid(format!("'{file}' is not a tokenizer.json: {e}")))?;
        let shape: &'static [i64] = match config.parameter("text_output_shape") {
            None | Some("row") => &[1, 1],
            Some("flat") => &[1],
            Some(other) => {
                return Err(Error::invalid(format!(
                    "parameter 'text_output_shape' is '{other}'; expected 'row' or 'flat'"
                )))
            }
        };
        Ok(Self { tokenizer, shape })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let new = ids(request, "output_ids")?;
        let context = ids(request, "context_ids")?;
        let before = self.decode(&context)?;
        let mut all = context;
        all.extend_from_slice(&new);
        let after = self.decode(&all)?;
        let text = match after.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_owned(),
            // A decoder that rewrites earlier text: answer from where the two differ.
            None => {
                let same = before
                    .char_indices()
                    .zip(after.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(before.len().min(after.len()), |((i, _), _)| i);
                after[same..].to_owned()
            }
        };
        request.select(vec![Tensor::from_bytes_elements(
            "text_output",
            self.shape,
            [text.as_bytes()],
        )])
    }
}

export_stage!(Postprocessing);
