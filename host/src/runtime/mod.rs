//! Backends that execute models. A backend turns a validated configuration and a version
//! directory into execution instances; each instance runs whole requests (later, batches) on a
//! thread the scheduler owns, never on the async runtime.

pub mod onnx;
pub mod request_check;

use std::{path::PathBuf, time::Duration};

use crate::{
    error::{Error, Result},
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

/// One execution instance of a model (one ONNX Runtime session, ...).
pub trait ModelInstance: Send {
    /// Runs the model on validated inputs and returns the named outputs, in that order.
    fn execute(
        &mut self,
        inputs: &[Tensor],
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)>;
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
        other => Err(Error::invalid(format!(
            "model '{}': backend '{other}' is not available (this server runs: {ONNXRUNTIME})",
            config.name
        ))),
    }
}
