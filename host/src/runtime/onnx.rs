//! The ONNX Runtime backend: one `ort` session per instance, auto-completion of the
//! configuration from the model's signature, and load-time cross-checks with messages that say
//! which side (config.pbtxt or the model) to change.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Instant,
};

use bytes::Bytes;
use ort::{
    environment::Environment,
    memory::Allocator,
    session::Session,
    value::{
        DynTensor, DynTensorValueType, DynValue, Outlet, Tensor as OrtTensor, TensorElementType,
        ValueType,
    },
};

use super::{
    batch,
    buckets::{self, ShapeBuckets},
    gpu::{self, Placement},
    model_file,
    staging::Staging,
    ExecTimings, LoadedBackend, ModelInstance, RuntimeOptions,
};
use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    repository::sequence::sequence_spec,
    tensor::{bytes_elements, element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// Default model file name inside a version directory.
pub const DEFAULT_MODEL_FILENAME: &str = "model.onnx";

/// Path baked in at build time: the library `make` fetches into the workspace cache.
const BUILD_TIME_LIBRARY: Option<&str> = option_env!("WASMTRON_DEFAULT_ORT_LIB");

static ENVIRONMENT: OnceLock<std::result::Result<Environment, String>> = OnceLock::new();

/// Where to find `libonnxruntime.so`: the explicit option, `ORT_DYLIB_PATH`, next to the
/// executable, then the copy `make` fetched when this binary was built.
fn library_path(options: &RuntimeOptions) -> PathBuf {
    if let Some(path) = &options.onnxruntime_library {
        return path.clone();
    }
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        return PathBuf::from(path);
    }
    if let Some(beside) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("libonnxruntime.so")))
        .filter(|p| p.exists())
    {
        return beside;
    }
    PathBuf::from(BUILD_TIME_LIBRARY.unwrap_or("libonnxruntime.so"))
}

pub(crate) fn environment(options: &RuntimeOptions) -> Result<Environment> {
    ENVIRONMENT
        .get_or_init(|| {
            let path = library_path(options);
            let builder = ort::init_from(&path).map_err(|e| {
                format!(
                    "cannot load ONNX Runtime from '{}': {e} (run `make onnxruntime` or pass --onnxruntime-library)",
                    path.display()
                )
            })?;
            builder
                .with_name("wasmtron")
                .build()
                .map_err(|e| format!("cannot start ONNX Runtime: {e}"))
        })
        .clone()
        .map_err(Error::internal)
}

fn to_data_type(ty: TensorElementType) -> Option<DataType> {
    Some(match ty {
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Uint16 => DataType::Uint16,
        TensorElementType::Uint32 => DataType::Uint32,
        TensorElementType::Uint64 => DataType::Uint64,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        TensorElementType::String => DataType::Bytes,
        TensorElementType::Bfloat16 => DataType::Bf16,
        _ => return None,
    })
}

fn to_element_type(dt: DataType) -> TensorElementType {
    match dt {
        DataType::Bool => TensorElementType::Bool,
        DataType::Uint8 => TensorElementType::Uint8,
        DataType::Uint16 => TensorElementType::Uint16,
        DataType::Uint32 => TensorElementType::Uint32,
        DataType::Uint64 => TensorElementType::Uint64,
        DataType::Int8 => TensorElementType::Int8,
        DataType::Int16 => TensorElementType::Int16,
        DataType::Int32 => TensorElementType::Int32,
        DataType::Int64 => TensorElementType::Int64,
        DataType::Fp16 => TensorElementType::Float16,
        DataType::Fp32 => TensorElementType::Float32,
        DataType::Fp64 => TensorElementType::Float64,
        DataType::Bytes => TensorElementType::String,
        DataType::Bf16 => TensorElementType::Bfloat16,
    }
}

/// A tensor of the ONNX model's signature: name, datatype and full shape (-1 = dynamic).
struct Signature {
    name: String,
    datatype: Option<DataType>,
    shape: Vec<i64>,
}

fn signatures(outlets: &[Outlet]) -> Vec<Signature> {
    outlets
        .iter()
        .map(|o| match o.dtype() {
            ValueType::Tensor { ty, shape, .. } => Signature {
                name: o.name().to_owned(),
                datatype: to_data_type(*ty),
                shape: shape.iter().copied().collect(),
            },
            _ => Signature {
                name: o.name().to_owned(),
                datatype: None,
                shape: vec![],
            },
        })
        .collect()
}

/// Loads every instance of one model version.
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let model_path = model_file(&config, version_dir, DEFAULT_MODEL_FILENAME)?;
    let env = environment(options)?;
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
    reconcile(
        &mut config,
        &signatures(probe.inputs()),
        &signatures(probe.outputs()),
        options,
    )?;
    // Buckets are read once the configuration is complete (auto-completion may set
    // max_batch_size and dims).
    let on_gpu = placements.iter().any(|p| matches!(p, Placement::Gpu(_)));
    let buckets = ShapeBuckets::from_config(&config, on_gpu)?.map(Arc::new);
    // One session per instance, or one per batch bucket; TensorRT builds each bucket's
    // session for exactly its shape.
    let profiles: Vec<Option<String>> = match &buckets {
        Some(b) if b.session_per_bucket => b
            .batch
            .iter()
            .map(|&n| {
                accelerators
                    .tensorrt
                    .as_ref()
                    .and_then(|_| tensorrt_profile(&config, n))
            })
            .collect(),
        _ => vec![None],
    };
    let output_types = output_types(&config);
    let shapes = Reshapes::of(&config);
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
        }));
    }
    Ok(LoadedBackend {
        config,
        instances,
        health: Default::default(),
        buckets,
        warmup: None,
        generation: None,
    })
}

/// TensorRT's optimisation profile for one batch bucket (`name:BxD1xD2,...`), the minimum,
/// optimum and maximum alike; `None` when an input has variable dimensions besides the batch
/// (TensorRT then profiles by itself).
fn tensorrt_profile(config: &ModelConfig, rows: usize) -> Option<String> {
    let mut shapes = Vec::with_capacity(config.input.len());
    for input in &config.input {
        let dims = input.reshape.as_ref().map_or(&input.dims, |r| &r.shape);
        if dims.iter().any(|&d| d < 0) {
            return None;
        }
        let all: Vec<String> = std::iter::once(rows as i64)
            .chain(dims.iter().copied())
            .map(|d| d.to_string())
            .collect();
        shapes.push(format!("{}:{}", input.name, all.join("x")));
    }
    Some(shapes.join(","))
}

fn output_types(config: &ModelConfig) -> Vec<(String, DataType)> {
    config
        .output
        .iter()
        .filter_map(|o| Some((o.name.clone(), DataType::from_config_value(o.data_type)?)))
        .collect()
}

fn thread_counts(config: &ModelConfig, instances: usize) -> Result<(usize, usize)> {
    let param = |key: &str| super::parameter::<usize>(config, key, "a non-negative integer");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Sessions that each use every core fight each other: split the cores between instances.
    let intra = param("intra_op_thread_count")?
        .filter(|&n| n > 0)
        .unwrap_or_else(|| (cores / instances.max(1)).max(1));
    let inter = param("inter_op_thread_count")?
        .filter(|&n| n > 0)
        .unwrap_or(1);
    Ok((intra, inter))
}

/// The execution providers of GPU sessions (read only by GPU builds).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Providers<'a> {
    accelerators: &'a gpu::Accelerators,
    /// Where TensorRT caches engines, if it does.
    engine_cache: Option<&'a str>,
}

fn build_session(
    env: &Environment,
    path: &Path,
    intra: usize,
    inter: usize,
    placement: Placement,
    providers: &Providers<'_>,
    profile: Option<&str>,
) -> std::result::Result<Session, String> {
    let mut builder = Session::builder(env)
        .map_err(|e| e.to_string())?
        .with_intra_threads(intra)
        .map_err(|e| e.to_string())?
        .with_inter_threads(inter)
        .map_err(|e| e.to_string())?;
    if let Placement::Gpu(device) = placement {
        builder = with_gpu(builder, device, providers, profile)?;
    }
    builder.commit_from_file(path).map_err(|e| e.to_string())
}

/// Adds the GPU execution providers: TensorRT first when asked for (ONNX Runtime falls back
/// to CUDA for what TensorRT does not take), then CUDA with the configured options, each
/// failing the load if unavailable.
#[cfg(feature = "cuda")]
fn with_gpu(
    builder: ort::session::builder::SessionBuilder,
    device: i32,
    providers: &Providers<'_>,
    profile: Option<&str>,
) -> std::result::Result<ort::session::builder::SessionBuilder, String> {
    use ort::ep::{ArbitrarilyConfigurableExecutionProvider, ExecutionProviderDispatch};
    let mut list: Vec<ExecutionProviderDispatch> = Vec::new();
    if let Some(options) = &providers.accelerators.tensorrt {
        #[cfg(feature = "tensorrt")]
        {
            let mut trt = ort::ep::TensorRT::default()
                .with_device_id(device)
                .with_fp16(options.fp16)
                .with_engine_cache(providers.engine_cache.is_some());
            if let Some(path) = providers.engine_cache {
                trt = trt.with_engine_cache_path(path);
            }
            if let Some(size) = options.max_workspace_size {
                trt = trt.with_max_workspace_size(size);
            }
            if let Some(size) = options.min_subgraph_size {
                trt = trt.with_min_subgraph_size(size);
            }
            if let Some(n) = options.max_partition_iterations {
                trt = trt.with_max_partition_iterations(n);
            }
            if let Some(shapes) = profile {
                trt = trt
                    .with_profile_min_shapes(shapes)
                    .with_profile_opt_shapes(shapes)
                    .with_profile_max_shapes(shapes);
            }
            list.push(trt.build().error_on_failure());
        }
        #[cfg(not(feature = "tensorrt"))]
        {
            let _ = (options, profile);
            return Err(
                "the configuration asks for the tensorrt accelerator, but this wasmtron \
                        build has no TensorRT support (rebuild with `--features tensorrt`)"
                    .to_owned(),
            );
        }
    }
    let mut cuda = ort::ep::CUDA::default().with_device_id(device);
    for (key, value) in &providers.accelerators.cuda {
        cuda = cuda.with_arbitrary_config(key, value);
    }
    list.push(cuda.build().error_on_failure());
    builder
        .with_execution_providers(list)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn with_gpu(
    _: ort::session::builder::SessionBuilder,
    _: i32,
    _: &Providers<'_>,
    _: Option<&str>,
) -> std::result::Result<ort::session::builder::SessionBuilder, String> {
    // `placements` refuses GPU groups in such a build; kept for a clear message regardless.
    Err("this wasmtron build has no GPU support (rebuild with `--features cuda`)".to_owned())
}

/// Auto-completes `config` from the model signature and checks that the two agree.
fn reconcile(
    config: &mut ModelConfig,
    inputs: &[Signature],
    outputs: &[Signature],
    options: &RuntimeOptions,
) -> Result<()> {
    let name = config.name.clone();
    let invalid = |msg: String| Error::invalid(format!("model '{name}': {msg}"));
    let all_inputs = inputs;
    for sig in inputs.iter().chain(outputs) {
        if sig.datatype.is_none() {
            return Err(invalid(format!(
                "tensor '{}' of the ONNX model is not a tensor of a supported type",
                sig.name
            )));
        }
    }
    // Control and state tensors of a sequence model are the server's, not the client's.
    let sequence = sequence_spec(config).map_err(&invalid)?;
    let injected: Vec<String> = sequence
        .iter()
        .flat_map(|s| s.injected_inputs().map(str::to_owned))
        .collect();
    let state_outputs: Vec<String> = sequence
        .iter()
        .flat_map(|s| s.states.iter().map(|st| st.output.clone()))
        .collect();
    let inputs: Vec<&Signature> = inputs
        .iter()
        .filter(|s| !injected.contains(&s.name))
        .collect();
    let model_outputs = outputs;
    let outputs: Vec<&Signature> = outputs
        .iter()
        .filter(|s| !state_outputs.contains(&s.name))
        .collect();
    if !options.disable_auto_complete && config.input.is_empty() && config.output.is_empty() {
        let batchable = config.max_batch_size == 0
            && options.default_max_batch_size > 0
            && inputs
                .iter()
                .chain(&outputs)
                .all(|s| s.shape.first() == Some(&-1));
        if batchable {
            config.max_batch_size = options.default_max_batch_size;
        }
        let skip = usize::from(config.max_batch_size > 0);
        config.input = inputs
            .iter()
            .map(|s| ModelInput {
                name: s.name.clone(),
                data_type: s.datatype.map_or(0, DataType::config_value),
                dims: s.shape.get(skip..).unwrap_or_default().to_vec(),
                ..Default::default()
            })
            .collect();
        config.output = outputs
            .iter()
            .map(|s| ModelOutput {
                name: s.name.clone(),
                data_type: s.datatype.map_or(0, DataType::config_value),
                dims: s.shape.get(skip..).unwrap_or_default().to_vec(),
                ..Default::default()
            })
            .collect();
    }
    if config.input.is_empty() || config.output.is_empty() {
        return Err(invalid(
            "config.pbtxt declares no inputs or no outputs and auto-complete is disabled"
                .to_owned(),
        ));
    }
    let batch = config.max_batch_size;
    for input in &config.input {
        // With `reshape`, the model sees the reshaped form.
        let shape = input.reshape.as_ref().map_or(&input.dims, |r| &r.shape);
        check_against_model(
            "input",
            &input.name,
            input.data_type,
            shape,
            batch,
            all_inputs,
        )
        .map_err(&invalid)?;
    }
    for sig in &inputs {
        if !config.input.iter().any(|i| i.name == sig.name) {
            return Err(invalid(format!(
                "the ONNX model has input '{}' {} {} that config.pbtxt does not declare",
                sig.name,
                sig.datatype.map_or("?", |d| d.config_name()),
                shape_string(&sig.shape)
            )));
        }
    }
    for output in &config.output {
        let shape = output.reshape.as_ref().map_or(&output.dims, |r| &r.shape);
        check_against_model(
            "output",
            &output.name,
            output.data_type,
            shape,
            batch,
            model_outputs,
        )
        .map_err(&invalid)?;
    }
    for control in sequence.iter().flat_map(|s| &s.controls) {
        let data_type = control.datatype.config_value();
        check_against_model("input", &control.name, data_type, &[1], batch, all_inputs)
            .map_err(|e| invalid(format!("control {e}")))?;
    }
    for state in sequence.iter().flat_map(|s| &s.states) {
        let data_type = state.datatype.config_value();
        check_against_model(
            "input",
            &state.input,
            data_type,
            &state.dims,
            batch,
            all_inputs,
        )
        .map_err(|e| invalid(format!("state {e}")))?;
        check_against_model(
            "output",
            &state.output,
            data_type,
            &state.dims,
            batch,
            model_outputs,
        )
        .map_err(|e| invalid(format!("state {e}")))?;
    }
    Ok(())
}

fn check_against_model(
    kind: &str,
    name: &str,
    data_type: i32,
    dims: &[i64],
    max_batch_size: i32,
    model: &[Signature],
) -> std::result::Result<(), String> {
    let Some(sig) = model.iter().find(|s| s.name == name) else {
        let names: Vec<&str> = model.iter().map(|s| s.name.as_str()).collect();
        return Err(format!(
            "{kind} '{name}' in config.pbtxt is not an {kind} of the ONNX model (its {kind}s are: {})",
            names.join(", ")
        ));
    };
    let declared = DataType::from_config_value(data_type);
    if declared != sig.datatype {
        return Err(format!(
            "{kind} '{name}': config.pbtxt says data_type {} but the ONNX model has {}",
            declared.map_or("TYPE_INVALID", |d| d.config_name()),
            sig.datatype
                .map_or("an unsupported type", |d| d.config_name())
        ));
    }
    let batch = usize::from(max_batch_size > 0);
    if sig.shape.is_empty() && dims.is_empty() && batch == 0 {
        return Ok(());
    }
    if dims.len() + batch != sig.shape.len() {
        let extra = if batch == 1 {
            format!(
                " (max_batch_size {max_batch_size} adds a leading batch dimension to dims, making {} dimensions)",
                dims.len() + 1
            )
        } else {
            String::new()
        };
        return Err(format!(
            "{kind} '{name}': the ONNX model's shape {} has {} dimensions, but config.pbtxt gives dims {}{extra}",
            shape_string(&sig.shape),
            sig.shape.len(),
            shape_string(dims)
        ));
    }
    if batch == 1 && sig.shape[0] != -1 {
        return Err(format!(
            "{kind} '{name}': max_batch_size is {max_batch_size}, but the ONNX model fixes the first dimension to {}; \
             set max_batch_size: 0 and give the full shape in dims",
            sig.shape[0]
        ));
    }
    for (i, (&want, &have)) in dims.iter().zip(&sig.shape[batch..]).enumerate() {
        if want != -1 && have != -1 && want != have {
            return Err(format!(
                "{kind} '{name}': dims {} differ from the ONNX model's shape {} at dimension {i}",
                shape_string(dims),
                shape_string(&sig.shape)
            ));
        }
    }
    Ok(())
}

/// One execution instance: an ONNX Runtime session, or one per batch bucket.
struct OnnxInstance {
    name: String,
    /// One session, or one per batch bucket in bucket order.
    sessions: Vec<Session>,
    /// The host memory inputs are gathered into and outputs land in.
    staging: Staging,
    output_types: Vec<(String, DataType)>,
    shapes: Reshapes,
    buckets: Option<Arc<ShapeBuckets>>,
}

/// The shape one execution runs at: rows padded to a batch bucket, variable dimensions to
/// the padded sequence length.
struct Padding {
    /// Real rows of the batch.
    rows: usize,
    /// Rows the execution runs with.
    padded_rows: usize,
    /// The padded length of the variable dimensions, when they are padded.
    sequence: Option<i64>,
    /// Which session runs it.
    session: usize,
}

/// The `reshape` settings of a model's tensors: inputs are handed to ONNX Runtime in their
/// reshaped form, outputs come back to their declared dims.
#[derive(Clone, Default)]
struct Reshapes {
    batching: bool,
    /// Input name → the shape the model takes.
    inputs: Vec<(String, Vec<i64>)>,
    /// Output name → the declared dims.
    outputs: Vec<(String, Vec<i64>)>,
}

impl Reshapes {
    fn of(config: &ModelConfig) -> Self {
        Self {
            batching: config.max_batch_size > 0,
            inputs: config
                .input
                .iter()
                .filter_map(|i| Some((i.name.clone(), i.reshape.as_ref()?.shape.clone())))
                .collect(),
            outputs: config
                .output
                .iter()
                .filter(|o| o.reshape.is_some())
                .map(|o| (o.name.clone(), o.dims.clone()))
                .collect(),
        }
    }

    fn input(&self, name: &str) -> Option<&[i64]> {
        let found = self.inputs.iter().find(|(n, _)| n == name);
        found.map(|(_, shape)| shape.as_slice())
    }

    /// Gives an output its declared dims back (they hold the same elements).
    fn output(&self, tensor: &mut Tensor) {
        if let Some((_, dims)) = self.outputs.iter().find(|(n, _)| *n == tensor.name) {
            let rows = tensor.shape.first().copied().filter(|_| self.batching);
            tensor.shape = rows.into_iter().chain(dims.iter().copied()).collect();
        }
    }
}

impl OnnxInstance {
    /// How a batch of `requests` is padded (no padding without buckets).
    fn padding(&self, requests: &[&InferRequest]) -> Padding {
        let rows = if self.shapes.batching {
            requests.iter().map(|r| batch::rows(r)).sum()
        } else {
            1
        };
        let Some(b) = self.buckets.as_deref() else {
            return Padding {
                rows,
                padded_rows: rows,
                sequence: None,
                session: 0,
            };
        };
        let padded_rows = if self.shapes.batching {
            b.batch_size(rows)
        } else {
            rows
        };
        // The batch's requests agree on their padded shape (the scheduler batches so).
        let sequence = requests
            .first()
            .and_then(|r| b.sequence_of(r))
            .map(|len| b.padded_len(len));
        let session = if self.sessions.len() > 1 {
            b.bucket_index(rows).min(self.sessions.len() - 1)
        } else {
            0
        };
        Padding {
            rows,
            padded_rows,
            sequence,
            session,
        }
    }

    /// Builds one ONNX Runtime input per model input from `requests` (several requests are
    /// concatenated along the batch dimension, and padded, while being copied in), runs the
    /// session and collects `outputs` for the real rows.
    fn run(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
        padding: &Padding,
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let start = Instant::now();
        let Some(first) = requests.first() else {
            return Err(Error::internal("no request to run"));
        };
        let mut values: Vec<(&str, DynValue)> = Vec::with_capacity(first.inputs.len());
        for (i, tensor) in first.inputs.iter().enumerate() {
            let parts: Vec<&Tensor> = requests.iter().filter_map(|r| r.inputs.get(i)).collect();
            let mut shape = match &self.buckets {
                Some(b) => b.padded_shape(&tensor.name, &tensor.shape, padding.sequence),
                None => tensor.shape.clone(),
            };
            if self.shapes.batching {
                if let Some(rows) = shape.first_mut() {
                    *rows = padding.padded_rows as i64;
                }
            }
            let reshape = self.shapes.input(&tensor.name);
            let value = to_ort_value(
                &parts,
                shape,
                reshape,
                self.shapes.batching,
                self.staging.allocator(),
            )?;
            values.push((tensor.name.as_str(), value));
        }
        let prepared = Instant::now();
        let session = self
            .sessions
            .get_mut(padding.session)
            .ok_or_else(|| Error::internal("no session for this batch size"))?;
        let results = self.staging.run(session, values, outputs)?;
        let ran = Instant::now();
        let mut tensors = Vec::with_capacity(outputs.len());
        for (name, value) in outputs.iter().zip(results) {
            let mut tensor = from_ort_value(name, value)?;
            if padding.padded_rows > padding.rows {
                tensor = batch::first_rows(&self.name, tensor, padding.rows)?;
            }
            self.shapes.output(&mut tensor);
            if let Some((_, want)) = self.output_types.iter().find(|(n, _)| n == name) {
                if *want != tensor.datatype {
                    return Err(Error::internal(format!(
                        "output '{name}' is {} but the configuration declares {}",
                        tensor.datatype, want
                    )));
                }
            }
            tensors.push(tensor);
        }
        let timings = ExecTimings {
            compute_input: prepared - start,
            compute_infer: ran - prepared,
            compute_output: ran.elapsed(),
            padded_rows: (padding.padded_rows - padding.rows) as u64,
        };
        Ok((tensors, timings))
    }

    /// Cuts a request's outputs back from the padded sequence length to its own.
    fn unpad(
        &self,
        request: &InferRequest,
        outputs: &mut [Tensor],
        padding: &Padding,
    ) -> Result<()> {
        match (&self.buckets, padding.sequence) {
            (Some(b), Some(padded)) => match b.sequence_of(request) {
                Some(len) => b.crop_outputs(outputs, len, padded),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

impl ModelInstance for OnnxInstance {
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let (mut results, timings) = self.execute_batch(&[request], outputs);
        let result = results
            .pop()
            .unwrap_or_else(|| Err(Error::internal("no result for the request")));
        result.map(|tensors| (tensors, timings))
    }

    /// Like the default, but each request's inputs are copied once, straight into ONNX
    /// Runtime's tensors (padded there), instead of into a merged request first.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let _span = crate::trace_span!(parent: &tracing::Span::current(), "onnx.run").entered();
        let padding = self.padding(requests);
        let (tensors, timings) = match self.run(requests, outputs, &padding) {
            Ok(ran) => ran,
            Err(e) => return (vec![Err(e); requests.len()], ExecTimings::default()),
        };
        let parts = if let [_] = requests {
            vec![tensors]
        } else {
            let rows: Vec<usize> = requests.iter().map(|r| batch::rows(r)).collect();
            match batch::split(&self.name, tensors, &rows) {
                Ok(parts) => parts,
                Err(e) => return (vec![Err(e); requests.len()], timings),
            }
        };
        let results = requests
            .iter()
            .zip(parts)
            .map(|(request, mut tensors)| {
                self.unpad(request, &mut tensors, &padding)?;
                Ok(tensors)
            })
            .collect();
        (results, timings)
    }
}

fn ort_error(name: &str, e: ort::Error) -> Error {
    Error::internal(format!("cannot hand tensor '{name}' to ONNX Runtime: {e}"))
}

/// One ONNX Runtime input of `shape` from `parts` (one per request, concatenated along the
/// batch dimension). Where `shape` is larger than the parts (padding to a bucket), the rest
/// is zeros, or empty strings. With `reshape`, the model sees that shape (after the batch
/// dimension when `batching`) instead of the declared dims.
fn to_ort_value(
    parts: &[&Tensor],
    shape: Vec<i64>,
    reshape: Option<&[i64]>,
    batching: bool,
    allocator: &Allocator,
) -> Result<DynValue> {
    let Some(first) = parts.first() else {
        return Err(Error::internal("no tensor to hand to ONNX Runtime"));
    };
    // Whether each part fills whole rows of `shape` (no padding inside a row).
    let whole_rows = if batching {
        parts.iter().all(|t| t.shape.get(1..) == shape.get(1..))
    } else {
        parts.len() == 1 && first.shape == shape
    };
    if !whole_rows && first.datatype == DataType::Bytes {
        return Err(Error::internal(format!(
            "input '{}': TYPE_STRING inputs are padded only along the batch dimension",
            first.name
        )));
    }
    let model_shape = |shape: &[i64]| -> Vec<i64> {
        match reshape {
            Some(reshape) => {
                let rows = shape.first().copied().filter(|_| batching);
                rows.into_iter().chain(reshape.iter().copied()).collect()
            }
            None => shape.to_vec(),
        }
    };
    if first.datatype == DataType::Bytes {
        let mut strings = parts
            .iter()
            .flat_map(|t| bytes_elements(&t.data))
            .map(|b| {
                if b.contains(&0) {
                    return Err(Error::invalid(format!(
                        "input '{}': ONNX string tensors cannot hold NUL bytes",
                        first.name
                    )));
                }
                std::str::from_utf8(b).map(str::to_owned).map_err(|_| {
                    Error::invalid(format!(
                        "input '{}': ONNX string tensors need UTF-8 text",
                        first.name
                    ))
                })
            })
            .collect::<Result<Vec<String>>>()?;
        // Padding rows of empty strings.
        strings.resize(
            element_count(&shape).unwrap_or(strings.len()),
            String::new(),
        );
        let value = OrtTensor::from_string_array((model_shape(&shape), strings.as_slice()))
            .map_err(|e| ort_error(&first.name, e))?;
        return Ok(value.into_dyn());
    }
    let size = first.datatype.element_size().unwrap_or(1);
    let total: usize = parts.iter().map(|t| t.data.len()).sum();
    for part in parts {
        if element_count(&part.shape).map(|n| n * size) != Some(part.data.len()) {
            return Err(Error::invalid(format!(
                "input '{}': {} bytes of data for shape {}",
                part.name,
                part.data.len(),
                shape_string(&part.shape)
            )));
        }
    }
    let bytes = element_count(&shape).map(|n| n * size).ok_or_else(|| {
        Error::invalid(format!(
            "input '{}': shape {} is not a tensor shape",
            first.name,
            shape_string(&shape)
        ))
    })?;
    let row_dims = buckets::dims(shape.get(usize::from(batching)..).unwrap_or_default());
    let fits = |part: &Tensor| {
        let d = buckets::dims(&part.shape);
        let inner = d.get(usize::from(batching)..).unwrap_or_default();
        inner.len() == row_dims.len() && inner.iter().zip(&row_dims).all(|(a, b)| a <= b)
    };
    if total > bytes || !parts.iter().all(|p| fits(p)) {
        return Err(Error::internal(format!(
            "input '{}': the batch's data does not fit shape {}",
            first.name,
            shape_string(&shape)
        )));
    }
    let mut value = DynTensor::new(
        allocator,
        to_element_type(first.datatype),
        model_shape(&shape),
    )
    .map_err(|e| ort_error(&first.name, e))?;
    if bytes > 0 {
        // SAFETY: the tensor was allocated in host memory (plain or pinned) for its shape and this element type,
        // which is `bytes` bytes.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(value.data_ptr_mut().cast::<u8>(), bytes) };
        if whole_rows {
            let mut offset = 0;
            for part in parts {
                dst[offset..offset + part.data.len()].copy_from_slice(&part.data);
                offset += part.data.len();
            }
            dst[total.min(bytes)..].fill(0);
        } else {
            dst.fill(0);
            let row_bytes = row_dims.iter().product::<usize>() * size;
            let mut offset = 0;
            for part in parts {
                let part_dims = buckets::dims(&part.shape);
                if !batching {
                    buckets::copy_corner(&part.data, &part_dims, dst, &row_dims, size);
                    continue;
                }
                let part_rows = part_dims.first().copied().unwrap_or(1);
                let target: Vec<usize> = std::iter::once(part_rows)
                    .chain(row_dims.iter().copied())
                    .collect();
                let end = offset + part_rows * row_bytes;
                if end > bytes {
                    return Err(Error::internal(format!(
                        "input '{}': the batch has more rows than shape {}",
                        first.name,
                        shape_string(&shape)
                    )));
                }
                buckets::copy_corner(&part.data, &part_dims, &mut dst[offset..end], &target, size);
                offset = end;
            }
        }
    }
    Ok(value.into_dyn())
}

fn from_ort_value(name: &str, value: DynValue) -> Result<Tensor> {
    let (ty, shape) = match value.dtype() {
        ValueType::Tensor { ty, shape, .. } => (*ty, shape.iter().copied().collect::<Vec<i64>>()),
        other => {
            return Err(Error::internal(format!(
                "output '{name}' is not a tensor ({other:?})"
            )))
        }
    };
    let datatype = to_data_type(ty).ok_or_else(|| {
        Error::internal(format!(
            "output '{name}' has an unsupported element type {ty:?}"
        ))
    })?;
    let data = if datatype == DataType::Bytes {
        let (_, strings) = value
            .try_extract_strings()
            .map_err(|e| ort_error(name, e))?;
        let mut out = Vec::new();
        for s in &strings {
            push_bytes_element(&mut out, s.as_bytes());
        }
        Bytes::from(out)
    } else {
        let tensor = value
            .downcast::<DynTensorValueType>()
            .map_err(|e| ort_error(name, e))?;
        match tensor.size().unwrap_or(0) {
            0 => Bytes::new(),
            len => Bytes::from_owner(OutputMemory { tensor, len }),
        }
    };
    Ok(Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        data,
    })
}

/// An output tensor's own memory, answered as it is: the bytes (and every request's slice of
/// a batch) keep the ONNX Runtime value alive instead of copying it out.
struct OutputMemory {
    tensor: DynTensor,
    /// Its size in bytes, as ONNX Runtime reports it.
    len: usize,
}

impl AsRef<[u8]> for OutputMemory {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a host tensor (`Staging` binds outputs to host memory, plain or pinned) that this owns, `len`
        // bytes as ONNX Runtime reports, never written after the run.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr().cast::<u8>(), self.len) }
    }
}
