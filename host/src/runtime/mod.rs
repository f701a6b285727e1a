//! Backends that execute models. A backend turns a validated configuration and a version
//! directory into execution instances; each instance runs whole requests (later, batches) on a
//! thread the scheduler owns, never on the async runtime.

pub mod onnx;
pub mod request_check;
pub mod wasm;

use std::{path::PathBuf, time::Duration};

use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    proto::inference::ModelConfig,
    repository::validate::{backend_name, ONNXRUNTIME},
    tensor::Tensor,
};

/// Time spent in the three phases Triton reports for each execution.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExecTimings {
    /// Preparing inputs for the engine.
    pub compute_input: Duration,
    /// The engine's run.
    pub compute_infer: Duration,
    /// Collecting outputs from the engine.
    pub compute_output: Duration,
}

/// One execution instance of a model (an ONNX Runtime session, a Wasm stage instance).
pub trait ModelInstance: Send {
    /// Runs the model on a validated request and returns the named outputs, in that order.
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)>;
}

/// How a backend reaches other models (a stage's `infer` import) without knowing the layers
/// above it: the scheduling layer provides the implementation. Blocking; called from model
/// worker threads only.
pub trait ModelCaller: Send + Sync + std::fmt::Debug {
    /// Runs a request through the target model's normal scheduling and waits for the result.
    fn infer(&self, request: InferRequest) -> Result<InferResponse>;
}

/// Total instances over all instance groups (a group's count of 0 means 1); 1 without groups.
pub fn instance_count(config: &ModelConfig) -> usize {
    if config.instance_group.is_empty() {
        return 1;
    }
    config
        .instance_group
        .iter()
        .map(|g| g.count.max(1) as usize)
        .sum()
}

/// A model version ready to serve: its completed configuration and its instances.
pub struct LoadedBackend {
    /// The configuration after auto-completion from the model file.
    pub config: ModelConfig,
    /// One entry per execution instance.
    pub instances: Vec<Box<dyn ModelInstance>>,
}

/// Settings that apply to every backend.
#[derive(Debug, Clone, Default)]
pub struct RuntimeOptions {
    /// Path of `libonnxruntime.so`; `None` looks in the usual places.
    pub onnxruntime_library: Option<PathBuf>,
    /// Fill inputs, outputs and `max_batch_size` from the model file when the config omits them.
    pub disable_auto_complete: bool,
    /// `max_batch_size` that auto-completion gives to models with a variable first dimension.
    pub default_max_batch_size: i32,
    /// Where compiled Wasm components are cached; `None` compiles every time.
    pub wasm_cache_dir: Option<PathBuf>,
    /// Lets Wasm stages call other models.
    pub model_caller: Option<std::sync::Arc<dyn ModelCaller>>,
}

/// Loads one version of a model with the backend its configuration names.
pub fn load(
    config: ModelConfig,
    version_dir: &std::path::Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let backend = backend_name(&config).unwrap_or_else(|| ONNXRUNTIME.to_owned());
    match backend.as_str() {
        ONNXRUNTIME => onnx::load(config, version_dir, options),
        wasm::BACKEND => wasm::load(config, version_dir, options),
        other => Err(Error::invalid(format!(
            "model '{}': backend '{other}' is not available (this server runs: {ONNXRUNTIME}, {})",
            config.name,
            wasm::BACKEND
        ))),
    }
}
