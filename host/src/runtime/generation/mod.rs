//! The generation backend (`backend: "generation"`): text generation with a decoder
//! (`input_ids`, `attention_mask`, `past_key_values.{i}.key|value` → `logits`,
//! `present.{i}.key|value`) in ONNX Runtime GenAI's shared-buffer layout (the cache
//! preallocated and written in place, [`kv_buffer`]) or Hugging Face Optimum's growing one
//! (with `position_ids`; [`kv_store`] runs both), with in-flight batching ([`engine`]) and
//! sampling on the host ([`sampling`]).
//!
//! The model takes token ids and answers token ids, like TensorRT-LLM's `tensorrt_llm` model:
//! tokenizer and detokenizer are separate models (Wasm stages) that an ensemble chains with
//! it. Decoupled (`model_transaction_policy { decoupled: true }`), it answers once per step as
//! tokens come (or once at the end when `stream` is false); otherwise once at the end.
//! `max_batch_size` is the number of sequences generated together; the key/value cache budget
//! is `kv_cache_max_tokens` (default `max_batch_size x max_sequence_length`).

pub mod engine;
pub mod guided;
pub mod kv_buffer;
pub mod kv_cache;
pub mod kv_store;
pub mod prefix_cache;
mod request;
pub mod sampling;
pub mod stats;
pub mod stop;
pub mod token_rules;

use std::{
    path::Path,
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use bytes::Bytes;
use ort::{session::Session, value::ValueType};

use self::{
    engine::{DecoderSpec, Engine, EngineLimits, Finish, Party, Submission},
    guided::Guides,
    request::{parse, timeout_of, Settings},
    sampling::PromptLogProbs,
    stats::GenerationStats,
    stop::{StopStrings, TokenBytes},
    token_rules::{BannedWords, TokenRules},
};
use super::{ExecTimings, LoadedBackend, ModelInstance, RuntimeOptions};
use crate::{
    error::{Code, Error, Result},
    inference::InferRequest,
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::{push_bytes_element, DataType, Tensor},
};

/// The `backend` name that selects this backend.
pub const BACKEND: &str = "generation";

/// How many generated tokens before a response's own each response carries (`context_ids`),
/// enough for a detokenizer to finish a character that began in an earlier response.
pub const CONTEXT_TOKENS: usize = 8;

const DEFAULT_MAX_SEQUENCE_LENGTH: usize = 2048;
const DEFAULT_MAX_TOKENS: usize = 128;

/// Reads `generation_config.json` (Hugging Face's), if there is one.
fn generation_config(dir: &Path) -> serde_json::Value {
    std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

fn ids_of(value: &serde_json::Value) -> Vec<i64> {
    match value {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    }
}

/// The tensors the model takes: (name, type, dims, optional).
const INPUTS: &[(&str, DataType, i64, bool)] = &[
    ("input_ids", DataType::Int32, -1, false),
    ("max_tokens", DataType::Int32, 1, true),
    ("temperature", DataType::Fp32, 1, true),
    ("top_k", DataType::Int32, 1, true),
    ("top_p", DataType::Fp32, 1, true),
    ("seed", DataType::Uint64, 1, true),
    ("repetition_penalty", DataType::Fp32, 1, true),
    ("frequency_penalty", DataType::Fp32, 1, true),
    ("presence_penalty", DataType::Fp32, 1, true),
    ("end_id", DataType::Int32, 1, true),
    ("stop", DataType::Bytes, -1, true),
    ("stream", DataType::Bool, 1, true),
    // TensorRT-LLM's names, so that its ensembles map onto this model unchanged.
    ("stop_words", DataType::Bytes, -1, true),
    ("bad_words", DataType::Bytes, -1, true),
    ("pad_id", DataType::Int32, 1, true),
    ("min_length", DataType::Int32, 1, true),
    ("random_seed", DataType::Uint64, 1, true),
    ("runtime_top_k", DataType::Int32, 1, true),
    ("runtime_top_p", DataType::Fp32, 1, true),
    ("length_penalty", DataType::Fp32, 1, true),
    ("beam_width", DataType::Int32, 1, true),
    ("num_return_sequences", DataType::Int32, 1, true),
    ("return_log_probs", DataType::Bool, 1, true),
    ("exclude_input_in_output", DataType::Bool, 1, true),
    ("return_context_logits", DataType::Bool, 1, true),
    ("return_generation_logits", DataType::Bool, 1, true),
    ("return_perf_metrics", DataType::Bool, 1, true),
    ("embedding_bias_words", DataType::Bytes, -1, true),
    ("embedding_bias_weights", DataType::Fp32, -1, true),
    // OpenAI's top_logprobs: the likeliest alternatives to report per token (up to 20).
    ("top_logprobs", DataType::Int32, 1, true),
    // vLLM's prompt_logprobs (OpenAI's echo with logprobs): score the prompt's tokens too.
    ("return_prompt_log_probs", DataType::Bool, 1, true),
    // OpenAI's logit_bias: token ids and the biases added to their logits.
    ("logit_bias_ids", DataType::Int32, -1, true),
    ("logit_bias_values", DataType::Fp32, -1, true),
    // TensorRT-LLM's guided decoding: json, json_schema, regex or lark, and the guide.
    ("guided_decoding_guide_type", DataType::Bytes, 1, true),
    ("guided_decoding_guide", DataType::Bytes, 1, true),
];

/// The tensors it answers: (name, type, dims).
const OUTPUTS: &[(&str, DataType, i64)] = &[
    ("output_ids", DataType::Int32, -1),
    ("context_ids", DataType::Int32, -1),
    ("finish_reason", DataType::Bytes, 1),
    ("prompt_tokens", DataType::Int32, 1),
    ("generated_tokens", DataType::Int32, 1),
    // With `return_log_probs`: the sum of the answered tokens' log-probabilities so far, and
    // each token's.
    ("cum_log_probs", DataType::Fp32, 1),
    ("output_log_probs", DataType::Fp32, -1),
    // What each answered token spells, and per token the `top_logprobs` likeliest tokens
    // (spellings and log-probabilities, in rows of top_logprobs).
    ("output_tokens", DataType::Bytes, -1),
    ("top_tokens", DataType::Bytes, -1),
    ("top_log_probs", DataType::Fp32, -1),
    // With `return_prompt_log_probs`, on the first response: what each prompt token spells,
    // its log-probability given the ones before (NaN for the first) and the `top_logprobs`
    // likeliest tokens at its position (rows of top_logprobs; the first row empty).
    ("prompt_token_texts", DataType::Bytes, -1),
    ("prompt_log_probs", DataType::Fp32, -1),
    ("prompt_top_tokens", DataType::Bytes, -1),
    ("prompt_top_log_probs", DataType::Fp32, -1),
];

/// Fills in the inputs and outputs when config.pbtxt leaves them out, and checks the ones it
/// declares.
fn complete_config(config: &mut ModelConfig) -> Result<()> {
    if config.input.is_empty() {
        config.input = INPUTS
            .iter()
            .map(|&(name, dt, dim, optional)| ModelInput {
                name: name.to_owned(),
                data_type: dt.config_value(),
                dims: vec![dim],
                optional,
                ..Default::default()
            })
            .collect();
    }
    if config.output.is_empty() {
        config.output = OUTPUTS
            .iter()
            .map(|&(name, dt, dim)| ModelOutput {
                name: name.to_owned(),
                data_type: dt.config_value(),
                dims: vec![dim],
                ..Default::default()
            })
            .collect();
    }
    for (i, input) in config.input.iter().enumerate() {
        if !INPUTS.iter().any(|(n, ..)| *n == input.name) {
            return Err(Error::invalid(format!(
                "model '{}': input[{i}] '{}' is not one the generation backend takes ({})",
                config.name,
                input.name,
                INPUTS.iter().map(|i| i.0).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    for (i, output) in config.output.iter().enumerate() {
        if !OUTPUTS.iter().any(|(n, ..)| *n == output.name) {
            return Err(Error::invalid(format!(
                "model '{}': output[{i}] '{}' is not one the generation backend answers ({})",
                config.name,
                output.name,
                OUTPUTS.iter().map(|o| o.0).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    Ok(())
}

/// What the decoder's signature says: its layers and cache shape, its vocabulary.
///
/// `share_buffer` is the configuration's `past_present_share_buffer`; without it, a decoder
/// whose past and present share their length's name (one buffer, as ONNX Runtime GenAI's
/// exports declare it) or whose cache is FP16 shares the buffer.
fn decoder_spec(
    session: &Session,
    model: &str,
    share_buffer: Option<bool>,
) -> Result<(DecoderSpec, Option<usize>)> {
    let bad = |what: String| {
        Error::invalid(format!(
            "model '{model}': the decoder does not have the layout the generation backend runs \
             (Optimum's text-generation-with-past export, or ONNX Runtime GenAI's with a \
             shared past/present buffer): {what}"
        ))
    };
    let inputs = session.inputs();
    let names: Vec<&str> = inputs.iter().map(|o| o.name()).collect();
    for required in ["input_ids", "attention_mask"] {
        if !names.contains(&required) {
            return Err(bad(format!("no input '{required}'")));
        }
    }
    let layers = names
        .iter()
        .filter(|n| n.starts_with("past_key_values.") && n.ends_with(".key"))
        .count();
    if layers == 0 {
        return Err(bad("no 'past_key_values.{i}.key' inputs".into()));
    }
    let mut kv_heads = 0;
    let mut head_dim = 0;
    let mut fp16 = None;
    let mut same_length = true;
    for i in 0..layers {
        for kind in ["key", "value"] {
            let name = format!("past_key_values.{i}.{kind}");
            let outlet = inputs
                .iter()
                .find(|o| o.name() == name)
                .ok_or_else(|| bad(format!("no input '{name}'")))?;
            let ValueType::Tensor {
                ty,
                shape,
                dimension_symbols,
            } = outlet.dtype()
            else {
                return Err(bad(format!("input '{name}' is not a tensor")));
            };
            let present = name.replace("past_key_values.", "present.");
            let present_length = session
                .outputs()
                .iter()
                .find(|o| o.name() == present)
                .and_then(|o| match o.dtype() {
                    ValueType::Tensor {
                        dimension_symbols, ..
                    } => dimension_symbols.get(2).cloned(),
                    _ => None,
                });
            same_length &= dimension_symbols
                .get(2)
                .is_some_and(|s| !s.is_empty() && Some(s) == present_length.as_ref());
            let half = match ty {
                ort::value::TensorElementType::Float32 => false,
                ort::value::TensorElementType::Float16 => true,
                _ => return Err(bad(format!("input '{name}' must be FP32 or FP16, is {ty}"))),
            };
            if *fp16.get_or_insert(half) != half || shape.len() != 4 {
                return Err(bad(format!(
                    "input '{name}' must be [batch, kv_heads, past, head_dim] of the same type \
                     as the other cache inputs"
                )));
            }
            if shape[1] <= 0 || shape[3] <= 0 {
                return Err(bad(format!(
                    "input '{name}' must have fixed kv_heads and head_dim, has {shape:?}"
                )));
            }
            kv_heads = shape[1] as usize;
            head_dim = shape[3] as usize;
        }
        let present = format!("present.{i}.key");
        if !session.outputs().iter().any(|o| o.name() == present) {
            return Err(bad(format!("no output '{present}'")));
        }
    }
    let logits_shape = session
        .outputs()
        .iter()
        .find(|o| o.name() == "logits")
        .ok_or_else(|| bad("no output 'logits'".into()))
        .map(|o| match o.dtype() {
            ValueType::Tensor { shape, .. } => shape.to_vec(),
            _ => Vec::new(),
        })?;
    let vocab = logits_shape
        .last()
        .copied()
        .filter(|&v| v > 0)
        .map(|v| v as usize);
    let all_logits = names.contains(&"all_logits");
    let half = fp16 == Some(true);
    let shared_buffer = share_buffer.unwrap_or(same_length || half);
    if shared_buffer && names.contains(&"position_ids") {
        return Err(bad(
            "a shared past/present buffer (ONNX Runtime GenAI's past_present_share_buffer \
             layout) takes no 'position_ids': positions come from the attention mask"
                .into(),
        ));
    }
    if half && !shared_buffer {
        return Err(bad(
            "an FP16 cache is only run in place (past_present_share_buffer); a growing cache \
             must be FP32"
                .into(),
        ));
    }
    Ok((
        DecoderSpec {
            layers,
            kv_heads,
            head_dim,
            position_ids: names.contains(&"position_ids"),
            all_logits,
            // Logits of fixed length 1 are the last position's only.
            prompt_logits: all_logits || logits_shape.get(1).is_some_and(|&d| d != 1),
            shared_buffer,
            half,
            vocab,
        },
        vocab,
    ))
}

/// The most sequences one client request may start (OpenAI's `n` choices of each of its
/// prompts): the frontends refuse more.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 64;

/// The model `parameters` the generation backend reads; any other is refused at load.
const PARAMETERS: [&str; 9] = [
    "max_sequence_length",
    "kv_cache_max_tokens",
    "end_ids",
    "max_prefill_tokens",
    "default_max_tokens",
    "prefix_cache_max_tokens",
    "prefix_cache_scope",
    "intra_op_thread_count",
    "past_present_share_buffer",
];

/// Loads a generation model: its decoder session and the loop that runs it, and instances
/// that each wait for one sequence: two per row of the batch, and one request's most beyond.
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    complete_config(&mut config)?;
    if let Some(key) = config
        .parameters
        .keys()
        .find(|k| !PARAMETERS.contains(&k.as_str()))
    {
        return Err(Error::invalid(format!(
            "model '{name}': parameter '{key}' is not one the generation backend takes ({})",
            PARAMETERS.join(", ")
        )));
    }
    if config.max_batch_size <= 0 {
        return Err(Error::invalid(format!(
            "model '{name}': field 'max_batch_size' must be at least 1 for the generation \
             backend: it is how many sequences are generated together"
        )));
    }
    let path = super::model_file(&config, version_dir, super::onnx::DEFAULT_MODEL_FILENAME)?;
    let generation = generation_config(version_dir);
    let context = generation
        .get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize);
    let max_sequence_length =
        match super::parameter::<usize>(&config, "max_sequence_length", "a positive integer")? {
            Some(0) => {
                return Err(Error::invalid(format!(
                    "model '{name}': parameter 'max_sequence_length' must be at least 2"
                )))
            }
            Some(n) => {
                if let Some(ctx) = context.filter(|&c| n > c) {
                    return Err(Error::invalid(format!(
                        "model '{name}': parameter 'max_sequence_length' is {n}, past the model's \
                     context of {ctx} tokens (generation_config.json max_position_embeddings)"
                    )));
                }
                n
            }
            None => context.map_or(DEFAULT_MAX_SEQUENCE_LENGTH, |c| {
                c.min(DEFAULT_MAX_SEQUENCE_LENGTH)
            }),
        };
    let rows = config.max_batch_size as usize;
    let cache_tokens =
        super::parameter::<usize>(&config, "kv_cache_max_tokens", "a positive integer")?
            .unwrap_or(rows * max_sequence_length);
    if cache_tokens < max_sequence_length {
        return Err(Error::invalid(format!(
            "model '{name}': parameter 'kv_cache_max_tokens' is {cache_tokens}, less than one \
             sequence of max_sequence_length {max_sequence_length}"
        )));
    }
    let end_ids = match config.parameters.get("end_ids") {
        Some(p) => p
            .string_value
            .split(',')
            .map(|s| s.trim().parse::<i64>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                Error::invalid(format!(
                    "model '{name}': parameter 'end_ids' must be comma-separated token ids, got \"{}\"",
                    p.string_value
                ))
            })?,
        None => ids_of(&generation["eos_token_id"]),
    };
    let pad_id = generation["pad_token_id"]
        .as_i64()
        .or_else(|| end_ids.first().copied())
        .unwrap_or(0);
    let max_prefill_tokens =
        super::parameter::<usize>(&config, "max_prefill_tokens", "a positive integer")?
            .unwrap_or(384);
    let default_max_tokens =
        super::parameter::<usize>(&config, "default_max_tokens", "a positive integer")?
            .unwrap_or(DEFAULT_MAX_TOKENS);
    let prefix_cache_tokens =
        super::parameter::<usize>(&config, "prefix_cache_max_tokens", "a whole number")?
            .unwrap_or(2 * max_sequence_length);
    let shared_prefixes = match config
        .parameters
        .get("prefix_cache_scope")
        .map(|p| p.string_value.as_str())
    {
        None | Some("tenant") => false,
        Some("server") => true,
        Some(other) => {
            return Err(Error::invalid(format!(
                "model '{name}': parameter 'prefix_cache_scope' is \"{other}\"; it must be \
                 \"tenant\" (each tenant reuses only its own prompts) or \"server\" (every \
                 request reuses every prompt)"
            )))
        }
    };
    let tokenizer = version_dir.join("tokenizer.json");
    let text = if tokenizer.is_file() {
        Some(Arc::new(
            TokenBytes::from_tokenizer_json(&tokenizer)
                .map_err(|e| Error::invalid(format!("model '{name}': {}", e.message)))?,
        ))
    } else {
        None
    };

    let env = super::onnx::environment(options)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let intra = super::parameter::<usize>(&config, "intra_op_thread_count", "a positive integer")?
        .filter(|&n| n > 0)
        .unwrap_or(cores);
    let cannot = |e: String| {
        Error::invalid(format!(
            "model '{name}': cannot load '{}': {e}",
            path.display()
        ))
    };
    let session = Session::builder(&env)
        .map_err(|e| cannot(e.to_string()))?
        .with_intra_threads(intra)
        .map_err(|e| cannot(e.to_string()))?
        .commit_from_file(&path)
        .map_err(|e| cannot(e.to_string()))?;
    let share_buffer = match config
        .parameters
        .get("past_present_share_buffer")
        .map(|p| p.string_value.as_str())
    {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(other) => {
            return Err(Error::invalid(format!(
                "model '{name}': parameter 'past_present_share_buffer' is \"{other}\"; it must \
                 be \"true\" (one buffer bound as past and present, written in place) or \
                 \"false\" (the present grows by a column each step)"
            )))
        }
    };
    let (spec, vocab) = decoder_spec(&session, &name, share_buffer)?;
    let prompt_logits = spec.prompt_logits;
    // The file's protobuf and the weights ONNX Runtime repacked are freed by now.
    super::heap::release_freed();
    let element_bytes = if spec.half { 2 } else { 4 };
    let bytes_per_token = (spec.layers * 2 * spec.kv_heads * spec.head_dim * element_bytes) as u64;
    let stats = Arc::new(GenerationStats::new(cache_tokens as u64, bytes_per_token));
    tracing::info!(
        model = %name,
        layers = spec.layers,
        kv_heads = spec.kv_heads,
        head_dim = spec.head_dim,
        shared_buffer = spec.shared_buffer,
        sequences = rows,
        max_sequence_length,
        cache_tokens,
        cache_mib = cache_tokens as u64 * bytes_per_token / (1 << 20),
        "generation model loaded"
    );
    let engine = Arc::new(Engine::start(
        &name,
        session,
        spec,
        EngineLimits {
            max_rows: rows,
            cache_tokens,
            pad_id,
            max_prefill_tokens,
            prefix_cache_tokens,
        },
        stats.clone(),
    )?);
    let guides = text.as_ref().map(|text| {
        Arc::new(Guides::new(
            text.clone(),
            vocab.unwrap_or(text.iter().count()),
            &end_ids,
        ))
    });
    let settings = Arc::new(Settings {
        max_sequence_length,
        default_max_tokens,
        end_ids,
        vocab,
        text,
        guides,
        shared_prefixes,
        prompt_logits,
    });
    let decoupled = super::is_decoupled(&config);
    // Each instance waits for one sequence. A request must reach the engine to claim its share
    // of the rows (the engine preempts a party over its share), so there are more instances
    // than rows: a batch's worth waiting, and one request of the most sequences on top, which
    // can thus never take every instance.
    let instances = (0..rows * 2 + MAX_SEQUENCES_PER_REQUEST)
        .map(|_| {
            Box::new(GenerationInstance {
                engine: engine.clone(),
                settings: settings.clone(),
                decoupled,
            }) as Box<dyn ModelInstance>
        })
        .collect();
    Ok(LoadedBackend {
        config,
        instances,
        health: Arc::new(super::InstanceHealth::default()),
        buckets: None,
        warmup: None,
        generation: Some(stats),
    })
}

/// Waits for one sequence at a time: submits it to the engine and relays its steps.
struct GenerationInstance {
    engine: Arc<Engine>,
    settings: Arc<Settings>,
    decoupled: bool,
}

/// A `[1, n]` tensor of 4-byte values.
fn row_tensor<T: Copy>(
    name: &str,
    datatype: DataType,
    values: &[T],
    le: fn(T) -> [u8; 4],
) -> Tensor {
    Tensor {
        name: name.to_owned(),
        datatype,
        shape: vec![1, values.len() as i64],
        data: Bytes::from(values.iter().flat_map(|&v| le(v)).collect::<Vec<u8>>()),
    }
}

fn fp32_tensor(name: &str, values: &[f32]) -> Tensor {
    row_tensor(name, DataType::Fp32, values, f32::to_le_bytes)
}

/// What one response says besides its tokens.
struct Answer<'a> {
    /// Recent tokens before these, for the detokenizer.
    context: &'a [u32],
    finish: Option<Finish>,
    prompt_tokens: usize,
    generated_tokens: usize,
    /// These tokens' log-probabilities, and the sum over every token answered so far.
    log_probs: &'a [f32],
    cum_log_prob: f32,
    /// The generated tokens this response covers, their likeliest alternatives (`top_k` each)
    /// and what tokens spell, for `output_tokens`, `top_tokens` and `top_log_probs`.
    new_tokens: &'a [u32],
    top: &'a [Vec<(u32, f32)>],
    top_k: usize,
    text: Option<&'a TokenBytes>,
    /// The prompt and how likely each of its tokens was, on the response that carries them.
    prompt: Option<(&'a [i64], &'a PromptLogProbs)>,
}

impl Answer<'_> {
    fn spelling(&self, token: u32) -> &[u8] {
        self.text.map_or(&[], |t| t.of(token))
    }

    fn strings<'b>(&self, name: &str, items: impl Iterator<Item = &'b [u8]>) -> Tensor {
        let mut data = Vec::new();
        let mut n = 0;
        for item in items {
            push_bytes_element(&mut data, item);
            n += 1;
        }
        Tensor {
            name: name.to_owned(),
            datatype: DataType::Bytes,
            shape: vec![1, n],
            data: Bytes::from(data),
        }
    }

    /// Each token's alternatives padded to `top_k` (an empty token at -inf).
    fn padded_top(&self) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
        padded(self.top, self.top_k)
    }

    /// The same for the prompt's tokens, when this response carries them.
    fn padded_prompt_top(&self) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
        padded(self.prompt.map_or(&[][..], |(_, p)| &p.top), self.top_k)
    }
}

/// Alternatives per token padded to `k` (an empty token at -inf): (token, log-probability,
/// whether real).
fn padded(top: &[Vec<(u32, f32)>], k: usize) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
    top.iter().flat_map(move |alternatives| {
        (0..k).map(move |i| match alternatives.get(i) {
            Some(&(t, l)) => (t, l, true),
            None => (0, f32::NEG_INFINITY, false),
        })
    })
}

impl Answer<'_> {
    fn spelled(&self, name: &str, top: impl Iterator<Item = (u32, f32, bool)>) -> Tensor {
        let spellings: Vec<&[u8]> = top
            .map(|(t, _, real)| if real { self.spelling(t) } else { &[][..] })
            .collect();
        self.strings(name, spellings.into_iter())
    }
}

fn int32_tensor(name: &str, values: &[i32]) -> Tensor {
    row_tensor(name, DataType::Int32, values, i32::to_le_bytes)
}

/// One response's tensors, in the order asked for.
fn response(outputs: &[String], tokens: &[u32], answer: &Answer) -> Vec<Tensor> {
    let ids = |t: &[u32]| t.iter().map(|&v| v as i32).collect::<Vec<i32>>();
    outputs
        .iter()
        .filter_map(|name| {
            Some(match name.as_str() {
                "output_ids" => int32_tensor(name, &ids(tokens)),
                "context_ids" => int32_tensor(name, &ids(answer.context)),
                "prompt_tokens" => int32_tensor(name, &[answer.prompt_tokens as i32]),
                "generated_tokens" => int32_tensor(name, &[answer.generated_tokens as i32]),
                "cum_log_probs" => fp32_tensor(name, &[answer.cum_log_prob]),
                "output_tokens" => {
                    let spellings: Vec<&[u8]> = answer
                        .new_tokens
                        .iter()
                        .map(|&t| answer.spelling(t))
                        .collect();
                    answer.strings(name, spellings.into_iter())
                }
                "top_tokens" => answer.spelled(name, answer.padded_top()),
                "prompt_top_tokens" => answer.spelled(name, answer.padded_prompt_top()),
                "prompt_top_log_probs" => {
                    let values: Vec<f32> = answer.padded_prompt_top().map(|(_, l, _)| l).collect();
                    fp32_tensor(name, &values)
                }
                "prompt_log_probs" => {
                    fp32_tensor(name, answer.prompt.map_or(&[][..], |(_, p)| &p.log_probs))
                }
                "prompt_token_texts" => {
                    let ids = answer.prompt.map_or(&[][..], |(ids, _)| ids);
                    let spellings: Vec<&[u8]> =
                        ids.iter().map(|&t| answer.spelling(t as u32)).collect();
                    answer.strings(name, spellings.into_iter())
                }
                "top_log_probs" => {
                    let values: Vec<f32> = answer.padded_top().map(|(_, l, _)| l).collect();
                    fp32_tensor(name, &values)
                }
                "output_log_probs" => fp32_tensor(name, answer.log_probs),
                "finish_reason" => {
                    let mut data = Vec::new();
                    push_bytes_element(
                        &mut data,
                        answer.finish.map_or("", Finish::as_str).as_bytes(),
                    );
                    Tensor {
                        name: name.clone(),
                        datatype: DataType::Bytes,
                        shape: vec![1, 1],
                        data: Bytes::from(data),
                    }
                }
                _ => return None,
            })
        })
        .collect()
}

impl GenerationInstance {
    /// Runs one request: its sequences, decoded to the end (or until cancelled).
    fn run(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let started = Instant::now();
        let parsed = parse(request, &self.settings)?;
        let (steps_tx, steps) = mpsc::channel();
        // The sequence's own: cancelled with the request, or by this instance giving up.
        let cancel = request.cancel.child();
        let stop = match (&self.settings.text, parsed.stop.is_empty()) {
            (Some(text), false) => Some(StopStrings::new(parsed.stop, text.clone())),
            _ => None,
        };
        let prompt_tokens = parsed.prompt.len();
        // Kept only to spell a scored prompt (its scores come back without the ids).
        let prompt_ids = match parsed.prompt_log_probs {
            true => parsed.prompt.clone(),
            false => Vec::new(),
        };
        let prompt: Vec<u32> = if parsed.include_prompt && !parsed.stream {
            parsed.prompt.iter().map(|&t| t as u32).collect()
        } else {
            Vec::new()
        };
        let rules = TokenRules {
            bias: parsed.bias,
            end_ids: parsed.end_ids.clone(),
            min_tokens: parsed.min_tokens,
            banned: match &self.settings.text {
                Some(text) => BannedWords::new(parsed.bad_words, text.clone()),
                None => None,
            },
        };
        // Compiled here, on the request's thread, with its first mask: the engine only steps it.
        let guide = match (&parsed.guide, &self.settings.guides) {
            (Some((kind, text)), Some(guides)) => {
                Some(guides.compile(kind, text).map_err(|e| {
                    Error::new(
                        e.code,
                        format!("model '{}': {}", request.model_name, e.message),
                    )
                })?)
            }
            _ => None,
        };
        let namespace = match self.settings.shared_prefixes {
            true => String::new(),
            false => request
                .callers
                .first()
                .and_then(|c| c.tenant())
                .unwrap_or_default()
                .to_owned(),
        };
        // The engine shares its rows among tenants, and without tenants among client requests
        // (every sequence of one request, its `n` choices included, is one party).
        let party = match request.callers.first() {
            Some(crate::tenancy::Caller::Tenant(t)) => Party {
                key: format!("tenant {}", t.name),
                weight: t.weight(),
            },
            _ => Party {
                key: format!("request {}", request.cancel.root()),
                weight: 1.0,
            },
        };
        self.engine.submit(Submission {
            party,
            rules,
            guide,
            namespace,
            log_probs: parsed.log_probs,
            top_log_probs: parsed.top_log_probs,
            prompt_log_probs: parsed.prompt_log_probs,
            prompt: parsed.prompt,
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling,
            end_ids: parsed.end_ids,
            stop,
            steps: steps_tx,
            cancel: cancel.clone(),
            arrived: started,
            deadline: timeout_of(request)
                .map(|t| started + t)
                .into_iter()
                .chain(request.deadline)
                .min(),
        })?;
        // Cancels the sequence however this returns (an error, the client gone); once it
        // finished, cancelling it is a no-op.
        let _cancel = cancel.cancel_on_drop();
        let sink = request
            .responses
            .as_ref()
            .filter(|_| self.decoupled && parsed.stream);
        let mut generated: Vec<u32> = Vec::new();
        let mut log_probs: Vec<f32> = Vec::new();
        let mut top: Vec<Vec<(u32, f32)>> = Vec::new();
        let mut scored: Option<PromptLogProbs> = None;
        let text = self.settings.text.as_deref();
        let top_k = parsed.top_log_probs;
        let gone = || {
            request.cancel.is_cancelled()
                || request.responses.as_ref().is_some_and(|s| s.is_closed())
        };
        loop {
            // Looked at before every step, not only while waiting: a sequence whose client
            // left stops within a step, even while tokens keep coming.
            if gone() {
                return Err(Error::new(Code::Cancelled, "the client has gone away"));
            }
            let step = match steps.recv_timeout(Duration::from_millis(50)) {
                Ok(step) => step?,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::unavailable(format!(
                        "model '{}': the generation loop stopped",
                        request.model_name
                    )))
                }
            };
            let mut step = step;
            let first = step.prompt.take();
            match sink {
                Some(sink) => {
                    let context_from = generated.len().saturating_sub(CONTEXT_TOKENS);
                    log_probs.extend_from_slice(&step.log_probs);
                    let tensors = response(
                        outputs,
                        &step.tokens,
                        &Answer {
                            context: &generated[context_from..],
                            finish: step.finish,
                            prompt_tokens,
                            generated_tokens: generated.len() + step.tokens.len(),
                            log_probs: &step.log_probs,
                            cum_log_prob: log_probs.iter().fold(0.0, |a, b| a + b),
                            new_tokens: &step.tokens,
                            top: &step.top,
                            top_k,
                            text,
                            prompt: first.as_ref().map(|p| (prompt_ids.as_slice(), p)),
                        },
                    );
                    generated.extend_from_slice(&step.tokens);
                    if step.finish.is_some() {
                        return Ok((tensors, timings(started)));
                    }
                    sink.send_blocking(tensors, None)?;
                }
                None => {
                    scored = scored.or(first);
                    generated.extend_from_slice(&step.tokens);
                    log_probs.extend_from_slice(&step.log_probs);
                    top.extend(step.top);
                    if step.finish.is_some() {
                        let tokens: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
                        let tensors = response(
                            outputs,
                            &tokens,
                            &Answer {
                                context: &[],
                                finish: step.finish,
                                prompt_tokens,
                                generated_tokens: generated.len(),
                                log_probs: &log_probs,
                                cum_log_prob: log_probs.iter().fold(0.0, |a, b| a + b),
                                new_tokens: &generated,
                                top: &top,
                                top_k,
                                text,
                                prompt: scored.as_ref().map(|p| (prompt_ids.as_slice(), p)),
                            },
                        );
                        return Ok((tensors, timings(started)));
                    }
                }
            }
        }
    }
}

impl ModelInstance for GenerationInstance {
    /// Several requests run as one, merged along the batch dimension and cut back (one
    /// request runs as it is).
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        crate::runtime::batch::execute_merged(requests, outputs, |r, o| self.run(r, o))
    }
}

fn timings(started: Instant) -> ExecTimings {
    ExecTimings {
        compute_infer: started.elapsed(),
        ..Default::default()
    }
}
