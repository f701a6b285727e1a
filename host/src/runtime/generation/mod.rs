//! The generation backend (`backend: "generation"`): text generation with a decoder exported
//! in Hugging Face Optimum's layout (`input_ids`, `attention_mask`, `position_ids`,
//! `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`), run by ONNX Runtime
//! with in-flight batching ([`engine`]) and sampled on the host ([`sampling`]).
//!
//! The model takes token ids and answers token ids, like TensorRT-LLM's `tensorrt_llm` model:
//! tokenizer and detokenizer are separate models (Wasm stages) that an ensemble chains with
//! it. Decoupled (`model_transaction_policy { decoupled: true }`), it answers once per step as
//! tokens come (or once at the end when `stream` is false); otherwise once at the end.
//! `max_batch_size` is the number of sequences generated together; the key/value cache budget
//! is `kv_cache_max_tokens` (default `max_batch_size x max_sequence_length`).

pub mod engine;
pub mod kv_cache;
pub mod sampling;
pub mod stats;
pub mod stop;

use std::{
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use ort::{session::Session, value::ValueType};

use self::{
    engine::{DecoderSpec, Engine, EngineLimits, Finish, Submission},
    sampling::SamplingParams,
    stats::GenerationStats,
    stop::{StopStrings, TokenBytes},
};
use super::{ExecTimings, LoadedBackend, ModelInstance, RuntimeOptions};
use crate::{
    error::{Code, Error, Result},
    inference::{InferRequest, ParamValue},
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::{bytes_elements, push_bytes_element, DataType, Tensor},
};

/// The `backend` name that selects this backend.
pub const BACKEND: &str = "generation";

/// How many generated tokens before a response's own each response carries (`context_ids`),
/// enough for a detokenizer to finish a character that began in an earlier response.
pub const CONTEXT_TOKENS: usize = 8;

const DEFAULT_MAX_SEQUENCE_LENGTH: usize = 2048;
const DEFAULT_MAX_TOKENS: usize = 128;

/// The model's settings from config.pbtxt parameters and `generation_config.json`.
#[derive(Debug, Clone)]
struct Settings {
    max_sequence_length: usize,
    default_max_tokens: usize,
    end_ids: Vec<i64>,
    vocab: Option<usize>,
    /// Token texts for stop strings, when the model has a `tokenizer.json`.
    text: Option<Arc<TokenBytes>>,
}

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
];

/// The tensors it answers: (name, type, dims).
const OUTPUTS: &[(&str, DataType, i64)] = &[
    ("output_ids", DataType::Int32, -1),
    ("context_ids", DataType::Int32, -1),
    ("finish_reason", DataType::Bytes, 1),
    ("prompt_tokens", DataType::Int32, 1),
    ("generated_tokens", DataType::Int32, 1),
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
fn decoder_spec(session: &Session, model: &str) -> Result<(DecoderSpec, Option<usize>)> {
    let bad = |what: String| {
        Error::invalid(format!(
            "model '{model}': the decoder does not have the layout the generation backend runs \
             (Optimum's text-generation-with-past export): {what}"
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
    for i in 0..layers {
        for kind in ["key", "value"] {
            let name = format!("past_key_values.{i}.{kind}");
            let outlet = inputs
                .iter()
                .find(|o| o.name() == name)
                .ok_or_else(|| bad(format!("no input '{name}'")))?;
            let ValueType::Tensor { ty, shape, .. } = outlet.dtype() else {
                return Err(bad(format!("input '{name}' is not a tensor")));
            };
            if *ty != ort::value::TensorElementType::Float32 || shape.len() != 4 {
                return Err(bad(format!(
                    "input '{name}' must be FP32 [batch, kv_heads, past, head_dim]"
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
    let vocab = session
        .outputs()
        .iter()
        .find(|o| o.name() == "logits")
        .ok_or_else(|| bad("no output 'logits'".into()))
        .map(|o| match o.dtype() {
            ValueType::Tensor { shape, .. } => shape.last().copied().filter(|&v| v > 0),
            _ => None,
        })?
        .map(|v| v as usize);
    Ok((
        DecoderSpec {
            layers,
            kv_heads,
            head_dim,
            position_ids: names.contains(&"position_ids"),
        },
        vocab,
    ))
}

/// Loads a generation model: its decoder session and the loop that runs it, and one instance
/// per sequence of the batch (each waits for its own sequence).
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    complete_config(&mut config)?;
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
    let (spec, vocab) = decoder_spec(&session, &name)?;
    let bytes_per_token = (spec.layers * 2 * spec.kv_heads * spec.head_dim * 4) as u64;
    let stats = Arc::new(GenerationStats::new(cache_tokens as u64, bytes_per_token));
    tracing::info!(
        model = %name,
        layers = spec.layers,
        kv_heads = spec.kv_heads,
        head_dim = spec.head_dim,
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
        },
        stats.clone(),
    )?);
    let settings = Arc::new(Settings {
        max_sequence_length,
        default_max_tokens,
        end_ids,
        vocab,
        text,
    });
    let decoupled = super::is_decoupled(&config);
    let instances = (0..rows)
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

/// A request's generation parameters, checked.
struct Parsed {
    prompt: Vec<i64>,
    max_tokens: usize,
    sampling: SamplingParams,
    end_ids: Vec<i64>,
    stop: Vec<String>,
    stream: bool,
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

/// Checks `value` of `name` against [lo, hi].
fn within(model: &str, name: &str, value: f64, lo: f64, hi: f64) -> Result<f64> {
    if value.is_finite() && value >= lo && value <= hi {
        Ok(value)
    } else {
        Err(invalid(
            model,
            format!("'{name}' is {value}, outside [{lo}, {hi}]"),
        ))
    }
}

fn parse(request: &InferRequest, settings: &Settings) -> Result<Parsed> {
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
        ));
    }
    if let Some(vocab) = settings.vocab {
        if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            return Err(invalid(
                model,
                format!("input 'input_ids' holds token {bad}, outside the vocabulary [0, {vocab})"),
            ));
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
        ));
    }
    let room = limit - prompt.len();
    let max_tokens = match scalar(request, "max_tokens")? {
        None => settings.default_max_tokens.min(room),
        Some(v) => {
            let v = within(model, "max_tokens", v, 1.0, f64::from(u32::MAX))? as usize;
            if v > room {
                return Err(invalid(
                    model,
                    format!(
                        "'max_tokens' is {v}, but the prompt's {} tokens leave room for {room} \
                         in the context of {limit} tokens (max_sequence_length)",
                        prompt.len()
                    ),
                ));
            }
            v
        }
    };
    let get = |name: &str, lo: f64, hi: f64| -> Result<Option<f64>> {
        scalar(request, name)?
            .map(|v| within(model, name, v, lo, hi))
            .transpose()
    };
    let sampling = SamplingParams {
        temperature: get("temperature", 0.0, 100.0)?.unwrap_or(0.0) as f32,
        top_k: get("top_k", 0.0, f64::from(u32::MAX))?.unwrap_or(0.0) as usize,
        top_p: get("top_p", f64::MIN_POSITIVE, 1.0)?.unwrap_or(1.0) as f32,
        seed: scalar(request, "seed")?
            .map(|v| within(model, "seed", v, 0.0, u64::MAX as f64).map(|v| v as u64))
            .transpose()?,
        repetition_penalty: get("repetition_penalty", f64::MIN_POSITIVE, 100.0)?.unwrap_or(1.0)
            as f32,
        frequency_penalty: get("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        presence_penalty: get("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
    };
    let end_ids = match get("end_id", -1.0, f64::from(i32::MAX))? {
        Some(v) if v >= 0.0 => vec![v as i64],
        // -1 turns end tokens off (generate exactly max_tokens), as TensorRT-LLM's end_id does.
        Some(_) => Vec::new(),
        None => settings.end_ids.clone(),
    };
    let mut stop = Vec::new();
    if let Some(t) = request.inputs.iter().find(|t| t.name == "stop") {
        for s in bytes_elements(&t.data) {
            stop.push(String::from_utf8(s.to_vec()).map_err(|_| {
                invalid(
                    model,
                    "input 'stop' holds a string that is not UTF-8".into(),
                )
            })?);
        }
    } else if let Some(ParamValue::String(s)) = request.parameters.get("stop") {
        stop.push(s.clone());
    }
    stop.retain(|s| !s.is_empty());
    if !stop.is_empty() && settings.text.is_none() {
        return Err(invalid(
            model,
            "'stop' needs the model's tokenizer.json beside model.onnx to read the text".into(),
        ));
    }
    let stream = scalar(request, "stream")?.is_none_or(|v| v != 0.0);
    Ok(Parsed {
        prompt,
        max_tokens,
        sampling,
        end_ids,
        stop,
        stream,
    })
}

fn int32_tensor(name: &str, values: &[i32]) -> Tensor {
    Tensor {
        name: name.to_owned(),
        datatype: DataType::Int32,
        shape: vec![1, values.len() as i64],
        data: Bytes::from(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
    }
}

/// One response's tensors, in the order asked for.
fn response(
    outputs: &[String],
    tokens: &[u32],
    context: &[u32],
    finish: Option<Finish>,
    prompt_tokens: usize,
    generated_tokens: usize,
) -> Vec<Tensor> {
    let ids = |t: &[u32]| t.iter().map(|&v| v as i32).collect::<Vec<i32>>();
    outputs
        .iter()
        .filter_map(|name| {
            Some(match name.as_str() {
                "output_ids" => int32_tensor(name, &ids(tokens)),
                "context_ids" => int32_tensor(name, &ids(context)),
                "prompt_tokens" => int32_tensor(name, &[prompt_tokens as i32]),
                "generated_tokens" => int32_tensor(name, &[generated_tokens as i32]),
                "finish_reason" => {
                    let mut data = Vec::new();
                    push_bytes_element(&mut data, finish.map_or("", Finish::as_str).as_bytes());
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

impl ModelInstance for GenerationInstance {
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let started = Instant::now();
        let parsed = parse(request, &self.settings)?;
        let (steps_tx, steps) = mpsc::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let stop = match (&self.settings.text, parsed.stop.is_empty()) {
            (Some(text), false) => Some(StopStrings::new(parsed.stop, text.clone())),
            _ => None,
        };
        let prompt_tokens = parsed.prompt.len();
        self.engine.submit(Submission {
            prompt: parsed.prompt,
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling,
            end_ids: parsed.end_ids,
            stop,
            steps: steps_tx,
            cancelled: cancelled.clone(),
            arrived: started,
            deadline: timeout_of(request)
                .map(|t| started + t)
                .into_iter()
                .chain(request.deadline)
                .min(),
        })?;
        // Cancels the sequence however this returns (an error, the client gone).
        struct CancelOnDrop(Arc<AtomicBool>);
        impl Drop for CancelOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Relaxed);
            }
        }
        let _cancel = CancelOnDrop(cancelled);
        let sink = request
            .responses
            .as_ref()
            .filter(|_| self.decoupled && parsed.stream);
        let mut generated: Vec<u32> = Vec::new();
        loop {
            let step = match steps.recv_timeout(Duration::from_millis(50)) {
                Ok(step) => step?,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if request.responses.as_ref().is_some_and(|s| s.is_closed()) {
                        return Err(Error::new(Code::Cancelled, "the client has gone away"));
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::unavailable(format!(
                        "model '{}': the generation loop stopped",
                        request.model_name
                    )))
                }
            };
            match sink {
                Some(sink) => {
                    let context_from = generated.len().saturating_sub(CONTEXT_TOKENS);
                    let tensors = response(
                        outputs,
                        &step.tokens,
                        &generated[context_from..],
                        step.finish,
                        prompt_tokens,
                        generated.len() + step.tokens.len(),
                    );
                    generated.extend_from_slice(&step.tokens);
                    if step.finish.is_some() {
                        return Ok((tensors, timings(started)));
                    }
                    sink.send_blocking(tensors, None)?;
                }
                None => {
                    generated.extend_from_slice(&step.tokens);
                    if step.finish.is_some() {
                        let tensors = response(
                            outputs,
                            &generated,
                            &[],
                            step.finish,
                            prompt_tokens,
                            generated.len(),
                        );
                        return Ok((tensors, timings(started)));
                    }
                }
            }
        }
    }
}

/// The request's `timeout` parameter (microseconds), as queue policies read it.
fn timeout_of(request: &InferRequest) -> Option<Duration> {
    request
        .parameters
        .get("timeout")?
        .as_u64()
        .filter(|&us| us > 0)
        .map(Duration::from_micros)
}

fn timings(started: Instant) -> ExecTimings {
    ExecTimings {
        compute_infer: started.elapsed(),
        ..Default::default()
    }
}
