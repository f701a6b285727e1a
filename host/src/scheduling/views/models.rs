//! Model metadata, the effective configuration and statistics, as the metadata, model
//! configuration and statistics extensions answer them (and Triton's statistics JSON).

use std::sync::Arc;

use serde_json::{json, Value};

use crate::{
    error::Result,
    names::parse_version,
    proto::inference::{
        model_metadata_response::TensorMetadata, InferBatchStatistics, InferResponseStatistics,
        InferStatistics, ModelConfig, ModelMetadataResponse, ModelStatistics, StatisticDuration,
    },
    scheduling::{model_manager::ModelVersion, server::Server, stats::DurationStat},
    tenancy::{Caller, ModelAction},
    tensor::DataType,
};

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

/// The version of `name` that `version` names (empty: the version policy's choice), for a
/// caller who may see the model.
fn seen(server: &Server, caller: &Caller, name: &str, version: &str) -> Result<Arc<ModelVersion>> {
    caller.require(ModelAction::See, name)?;
    server.models().get(name, parse_version(name, version)?)
}

/// Whether `name` (at `version`, or the policy's versions) is loaded and ready, its own
/// readiness check included.
pub async fn model_ready(
    server: &Server,
    caller: &Caller,
    name: &str,
    version: &str,
) -> Result<bool> {
    let models = server.models();
    // `model:adapter`: the model is ready and has the adapter loaded.
    if let Some((model, adapter)) = models.adapter_ref(name) {
        caller.require(ModelAction::See, model)?;
        let version = parse_version(model, version)?;
        return Ok(models.check_ready(model, version).await
            && models.adapter_names(model).iter().any(|a| a == adapter));
    }
    caller.require(ModelAction::See, name)?;
    let version = parse_version(name, version)?;
    Ok(models.check_ready(name, version).await)
}

/// Model metadata: loaded versions, platform and tensor signatures (batch dimension as -1).
pub fn model_metadata(
    server: &Server,
    caller: &Caller,
    name: &str,
    version: &str,
) -> Result<ModelMetadataResponse> {
    let model = seen(server, caller, name, version)?;
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
    let tensor = |name: &str, data_type: i32, dims: &[i64]| TensorMetadata {
        name: name.to_owned(),
        datatype: DataType::from_config_value(data_type)
            .map_or("INVALID", |d| d.wire_name())
            .to_owned(),
        shape: shape(dims),
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
            .map(|i| tensor(&i.name, i.data_type, &i.dims))
            .collect(),
        outputs: config
            .output
            .iter()
            .map(|o| tensor(&o.name, o.data_type, &o.dims))
            .collect(),
    })
}

/// The metadata as the HTTP API's JSON answers it (also what the in-process package returns).
pub fn metadata_json(m: &ModelMetadataResponse) -> Value {
    let tensors = |ts: &[TensorMetadata]| -> Vec<Value> {
        ts.iter()
            .map(|t| json!({"name": t.name, "datatype": t.datatype, "shape": t.shape}))
            .collect()
    };
    json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
    })
}

/// The effective configuration of a model version.
pub fn model_config(
    server: &Server,
    caller: &Caller,
    name: &str,
    version: &str,
) -> Result<ModelConfig> {
    let model = seen(server, caller, name, version)?;
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

/// Statistics for one model (all its loaded versions, or one), or for every model the caller
/// may see when `name` is empty.
pub fn model_statistics(
    server: &Server,
    caller: &Caller,
    name: &str,
    version: &str,
) -> Result<Vec<ModelStatistics>> {
    let versions = if name.is_empty() {
        let mut all = server.models().loaded();
        all.retain(|m| caller.may(ModelAction::See, &m.name));
        all
    } else {
        caller.require(ModelAction::See, name)?;
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

fn duration_json(d: &Option<StatisticDuration>) -> Value {
    let d = d.unwrap_or_default();
    json!({"count": d.count, "ns": d.ns})
}

/// The statistics extension's JSON (`GET /v2/models/<m>/stats`), also what the in-process
/// Python API returns.
pub fn stats_json(stats: Vec<ModelStatistics>) -> Value {
    let models: Vec<Value> = stats
        .into_iter()
        .map(|s| {
            let i = s.inference_stats.unwrap_or_default();
            json!({
                "name": s.name,
                "version": s.version,
                "last_inference": s.last_inference,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": duration_json(&i.success),
                    "fail": duration_json(&i.fail),
                    "queue": duration_json(&i.queue),
                    "compute_input": duration_json(&i.compute_input),
                    "compute_infer": duration_json(&i.compute_infer),
                    "compute_output": duration_json(&i.compute_output),
                    "cache_hit": duration_json(&i.cache_hit),
                    "cache_miss": duration_json(&i.cache_miss),
                },
                "response_stats": s.response_stats.iter().map(|(index, r)| (index.clone(), json!({
                    "compute_infer": duration_json(&r.compute_infer),
                    "compute_output": duration_json(&r.compute_output),
                    "success": duration_json(&r.success),
                    "fail": duration_json(&r.fail),
                    "empty_response": duration_json(&r.empty_response),
                    "cancel": duration_json(&r.cancel),
                }))).collect::<serde_json::Map<String, Value>>(),
                "batch_stats": s.batch_stats.iter().map(|b| json!({
                    "batch_size": b.batch_size,
                    "compute_input": duration_json(&b.compute_input),
                    "compute_infer": duration_json(&b.compute_infer),
                    "compute_output": duration_json(&b.compute_output),
                })).collect::<Vec<_>>(),
                "memory_usage": [],
                "warmup": duration_json(&s.warmup),
            })
        })
        .collect();
    json!({ "model_stats": models })
}

/// The blocks a generation model's prefix cache holds, as its KV-cache events told them
/// (`GET /v2/models/<name>/kv_cache`): tokens per block and the blocks' hashes, increasing.
pub fn kv_cache_blocks(server: &Server, caller: &Caller, name: &str) -> Result<(usize, Vec<u64>)> {
    caller.require(ModelAction::See, name)?;
    let model = server.models().get(name, None)?;
    let blocks = model
        .capabilities
        .prefix_cache
        .as_ref()
        .and_then(|cache| cache.blocks());
    blocks.ok_or_else(|| {
        crate::error::Error::new(
            crate::error::Code::NotFound,
            format!(
                "model '{name}' publishes no KV-cache events (a generation model, with \
                 --kv-events-config)"
            ),
        )
    })
}
