//! LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), several
//! in one batch, on a decoder exported to take them (`scripts/llm_export.py --lora`).
//!
//! Such a decoder adds `((x A) * mask) B` to each adapted projection: per layer `i` and
//! projection `p` (PEFT's module names, `q_proj`, `v_proj`, ...) the inputs
//! `lora.{i}.{p}.a` `[fan_in, columns]` and `lora.{i}.{p}.b` `[columns, fan_out]` hold the
//! adapters of the batch side by side (an adapter of rank `r` takes `r` columns, its B scaled
//! by `lora_alpha / r`), and `lora_mask` `[rows, 1, columns]` gives each row its adapter's
//! columns (a row without adapter: none). A [`Stack`] is those inputs for one set of adapters;
//! the engine builds one when the set of adapters its rows use changes.
//!
//! Adapters are loaded and unloaded while the model serves ([`Adapters`]); a sequence keeps
//! its adapter until it ends, even when the adapter is unloaded meanwhile.

mod peft;
mod stack;

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, RwLock},
};

use ort::{session::Session, value::ValueType};

pub use self::{
    peft::Adapter,
    stack::{LoraRun, Stack, Stacks},
};
use crate::{
    error::{Error, Result},
    names::AdapterName,
};

/// The input that gives each row its adapter's columns.
pub const MASK_INPUT: &str = "lora_mask";

/// Where a model keeps its adapters in the repository: `<model>/adapters/<name>/`, each with
/// PEFT's two files; they are loaded with the model.
pub const ADAPTERS_FOLDER: &str = "adapters";
/// PEFT's adapter configuration.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's adapter weights.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The largest rank an adapter may have by default (vLLM's `max_lora_rank` default is 16;
/// PEFT adapters of 64 are common).
pub const DEFAULT_MAX_RANK: usize = 64;
/// Adapters loaded at once by default (vLLM's `max_loras`-like bound on what a model holds).
pub const DEFAULT_MAX_ADAPTERS: usize = 16;
/// One projection a decoder takes adapters on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    /// Its layer.
    pub layer: usize,
    /// PEFT's module name (`q_proj`, ...).
    pub module: String,
    /// Its input width.
    pub fan_in: usize,
    /// Its output width.
    pub fan_out: usize,
}

impl Projection {
    pub(super) fn input_a(&self) -> String {
        format!("lora.{}.{}.a", self.layer, self.module)
    }

    pub(super) fn input_b(&self) -> String {
        format!("lora.{}.{}.b", self.layer, self.module)
    }
}

/// The projections a decoder takes adapters on, read from its inputs.
#[derive(Debug, Clone, Default)]
pub struct Signature {
    /// In input order.
    pub projections: Vec<Projection>,
}

impl Signature {
    /// The decoder's adapter inputs, or `None` when it takes no adapters (no `lora_mask`).
    pub fn of(session: &Session, model: &str) -> Result<Option<Self>> {
        let inputs = session.inputs();
        if !inputs.iter().any(|i| i.name() == MASK_INPUT) {
            return Ok(None);
        }
        let bad = |what: String| {
            Error::invalid(format!(
                "model '{model}': the decoder's adapter inputs are not the layout \
                 scripts/llm_export.py --lora writes: {what}"
            ))
        };
        let dims = |name: &str| -> Option<Vec<i64>> {
            inputs
                .iter()
                .find(|i| i.name() == name)
                .and_then(|i| match i.dtype() {
                    ValueType::Tensor { shape, .. } => Some(shape.iter().copied().collect()),
                    _ => None,
                })
        };
        let mut projections = Vec::new();
        for input in inputs.iter() {
            let Some(rest) = input.name().strip_prefix("lora.") else {
                continue;
            };
            let Some(head) = rest.strip_suffix(".a") else {
                continue;
            };
            let Some((layer, module)) = head.split_once('.') else {
                return Err(bad(format!("input '{}'", input.name())));
            };
            let layer = layer
                .parse::<usize>()
                .map_err(|_| bad(format!("input '{}' names no layer", input.name())))?;
            let a = dims(input.name()).unwrap_or_default();
            let b = dims(&format!("lora.{layer}.{module}.b"))
                .ok_or_else(|| bad(format!("no input 'lora.{layer}.{module}.b'")))?;
            let (Some(&fan_in), Some(&fan_out)) = (a.first(), b.get(1)) else {
                return Err(bad(format!("inputs of layer {layer}'s {module}")));
            };
            if fan_in <= 0 || fan_out <= 0 {
                return Err(bad(format!(
                    "layer {layer}'s {module} has no fixed width ({a:?}, {b:?})"
                )));
            }
            projections.push(Projection {
                layer,
                module: module.to_owned(),
                fan_in: fan_in as usize,
                fan_out: fan_out as usize,
            });
        }
        if projections.is_empty() {
            return Err(bad("'lora_mask' but no 'lora.{i}.{p}.a' inputs".into()));
        }
        Ok(Some(Self { projections }))
    }

    /// The module names it adapts, sorted.
    pub fn modules(&self) -> Vec<&str> {
        let mut m: Vec<&str> = self.projections.iter().map(|p| p.module.as_str()).collect();
        m.sort_unstable();
        m.dedup();
        m
    }

    pub(super) fn index(&self, layer: usize, module: &str) -> Option<usize> {
        self.projections
            .iter()
            .position(|p| p.layer == layer && p.module == module)
    }
}

/// Limits on the adapters a model holds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest rank (`max_lora_rank`).
    pub max_rank: usize,
    /// Adapters loaded at once (`max_loras`).
    pub max_adapters: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_rank: DEFAULT_MAX_RANK,
            max_adapters: DEFAULT_MAX_ADAPTERS,
        }
    }
}
/// The adapters a model holds, by name.
#[derive(Debug)]
pub struct Adapters {
    model: String,
    signature: Signature,
    limits: Limits,
    loaded: RwLock<BTreeMap<String, Arc<Adapter>>>,
}

impl Adapters {
    /// None loaded yet.
    pub fn new(model: &str, signature: Signature, limits: Limits) -> Self {
        Self {
            model: model.to_owned(),
            signature,
            limits,
            loaded: RwLock::new(BTreeMap::new()),
        }
    }

    /// The decoder's adapter inputs.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    /// Loads (or replaces) adapter `name` from PEFT's two files.
    pub fn load(&self, name: &str, config: &[u8], tensors: &[u8]) -> Result<()> {
        let adapter = Adapter::from_peft(name, config, tensors, &self.signature, &self.limits)
            .map_err(|e| e.within(format_args!("model '{}'", self.model)))?;
        let mut loaded = self.loaded.write().unwrap_or_else(|p| p.into_inner());
        if !loaded.contains_key(name) && loaded.len() >= self.limits.max_adapters {
            return Err(Error::unavailable(format!(
                "model '{}': {} adapters are loaded, the most it holds (parameter max_loras); \
                 unload one first",
                self.model,
                loaded.len()
            )));
        }
        tracing::info!(model = %self.model, adapter = name, rank = adapter.rank, "adapter loaded");
        loaded.insert(name.to_owned(), Arc::new(adapter));
        Ok(())
    }

    /// Loads the adapters kept in `folder` (`<name>/adapter_config.json` and
    /// `<name>/adapter_model.safetensors`), in name order; answers their names.
    pub fn load_folder(&self, folder: &Path) -> Result<Vec<String>> {
        let Ok(entries) = std::fs::read_dir(folder) else {
            return Ok(Vec::new());
        };
        let mut names: Vec<String> = entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for name in &names {
            AdapterName::parse(name).map_err(|e| {
                e.within(format_args!("model '{}': {}", self.model, folder.display()))
            })?;
            let dir = folder.join(name);
            let (config, weights) =
                read_files(&dir).map_err(|e| e.within(format_args!("model '{}'", self.model)))?;
            self.load(name, &config, &weights)?;
        }
        Ok(names)
    }

    /// Unloads adapter `name`; sequences running with it finish with it.
    pub fn unload(&self, name: &str) -> Result<()> {
        let mut loaded = self.loaded.write().unwrap_or_else(|p| p.into_inner());
        loaded
            .remove(name)
            .map(|_| tracing::info!(model = %self.model, adapter = name, "adapter unloaded"))
            .ok_or_else(|| self.unknown(name, &loaded))
    }

    /// Adapter `name`, or an error that says which are loaded.
    pub fn get(&self, name: &str) -> Result<Arc<Adapter>> {
        let loaded = self.loaded.read().unwrap_or_else(|p| p.into_inner());
        loaded
            .get(name)
            .cloned()
            .ok_or_else(|| self.unknown(name, &loaded))
    }

    /// The loaded adapters' names, sorted.
    pub fn names(&self) -> Vec<String> {
        let loaded = self.loaded.read().unwrap_or_else(|p| p.into_inner());
        loaded.keys().cloned().collect()
    }

    fn unknown(&self, name: &str, loaded: &BTreeMap<String, Arc<Adapter>>) -> Error {
        let names: Vec<&str> = loaded.keys().map(String::as_str).collect();
        Error::not_found(format!(
            "model '{}': no adapter '{name}' is loaded (loaded: {})",
            self.model,
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        ))
    }
}

impl crate::runtime::capabilities::AdapterStore for Adapters {
    fn folder(&self) -> &'static str {
        ADAPTERS_FOLDER
    }

    fn files(&self) -> &'static [&'static str] {
        &[CONFIG_FILE, WEIGHTS_FILE]
    }

    fn names(&self) -> Vec<String> {
        Adapters::names(self)
    }

    fn read(&self, dir: &Path) -> Result<Vec<Vec<u8>>> {
        let (config, weights) = read_files(dir)?;
        Ok(vec![config, weights])
    }

    fn load(&self, name: &str, files: &[Vec<u8>]) -> Result<()> {
        match files {
            [config, weights] => Adapters::load(self, name, config, weights),
            _ => Err(Error::invalid(format!(
                "adapter '{name}': PEFT's {CONFIG_FILE} and {WEIGHTS_FILE} are needed"
            ))),
        }
    }

    fn unload(&self, name: &str) -> Result<()> {
        Adapters::unload(self, name)
    }
}

/// PEFT's two files of the adapter kept in `dir`.
pub fn read_files(dir: &Path) -> Result<(Vec<u8>, Vec<u8>)> {
    let read = |file: &str| {
        std::fs::read(dir.join(file)).map_err(|e| {
            Error::not_found(format!(
                "no adapter at {}: cannot read {file}: {e} (an adapter is PEFT's {CONFIG_FILE} \
                 and {WEIGHTS_FILE}, kept in the model's {ADAPTERS_FOLDER}/<adapter>/ folder \
                 or given as 'file:' load parameters)",
                dir.display()
            ))
        })
    };
    Ok((read(CONFIG_FILE)?, read(WEIGHTS_FILE)?))
}
#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    #[test]
    fn peft_keys_name_their_layer_module_and_side() {
        assert_eq!(
            peft::lora_key("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some((3, "q_proj", 'A'))
        );
        assert_eq!(
            peft::lora_key("base_model.model.model.layers.12.mlp.down_proj.lora_B.default.weight"),
            Some((12, "down_proj", 'B'))
        );
        assert_eq!(
            peft::lora_key(
                "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
            ),
            None
        );
        assert_eq!(
            peft::lora_key("base_model.model.model.embed_tokens.lora_embedding_A"),
            None
        );
    }

    fn signature() -> Signature {
        Signature {
            projections: vec![Projection {
                layer: 0,
                module: "q_proj".into(),
                fan_in: 3,
                fan_out: 2,
            }],
        }
    }

    fn safetensors_of(tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), data)| {
                (
                    (*name).to_owned(),
                    safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), data)
                        .expect("a valid view"),
                )
            })
            .collect();
        safetensors::serialize(views, None).expect("serialised")
    }

    #[test]
    fn an_adapter_is_stacked_transposed_and_scaled_and_masked_by_row() {
        // The stack's tensors are ONNX Runtime's.
        crate::runtime::onnx::environment(&Default::default()).unwrap();
        let file = safetensors_of(&[
            (
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                vec![1, 3],
                vec![1.0, 2.0, 3.0],
            ),
            (
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                vec![2, 1],
                vec![10.0, 20.0],
            ),
        ]);
        let config = br#"{"peft_type": "LORA", "r": 1, "lora_alpha": 2}"#;
        let sig = signature();
        let adapter =
            Arc::new(Adapter::from_peft("x", config, &file, &sig, &Limits::default()).unwrap());
        let stack = Stack::build(&sig, std::slice::from_ref(&adapter)).unwrap();
        assert_eq!(stack.columns, 1);
        let (_, a) = stack.tensors[0].1.extract_tensor();
        assert_eq!(a, &[1.0, 2.0, 3.0]);
        let (_, b) = stack.tensors[1].1.extract_tensor();
        assert_eq!(b, &[20.0, 40.0], "B scaled by lora_alpha / r");
        assert_eq!(stack.mask(&[None, Some(&adapter)]), vec![0.0, 1.0]);
    }

    #[test]
    fn unsupported_adapters_are_refused_by_name() {
        let sig = signature();
        let file = safetensors_of(&[(
            "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
            vec![1, 3],
            vec![1.0, 2.0, 3.0],
        )]);
        let err = Adapter::from_peft("x", b"{\"lora_alpha\": 1}", &file, &sig, &Limits::default())
            .unwrap_err();
        assert!(err.message.contains("k_proj") && err.message.contains("q_proj"));
        let err = Adapter::from_peft(
            "x",
            b"{\"lora_alpha\": 1, \"use_dora\": true}",
            &file,
            &sig,
            &Limits::default(),
        )
        .unwrap_err();
        assert!(err.message.contains("use_dora"), "{}", err.message);
        let wide = safetensors_of(&[(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            vec![2, 3],
            vec![0.0; 6],
        )]);
        let limits = Limits {
            max_rank: 1,
            ..Limits::default()
        };
        let err =
            Adapter::from_peft("x", b"{\"lora_alpha\": 1}", &wide, &sig, &limits).unwrap_err();
        assert!(err.message.contains("max_lora_rank"), "{}", err.message);
        let config = b"{\"lora_alpha\": 1}";
        let err =
            Adapter::from_peft("x", config, b"not a safetensors file", &sig, &limits).unwrap_err();
        assert!(
            err.message.contains("adapter_model.safetensors"),
            "{}",
            err.message
        );
    }
}
