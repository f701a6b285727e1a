//! Building a session: thread counts, execution providers (CPU, CUDA, TensorRT) and the
//! TensorRT shape profile.

use std::path::Path;

use ort::{environment::Environment, session::Session};

use crate::runtime::gpu::{self, Placement};
use crate::{error::Result, proto::inference::ModelConfig, tensor::DataType};

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
    let param =
        |key: &str| crate::runtime::parameter::<usize>(config, key, "a non-negative integer");
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
pub(super) struct Providers<'a> {
    pub(super) accelerators: &'a gpu::Accelerators,
    /// Where TensorRT caches engines, if it does.
    pub(super) engine_cache: Option<&'a str>,
}

pub(super) fn build_session(
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
