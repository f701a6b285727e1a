//! The generation backend (`backend: "generation"`): text generation with a decoder
//! (`input_ids`, `attention_mask`, `past_key_values.{i}.key|value` → `logits`,
//! `present.{i}.key|value`) in ONNX Runtime GenAI's shared-buffer layout (the cache
//! preallocated and written in place, [`kv::buffer`]) or Hugging Face Optimum's growing one
//! (with `position_ids`; [`kv`] runs both), with in-flight batching ([`engine`]) and
//! sampling on the host ([`sampling`]).
//!
//! The model takes token ids and answers token ids, like TensorRT-LLM's `tensorrt_llm` model:
//! tokenizer and detokenizer are separate models (Wasm stages) that an ensemble chains with
//! it. Decoupled (`model_transaction_policy { decoupled: true }`), it answers once per step as
//! tokens come (or once at the end when `stream` is false); otherwise once at the end.
//! `max_batch_size` is the number of sequences generated together; the key/value cache budget
//! is `kv_cache_max_tokens` (default `max_batch_size x max_sequence_length`).

mod config;
pub mod engine;
pub mod guided;
mod instance;
pub mod kv;
pub mod lora;
mod metrics;
mod request;
mod response;
pub mod sampling;
pub mod speculation;
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

use self::{config::*, instance::*, response::*};
use self::{
    engine::{DecoderSpec, Engine, EngineLimits, Finish, Party, Submission},
    guided::Guides,
    request::{parse, timeout_of, Settings},
    sampling::PromptLogProbs,
    stats::GenerationStats,
    stop::{StopStrings, TokenBytes},
    token_rules::{BannedWords, TokenRules},
};
use super::{
    backend::{ExecTimings, LoadedBackend, ModelInstance},
    onnx::OnnxSettings,
};
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

/// The generation backend's settings.
#[derive(Debug, Clone, Default)]
pub struct GenerationSettings {
    /// Generation models tell their prefix cache's changes as vLLM's KV-cache events here
    /// (`--kv-events-config`).
    pub kv_events: Option<kv::events::KvEvents>,
}

const DEFAULT_MAX_SEQUENCE_LENGTH: usize = 2048;
const DEFAULT_MAX_TOKENS: usize = 128;

/// The request parameter that names a LoRA adapter to generate with.
pub use crate::inference::ADAPTER_PARAMETER as LORA_PARAMETER;
use crate::limits::MAX_SEQUENCES_PER_REQUEST;

/// The decoder's ONNX Runtime session.
fn open_decoder(
    name: &str,
    path: &Path,
    onnx: &OnnxSettings,
    intra_threads: usize,
) -> Result<Session> {
    let env = super::onnx::environment(onnx)?;
    let cannot = |e: String| {
        Error::invalid(format!(
            "model '{name}': cannot load '{}': {e}",
            path.display()
        ))
    };
    Session::builder(&env)
        .map_err(|e| cannot(e.to_string()))?
        .with_intra_threads(intra_threads)
        .map_err(|e| cannot(e.to_string()))?
        .commit_from_file(path)
        .map_err(|e| cannot(e.to_string()))
}

/// Loads a generation model: its decoder session and the loop that runs it, and instances
/// that each wait for one sequence: two per row of the batch, and one request's most beyond.
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    onnx: &OnnxSettings,
    settings: &GenerationSettings,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    complete_config(&mut config)?;
    let Parameters {
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
    } = read_parameters(&config, version_dir)?;
    let rows = config.max_batch_size as usize;
    let path =
        super::model_config::model_file(&config, version_dir, super::onnx::DEFAULT_MODEL_FILENAME)?;
    let tokenizer = version_dir.join("tokenizer.json");
    let text = if tokenizer.is_file() {
        Some(Arc::new(
            TokenBytes::from_tokenizer_json(&tokenizer)
                .map_err(|e| Error::invalid(format!("model '{name}': {}", e.message)))?,
        ))
    } else {
        None
    };

    let session = open_decoder(&name, &path, onnx, intra_threads)?;
    let (spec, vocab) = decoder_spec(&session, &name, share_buffer)?;
    let prompt_logits = spec.prompt_logits;
    if speculation.is_some() && !spec.shared_buffer {
        return Err(Error::invalid(format!(
            "model '{name}': parameter 'speculative_config' needs a decoder in the shared-buffer \
             layout (GroupQueryAttention over a cache bound as past and present, as \
             scripts/llm_export.py --shared-cache writes): a growing cache cannot run a draft \
             after its past"
        )));
    }
    let lora = lora::Signature::of(&session, &name)?;
    if lora.is_some() && !spec.shared_buffer {
        return Err(Error::invalid(format!(
            "model '{name}': the decoder takes LoRA adapters (input 'lora_mask') but not in the \
             shared-buffer layout, the only one the generation backend runs adapters in"
        )));
    }
    let adapters = lora
        .clone()
        .map(|signature| Arc::new(lora::Adapters::new(&name, signature, lora_limits)));
    // The adapters the repository keeps beside the model are served with it.
    let kept = version_dir
        .parent()
        .map(|dir| dir.join(lora::ADAPTERS_FOLDER))
        .filter(|dir| dir.is_dir());
    match (&adapters, kept) {
        (Some(adapters), Some(dir)) => {
            adapters.load_folder(&dir)?;
        }
        (None, Some(dir)) => {
            return Err(Error::invalid(format!(
                "model '{name}': {} holds LoRA adapters, but the decoder takes none (it was \
                 exported without adapter inputs: scripts/llm_export.py --lora)",
                dir.display()
            )))
        }
        _ => {}
    }
    // The file's protobuf and the weights ONNX Runtime repacked are freed by now.
    super::heap::release_freed();
    let element_bytes = if spec.half { 2 } else { 4 };
    let bytes_per_token = (spec.layers * 2 * spec.kv_heads * spec.head_dim * element_bytes) as u64;
    let mut stats = GenerationStats::new(
        cache_tokens as u64,
        bytes_per_token,
        prefix_cache_tokens > 0,
    );
    if adapters.is_some() {
        stats = stats.with_lora(lora_limits.max_adapters);
    }
    let stats = Arc::new(stats);
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
            kv_events: settings.kv_events.clone(),
            speculation,
            lora,
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
        adapters: adapters.clone(),
    });
    let decoupled = super::model_config::is_decoupled(&config);
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
    let mut loaded = LoadedBackend::new(config, instances);
    loaded.capabilities = super::capabilities::Capabilities {
        metrics: Some(stats.clone()),
        prefix_cache: Some(stats),
        adapters: adapters.map(|a| a as Arc<dyn super::capabilities::AdapterStore>),
        batches_alone: true,
    };
    Ok(loaded)
}
