//! Backends that execute models: ONNX Runtime ([`onnx`]), WebAssembly stages ([`wasm`]),
//! Triton Python-backend models in a sandboxed interpreter ([`python`]) and text generation
//! ([`generation`]). A backend turns a validated configuration and a version directory into
//! execution instances; each instance runs a request or a batch of them at a time on a thread
//! the scheduler owns, never on the async runtime.

pub mod batch;
pub mod buckets;
pub mod capabilities;
pub mod conversion;
pub mod generation;
pub mod gpu;
pub mod heap;
pub mod onnx;
pub mod python;
pub mod ragged;
pub mod request_check;
pub mod sandbox;
mod staging;
pub mod tensor_ops;
pub mod warmup;
pub mod wasm;

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    proto::inference::ModelConfig,
    repository::validate::{backend_name, ONNXRUNTIME},
    tensor::Tensor,
};

/// What one execution reports: the time spent in the three phases Triton reports, and the
/// rows of padding it ran with.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExecTimings {
    /// Preparing inputs for the engine.
    pub compute_input: Duration,
    /// The engine's run.
    pub compute_infer: Duration,
    /// Collecting outputs from the engine.
    pub compute_output: Duration,
    /// Rows of zeros added to reach a batch bucket ([`buckets`]); never answered.
    pub padded_rows: u64,
}

/// One execution instance of a model (an ONNX Runtime session, a Wasm stage instance).
pub trait ModelInstance: Send {
    /// Runs the requests of one batch ([`batch::compatible`], or ragged-compatible) as one
    /// execution and answers each, in order; `outputs` applies to all of them. Backends that
    /// run one merged tensor use [`batch::execute_merged`].
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings);

    /// Runs one validated request and returns the named outputs, in that order: a batch of
    /// one.
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        execute_alone(self, request, outputs)
    }

    /// The model's own readiness check (a `model.py`'s `is_ready()`), run between batches
    /// when a client asks whether the model is ready; `None`: the model has none, and its
    /// readiness is its instances' health.
    fn check_ready(&mut self) -> Option<bool> {
        None
    }
}

/// [`ModelInstance::execute`]'s default: the request as a batch of one.
pub fn execute_alone<I: ModelInstance + ?Sized>(
    instance: &mut I,
    request: &InferRequest,
    outputs: &[String],
) -> Result<(Vec<Tensor>, ExecTimings)> {
    let (mut results, timings) = instance.execute_batch(&[request], outputs);
    let result = results.pop().unwrap_or_else(|| {
        Err(Error::internal(format!(
            "model '{}' gave no result",
            request.model_name
        )))
    });
    result.map(|tensors| (tensors, timings))
}

/// How a backend reaches other models (a stage's `infer` import) without knowing the layers
/// above it: the scheduling layer provides the implementation. Blocking; called from model
/// worker threads only.
pub trait ModelCaller: Send + Sync + std::fmt::Debug {
    /// Runs a request through the target model's normal scheduling and waits for the result;
    /// the wait ends early once the request's own cancellation fires.
    fn infer(&self, request: InferRequest) -> Result<InferResponse> {
        let watch = request.cancel.clone();
        self.infer_watching(request, watch)
    }

    /// [`Self::infer`] whose wait ends early once `watch` fires (not the request's own
    /// cancellation, which the called model sees and may answer as it chooses).
    fn infer_watching(
        &self,
        request: InferRequest,
        watch: crate::cancellation::Cancellation,
    ) -> Result<InferResponse>;

    /// Whether `model` (at `version`; `None`: the policy's) is loaded and ready.
    fn is_ready(&self, model: &str, version: Option<i64>) -> bool;

    /// Loads (or reloads) a model as the repository API does, asked by model `by` for its
    /// `callers` (explicit model control mode; each caller must be allowed the load).
    fn load(&self, by: &str, callers: &[crate::tenancy::Caller], load: ModelLoad) -> Result<()>;

    /// Unloads a model as the repository API does, asked by model `by` for its `callers`.
    fn unload(
        &self,
        by: &str,
        callers: &[crate::tenancy::Caller],
        model: &str,
        unload_dependents: bool,
    ) -> Result<()>;
}

/// A load a model asks for (Triton's Python `pb_utils.load_model`).
#[derive(Debug, Default)]
pub struct ModelLoad {
    /// The model.
    pub model: String,
    /// A configuration in JSON used instead of its `config.pbtxt`.
    pub config_json: Option<String>,
    /// Its files by `file:` key (`file:1/model.onnx`), which need `config_json`.
    pub files: Vec<(String, Vec<u8>)>,
}

/// The name of a version's model file: `default_model_filename`, or the backend's `default`.
pub fn model_file_name<'a>(config: &'a ModelConfig, default: &'a str) -> &'a str {
    if config.default_model_filename.is_empty() {
        default
    } else {
        config.default_model_filename.as_str()
    }
}

/// Whether the model's answers go to the response cache (`response_cache { enable: true }`).
pub fn caches_responses(config: &ModelConfig) -> bool {
    config.response_cache.as_ref().is_some_and(|c| c.enable)
}

/// The model file of a version: `default_model_filename` from the configuration, or the
/// backend's default name; an error naming the path when it is missing.
pub fn model_file(
    config: &ModelConfig,
    version_dir: &std::path::Path,
    default: &str,
) -> Result<PathBuf> {
    let path = version_dir.join(model_file_name(config, default));
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::invalid(format!(
            "model '{}': model file '{}' not found",
            config.name,
            path.display()
        )))
    }
}

/// A config.pbtxt `parameters` value parsed as `T` (spaces around it ignored), `None` when
/// absent; a value that does not parse is an error naming the model, the parameter and `what`
/// it must be.
pub fn parameter<T: std::str::FromStr>(
    config: &ModelConfig,
    key: &str,
    what: &str,
) -> Result<Option<T>> {
    config
        .parameters
        .get(key)
        .map(|p| {
            p.string_value.trim().parse::<T>().map_err(|_| {
                Error::invalid(format!(
                    "model '{}': parameter '{key}' must be {what}, got \"{}\"",
                    config.name, p.string_value
                ))
            })
        })
        .transpose()
}

/// Instances that take requests over all instance groups (a group's count of 0 means 1;
/// `passive` groups, which Triton loads but never schedules, are not started); 1 without
/// groups, 0 when every group is passive.
pub fn instance_count(config: &ModelConfig) -> usize {
    if config.instance_group.is_empty() {
        return 1;
    }
    config
        .instance_group
        .iter()
        .filter(|g| !g.passive)
        .map(|g| g.count.max(1) as usize)
        .sum()
}

/// A model version ready to serve: its completed configuration and its instances.
pub struct LoadedBackend {
    /// The configuration after auto-completion from the model file.
    pub config: ModelConfig,
    /// One entry per execution instance.
    pub instances: Vec<Box<dyn ModelInstance>>,
    /// Crash accounting shared by the instances.
    pub health: Arc<InstanceHealth>,
    /// The shapes its executions are padded to, if any: the scheduler batches requests
    /// whose padded shapes agree.
    pub buckets: Option<Arc<buckets::ShapeBuckets>>,
    /// What warming up the instances took, if the model was warmed up.
    pub warmup: Option<warmup::WarmupReport>,
    /// What only some backends have (metrics of their own, adapters, …).
    pub capabilities: capabilities::Capabilities,
    /// Where the served model came from when it is not the version's own file (a
    /// conversion), shown as the version's status.
    pub origin: Option<String>,
    /// The model has a readiness check of its own ([`ModelInstance::check_ready`]).
    pub checks_readiness: bool,
}

impl LoadedBackend {
    /// `instances` serving `config`, with nothing else: no padding buckets, warm-up, optional
    /// capabilities, origin or readiness check of its own (a backend sets what it has).
    pub fn new(config: ModelConfig, instances: Vec<Box<dyn ModelInstance>>) -> Self {
        Self {
            config,
            instances,
            health: Arc::default(),
            buckets: None,
            warmup: None,
            capabilities: capabilities::Capabilities::default(),
            origin: None,
            checks_readiness: false,
        }
    }
}

/// Crash accounting for a model version: instances that trap are replaced, and a version
/// whose instances keep trapping reports itself unhealthy (not ready) instead of flapping
/// silently. One success makes it healthy again.
#[derive(Debug)]
pub struct InstanceHealth {
    consecutive_failures: AtomicU64,
    restarts: AtomicU64,
    threshold: u64,
}

impl InstanceHealth {
    /// Unhealthy after `threshold` consecutive crashes (0 never).
    pub fn new(threshold: u64) -> Self {
        Self {
            consecutive_failures: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            threshold,
        }
    }
    /// An instance crashed and will be replaced.
    pub fn record_crash(&self) {
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed);
        self.restarts.fetch_add(1, Ordering::Relaxed);
    }
    /// An execution succeeded.
    pub fn record_success(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }
    /// Instances replaced after a crash so far.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
    /// Crashes since the last success.
    pub fn consecutive_failures(&self) -> u64 {
        self.consecutive_failures.load(Ordering::Relaxed)
    }
    /// False once the crashes since the last success reach the threshold.
    pub fn is_healthy(&self) -> bool {
        self.threshold == 0 || self.consecutive_failures() < self.threshold
    }
}

impl Default for InstanceHealth {
    fn default() -> Self {
        Self::new(0)
    }
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
    /// The size that cache is kept under (least recently used stages removed first); `None`:
    /// [`sandbox::compile_cache::DEFAULT_MAX_BYTES`].
    pub wasm_cache_max_bytes: Option<u64>,
    /// The Python backend's interpreter build (`--python-runtime`); `None`: the default
    /// place ([`python::interpreter::default_dir`]).
    pub python_runtime: Option<PathBuf>,
    /// Lets Wasm stages call other models.
    pub model_caller: Option<Arc<dyn ModelCaller>>,
    /// The tenants, whose `[tenant.wasm]` limits bound the stages they may load.
    pub tenancy: Option<Arc<crate::tenancy::Tenancy>>,
    /// Converts PyTorch and TensorFlow models to ONNX at load (`--converter-python`); `None`:
    /// only conversions already cached are served.
    pub converter: Option<conversion::ConverterSettings>,
    /// Load ONNX Runtime custom operator libraries (`model_operations`): native code run
    /// inside the server (`--allow-custom-op-libraries`).
    pub allow_custom_op_libraries: bool,
    /// Generation models tell their prefix cache's changes as vLLM's KV-cache events here
    /// (`--kv-events-config`).
    pub kv_events: Option<generation::kv::events::KvEvents>,
    /// The model's configuration or files came with a load request (a client's, or a
    /// sandboxed model's `load_model`), not from the repository the operator placed: nothing
    /// of it may make native code run (no conversion unless `--convert-uploaded-models`, no
    /// custom operator libraries). Set per load by the model manager.
    pub sent_by_client: bool,
    /// Models may not load or unload models from their code (`--allow-model-repository-calls
    /// =false`); per model, the `repository_calls` parameter says the same.
    pub forbid_repository_calls: bool,
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

/// Whether the model answers 0..N times per request (`model_transaction_policy.decoupled`).
pub fn is_decoupled(config: &ModelConfig) -> bool {
    config
        .model_transaction_policy
        .as_ref()
        .is_some_and(|p| p.decoupled)
}

/// How the field table reads a configuration of the backend it names (ONNX Runtime when it
/// names none; a backend this server lacks is refused at load, so any reading does).
pub fn family(config: &ModelConfig) -> crate::repository::config_fields::Family {
    use crate::repository::config_fields::Family;
    match backend_name(config).as_deref() {
        Some(wasm::BACKEND) | Some(python::BACKEND) => Family::Stage,
        Some(generation::BACKEND) => Family::Generation,
        _ => Family::Onnx,
    }
}

/// A PyTorch or TensorFlow model, converted to ONNX (or taken from the conversion cache) and
/// served by ONNX Runtime; the conversion's summary becomes the version's status line.
fn converted(
    backend: &str,
    config: ModelConfig,
    version_dir: &std::path::Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let framework = conversion::Framework::of(backend)
        .ok_or_else(|| Error::internal(format!("no converter for '{backend}'")))?;
    let name = config.name.clone();
    let converted = conversion::convert(framework, &config, version_dir, options)?;
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
    let mut loaded = onnx::load_file(onnx_config, &converted.onnx, version_dir, options)?;
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
    version_dir: &std::path::Path,
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
    if is_decoupled(&config)
        && backend != wasm::BACKEND
        && backend != generation::BACKEND
        && backend != python::BACKEND
    {
        return Err(Error::invalid(format!(
            "model '{}': field 'model_transaction_policy.decoupled': only wasm stages, Python \
             models and generation models can be decoupled (backend '{backend}' answers each \
             request once)",
            config.name
        )));
    }
    let mut loaded = match backend.as_str() {
        ONNXRUNTIME => onnx::load(config, version_dir, options),
        other if conversion::Framework::of(other).is_some() => {
            converted(other, config, version_dir, options)
        }
        wasm::BACKEND => wasm::load(config, version_dir, options),
        generation::BACKEND => generation::load(config, version_dir, options),
        python::BACKEND => python::load(config, version_dir, options),
        other => Err(Error::invalid(format!(
            "model '{}': backend '{other}' is not available (this server runs: {ONNXRUNTIME}, {}, {}, {})",
            config.name,
            wasm::BACKEND,
            python::BACKEND,
            generation::BACKEND
        ))),
    }?;
    // Warm-up runs against the completed configuration, before the version is READY.
    loaded.warmup = warmup::run(&mut loaded, version_dir)?;
    Ok(loaded)
}
