//! Backends that execute models: ONNX Runtime ([`onnx`]), WebAssembly stages ([`wasm`]),
//! Triton Python-backend models in a sandboxed interpreter ([`python`]), PyTorch and
//! TensorFlow models converted to ONNX ([`conversion`]) and text generation ([`generation`]).
//! A backend turns a validated configuration and a version directory into execution
//! instances; each instance runs a request or a batch of them at a time on a thread the
//! scheduler owns, never on the async runtime.
//!
//! Three parts a newcomer meets first: the contract every backend implements and the layers
//! above use ([`backend`], [`model_config`], optional [`capabilities`]), the host all guest
//! code runs on ([`sandbox`]), and this module, which only dispatches: one table of backends
//! and [`RuntimeOptions`], made of each backend's own settings. No module under `runtime/`
//! imports this one; the layers above use its re-exports of the contract.

pub mod backend;
pub mod batch;
pub mod buckets;
pub mod capabilities;
pub mod conversion;
pub mod generation;
pub mod gpu;
pub mod heap;
pub mod model_config;
pub mod onnx;
pub mod python;
pub mod ragged;
pub mod request_check;
pub mod sandbox;
mod staging;
pub mod tensor_ops;
pub mod warmup;
pub mod wasm;

use std::path::{Path, PathBuf};

pub use backend::{
    execute_alone, ExecTimings, InstanceHealth, LoadContext, LoadedBackend, ModelCaller,
    ModelInstance, ModelLoad, WarmupReport,
};
pub use model_config::{
    caches_responses, instance_count, is_decoupled, model_file, model_file_name, parameter,
};

use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    repository::{
        config_fields::Family,
        validate::{backend_name, ONNXRUNTIME},
    },
};

/// What the backends are started with: each backend's own settings, and what every load
/// gives them all ([`LoadContext`]). A new backend adds its settings here and its row to
/// the table of backends in `runtime/mod.rs`.
#[derive(Debug, Clone, Default)]
pub struct RuntimeOptions {
    /// What every backend's load receives (the caller, the tenants, where the model came from).
    pub load: LoadContext,
    /// ONNX Runtime's (also the generation backend's and converted models' runtime).
    pub onnx: onnx::OnnxSettings,
    /// The host of guest code shared by Wasm stages and Python models (its compile cache).
    pub sandbox: sandbox::SandboxSettings,
    /// The Python backend's.
    pub python: python::PythonSettings,
    /// Converting PyTorch and TensorFlow models to ONNX.
    pub conversion: conversion::ConversionSettings,
    /// The generation backend's.
    pub generation: generation::GenerationSettings,
}

impl RuntimeOptions {
    /// What a server starts from: Triton's `default-max-batch-size` of 4 for auto-completed
    /// models, and guest code and conversions cached in the default place
    /// ([`default_compile_cache_dir`]).
    pub fn for_server() -> Self {
        Self {
            onnx: onnx::OnnxSettings {
                default_max_batch_size: 4,
                ..Default::default()
            },
            ..Default::default()
        }
        .with_cache_dir(default_compile_cache_dir())
    }

    /// The server's cache directory for what it compiles and converts: guest code's compile
    /// cache (`dir` itself) and conversions (`dir/converted`).
    pub fn with_cache_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.conversion.cache_dir = dir.as_ref().map(|d| d.join("converted"));
        self.sandbox.compile_cache_dir = dir;
        self
    }
}

/// Where compiled guest code (Wasm stages, the Python backend's interpreter) is cached unless
/// the operator says otherwise ([`sandbox::engine::default_cache_dir`]).
pub fn default_compile_cache_dir() -> Option<PathBuf> {
    sandbox::engine::default_cache_dir()
}

/// Metric families the backends keep for the whole process, in the text format: the families
/// `model.py` files create (the Python backend's custom metrics).
pub fn process_metrics() -> String {
    python::metrics::render()
}

/// One backend of this server: the name a configuration gives it, how the field table reads
/// its configurations, whether its models may be decoupled, and how it loads a version.
struct BackendRow {
    name: &'static str,
    family: Family,
    decoupled: bool,
    load: fn(ModelConfig, &Path, &RuntimeOptions) -> Result<LoadedBackend>,
}

/// The backends, in the order an error lists them: the one table a new backend joins.
static BACKENDS: &[BackendRow] = &[
    BackendRow {
        name: ONNXRUNTIME,
        family: Family::Onnx,
        decoupled: false,
        load: |config, dir, o| onnx::load(config, dir, &o.onnx, &o.load),
    },
    BackendRow {
        name: wasm::BACKEND,
        family: Family::Stage,
        decoupled: true,
        load: |config, dir, o| wasm::load(config, dir, &o.sandbox, &o.load),
    },
    BackendRow {
        name: python::BACKEND,
        family: Family::Stage,
        decoupled: true,
        load: |config, dir, o| python::load(config, dir, &o.python, &o.sandbox, &o.load),
    },
    BackendRow {
        name: generation::BACKEND,
        family: Family::Generation,
        decoupled: true,
        load: |config, dir, o| generation::load(config, dir, &o.onnx, &o.generation),
    },
];

/// The row of a backend name (a framework served by conversion has none: `load` serves it
/// with ONNX Runtime's).
fn row(backend: &str) -> Option<&'static BackendRow> {
    BACKENDS.iter().find(|r| r.name == backend)
}

/// How the field table reads a configuration of the backend it names (ONNX Runtime when it
/// names none, or names a framework served converted; a backend this server lacks is refused
/// at load, so any reading does).
pub fn family(config: &ModelConfig) -> Family {
    backend_name(config)
        .as_deref()
        .and_then(row)
        .map_or(Family::Onnx, |r| r.family)
}

/// A PyTorch or TensorFlow model, converted to ONNX (or taken from the conversion cache) and
/// served by ONNX Runtime; the conversion's summary becomes the version's status line.
fn converted(
    framework: conversion::Framework,
    backend: &str,
    config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    let converted = conversion::convert(
        framework,
        &config,
        version_dir,
        &options.conversion,
        &options.load,
    )?;
    let summary = converted.manifest.summary();
    if converted.cached {
        tracing::info!(model = %name, "{summary} (from the conversion cache)");
    } else {
        tracing::info!(
            model = %name,
            seconds = converted.manifest.seconds,
            "{summary}"
        );
    }
    // The framework backends' own tuning parameters are set aside while ONNX Runtime loads
    // the model (they would read as unknown ONNX Runtime parameters), said once here, and
    // kept in the configuration the server reports.
    let mut onnx_config = config.clone();
    for key in conversion::FRAMEWORK_PARAMETERS {
        if onnx_config.parameters.remove(*key).is_some()
            && !matches!(*key, "TF_SIGNATURE_DEF" | "TF_GRAPH_TAG")
        {
            tracing::warn!(
                model = %name,
                "parameter '{key}' tunes Triton's {backend} backend and has no effect here: \
                 the model runs converted to ONNX on ONNX Runtime"
            );
        }
    }
    let mut loaded = onnx::load_file(
        onnx_config,
        &converted.onnx,
        version_dir,
        &options.onnx,
        &options.load,
    )?;
    for (key, value) in &config.parameters {
        loaded
            .config
            .parameters
            .entry(key.clone())
            .or_insert_with(|| value.clone());
    }
    loaded.origin = Some(summary);
    Ok(loaded)
}

/// Loads one version of a model with the backend its configuration names.
pub fn load(
    config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let backend = backend_name(&config)
        .or_else(|| {
            // A model.py beside no model.onnx: a Python model without a backend named.
            let python = python::owns(&config, version_dir)
                && !version_dir.join(onnx::DEFAULT_MODEL_FILENAME).exists();
            python.then(|| python::BACKEND.to_owned())
        })
        .unwrap_or_else(|| ONNXRUNTIME.to_owned());
    let converted_from = conversion::Framework::of(&backend);
    let row = match (row(&backend), converted_from) {
        (Some(row), _) => row,
        (None, Some(_)) => &BACKENDS[0],
        (None, None) => {
            let names: Vec<&str> = BACKENDS.iter().map(|r| r.name).collect();
            return Err(Error::invalid(format!(
                "model '{}': backend '{backend}' is not available (this server runs: {})",
                config.name,
                names.join(", ")
            )));
        }
    };
    if is_decoupled(&config) && !row.decoupled {
        return Err(Error::invalid(format!(
            "model '{}': field 'model_transaction_policy.decoupled': only wasm stages, Python \
             models and generation models can be decoupled (backend '{backend}' answers each \
             request once)",
            config.name
        )));
    }
    let mut loaded = match converted_from {
        Some(framework) => converted(framework, &backend, config, version_dir, options),
        None => (row.load)(config, version_dir, options),
    }?;
    // Warm-up runs against the completed configuration, before the version is READY.
    loaded.warmup = warmup::run(&mut loaded, version_dir)?;
    Ok(loaded)
}
