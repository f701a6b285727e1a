//! A generation model's configuration: its inputs and outputs completed by the backend (the
//! names TensorRT-LLM's model takes), the decoder's signature read into a [`DecoderSpec`], and
//! the `parameters` the backend reads.

use super::speculation::NgramConfig;
use super::*;

/// Reads `generation_config.json` (Hugging Face's), if there is one.
pub(super) fn generation_config(dir: &Path) -> serde_json::Value {
    std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

pub(super) fn ids_of(value: &serde_json::Value) -> Vec<i64> {
    match value {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    }
}

/// The tensors the model takes: (name, type, dims, optional).
pub(super) const INPUTS: &[(&str, DataType, i64, bool)] = &[
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
pub(super) const OUTPUTS: &[(&str, DataType, i64)] = &[
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
pub(super) fn complete_config(config: &mut ModelConfig) -> Result<()> {
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
pub(super) fn decoder_spec(
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

/// The model `parameters` the generation backend reads; any other is refused at load.
pub(super) const PARAMETERS: [&str; 12] = [
    "max_sequence_length",
    "kv_cache_max_tokens",
    "end_ids",
    "max_prefill_tokens",
    "default_max_tokens",
    "prefix_cache_max_tokens",
    "prefix_cache_scope",
    "intra_op_thread_count",
    "past_present_share_buffer",
    "speculative_config",
    "max_loras",
    "max_lora_rank",
];

/// The backend's parameters, read and checked before anything is loaded.
pub(super) struct Parameters {
    /// The longest sequence, prompt and generated tokens together.
    pub max_sequence_length: usize,
    /// Tokens the key/value cache holds, all rows together.
    pub cache_tokens: usize,
    /// Tokens that end a sequence.
    pub end_ids: Vec<i64>,
    /// The token that pads prompts prefilled together.
    pub pad_id: i64,
    /// Most prompt tokens prefilled in one run.
    pub max_prefill_tokens: usize,
    /// Tokens generated when a request does not say.
    pub default_max_tokens: usize,
    /// Tokens the prefix cache keeps.
    pub prefix_cache_tokens: usize,
    /// Whether every request may reuse every cached prompt (`prefix_cache_scope: server`).
    pub shared_prefixes: bool,
    /// The cache layout asked for (`past_present_share_buffer`), if any.
    pub share_buffer: Option<bool>,
    /// ONNX Runtime's threads within one run.
    pub intra_threads: usize,
    /// N-gram speculative decoding (vLLM's `speculative_config`), if asked for.
    pub speculation: Option<NgramConfig>,
    /// What LoRA adapters it holds at most (vLLM's `max_loras`, `max_lora_rank`).
    pub lora_limits: super::lora::Limits,
}

/// Reads the parameters of a completed configuration, with `generation_config.json` from the
/// version's folder for what they leave out (context, end and pad tokens).
pub(super) fn read_parameters(config: &ModelConfig, version_dir: &Path) -> Result<Parameters> {
    let name = &config.name;
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
    let generation = generation_config(version_dir);
    let context = generation
        .get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize);
    let max_sequence_length = match super::super::model_config::parameter::<usize>(
        config,
        "max_sequence_length",
        "a positive integer",
    )? {
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
    let cache_tokens = super::super::model_config::parameter::<usize>(
        config,
        "kv_cache_max_tokens",
        "a positive integer",
    )?
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
    let max_prefill_tokens = super::super::model_config::parameter::<usize>(
        config,
        "max_prefill_tokens",
        "a positive integer",
    )?
    .unwrap_or(384);
    let default_max_tokens = super::super::model_config::parameter::<usize>(
        config,
        "default_max_tokens",
        "a positive integer",
    )?
    .unwrap_or(DEFAULT_MAX_TOKENS);
    let prefix_cache_tokens = super::super::model_config::parameter::<usize>(
        config,
        "prefix_cache_max_tokens",
        "a whole number",
    )?
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
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let intra_threads = super::super::model_config::parameter::<usize>(
        config,
        "intra_op_thread_count",
        "a positive integer",
    )?
    .filter(|&n| n > 0)
    .unwrap_or(cores);
    let speculation = config
        .parameters
        .get("speculative_config")
        .map(|p| NgramConfig::parse(name, &p.string_value))
        .transpose()?;
    let defaults = super::lora::Limits::default();
    let positive = |key: &str, default: usize| -> Result<usize> {
        match super::super::model_config::parameter::<usize>(config, key, "a positive integer")? {
            Some(0) => Err(Error::invalid(format!(
                "model '{name}': parameter '{key}' must be at least 1"
            ))),
            Some(n) => Ok(n),
            None => Ok(default),
        }
    };
    let lora_limits = super::lora::Limits {
        max_adapters: positive("max_loras", defaults.max_adapters)?,
        max_rank: positive("max_lora_rank", defaults.max_rank)?,
    };
    Ok(Parameters {
        max_sequence_length,
        cache_tokens,
        end_ids,
        pad_id,
        max_prefill_tokens,
        default_max_tokens,
        prefix_cache_tokens,
        shared_prefixes,
        share_buffer,
        intra_threads,
        speculation,
        lora_limits,
    })
}
