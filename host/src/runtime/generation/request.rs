//! A generation request's inputs (or request parameters of the same names), checked against
//! the model's limits: each error names the field and the limit.

use std::{sync::Arc, time::Duration};

use super::{
    guided::{Guides, GUIDE_TYPES},
    sampling::SamplingParams,
    stop::TokenBytes,
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, ParamValue},
    tensor::{bytes_elements, DataType},
};

/// The model's settings from config.pbtxt parameters and `generation_config.json`: what a
/// request is checked against.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The context: prompt and generated tokens together.
    pub max_sequence_length: usize,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: usize,
    /// Tokens that end a sequence.
    pub end_ids: Vec<i64>,
    /// The vocabulary's size, when known.
    pub vocab: Option<usize>,
    /// Token texts for stop strings, when the model has a `tokenizer.json`.
    pub text: Option<Arc<TokenBytes>>,
    /// Grammars over the vocabulary (guided decoding), when the model has a `tokenizer.json`.
    pub guides: Option<Arc<Guides>>,
    /// Whether every request may reuse every cached prompt (`prefix_cache_scope: server`)
    /// rather than only its own tenant's.
    pub shared_prefixes: bool,
    /// Whether the decoder can answer every prompt position's logits (for
    /// `return_prompt_log_probs`).
    pub prompt_logits: bool,
    /// The LoRA adapters loaded, when the decoder takes them.
    pub adapters: Option<Arc<super::lora::Adapters>>,
}

/// A request's generation parameters, checked.
pub struct Parsed {
    /// Prompt tokens.
    pub prompt: Vec<i64>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence.
    pub end_ids: Vec<i64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Whether to answer per step (decoupled models) rather than once.
    pub stream: bool,
    /// Words not to generate (TensorRT-LLM's `bad_words`).
    pub bad_words: Vec<String>,
    /// Tokens to generate before an end token may come (`min_length`).
    pub min_tokens: usize,
    /// Whether to answer each token's log-probability (`return_log_probs`).
    pub log_probs: bool,
    /// How many likeliest alternatives to answer per token (`top_logprobs`, 0 to 20).
    pub top_log_probs: usize,
    /// Whether to answer each prompt token's log-probability (`return_prompt_log_probs`, as
    /// vLLM's `prompt_logprobs`; with `top_logprobs` alternatives per token).
    pub prompt_log_probs: bool,
    /// Added to these tokens' logits (`logit_bias_ids` and `logit_bias_values`).
    pub bias: Vec<(u32, f32)>,
    /// Whether a whole (not streamed) answer starts with the prompt's tokens
    /// (`exclude_input_in_output` false).
    pub include_prompt: bool,
    /// The guide the text must follow: its type and text (`guided_decoding_guide_type`,
    /// `guided_decoding_guide`).
    pub guide: Option<(String, String)>,
}

fn invalid(model: &str, message: String) -> Error {
    Error::invalid(format!("model '{model}': {message}"))
}

/// One scalar of an input, or the request parameter of the same name.
fn scalar(request: &InferRequest, name: &str) -> Result<Option<f64>> {
    if let Some(t) = request.inputs.iter().find(|t| t.name == name) {
        let d = &t.data;
        let size = t.datatype.element_size().unwrap_or(0);
        if size == 0 || d.len() != size {
            return Err(invalid(
                &request.model_name,
                format!("input '{name}' must hold one value, has {} bytes", d.len()),
            ));
        }
        let v = match t.datatype {
            DataType::Bool => f64::from(d[0]),
            DataType::Int32 => f64::from(i32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            DataType::Uint32 => f64::from(u32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            DataType::Fp32 => f64::from(f32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            DataType::Int64 => i64::from_le_bytes(d[..8].try_into().unwrap_or_default()) as f64,
            DataType::Uint64 => u64::from_le_bytes(d[..8].try_into().unwrap_or_default()) as f64,
            DataType::Fp64 => f64::from_le_bytes(d[..8].try_into().unwrap_or_default()),
            other => {
                return Err(invalid(
                    &request.model_name,
                    format!(
                        "input '{name}' has type {}, not a number",
                        other.wire_name()
                    ),
                ))
            }
        };
        return Ok(Some(v));
    }
    Ok(match request.parameters.get(name) {
        None => None,
        Some(ParamValue::Bool(b)) => Some(f64::from(u8::from(*b))),
        Some(ParamValue::Int(i)) => Some(*i as f64),
        Some(ParamValue::Uint(u)) => Some(*u as f64),
        Some(ParamValue::Double(d)) => Some(*d),
        Some(ParamValue::String(s)) => Some(s.trim().parse::<f64>().map_err(|_| {
            invalid(
                &request.model_name,
                format!("parameter '{name}' must be a number, got \"{s}\""),
            )
        })?),
    })
}

/// The most stop or banned strings one request may give, and their longest: each is checked
/// at every step (and banned words against the whole vocabulary once), so both are bounded.
const MAX_WORDS: usize = 32;
const MAX_WORD_BYTES: usize = 256;

/// `words` (of `total` sent) when within [`MAX_WORDS`] and [`MAX_WORD_BYTES`], else an error
/// naming the field.
fn bounded(model: &str, name: &str, (words, total): (Vec<String>, usize)) -> Result<Vec<String>> {
    if total > MAX_WORDS {
        return Err(invalid(
            model,
            format!("'{name}' holds {total} strings; at most {MAX_WORDS}"),
        ));
    }
    if let Some(long) = words.iter().find(|w| w.len() > MAX_WORD_BYTES) {
        return Err(invalid(
            model,
            format!(
                "'{name}' holds a string of {} bytes; at most {MAX_WORD_BYTES}",
                long.len()
            ),
        ));
    }
    Ok(words)
}

/// The first of `names` the request sets (TensorRT-LLM has several names for some fields).
fn scalar_of(request: &InferRequest, names: &[&str]) -> Result<Option<f64>> {
    for name in names {
        if let Some(v) = scalar(request, name)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

/// The strings of a BYTES input, or of the request parameter of the same name, and how many
/// there were; empty strings are left out (TensorRT-LLM's clients send `[[""]]` for none), and
/// only the first [`MAX_WORDS`] + 1 are kept (more are refused, counted).
fn strings(request: &InferRequest, name: &str) -> Result<(Vec<String>, usize)> {
    let mut out = Vec::new();
    let mut total = 0;
    if let Some(t) = request.inputs.iter().find(|t| t.name == name) {
        if t.datatype != DataType::Bytes {
            return Err(invalid(
                &request.model_name,
                format!(
                    "input '{name}' must be BYTES (strings), is {}",
                    t.datatype.wire_name()
                ),
            ));
        }
        for s in bytes_elements(&t.data).filter(|s| !s.is_empty()) {
            total += 1;
            if out.len() > MAX_WORDS {
                continue;
            }
            out.push(String::from_utf8(s.to_vec()).map_err(|_| {
                invalid(
                    &request.model_name,
                    format!("input '{name}' holds a string that is not UTF-8"),
                )
            })?);
        }
    } else if let Some(ParamValue::String(s)) = request.parameters.get(name) {
        if !s.is_empty() {
            out.push(s.clone());
            total = 1;
        }
    }
    Ok((out, total))
}

/// TensorRT-LLM's fields that ask for more than one sequence or for something not computed
/// here: their neutral values are accepted, anything else is refused by name.
fn refuse_unserved(request: &InferRequest) -> Result<()> {
    let model = request.model_name.as_str();
    for name in ["beam_width", "num_return_sequences"] {
        if let Some(v) = scalar(request, name)? {
            if v != 1.0 {
                return Err(invalid(
                    model,
                    format!(
                        "'{name}' is {v}; only 1 is supported (one sequence per request:                          greedy or sampled decoding, no beam search)"
                    ),
                ));
            }
        }
    }
    for name in [
        "return_context_logits",
        "return_generation_logits",
        "return_perf_metrics",
    ] {
        if scalar(request, name)?.is_some_and(|v| v != 0.0) {
            return Err(invalid(model, format!("'{name}' is not supported")));
        }
    }
    if strings(request, "embedding_bias_words")?.1 > 0 {
        return Err(invalid(
            model,
            "'embedding_bias_words' is not supported".into(),
        ));
    }
    Ok(())
}

/// OpenAI's `logit_bias` as two inputs of equal length: token ids (INT32) and the biases to
/// add to their logits (FP32, -100 to 100).
fn logit_bias(request: &InferRequest, settings: &Settings) -> Result<Vec<(u32, f32)>> {
    let model = request.model_name.as_str();
    let find = |name: &str| request.inputs.iter().find(|t| t.name == name);
    let (ids, values) = match (find("logit_bias_ids"), find("logit_bias_values")) {
        (None, None) => return Ok(Vec::new()),
        (Some(ids), Some(values)) => (ids, values),
        _ => {
            return Err(invalid(
                model,
                "'logit_bias_ids' and 'logit_bias_values' come together".into(),
            ))
        }
    };
    if ids.datatype != DataType::Int32 || values.datatype != DataType::Fp32 {
        return Err(invalid(
            model,
            "'logit_bias_ids' must be INT32 and 'logit_bias_values' FP32".into(),
        ));
    }
    let ids: Vec<i32> = ids
        .data
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let values: Vec<f32> = values
        .data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if ids.len() != values.len() {
        return Err(invalid(
            model,
            format!(
                "'logit_bias_ids' has {} tokens and 'logit_bias_values' {} biases",
                ids.len(),
                values.len()
            ),
        ));
    }
    let vocab = settings.vocab.unwrap_or(usize::MAX);
    ids.into_iter()
        .zip(values)
        .map(|(id, bias)| {
            if id < 0 || id as usize >= vocab {
                return Err(invalid(
                    model,
                    format!("'logit_bias' names token {id}, outside the vocabulary [0, {vocab})"),
                ));
            }
            in_range(model, "logit_bias", f64::from(bias), -100.0, 100.0)?;
            Ok((id as u32, bias))
        })
        .collect()
}

/// Checks `value` of `name` against [lo, hi].
fn in_range(model: &str, name: &str, value: f64, lo: f64, hi: f64) -> Result<f64> {
    if value.is_finite() && value >= lo && value <= hi {
        Ok(value)
    } else {
        Err(invalid(model, format!("'{name}' is {value}, outside [{lo}, {hi}]")).with_field(name))
    }
}

/// Reads and checks a request's generation inputs.
pub fn parse(request: &InferRequest, settings: &Settings) -> Result<Parsed> {
    let model = request.model_name.as_str();
    let prompt = prompt_of(request, settings)?;
    refuse_unserved(request)?;
    let max_tokens = max_tokens_of(request, settings, prompt.len())?;
    let get = |name: &'static str, lo: f64, hi: f64| ranged(request, name, lo, hi);
    let sampling = sampling_of(request)?;
    let end_ids = match get("end_id", -1.0, f64::from(i32::MAX))? {
        Some(v) if v >= 0.0 => vec![v as i64],
        // -1 turns end tokens off (generate exactly max_tokens), as TensorRT-LLM's end_id does.
        Some(_) => Vec::new(),
        None => settings.end_ids.clone(),
    };
    let (stop, bad_words) = stop_and_bad_words(request, settings)?;
    let guide = guide(request, settings)?;
    // Answers are never padded (one sequence per request): the id is only checked.
    get("pad_id", 0.0, f64::from(i32::MAX))?;
    let min_tokens = get("min_length", 0.0, f64::from(u32::MAX))?.unwrap_or(0.0) as usize;
    let top_log_probs = get("top_logprobs", 0.0, 20.0)?.unwrap_or(0.0) as usize;
    let bias = logit_bias(request, settings)?;
    let log_probs =
        scalar(request, "return_log_probs")?.is_some_and(|v| v != 0.0) || top_log_probs > 0;
    let prompt_log_probs = scalar(request, "return_prompt_log_probs")?.is_some_and(|v| v != 0.0);
    if prompt_log_probs && !settings.prompt_logits {
        return Err(invalid(
            model,
            "'return_prompt_log_probs' needs a decoder that answers every position's logits \
             (an input 'all_logits', as scripts/llm_export.py writes, or logits of every \
             position, as Optimum's exports answer)"
                .into(),
        ));
    }
    // As TensorRT-LLM (and vLLM's backend): one answer unless `stream` asks for tokens as
    // they come (`…/generate_stream` asks for them when the body does not say).
    let stream = scalar(request, "stream")?.is_some_and(|v| v != 0.0);
    // TensorRT-LLM answers the prompt too unless told to exclude it; a stream never has it.
    let include_prompt = scalar(request, "exclude_input_in_output")?.is_some_and(|v| v == 0.0);
    Ok(Parsed {
        prompt,
        max_tokens,
        sampling,
        end_ids,
        stop,
        stream,
        bad_words,
        min_tokens,
        log_probs,
        top_log_probs,
        prompt_log_probs,
        bias,
        include_prompt,
        guide,
    })
}

/// The prompt's tokens (`input_ids`, one row), checked against the vocabulary and the
/// context.
fn prompt_of(request: &InferRequest, settings: &Settings) -> Result<Vec<i64>> {
    let model = request.model_name.as_str();
    let ids = request
        .inputs
        .iter()
        .find(|t| t.name == "input_ids")
        .ok_or_else(|| invalid(model, "input 'input_ids' is missing".into()))?;
    if ids.shape.first().is_some_and(|&rows| rows != 1) {
        return Err(invalid(
            model,
            format!(
                "input 'input_ids' has {} rows: a request generates one sequence (send one \
                 request per prompt)",
                ids.shape[0]
            ),
        ));
    }
    let prompt: Vec<i64> = match ids.datatype {
        DataType::Int32 => ids
            .data
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        DataType::Int64 => ids
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect(),
        other => {
            return Err(invalid(
                model,
                format!(
                    "input 'input_ids' must be INT32 or INT64, is {}",
                    other.wire_name()
                ),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(invalid(
            model,
            "the prompt is empty: input 'input_ids' needs at least one token".into(),
        )
        .with_field("input_ids"));
    }
    if let Some(vocab) = settings.vocab {
        if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            return Err(invalid(
                model,
                format!("input 'input_ids' holds token {bad}, outside the vocabulary [0, {vocab})"),
            )
            .with_field("input_ids"));
        }
    }
    let limit = settings.max_sequence_length;
    if prompt.len() >= limit {
        return Err(invalid(
            model,
            format!(
                "the prompt has {} tokens; the context is {limit} tokens (max_sequence_length), \
                 so a prompt may have at most {}",
                prompt.len(),
                limit - 1
            ),
        )
        .with_field("input_ids"));
    }
    Ok(prompt)
}

/// How many tokens to generate: `max_tokens` (or TensorRT-LLM's `request_output_len`) within
/// the room the prompt leaves, else the model's default.
fn max_tokens_of(request: &InferRequest, settings: &Settings, prompt_len: usize) -> Result<usize> {
    let model = request.model_name.as_str();
    let limit = settings.max_sequence_length;
    let room = limit - prompt_len;
    Ok(
        match scalar_of(request, &["max_tokens", "request_output_len"])? {
            None => settings.default_max_tokens.min(room),
            Some(v) => {
                let v = in_range(model, "max_tokens", v, 1.0, f64::from(u32::MAX))? as usize;
                if v > room {
                    return Err(invalid(
                        model,
                        format!(
                        "'max_tokens' is {v}, but the prompt's {} tokens leave room for {room} \
                         in the context of {limit} tokens (max_sequence_length)",
                        prompt_len
                    ),
                    )
                    .with_field("max_tokens"));
                }
                v
            }
        },
    )
}

/// TensorRT-LLM's other names for a field, after ours (none: the name alone).
fn names(name: &'static str) -> &'static [&'static str] {
    match name {
        "top_k" => &["top_k", "runtime_top_k"],
        "top_p" => &["top_p", "runtime_top_p"],
        "seed" => &["seed", "random_seed"],
        "temperature" => &["temperature", "runtime_temperature"],
        "min_length" => &["min_length", "min_tokens"],
        _ => &[],
    }
}

/// A scalar field (by any of its names), checked to lie in `[lo, hi]`.
fn ranged(request: &InferRequest, name: &'static str, lo: f64, hi: f64) -> Result<Option<f64>> {
    let value = match names(name) {
        [] => scalar(request, name)?,
        several => scalar_of(request, several)?,
    };
    value
        .map(|v| in_range(&request.model_name, name, v, lo, hi))
        .transpose()
}

/// The sampling fields, each checked against its range.
fn sampling_of(request: &InferRequest) -> Result<SamplingParams> {
    let model = request.model_name.as_str();
    let get = |name: &'static str, lo: f64, hi: f64| ranged(request, name, lo, hi);
    Ok(SamplingParams {
        temperature: get("temperature", 0.0, 100.0)?.unwrap_or(0.0) as f32,
        top_k: get("top_k", 0.0, f64::from(u32::MAX))?.unwrap_or(0.0) as usize,
        top_p: get("top_p", f64::MIN_POSITIVE, 1.0)?.unwrap_or(1.0) as f32,
        seed: scalar_of(request, names("seed"))?
            .map(|v| in_range(model, "seed", v, 0.0, u64::MAX as f64).map(|v| v as u64))
            .transpose()?,
        repetition_penalty: get("repetition_penalty", f64::MIN_POSITIVE, 100.0)?.unwrap_or(1.0)
            as f32,
        frequency_penalty: get("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        presence_penalty: get("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
    })
}

/// The stop strings (OpenAI's `stop` and TensorRT-LLM's `stop_words`) and the bad words, which
/// both need the model's tokenizer to read the text.
fn stop_and_bad_words(
    request: &InferRequest,
    settings: &Settings,
) -> Result<(Vec<String>, Vec<String>)> {
    let model = request.model_name.as_str();
    // OpenAI's `stop` and TensorRT-LLM's `stop_words` both end the text (without the stop
    // string itself).
    let (mut stop, mut total) = strings(request, "stop")?;
    let (more, more_total) = strings(request, "stop_words")?;
    stop.extend(more);
    total += more_total;
    let stop = bounded(model, "stop", (stop, total))?;
    if !stop.is_empty() && settings.text.is_none() {
        return Err(invalid(
            model,
            "'stop' needs the model's tokenizer.json beside model.onnx to read the text".into(),
        ));
    }
    let bad_words = bounded(model, "bad_words", strings(request, "bad_words")?)?;
    if !bad_words.is_empty() && settings.text.is_none() {
        return Err(invalid(
            model,
            "'bad_words' needs the model's tokenizer.json beside model.onnx to read the text"
                .into(),
        ));
    }
    Ok((stop, bad_words))
}

/// TensorRT-LLM's guided-decoding inputs: a type and, except for `json` (any JSON), a guide.
fn guide(request: &InferRequest, settings: &Settings) -> Result<Option<(String, String)>> {
    let model = request.model_name.as_str();
    let first =
        |name: &str| -> Result<Option<String>> { Ok(strings(request, name)?.0.into_iter().next()) };
    let kind = first("guided_decoding_guide_type")?.filter(|k| !k.is_empty());
    let text = first("guided_decoding_guide")?.unwrap_or_default();
    let Some(kind) = kind else {
        if !text.is_empty() {
            return Err(invalid(
                model,
                "input 'guided_decoding_guide' needs 'guided_decoding_guide_type'".into(),
            ));
        }
        return Ok(None);
    };
    if !GUIDE_TYPES.contains(&kind.as_str()) {
        return Err(invalid(
            model,
            format!(
                "input 'guided_decoding_guide_type' is '{kind}'; supported: {}",
                GUIDE_TYPES.join(", ")
            ),
        ));
    }
    if kind != "json" && text.is_empty() {
        return Err(invalid(
            model,
            format!("guide type '{kind}' needs input 'guided_decoding_guide'"),
        ));
    }
    if settings.guides.is_none() {
        return Err(invalid(
            model,
            "guided decoding needs the model's tokenizer.json beside model.onnx".into(),
        ));
    }
    Ok(Some((kind, text)))
}

/// The request's `timeout` parameter (microseconds), as queue policies read it.
pub fn timeout_of(request: &InferRequest) -> Option<Duration> {
    request
        .parameters
        .get("timeout")?
        .as_u64()
        .filter(|&us| us > 0)
        .map(Duration::from_micros)
}
