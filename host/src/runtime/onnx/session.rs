//! Building a session: thread counts, the session settings a configuration names (graph
//! optimisation level, execution mode, memory arena and pattern), execution providers (CPU,
//! CUDA, TensorRT) and the TensorRT shape profile.

use std::path::Path;

use ort::{
    environment::Environment,
    session::{builder::GraphOptimizationLevel, RunOptions, Session},
};

use crate::runtime::gpu::{self, Placement};
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    tensor::DataType,
};

/// TensorRT's optimisation profile for one batch bucket (`name:BxD1xD2,...`), the minimum,
/// optimum and maximum alike; `None` when an input has variable dimensions besides the batch
/// (TensorRT then profiles by itself).
pub(super) fn tensorrt_profile(config: &ModelConfig, rows: usize) -> Option<String> {
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

pub(super) fn output_types(config: &ModelConfig) -> Vec<(String, DataType)> {
    config
        .output
        .iter()
        .filter_map(|o| Some((o.name.clone(), DataType::from_config_value(o.data_type)?)))
        .collect()
}

pub(super) fn thread_counts(config: &ModelConfig, instances: usize) -> Result<(usize, usize)> {
    let param = |key: &str| {
        crate::runtime::model_config::parameter::<usize>(config, key, "a non-negative integer")
    };
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

/// The model `parameters` ONNX Runtime models take here: Triton's ONNX Runtime backend's own,
/// and this server's batch buckets. Triton's backend ignores any other key; so does this one,
/// with a log line.
pub(super) fn known_parameter(key: &str) -> bool {
    const KEYS: [&str; 10] = [
        "intra_op_thread_count",
        "inter_op_thread_count",
        "execution_mode",
        "enable_mem_arena",
        "enable_mem_pattern",
        USE_DEVICE_ALLOCATOR,
        ARENA_SHRINKAGE,
        crate::runtime::buckets::BATCH_BUCKETS,
        crate::runtime::buckets::PAD_SEQUENCE,
        crate::runtime::buckets::SESSION_PER_BUCKET,
    ];
    KEYS.contains(&key) || gpu::CUDA_MODEL_PARAMETERS.contains(&key)
}

const USE_DEVICE_ALLOCATOR: &str = "session.use_device_allocator_for_initializers";
const ARENA_SHRINKAGE: &str = "memory.enable_memory_arena_shrinkage";

/// The session and run settings a configuration names, read as Triton's ONNX Runtime backend
/// reads them: `optimization { graph { level } }` (-1 basic, 1 extended, 2 none, anything
/// else all), and the parameters `execution_mode` (0 sequential, 1 parallel),
/// `enable_mem_arena`, `enable_mem_pattern`, `session.use_device_allocator_for_initializers`
/// and `memory.enable_memory_arena_shrinkage` (a run option).
#[derive(Debug, Clone)]
pub(super) struct SessionSettings {
    level: GraphOptimizationLevel,
    parallel: bool,
    mem_arena: Option<bool>,
    mem_pattern: Option<bool>,
    device_allocator_for_initializers: Option<String>,
    arena_shrinkage: Option<String>,
    /// Custom operator libraries (`model_operations { op_library_filename }`).
    pub(super) op_libraries: Vec<std::path::PathBuf>,
}

impl SessionSettings {
    pub(super) fn of(config: &ModelConfig) -> Result<Self> {
        let name = &config.name;
        let level = match config
            .optimization
            .as_ref()
            .and_then(|o| o.graph.as_ref())
            .map(|g| g.level)
        {
            Some(-1) => GraphOptimizationLevel::Level1,
            Some(1) => GraphOptimizationLevel::Level2,
            Some(2) => GraphOptimizationLevel::Disable,
            _ => GraphOptimizationLevel::All,
        };
        let text = |key: &str| config.parameters.get(key).map(|p| p.string_value.trim());
        let flag = |key: &str| -> Result<Option<bool>> {
            text(key)
                .map(|v| {
                    parse_bool(v).ok_or_else(|| {
                        Error::invalid(format!(
                            "model '{name}': parameter '{key}' must be true or false (or 1/0, \
                             on/off), got \"{v}\""
                        ))
                    })
                })
                .transpose()
        };
        let parallel = match text("execution_mode") {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(Error::invalid(format!(
                    "model '{name}': parameter 'execution_mode' must be 0 (sequential) or 1 \
                     (parallel), got \"{other}\""
                )))
            }
        };
        let mem_arena = flag("enable_mem_arena")?;
        let arena_shrinkage = text(ARENA_SHRINKAGE).map(str::to_owned);
        if let (Some(false), Some(devices)) = (mem_arena, &arena_shrinkage) {
            if devices.contains("cpu") {
                // ONNX Runtime would fail every run saying it has no arena to shrink.
                return Err(Error::invalid(format!(
                    "model '{name}': parameter '{ARENA_SHRINKAGE}' shrinks the CPU arena \
                     (\"{devices}\"), but 'enable_mem_arena' turns that arena off"
                )));
            }
        }
        Ok(Self {
            level,
            parallel,
            mem_arena,
            mem_pattern: flag("enable_mem_pattern")?,
            device_allocator_for_initializers: text(USE_DEVICE_ALLOCATOR).map(str::to_owned),
            arena_shrinkage,
            op_libraries: Vec::new(),
        })
    }

    /// The run options every execution of the model uses, if any are set.
    pub(super) fn run_options(&self, model: &str) -> Result<Option<RunOptions>> {
        let Some(devices) = &self.arena_shrinkage else {
            return Ok(None);
        };
        let failed = |e: ort::Error| {
            Error::invalid(format!(
                "model '{model}': parameter '{ARENA_SHRINKAGE}' \"{devices}\": {e}"
            ))
        };
        let mut options = RunOptions::new().map_err(failed)?;
        options.set(ARENA_SHRINKAGE, devices).map_err(failed)?;
        Ok(Some(options))
    }
}

fn parse_bool(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "yes" => Some(true),
        "false" | "0" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// The execution providers of GPU sessions (read only by GPU builds).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct Providers<'a> {
    pub(super) accelerators: &'a gpu::Accelerators,
    /// Where TensorRT caches engines, if it does.
    pub(super) engine_cache: Option<&'a str>,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn build_session(
    env: &Environment,
    path: &Path,
    intra: usize,
    inter: usize,
    settings: &SessionSettings,
    placement: Placement,
    providers: &Providers<'_>,
    profile: Option<&str>,
) -> std::result::Result<Session, String> {
    let mut builder = Session::builder(env)
        .map_err(|e| e.to_string())?
        .with_intra_threads(intra)
        .map_err(|e| e.to_string())?
        .with_inter_threads(inter)
        .map_err(|e| e.to_string())?
        .with_optimization_level(settings.level)
        .map_err(|e| e.to_string())?
        .with_parallel_execution(settings.parallel)
        .map_err(|e| e.to_string())?;
    if let Some(enable) = settings.mem_pattern {
        builder = builder
            .with_memory_pattern(enable)
            .map_err(|e| e.to_string())?;
    }
    if let Some(value) = &settings.device_allocator_for_initializers {
        builder = builder
            .with_config_entry(USE_DEVICE_ALLOCATOR, value)
            .map_err(|e| e.to_string())?;
    }
    // Sessions with custom operator libraries are built one at a time: registering a
    // library's domain while another session registers it has failed in ONNX Runtime ("the
    // domain is already exist") when two models loaded in parallel.
    static CUSTOM_OPS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = (!settings.op_libraries.is_empty()).then(|| {
        CUSTOM_OPS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    });
    for library in &settings.op_libraries {
        builder = builder
            .with_operator_library(library)
            .map_err(|e| format!("custom operator library '{}': {e}", library.display()))?;
    }
    if let Placement::Gpu(device) = placement {
        builder = with_gpu(builder, device, providers, profile)?;
    }
    if let Some(enable) = settings.mem_arena {
        // The CPU provider's registration is what turns the CPU memory arena on or off.
        builder = builder
            .with_execution_providers([ort::ep::CPU::default()
                .with_arena_allocator(enable)
                .build()
                .error_on_failure()])
            .map_err(|e| e.to_string())?;
    }
    let session = builder.commit_from_file(path).map_err(|e| e.to_string())?;
    // The file's protobuf and the weights ONNX Runtime repacked are freed by now.
    super::super::heap::release_freed();
    Ok(session)
}

/// Adds the GPU execution providers: TensorRT first when asked for (ONNX Runtime falls back
/// to CUDA for what TensorRT does not take), then CUDA with the configured options, each
/// failing the load if unavailable.
#[cfg(feature = "cuda")]
pub(super) fn with_gpu(
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
pub(super) fn with_gpu(
    _: ort::session::builder::SessionBuilder,
    _: i32,
    _: &Providers<'_>,
    _: Option<&str>,
) -> std::result::Result<ort::session::builder::SessionBuilder, String> {
    // `placements` refuses GPU groups in such a build; kept for a clear message regardless.
    Err("this wasmtron build has no GPU support (rebuild with `--features cuda`)".to_owned())
}

/// The custom operator libraries of `model_operations { op_library_filename }`, as Triton's ONNX
/// Runtime backend registers them with each session: native code run inside the server, so
/// loaded only when allowed (`--allow-custom-op-libraries`), else the load is refused naming
/// the flag, and never for a configuration or files sent with a load request. An absolute
/// path is taken as given; a relative one names a file in the model's folder (without `.` or
/// `..`).
pub(super) fn operator_libraries(
    config: &ModelConfig,
    model_dir: &Path,
    settings: &super::OnnxSettings,
    load: &crate::runtime::backend::LoadContext,
) -> Result<Vec<std::path::PathBuf>> {
    let name = &config.name;
    let named: Vec<&String> = config
        .model_operations
        .iter()
        .flat_map(|ops| &ops.op_library_filename)
        .collect();
    if named.is_empty() {
        return Ok(Vec::new());
    }
    if load.sent_by_client {
        return Err(Error::invalid(format!(
            "model '{name}': field 'model_operations.op_library_filename': custom operator \
             libraries are native code, and a configuration or files sent with a load request \
             never name one; place the model and its library in the repository"
        )));
    }
    if !settings.allow_custom_op_libraries {
        return Err(Error::invalid(format!(
            "model '{name}': field 'model_operations.op_library_filename': custom operator \
             libraries are native code that would run inside the server, outside any sandbox; \
             start the server with --allow-custom-op-libraries to load them"
        )));
    }
    named
        .into_iter()
        .map(|file| {
            let path = Path::new(file);
            let path = if path.is_absolute() {
                path.to_path_buf()
            } else {
                let relative = crate::names::ModelFilePath::parse(file).map_err(|_| {
                    Error::invalid(format!(
                        "model '{name}': field 'model_operations.op_library_filename': '{file}' \
                         must be an absolute path or a file in the model's folder (without \
                         '.' or '..')"
                    ))
                })?;
                model_dir.join(relative.to_path())
            };
            if path.is_file() {
                Ok(path)
            } else {
                Err(Error::invalid(format!(
                    "model '{name}': field 'model_operations.op_library_filename': '{}' is not \
                     a file",
                    path.display()
                )))
            }
        })
        .collect()
}
