//! One adapter read from PEFT's files: its configuration checked (what changes the weights'
//! meaning and is not served is refused by name), its A and B matrices per projection
//! transposed for the decoder's inputs and B scaled by `lora_alpha / r` (rsLoRA:
//! `lora_alpha / sqrt(r)`).

use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use super::{Limits, Signature};
use crate::error::{Error, Result};

/// One adapter's weights, per projection of the signature: A `[fan_in, r]` and scaled B
/// `[r, fan_out]`, row-major.
#[derive(Debug)]
pub struct Adapter {
    /// Its name.
    pub name: String,
    /// Unique to this load: a reloaded adapter of the same name shares no cached prefix or
    /// stack with the one it replaced.
    pub id: u64,
    /// Columns it takes in a stack: its largest rank.
    pub rank: usize,
    pub(super) weights: Vec<Option<Weights>>,
}

#[derive(Debug)]
pub(super) struct Weights {
    pub(super) rank: usize,
    pub(super) a: Vec<f32>,
    pub(super) b: Vec<f32>,
}

/// The fields of `adapter_config.json` read; any field that changes what the weights mean and
/// is not supported is refused by name.
#[derive(Debug, serde::Deserialize)]
struct PeftConfig {
    peft_type: Option<String>,
    r: Option<f64>,
    lora_alpha: Option<f64>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    bias: Option<String>,
    modules_to_save: Option<serde_json::Value>,
    alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    use_qalora: bool,
    layer_replication: Option<serde_json::Value>,
}

pub(super) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Adapter {
    /// Reads a PEFT LoRA adapter for the decoder `signature`: `config` is
    /// `adapter_config.json`, `tensors` `adapter_model.safetensors`.
    pub fn from_peft(
        name: &str,
        config: &[u8],
        tensors: &[u8],
        signature: &Signature,
        limits: &Limits,
    ) -> Result<Self> {
        let refuse = |what: String| Error::invalid(format!("adapter '{name}': {what}"));
        let config: PeftConfig = serde_json::from_slice(config)
            .map_err(|e| refuse(format!("adapter_config.json is not valid: {e}")))?;
        if let Some(kind) = config.peft_type.as_deref().filter(|k| *k != "LORA") {
            return Err(refuse(format!(
                "adapter_config.json's peft_type is '{kind}'; only LORA adapters are served"
            )));
        }
        if config.use_dora {
            return Err(refuse(
                "adapter_config.json's use_dora is true; DoRA adapters are not served".into(),
            ));
        }
        for (field, set) in [
            ("lora_bias", config.lora_bias),
            ("use_qalora", config.use_qalora),
            (
                "layer_replication",
                config
                    .layer_replication
                    .as_ref()
                    .is_some_and(|v| !v.is_null()),
            ),
        ] {
            if set {
                return Err(refuse(format!(
                    "adapter_config.json's {field} is set; only plain LoRA weights are served"
                )));
            }
        }
        if config.fan_in_fan_out {
            return Err(refuse(
                "adapter_config.json's fan_in_fan_out is true (GPT-2's Conv1D layout); the \
                 decoder's projections are Linear"
                    .into(),
            ));
        }
        if let Some(bias) = config.bias.as_deref().filter(|b| *b != "none") {
            return Err(refuse(format!(
                "adapter_config.json's bias is '{bias}'; only adapters without trained biases \
                 (bias 'none') are served"
            )));
        }
        if config
            .modules_to_save
            .as_ref()
            .is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(refuse(
                "adapter_config.json's modules_to_save replaces whole modules; only low-rank \
                 weights are served"
                    .into(),
            ));
        }
        if config.alpha_pattern.as_ref().is_some_and(|p| !p.is_empty()) {
            return Err(refuse(
                "adapter_config.json's alpha_pattern (per-module alphas) is not supported".into(),
            ));
        }
        let alpha = config
            .lora_alpha
            .or(config.r)
            .ok_or_else(|| refuse("adapter_config.json has no 'lora_alpha'".into()))?;
        let file = SafeTensors::deserialize(tensors)
            .map_err(|e| refuse(format!("adapter_model.safetensors is not valid: {e}")))?;
        let mut a_parts: Vec<Option<Vec<f32>>> = vec![None; signature.projections.len()];
        let mut b_parts: Vec<Option<Vec<f32>>> = vec![None; signature.projections.len()];
        let mut ranks: Vec<usize> = vec![0; signature.projections.len()];
        for (key, view) in file.tensors() {
            let (layer, module, which) = lora_key(&key).ok_or_else(|| {
                refuse(format!(
                    "tensor '{key}' is not a LoRA weight of a decoder layer's projection \
                     (layers.{{i}}.self_attn|mlp.{{module}}.lora_A|lora_B.weight)"
                ))
            })?;
            let index = signature.index(layer, module).ok_or_else(|| {
                refuse(format!(
                    "tensor '{key}' adapts layer {layer}'s {module}, which the decoder takes no \
                     adapters on (it takes them on {} of its layers; scripts/llm_export.py \
                     --lora exports others)",
                    signature.modules().join(", ")
                ))
            })?;
            let projection = &signature.projections[index];
            let shape = view.shape();
            let values = floats(view.dtype(), view.data())
                .ok_or_else(|| refuse(format!("tensor '{key}' has type {:?}", view.dtype())))?;
            let (rank, wide) =
                match (which, shape) {
                    ('A', &[r, n]) if n == projection.fan_in => (r, values),
                    ('B', &[n, r]) if n == projection.fan_out => (r, values),
                    _ => {
                        return Err(refuse(format!(
                        "tensor '{key}' has shape {shape:?}; layer {layer}'s {module} is {} in, \
                         {} out (lora_A [r, {}], lora_B [{}, r])",
                        projection.fan_in, projection.fan_out, projection.fan_in, projection.fan_out
                    )))
                    }
                };
            if rank == 0 || rank > limits.max_rank {
                return Err(refuse(format!(
                    "tensor '{key}' has rank {rank}; the model takes ranks 1 to {} \
                     (parameter max_lora_rank)",
                    limits.max_rank
                )));
            }
            if ranks[index] != 0 && ranks[index] != rank {
                return Err(refuse(format!(
                    "layer {layer}'s {module} has lora_A and lora_B of different ranks"
                )));
            }
            ranks[index] = rank;
            let slot = if which == 'A' {
                &mut a_parts[index]
            } else {
                &mut b_parts[index]
            };
            *slot = Some(wide);
        }
        let mut weights = Vec::with_capacity(signature.projections.len());
        for (index, projection) in signature.projections.iter().enumerate() {
            let rank = ranks[index];
            match (a_parts[index].take(), b_parts[index].take()) {
                (None, None) => weights.push(None),
                (Some(a), Some(b)) => {
                    let scale = if config.use_rslora {
                        alpha / (rank as f64).sqrt()
                    } else {
                        alpha / rank as f64
                    } as f32;
                    // A arrives [r, fan_in]: stored [fan_in, r]. B arrives [fan_out, r]:
                    // stored [r, fan_out], scaled.
                    let (n_in, n_out) = (projection.fan_in, projection.fan_out);
                    let mut at = vec![0f32; n_in * rank];
                    for k in 0..rank {
                        for i in 0..n_in {
                            at[i * rank + k] = a[k * n_in + i];
                        }
                    }
                    let mut bt = vec![0f32; rank * n_out];
                    for o in 0..n_out {
                        for k in 0..rank {
                            bt[k * n_out + o] = b[o * rank + k] * scale;
                        }
                    }
                    weights.push(Some(Weights { rank, a: at, b: bt }));
                }
                _ => {
                    return Err(refuse(format!(
                        "layer {}'s {} has lora_A or lora_B but not both",
                        projection.layer, projection.module
                    )))
                }
            }
        }
        let rank = weights.iter().flatten().map(|w| w.rank).max().unwrap_or(0);
        if rank == 0 {
            return Err(refuse(
                "adapter_model.safetensors holds no LoRA weights".into(),
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            id: next_id(),
            rank,
            weights,
        })
    }
}

/// (layer, module, 'A' or 'B') of a PEFT key such as
/// `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (the adapter's own name
/// may come before `weight`, as older PEFT versions save it).
pub(super) fn lora_key(key: &str) -> Option<(usize, &str, char)> {
    let rest = &key[key.find("layers.")? + "layers.".len()..];
    let mut parts = rest.split('.');
    let layer = parts.next()?.parse().ok()?;
    let block = parts.next()?;
    if block != "self_attn" && block != "mlp" {
        return None;
    }
    let module = parts.next()?;
    let which = match parts.next()? {
        "lora_A" => 'A',
        "lora_B" => 'B',
        _ => return None,
    };
    let tail: Vec<&str> = parts.collect();
    match tail.as_slice() {
        ["weight"] | [_, "weight"] => Some((layer, module, which)),
        _ => None,
    }
}

/// A tensor's values as FP32 (FP32, FP16 or BF16).
fn floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    let pairs = || {
        data.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    Some(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => pairs().map(|b| f16::from_bits(b).to_f32()).collect(),
        Dtype::BF16 => pairs().map(|b| bf16::from_bits(b).to_f32()).collect(),
        _ => return None,
    })
}
