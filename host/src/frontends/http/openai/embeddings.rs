//! `POST /v1/embeddings` over an embedding pipeline of the repository: a batching model with
//! one text input (BYTES, dims `[1]`) and a float vector output (FP32, dims `[n]`), like the
//! `embed_text` ensemble. Texts (up to 2,048) are sent in batches of the model's
//! `max_batch_size`, a few at a time; vectors come back as floats or as base64 of little-endian float32 (OpenAI's
//! `encoding_format`). `dimensions` is the model's own size, or a shorter one the model lists
//! in its `matryoshka_dimensions` parameter (the vector is cut and normalised again).

use base64::Engine as _;
use bytes::Bytes;

use super::{
    decode,
    invalid::Invalid,
    types::{
        Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage, EmbeddingVector, TextsOrIds,
    },
};
use crate::{
    error::Error,
    inference::{InferRequest, RequestedOutput},
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, DataType, Tensor},
};

/// The most texts one request may embed, as OpenAI's API allows.
pub const MAX_INPUTS: usize = 2048;

/// Batches of one request run at once; the rest wait their turn, so that a long list neither
/// fills the model's queue nor takes every instance from other callers.
pub const BATCHES_AT_ONCE: usize = 4;

/// Fields `/v1/embeddings` takes; any other is refused by name.
const FIELDS: &[&str] = &["model", "input", "encoding_format", "dimensions", "user"];

/// What an embedding model looks like to this endpoint: its text input, its vector output
/// and the vector's length.
#[derive(Debug, Clone)]
pub struct EmbeddingModel {
    input: String,
    output: String,
    size: usize,
    /// Shorter sizes the model was trained to be cut to (`matryoshka_dimensions`).
    shorter: Vec<usize>,
    max_batch_size: usize,
    /// An integer output counting tokens per text (`attention_mask`), if the model answers one.
    mask: Option<String>,
}

/// The model's embedding signature, if it has one: one BYTES input that is text (see
/// [`takes_text`]), an FP32 vector out, batching.
pub fn embedding_model(config: &ModelConfig) -> Option<EmbeddingModel> {
    if config.max_batch_size <= 0 || config.input.len() != 1 {
        return None;
    }
    let input = &config.input[0];
    if DataType::from_config_value(input.data_type) != Some(DataType::Bytes)
        || input.dims != [1]
        || !takes_text(config, &input.name)
    {
        return None;
    }
    let output = config.output.iter().find(|o| {
        DataType::from_config_value(o.data_type) == Some(DataType::Fp32)
            && o.dims.len() == 1
            && o.dims[0] > 0
    })?;
    let mask = config
        .output
        .iter()
        .find(|o| {
            o.name == "attention_mask"
                && matches!(
                    DataType::from_config_value(o.data_type),
                    Some(DataType::Int64 | DataType::Int32)
                )
        })
        .map(|o| o.name.clone());
    let shorter = config
        .parameters
        .get("matryoshka_dimensions")
        .map(|p| {
            p.string_value
                .split(',')
                .filter_map(|d| d.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default();
    Some(EmbeddingModel {
        input: input.name.clone(),
        output: output.name.clone(),
        size: output.dims[0] as usize,
        shorter,
        max_batch_size: config.max_batch_size as usize,
        mask,
    })
}

/// Whether the BYTES input `input` holds text, not any bytes (an image classifier takes BYTES
/// too): the config says so (`parameters { key: "text_input" value: { string_value: "<input>" } }`),
/// or the model is an ensemble whose step reading the input is a tokenizer (it answers
/// `input_ids`).
pub fn takes_text(config: &ModelConfig, input: &str) -> bool {
    use crate::proto::inference::model_config::SchedulingChoice;
    if config
        .parameters
        .get("text_input")
        .is_some_and(|p| p.string_value == input)
    {
        return true;
    }
    let Some(SchedulingChoice::EnsembleScheduling(ensemble)) = &config.scheduling_choice else {
        return false;
    };
    ensemble.step.iter().any(|step| {
        step.input_map.values().any(|v| v == input) && step.output_map.contains_key("input_ids")
    })
}

/// A checked embeddings request: the model, its texts in batches, and how to answer.
#[derive(Debug)]
pub struct Parsed {
    /// The model named.
    pub model: String,
    /// One request per batch of texts, in order.
    pub requests: Vec<InferRequest>,
    /// The length to answer (the model's, or a shorter one it allows).
    pub dimensions: usize,
    /// Answer base64 instead of floats.
    pub base64: bool,
    signature: EmbeddingModel,
}

fn field(param: &str, message: String) -> Invalid {
    Invalid {
        error: Error::invalid(message),
        param: Some(param.to_owned()),
    }
}

/// Checks the body (its bytes, read once into the wire type) and builds the model's requests;
/// `lookup` finds the named model (the handler's target), asked before the body is decoded,
/// and is answered with the requests.
pub fn parse<T: std::borrow::Borrow<ModelConfig>>(
    body: &[u8],
    lookup: impl FnOnce(&str) -> Result<T, Error>,
) -> Result<(T, Parsed), Invalid> {
    let head = decode::head(body)?;
    if let Some(key) = head.fields.iter().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(field(
            key,
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    let model = match head.model {
        Some(m) if !m.is_empty() => m,
        _ => return Err(field("model", "'model' is required (a string)".into())),
    };
    let target = lookup(&model)?;
    let config: &ModelConfig = target.borrow();
    let req: EmbeddingRequest = decode::read(body)?;
    let signature = embedding_model(config).ok_or_else(|| {
        Error::not_found(format!(
            "model '{model}' does not embed text (it needs one BYTES input of dims [1] that is \
             text: read by a tokenizer step answering 'input_ids', or named by the config \
             parameter 'text_input'; and an FP32 output of dims [n], with batching)"
        ))
    })?;
    let texts = match req.input {
        Some(TextsOrIds::Text(text)) => vec![text],
        Some(TextsOrIds::Texts(texts)) if texts.total > MAX_INPUTS => {
            return Err(field(
                "input",
                format!("'input' holds {} texts; at most {MAX_INPUTS}", texts.total),
            ))
        }
        Some(TextsOrIds::Texts(texts)) => texts.kept,
        Some(TextsOrIds::Ids(_) | TextsOrIds::IdLists(_)) => {
            return Err(field(
                "input",
                "'input' must be a string or a list of strings (token ids are not supported)"
                    .into(),
            ))
        }
        Some(TextsOrIds::Mixed { at, found, .. }) => {
            return Err(field(
                "input",
                format!("'input' must be a string or a list of strings: item {at} is {found}"),
            ))
        }
        Some(TextsOrIds::Other(other)) => {
            return Err(field(
                "input",
                format!("'input' must be a string or a list of strings, got {other}"),
            ))
        }
        None => return Err(field("input", "'input' is required".into())),
    };
    if texts.is_empty() {
        return Err(field("input", "'input' is empty".into()));
    }
    if let Some(i) = texts.iter().position(String::is_empty) {
        return Err(field(
            "input",
            format!("'input'[{i}] is an empty string; every input must hold text"),
        ));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(field(
                "encoding_format",
                format!("'encoding_format' is '{other}'; expected 'float' or 'base64'"),
            ))
        }
    };
    let dimensions = match req.dimensions {
        None => signature.size,
        Some(d) if d > 0 && d as usize == signature.size => signature.size,
        Some(d) if d > 0 && signature.shorter.contains(&(d as usize)) => d as usize,
        Some(d) => {
            let mut allowed = signature.shorter.clone();
            allowed.push(signature.size);
            allowed.sort_unstable();
            let allowed: Vec<String> = allowed.iter().map(usize::to_string).collect();
            return Err(field(
                "dimensions",
                format!(
                    "'dimensions' is {d}; model '{model}' answers {} (the sizes it allows)",
                    allowed.join(", ")
                ),
            ));
        }
    };
    let output = |name: &String| RequestedOutput {
        name: name.clone(),
        parameters: Default::default(),
    };
    let mut outputs = vec![output(&signature.output)];
    if let Some(mask) = &signature.mask {
        outputs.push(output(mask));
    }
    let requests = texts
        .chunks(signature.max_batch_size.max(1))
        .map(|chunk| {
            let mut data = Vec::new();
            for text in chunk {
                push_bytes_element(&mut data, text.as_bytes());
            }
            let text = Tensor {
                name: signature.input.clone(),
                datatype: DataType::Bytes,
                shape: vec![chunk.len() as i64, 1],
                data: Bytes::from(data),
            };
            InferRequest::new(model.clone(), None)
                .with_inputs(vec![text])
                .with_outputs(outputs.clone())
        })
        .collect();
    let parsed = Parsed {
        model,
        requests,
        dimensions,
        base64,
        signature,
    };
    Ok((target, parsed))
}

/// The answer from the model's responses, one per request of [`Parsed::requests`].
pub fn answer(
    parsed: &Parsed,
    responses: Vec<crate::inference::InferResponse>,
) -> Result<EmbeddingList, Error> {
    let mut data = Vec::new();
    let mut tokens = 0i64;
    for response in responses {
        let vectors = response
            .outputs
            .iter()
            .find(|t| t.name == parsed.signature.output)
            .ok_or_else(|| {
                Error::internal(format!(
                    "model '{}' did not answer '{}'",
                    parsed.model, parsed.signature.output
                ))
            })?;
        let values: Vec<f32> = vectors
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for row in values.chunks(parsed.signature.size.max(1)) {
            let mut vector = row[..parsed.dimensions.min(row.len())].to_vec();
            if parsed.dimensions < parsed.signature.size {
                let norm = vector.iter().map(|v| v * v).sum::<f32>().sqrt();
                if norm > 0.0 {
                    vector.iter_mut().for_each(|v| *v /= norm);
                }
            }
            let embedding = if parsed.base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
                EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                EmbeddingVector::Float(vector)
            };
            data.push(Embedding {
                object: "embedding",
                index: data.len(),
                embedding,
            });
        }
        if let Some(mask) = response
            .outputs
            .iter()
            .find(|t| Some(&t.name) == parsed.signature.mask.as_ref())
        {
            let width = if mask.datatype == DataType::Int64 {
                8
            } else {
                4
            };
            tokens += mask
                .data
                .chunks_exact(width)
                .filter(|b| b.iter().any(|&x| x != 0))
                .count() as i64;
        }
    }
    Ok(EmbeddingList {
        object: "list",
        data,
        model: parsed.model.clone(),
        usage: EmbeddingUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
}
