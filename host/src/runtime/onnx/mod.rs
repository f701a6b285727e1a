//! The ONNX Runtime backend: one `ort` session per instance, auto-completion of the
//! configuration from the model's signature, and load-time cross-checks with messages that say
//! which side (config.pbtxt or the model) to change. `load` is here; the library, type mapping,
//! session building, auto-complete, instances and value conversion each have their file.

use std::{path::Path, sync::Arc};

use super::{
    backend::{LoadContext, LoadedBackend, ModelInstance},
    buckets::ShapeBuckets,
    gpu::{self, Placement},
    model_config::model_file,
    ragged::RaggedBatching,
    staging::Staging,
};
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
};

mod autocomplete;
mod instance;
mod library;
mod session;
mod types;
mod values;

use autocomplete::*;
use instance::*;
pub(crate) use library::environment;
use session::*;
use types::*;
use values::*;

/// Default model file name inside a version directory.
pub const DEFAULT_MODEL_FILENAME: &str = "model.onnx";

/// The ONNX Runtime backend's settings (also used by the backends that run on ONNX Runtime).
#[derive(Debug, Clone, Default)]
pub struct OnnxSettings {
    /// Path of `libonnxruntime.so`; `None` looks in the usual places.
    pub library: Option<std::path::PathBuf>,
    /// `max_batch_size` that auto-completion gives to models with a variable first dimension.
    pub default_max_batch_size: i32,
    /// Load ONNX Runtime custom operator libraries (`model_operations`): native code run
    /// inside the server (`--allow-custom-op-libraries`).
    pub allow_custom_op_libraries: bool,
}

/// Loads every instance of one model version.
pub fn load(
    config: ModelConfig,
    version_dir: &Path,
    settings: &OnnxSettings,
    load: &LoadContext,
) -> Result<LoadedBackend> {
    let model_path = onnx_file(&config, version_dir)?;
    load_file(config, &model_path, version_dir, settings, load)
}

/// [`load`] with the ONNX file given (a model converted from another framework); the version
/// folder still holds what the configuration refers to (operator libraries, engine caches).
pub fn load_file(
    mut config: ModelConfig,
    model_path: &Path,
    version_dir: &Path,
    onnx: &OnnxSettings,
    load: &LoadContext,
) -> Result<LoadedBackend> {
    let model_path = model_path.to_path_buf();
    let env = environment(onnx)?;
    gpu::normalize_instance_groups(&mut config, gpu::DEFAULT_CPU_INSTANCE_COUNT);
    let mut settings = SessionSettings::of(&config)?;
    let model_dir = version_dir.parent().unwrap_or(version_dir);
    settings.op_libraries = operator_libraries(&config, model_dir, onnx, load)?;
    let run_options = settings.run_options(&config.name)?.map(Arc::new);
    warn_unknown_parameters(&config);
    let placements = gpu::placements(&config)?;
    let accelerators = gpu::accelerators(&config)?;
    let engine_cache = accelerators
        .tensorrt
        .as_ref()
        .and_then(|t| t.engine_cache_dir(version_dir));
    let count = placements.len();
    let (intra, inter) = thread_counts(&config, count)?;
    let (&first_place, _) = placements
        .split_first()
        .ok_or_else(|| Error::internal(format!("model '{}': no instances", config.name)))?;
    let providers = Providers {
        accelerators: &accelerators,
        engine_cache: engine_cache.as_deref(),
    };
    let build = |placement, profile: Option<&str>| {
        build_session(
            &env,
            &model_path,
            intra,
            inter,
            &settings,
            placement,
            &providers,
            profile,
        )
    };
    let probe = build(first_place, None).map_err(|e| {
        Error::invalid(format!(
            "model '{}': ONNX Runtime cannot load '{}'{}: {e}",
            config.name,
            model_path.display(),
            match first_place {
                Placement::Cpu => String::new(),
                Placement::Gpu(d) => format!(" on GPU {d}"),
            }
        ))
    })?;
    let (model_inputs, model_outputs) = (input_signatures(&probe), signatures(probe.outputs()));
    reconcile(&mut config, &model_inputs, &model_outputs, onnx, load)?;
    // Buckets are read once the configuration is complete (auto-completion may set
    // max_batch_size and dims).
    let on_gpu = placements.iter().any(|p| matches!(p, Placement::Gpu(_)));
    let ragged = RaggedBatching::from_config(&config)?.map(Arc::new);
    // A ragged batch is one 1-D run of elements: there are no rows or lengths to pad.
    let buckets = match ragged {
        Some(_) => None,
        None => ShapeBuckets::from_config(&config, on_gpu)?.map(Arc::new),
    };
    let profiles = session_profiles(&config, buckets.as_deref(), &accelerators);
    let output_types = output_types(&config);
    let shapes = Reshapes::of(&config, &model_inputs, &model_outputs);
    let mut probe = Some(probe);
    let mut instances: Vec<Box<dyn ModelInstance>> = Vec::with_capacity(count);
    for (index, &placement) in placements.iter().enumerate() {
        let mut sessions = Vec::with_capacity(profiles.len());
        for profile in &profiles {
            // The session built to read the signature serves when it fits.
            let reuse = index == 0 && profile.is_none();
            let session = match probe.take().filter(|_| reuse) {
                Some(session) => session,
                None => build(placement, profile.as_deref())
                    .map_err(|e| Error::internal(format!("model '{}': {e}", config.name)))?,
            };
            sessions.push(session);
        }
        let staging = match sessions.first() {
            Some(session) => Staging::for_session(session, placement, &config.name)?,
            None => Staging::host()?,
        };
        if staging.pinned() {
            tracing::debug!(model = %config.name, instance = index, "inputs and outputs staged in CUDA pinned memory");
        }
        instances.push(Box::new(OnnxInstance {
            name: config.name.clone(),
            sessions,
            staging,
            output_types: output_types.clone(),
            shapes: shapes.clone(),
            buckets: buckets.clone(),
            ragged: ragged.clone(),
            run_options: run_options.clone(),
        }));
    }
    Ok(LoadedBackend {
        buckets,
        ..LoadedBackend::new(config, instances)
    })
}

/// Parameters ONNX Runtime does not read, said once (Triton's backend ignores them too).
fn warn_unknown_parameters(config: &ModelConfig) {
    for key in config.parameters.keys().filter(|k| !known_parameter(k)) {
        tracing::warn!(
            model = %config.name,
            "parameter '{key}' has no effect on ONNX Runtime models (Triton's ONNX Runtime \
             backend ignores it too)"
        );
    }
}

/// The sessions each instance has: one, or one per batch bucket (TensorRT builds each
/// bucket's session for exactly its shape, named by its optimisation profile).
fn session_profiles(
    config: &ModelConfig,
    buckets: Option<&ShapeBuckets>,
    accelerators: &gpu::Accelerators,
) -> Vec<Option<String>> {
    match buckets {
        Some(b) if b.session_per_bucket => b
            .batch
            .iter()
            .map(|&n| {
                accelerators
                    .tensorrt
                    .as_ref()
                    .and_then(|_| tensorrt_profile(config, n))
            })
            .collect(),
        _ => vec![None],
    }
}

/// The model's file: `default_model_filename` or `model.onnx` in the version folder; when that
/// is a directory (a model saved with its weights as external data beside it), the
/// `model.onnx` inside it, as Triton's ONNX Runtime backend reads it. ONNX Runtime then loads
/// the external data from the file's own directory.
fn onnx_file(config: &ModelConfig, version_dir: &Path) -> Result<std::path::PathBuf> {
    model_file(config, version_dir, DEFAULT_MODEL_FILENAME).or_else(|missing| {
        let named = super::model_config::model_file_name(config, DEFAULT_MODEL_FILENAME);
        let inside = version_dir.join(named).join(DEFAULT_MODEL_FILENAME);
        if inside.is_file() {
            Ok(inside)
        } else {
            Err(missing)
        }
    })
}

impl AsRef<[u8]> for OutputMemory {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a host tensor (`Staging` binds outputs to host memory, plain or pinned) that this owns, `len`
        // bytes as ONNX Runtime reports, never written after the run.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr().cast::<u8>(), self.len) }
    }
}
