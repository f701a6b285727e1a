//! Frontends: KServe v2 and OpenAI's API over HTTP ([`http`]), KServe v2 over gRPC ([`grpc`]),
//! Prometheus [`metrics`], shared memory, and the [`listeners`] that serve them.
//! They translate the wire into [`crate::inference`] types and back; the views they share
//! (metadata, statistics) are built once here in protocol types.

pub mod connections;
pub mod cpu_metrics;
pub mod generation_metrics;
pub mod gpu_metrics;
pub mod grpc;
pub mod http;
pub mod latency_metrics;
pub mod listeners;
pub mod logging;
pub mod metrics;
pub mod restricted;
pub mod shared_memory;
pub mod tls;
pub mod trace;
pub mod trace_file;

use crate::{
    error::{Error, Result},
    names::ModelName,
    proto::inference::{
        model_metadata_response::TensorMetadata, InferBatchStatistics, InferResponseStatistics,
        InferStatistics, ModelConfig, ModelMetadataResponse, ModelStatistics, StatisticDuration,
    },
    scheduling::{model_manager::LoadOverride, server::Server, stats::DurationStat},
    tenancy::{Caller, ModelAction, Tracked},
    tensor::DataType,
};

/// Server name reported by the metadata endpoints.
pub const SERVER_NAME: &str = "wasmtron";
/// Server version reported by the metadata endpoints.
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Protocol extensions this server really implements (CUDA shared memory in GPU builds).
pub const EXTENSIONS: &[&str] = &[
    #[cfg(feature = "cuda")]
    "cuda_shared_memory",
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "sequence",
    "statistics",
    "parameters",
    "generate",
    "logging",
    "system_shared_memory",
];

pub use crate::names::parse_version;

/// The platform string Triton reports for a configuration.
fn platform(config: &ModelConfig) -> String {
    if !config.platform.is_empty() {
        config.platform.clone()
    } else if config.backend == "onnxruntime" || config.backend.is_empty() {
        "onnxruntime_onnx".to_owned()
    } else {
        config.backend.clone()
    }
}

/// Model metadata: loaded versions, platform and tensor signatures (batch dimension as -1).
pub fn model_metadata(server: &Server, name: &str, version: &str) -> Result<ModelMetadataResponse> {
    let model = server.models().get(name, parse_version(name, version)?)?;
    let config = &model.config;
    let batch = config.max_batch_size > 0;
    let shape = |dims: &[i64]| -> Vec<i64> {
        let mut s = Vec::with_capacity(dims.len() + 1);
        if batch {
            s.push(-1);
        }
        s.extend_from_slice(dims);
        s
    };
    let datatype = |t: i32| {
        DataType::from_config_value(t)
            .map_or("INVALID", |d| d.wire_name())
            .to_owned()
    };
    Ok(ModelMetadataResponse {
        name: name.to_owned(),
        versions: server
            .models()
            .versions(name)
            .iter()
            .map(i64::to_string)
            .collect(),
        platform: platform(config),
        inputs: config
            .input
            .iter()
            .map(|i| TensorMetadata {
                name: i.name.clone(),
                datatype: datatype(i.data_type),
                shape: shape(&i.dims),
            })
            .collect(),
        outputs: config
            .output
            .iter()
            .map(|o| TensorMetadata {
                name: o.name.clone(),
                datatype: datatype(o.data_type),
                shape: shape(&o.dims),
            })
            .collect(),
    })
}

/// The effective configuration of a model version.
pub fn model_config(server: &Server, name: &str, version: &str) -> Result<ModelConfig> {
    let model = server.models().get(name, parse_version(name, version)?)?;
    let mut config = model.config.clone();
    if config.platform.is_empty() {
        config.platform = platform(&config);
    }
    if config.backend.is_empty() && config.platform == "onnxruntime_onnx" {
        config.backend = "onnxruntime".to_owned();
    }
    Ok(config)
}

fn duration(stat: &DurationStat) -> Option<StatisticDuration> {
    Some(StatisticDuration {
        count: stat.count(),
        ns: stat.ns(),
    })
}

/// Statistics for one model (all its loaded versions, or one), or for every model when `name`
/// is empty.
pub fn model_statistics(
    server: &Server,
    name: &str,
    version: &str,
) -> Result<Vec<ModelStatistics>> {
    let versions = if name.is_empty() {
        server.models().loaded()
    } else {
        match parse_version(name, version)? {
            Some(v) => vec![server.models().get(name, Some(v))?],
            None => {
                // Fails with the usual not-found message when nothing is loaded.
                server.models().get(name, None)?;
                server
                    .models()
                    .loaded()
                    .into_iter()
                    .filter(|m| m.name == name)
                    .collect()
            }
        }
    };
    Ok(versions
        .iter()
        .map(|m| {
            let s = &m.stats;
            ModelStatistics {
                name: m.name.clone(),
                version: m.version.to_string(),
                last_inference: s
                    .last_inference_ms
                    .load(std::sync::atomic::Ordering::Relaxed),
                inference_count: s.inference_count.load(std::sync::atomic::Ordering::Relaxed),
                execution_count: s.execution_count.load(std::sync::atomic::Ordering::Relaxed),
                inference_stats: Some(InferStatistics {
                    success: duration(&s.success),
                    fail: duration(&s.fail),
                    queue: duration(&s.queue),
                    compute_input: duration(&s.compute_input),
                    compute_infer: duration(&s.compute_infer),
                    compute_output: duration(&s.compute_output),
                    cache_hit: duration(&s.cache_hit),
                    cache_miss: duration(&s.cache_miss),
                }),
                warmup: duration(&s.warmup),
                batch_stats: s
                    .batch_stats()
                    .into_iter()
                    .map(|(size, b)| InferBatchStatistics {
                        batch_size: size,
                        compute_input: Some(StatisticDuration {
                            count: b.count,
                            ns: b.compute_input_ns,
                        }),
                        compute_infer: Some(StatisticDuration {
                            count: b.count,
                            ns: b.compute_infer_ns,
                        }),
                        compute_output: Some(StatisticDuration {
                            count: b.count,
                            ns: b.compute_output_ns,
                        }),
                    })
                    .collect(),
                // Triton reports the GPU memory a model's load took; CPU models report none
                // there either.
                memory_usage: vec![],
                response_stats: s
                    .response_stats()
                    .into_iter()
                    .map(|(index, r)| {
                        let d = |t: crate::scheduling::stats::Tally| {
                            Some(StatisticDuration {
                                count: t.count,
                                ns: t.ns,
                            })
                        };
                        (
                            index.to_string(),
                            InferResponseStatistics {
                                compute_infer: d(r.compute_infer),
                                compute_output: d(r.compute_output),
                                success: d(r.success),
                                fail: d(r.fail),
                                empty_response: d(r.empty_response),
                                cancel: d(r.cancel),
                            },
                        )
                    })
                    .collect(),
            }
        })
        .collect())
}

/// Starts accounting a request to `model` for the caller's tenant. A name that is not loaded
/// is accounted under the empty model label: clients choose names, and every label value would
/// be kept for good (a bad version or an open stream would otherwise record any name).
pub fn track(server: &Server, caller: &Caller, model: &str) -> Tracked {
    let known = matches!(caller, Caller::Anyone) || server.models().get(model, None).is_ok();
    caller.track(if known { model } else { "" })
}

/// Whether `caller` may load `model` as asked. A configuration or files in the request are for
/// administrators: they could make an ensemble of other tenants' models or run any stage. An
/// ensemble's load also loads the composing models that are not loaded yet: the caller must be
/// allowed to load each of them too.
pub fn check_load(
    server: &Server,
    caller: &Caller,
    model: &str,
    overrides: &LoadOverride,
) -> Result<()> {
    ModelName::parse(model)?;
    caller.require(ModelAction::Load, model)?;
    if overrides.config_json.is_some() || !overrides.files.is_empty() {
        caller.require_admin("load with a configuration or files")?;
    }
    if !matches!(caller, Caller::Tenant(_)) {
        return Ok(());
    }
    for composing in server.models().would_also_load(model, overrides) {
        caller.require(ModelAction::Load, &composing).map_err(|e| {
            Error::new(
                e.code,
                format!(
                    "loading ensemble '{model}' would load '{composing}', which this key may not                      load: {}",
                    e.message
                ),
            )
        })?;
    }
    Ok(())
}

/// Whether `caller` may unload `model` as asked; `unload_dependents` (which unloads the models
/// an ensemble calls, whoever's they are) is for administrators.
pub fn check_unload(caller: &Caller, model: &str, unload_dependents: bool) -> Result<()> {
    ModelName::parse(model)?;
    caller.require(ModelAction::Load, model)?;
    if unload_dependents {
        caller.require_admin("unload_dependents")?;
    }
    Ok(())
}
