//! Text → BERT token ids, the first step of the `embed_text` pipeline. The stage reads the
//! `tokenizer.json` shipped in its model's version directory (the file the model was trained
//! with) and tokenizes with the `tokenizers` crate, the library behind Hugging Face's Python
//! tokenizers: normalisation, WordPiece, `[CLS] … [SEP]`, truncation. Texts are truncated at
//! the `max_length` parameter, else at sentence-transformers' `max_seq_length` when its
//! `sentence_bert_config.json` is beside the tokenizer, else at the tokenizer file's length.
//!
//! One request holds one sentence per row (`TEXT` [N, 1] or [1]); the rows are padded to the
//! longest one, rounded up to `pad_to_multiple_of` so that requests of similar length share a
//! shape and the encoder's dynamic batcher can merge them. Padding is masked out downstream.

use tokenizers::{Tokenizer, TruncationParams};
use wasmtron_guest::{
    export_stage, read_model_file, Config, Error, Request, Result, Stage, Tensor,
};

struct BertTokenizer {
    tokenizer: Tokenizer,
    pad_id: i64,
    pad_to_multiple_of: usize,
}

/// The file in which sentence-transformers keeps a model's `max_seq_length`.
const SENTENCE_CONFIG: &str = "sentence_bert_config.json";

/// `max_seq_length` from the model's `sentence_bert_config.json`, when it ships one.
fn sentence_transformers_length() -> Result<Option<usize>> {
    let Ok(bytes) = read_model_file(SENTENCE_CONFIG) else {
        return Ok(None);
    };
    let config: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::invalid(format!("'{SENTENCE_CONFIG}' is not JSON: {e}")))?;
    match config.get("max_seq_length") {
        None => Ok(None),
        Some(n) => n
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "'{SENTENCE_CONFIG}': max_seq_length must be a whole number, got {n}"
                ))
            }),
    }
}

impl Stage for BertTokenizer {
    fn init(config: &Config) -> Result<Self> {
        let file = config
            .parameter("tokenizer_file")
            .unwrap_or("tokenizer.json");
        let mut tokenizer = Tokenizer::from_bytes(read_model_file(file)?)
            .map_err(|e| Error::invalid(format!("'{file}' is not a tokenizer.json: {e}")))?;
        let pad_id = tokenizer.get_padding().map_or(0, |p| i64::from(p.pad_id));
        // sentence-transformers truncates at its own `max_seq_length` (256 for
        // all-MiniLM-L6-v2), not at the tokenizer file's (128): follow it when the model ships
        // it, so long texts embed as the reference library embeds them.
        let default_length = match sentence_transformers_length()? {
            Some(n) => n,
            None => tokenizer.get_truncation().map_or(128, |t| t.max_length),
        };
        let max_length = config.parameter_or("max_length", default_length)?;
        let pad_to_multiple_of = config.parameter_or("pad_to_multiple_of", 16usize)?.max(1);
        if max_length < 2 {
            return Err(Error::invalid(
                "parameter 'max_length' must leave room for [CLS] and [SEP] (at least 2)",
            ));
        }
        // Padding is per request (below); truncation keeps [CLS] and [SEP].
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length,
                ..TruncationParams::default()
            }))
            .map_err(|e| Error::invalid(format!("parameter 'max_length': {e}")))?;
        Ok(Self {
            tokenizer,
            pad_id,
            pad_to_multiple_of,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let text = request.input("TEXT")?;
        let sentences = text.bytes_elements()?;
        let rows = match text.shape.as_slice() {
            [1] => None,
            [n, 1] => Some(*n),
            other => {
                return Err(Error::invalid(format!(
                    "TEXT must hold one sentence per row ([N, 1] or [1]), got shape {other:?}"
                )))
            }
        };
        let mut encoded = Vec::with_capacity(sentences.len());
        for (row, bytes) in sentences.iter().enumerate() {
            let sentence = std::str::from_utf8(bytes)
                .map_err(|e| Error::invalid(format!("TEXT row {row} is not UTF-8: {e}")))?;
            let encoding = self
                .tokenizer
                .encode(sentence, true)
                .map_err(|e| Error::invalid(format!("TEXT row {row}: {e}")))?;
            encoded.push(encoding);
        }
        let longest = encoded.iter().map(|e| e.len()).max().unwrap_or(0);
        let width = longest.div_ceil(self.pad_to_multiple_of) * self.pad_to_multiple_of;
        let mut ids = Vec::with_capacity(width * encoded.len());
        let mut mask = Vec::with_capacity(ids.capacity());
        let mut types = Vec::with_capacity(ids.capacity());
        for e in &encoded {
            let pad = width - e.len();
            ids.extend(e.get_ids().iter().map(|&v| i64::from(v)));
            ids.extend(std::iter::repeat_n(self.pad_id, pad));
            mask.extend(e.get_attention_mask().iter().map(|&v| i64::from(v)));
            mask.extend(std::iter::repeat_n(0, pad));
            types.extend(e.get_type_ids().iter().map(|&v| i64::from(v)));
            types.extend(std::iter::repeat_n(0, pad));
        }
        let shape = match rows {
            Some(n) => vec![n, width as i64],
            None => vec![width as i64],
        };
        request.select(vec![
            Tensor::from_i64("input_ids", &shape, &ids),
            Tensor::from_i64("attention_mask", &shape, &mask),
            Tensor::from_i64("token_type_ids", &shape, &types),
        ])
    }
}

export_stage!(BertTokenizer);
