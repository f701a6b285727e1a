//! Where model instances run (Triton's `instance_group`: CPU, or GPUs by device id) and the
//! GPU execution accelerators of `config.pbtxt`, for the ONNX Runtime backend; and, with the
//! `cuda` feature, the NVIDIA driver calls behind CUDA shared memory (cudarc, loaded at run
//! time, so a GPU build starts, and says clearly what is missing, on a host without a GPU).

use crate::{
    error::{Error, Result},
    proto::inference::{model_instance_group::Kind, ModelConfig, ModelInstanceGroup},
};

/// Where one model instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On the CPU.
    Cpu,
    /// On the GPU with this CUDA device id.
    Gpu(i32),
}

/// The instances an ONNX Runtime instance group gets on the CPU when its `count` is unset:
/// Triton's default for this backend (one per GPU on a GPU).
pub const DEFAULT_CPU_INSTANCE_COUNT: i32 = 2;

/// Writes Triton's defaults into the instance groups, so that the configuration the server
/// reports is the one it runs: no group means one named after the model, `KIND_AUTO` becomes
/// `KIND_GPU` (every visible GPU) or `KIND_CPU`, an unset name `<model>_<index>` and an unset
/// `count` 1 per GPU or `default_cpu_count` on the CPU. A `KIND_GPU` group on a host without a
/// GPU is left as it is for [`placements`] to refuse by name.
pub fn normalize_instance_groups(config: &mut ModelConfig, default_cpu_count: i32) {
    let visible = device_count().unwrap_or(0) as i32;
    if config.instance_group.is_empty() {
        config.instance_group.push(ModelInstanceGroup {
            name: config.name.clone(),
            kind: Kind::Auto as i32,
            ..Default::default()
        });
    }
    for (i, group) in config.instance_group.iter_mut().enumerate() {
        if group.name.is_empty() {
            group.name = format!("{}_{i}", config.name);
        }
        if group.kind == Kind::Auto as i32 {
            group.kind = if !group.gpus.is_empty() || visible > 0 {
                Kind::Gpu as i32
            } else {
                Kind::Cpu as i32
            };
        }
        if group.kind == Kind::Gpu as i32 && group.gpus.is_empty() && visible > 0 {
            group.gpus = (0..visible).collect();
        }
        if group.count < 1 {
            group.count = if group.kind == Kind::Cpu as i32 {
                default_cpu_count
            } else {
                1
            };
        }
    }
}

/// One placement per instance, as Triton places them: a `KIND_CPU` group gives `count`
/// instances on the CPU, a `KIND_GPU` group `count` instances on each of its `gpus` (every
/// visible GPU when none are listed), `KIND_AUTO` is `KIND_GPU` where a GPU build finds GPUs
/// and `KIND_CPU` otherwise. Without groups: one instance, placed as `KIND_AUTO`.
pub fn placements(config: &ModelConfig) -> Result<Vec<Placement>> {
    let name = &config.name;
    let auto = || -> Vec<Placement> {
        match device_count() {
            Ok(n) if n > 0 => (0..n as i32).map(Placement::Gpu).collect(),
            _ => vec![Placement::Cpu],
        }
    };
    if config.instance_group.is_empty() {
        return Ok(auto().into_iter().take(1).collect());
    }
    let mut out = Vec::new();
    for (i, group) in config.instance_group.iter().enumerate() {
        let count = group.count.max(1) as usize;
        let devices = match Kind::try_from(group.kind) {
            Ok(Kind::Cpu) => vec![Placement::Cpu],
            Ok(Kind::Auto) if group.gpus.is_empty() => auto(),
            Ok(Kind::Gpu) | Ok(Kind::Auto) => {
                let visible = device_count().map_err(|e| {
                    Error::invalid(format!(
                        "model '{name}': instance_group[{i}] asks for KIND_GPU, but {e}; use \
                         kind: KIND_CPU, or run on a GPU host"
                    ))
                })?;
                if visible == 0 {
                    return Err(Error::invalid(format!(
                        "model '{name}': instance_group[{i}] asks for KIND_GPU, but this host \
                         has no CUDA device; use kind: KIND_CPU"
                    )));
                }
                if let Some(bad) = group.gpus.iter().find(|&&g| g < 0 || g as usize >= visible) {
                    return Err(Error::invalid(format!(
                        "model '{name}': instance_group[{i}].gpus names GPU {bad}, but this \
                         host has {visible} (0..{})",
                        visible - 1
                    )));
                }
                if group.gpus.is_empty() {
                    (0..visible as i32).map(Placement::Gpu).collect()
                } else {
                    group.gpus.iter().map(|&g| Placement::Gpu(g)).collect()
                }
            }
            _ => {
                return Err(Error::invalid(format!(
                    "model '{name}': instance_group[{i}].kind {} is not supported for ONNX \
                     models (use KIND_CPU or KIND_GPU)",
                    group.kind
                )))
            }
        };
        // A passive group is loaded on Triton but never scheduled: here it is not started.
        if group.passive {
            continue;
        }
        for device in devices {
            out.extend(std::iter::repeat_n(device, count));
        }
    }
    if out.is_empty() {
        return Err(Error::invalid(format!(
            "model '{name}': every instance_group is passive, so no instance would take \
             requests; set passive: false on at least one"
        )));
    }
    Ok(out)
}

/// A GPU execution accelerator from `optimization { execution_accelerators {
/// gpu_execution_accelerator [...] } }`, checked at load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorRtOptions {
    /// `precision_mode: "FP16"` (default FP32).
    pub fp16: bool,
    /// `max_workspace_size_bytes`.
    pub max_workspace_size: Option<usize>,
    /// `trt_engine_cache_enable`; unset means on: building engines takes minutes, and a
    /// restart should not pay it again.
    pub engine_cache: Option<bool>,
    /// `trt_engine_cache_path`; unset means `trt_engine_cache/` in the version directory.
    pub engine_cache_path: Option<String>,
    /// `trt_min_subgraph_size`.
    pub min_subgraph_size: Option<usize>,
    /// `trt_max_partition_iterations`.
    pub max_partition_iterations: Option<u32>,
}

impl TensorRtOptions {
    /// Where engines are cached, if they are: the configured path, else a directory in the
    /// version directory, created here (a read-only repository turns the cache off, with a
    /// warning, rather than failing the load).
    pub fn engine_cache_dir(&self, version_dir: &std::path::Path) -> Option<String> {
        if self.engine_cache == Some(false) {
            return None;
        }
        if let Some(path) = &self.engine_cache_path {
            return Some(path.clone());
        }
        let dir = version_dir.join("trt_engine_cache");
        match std::fs::create_dir_all(&dir) {
            Ok(()) => Some(dir.display().to_string()),
            Err(e) if self.engine_cache == Some(true) => {
                tracing::warn!(
                    "TensorRT engine cache '{}' cannot be created: {e}",
                    dir.display()
                );
                Some(dir.display().to_string())
            }
            Err(e) => {
                tracing::warn!(
                    "TensorRT engine cache off: '{}' cannot be created ({e}); set \
                     trt_engine_cache_path to a writable directory",
                    dir.display()
                );
                None
            }
        }
    }
}

/// The GPU execution accelerators a configuration asks for, checked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Accelerators {
    /// TensorRT first, when asked for (CUDA runs what it does not take).
    pub tensorrt: Option<TensorRtOptions>,
    /// CUDA execution provider options, by ONNX Runtime's names with values it accepts.
    pub cuda: Vec<(String, String)>,
}

/// CUDA options Triton's ONNX Runtime backend also takes as model `parameters` (its older form).
pub(crate) const CUDA_MODEL_PARAMETERS: [&str; 4] = [
    "cudnn_conv_algo_search",
    "gpu_mem_limit",
    "arena_extend_strategy",
    "do_copy_in_default_stream",
];

/// The CUDA options understood, for messages.
const CUDA_OPTIONS: &str = "cudnn_conv_algo_search, gpu_mem_limit, arena_extend_strategy, \
     cudnn_conv_use_max_workspace, do_copy_in_default_stream, use_ep_level_unified_stream, \
     use_tf32, prefer_nhwc, enable_cuda_graph";

/// One CUDA option as ONNX Runtime takes it, or why `value` is not one; `Ok(None)` for an
/// unknown key.
fn cuda_option(key: &str, value: &str) -> std::result::Result<Option<String>, String> {
    let v = value.trim();
    let flag = || match v.to_ascii_lowercase().as_str() {
        "1" | "true" => Ok("1".to_owned()),
        "0" | "false" => Ok("0".to_owned()),
        _ => Err(format!("must be 1 or 0 (true or false), got \"{value}\"")),
    };
    Ok(Some(match key {
        "cudnn_conv_algo_search" => match v.to_ascii_uppercase().as_str() {
            "0" | "EXHAUSTIVE" => "EXHAUSTIVE".to_owned(),
            "1" | "HEURISTIC" => "HEURISTIC".to_owned(),
            "2" | "DEFAULT" => "DEFAULT".to_owned(),
            _ => {
                return Err(format!(
                    "must be EXHAUSTIVE (0), HEURISTIC (1) or DEFAULT (2), got \"{value}\""
                ))
            }
        },
        "arena_extend_strategy" => match v {
            "0" | "kNextPowerOfTwo" => "kNextPowerOfTwo".to_owned(),
            "1" | "kSameAsRequested" => "kSameAsRequested".to_owned(),
            _ => {
                return Err(format!(
                    "must be kNextPowerOfTwo (0) or kSameAsRequested (1), got \"{value}\""
                ))
            }
        },
        "gpu_mem_limit" => v
            .parse::<u64>()
            .map_err(|_| format!("must be a number of bytes, got \"{value}\""))?
            .to_string(),
        "cudnn_conv_use_max_workspace"
        | "do_copy_in_default_stream"
        | "use_ep_level_unified_stream"
        | "use_tf32"
        | "prefer_nhwc" => flag()?,
        "enable_cuda_graph" => {
            let on = flag()?;
            if on == "1" {
                return Err(
                    "CUDA graphs need inputs bound in GPU memory at fixed addresses, \
                            which wasmtron does not do yet; leave it 0"
                        .to_owned(),
                );
            }
            on
        }
        _ => return Ok(None),
    }))
}

/// The accelerators the configuration asks for on GPU instances. `cuda` takes the CUDA
/// provider's options as parameters (Triton's form; the four older model-level `parameters`
/// are read too, the accelerator's winning); unknown names, parameters and values, and CPU
/// accelerators, are refused by name.
pub fn accelerators(config: &ModelConfig) -> Result<Accelerators> {
    let name = &config.name;
    let mut out = Accelerators::default();
    for key in CUDA_MODEL_PARAMETERS {
        if let Some(p) = config.parameters.get(key) {
            let value = cuda_option(key, &p.string_value)
                .map_err(|msg| Error::invalid(format!("model '{name}': parameter '{key}' {msg}")))?
                .unwrap_or_default();
            out.cuda.push((key.to_owned(), value));
        }
    }
    let Some(acc) = config
        .optimization
        .as_ref()
        .and_then(|o| o.execution_accelerators.as_ref())
    else {
        return Ok(out);
    };
    if let Some(cpu) = acc.cpu_execution_accelerator.first() {
        return Err(Error::invalid(format!(
            "model '{name}': cpu_execution_accelerator '{}' is not supported (ONNX Runtime's \
             default CPU provider runs CPU instances)",
            cpu.name
        )));
    }
    for (i, a) in acc.gpu_execution_accelerator.iter().enumerate() {
        let field = format!("optimization.execution_accelerators.gpu_execution_accelerator[{i}]");
        match a.name.as_str() {
            "tensorrt" => out.tensorrt = Some(tensorrt_options(name, &field, a)?),
            "cuda" => {
                let mut keys: Vec<&String> = a.parameters.keys().collect();
                keys.sort();
                for key in keys {
                    let value = cuda_option(key, &a.parameters[key])
                        .map_err(|msg| {
                            Error::invalid(format!(
                                "model '{name}': {field} parameter '{key}' {msg}"
                            ))
                        })?
                        .ok_or_else(|| {
                            Error::invalid(format!(
                                "model '{name}': {field} has unknown CUDA parameter '{key}' \
                                 (supported: {CUDA_OPTIONS})"
                            ))
                        })?;
                    out.cuda.retain(|(k, _)| k != key);
                    out.cuda.push((key.clone(), value));
                }
            }
            other => {
                return Err(Error::invalid(format!(
                    "model '{name}': {field} name '{other}' is not supported (tensorrt or cuda)"
                )))
            }
        }
    }
    Ok(out)
}

fn tensorrt_options(
    name: &str,
    field: &str,
    a: &crate::proto::inference::model_optimization_policy::execution_accelerators::Accelerator,
) -> Result<TensorRtOptions> {
    let mut o = TensorRtOptions::default();
    for (key, value) in &a.parameters {
        let number = || {
            value.trim().parse::<usize>().map_err(|_| {
                Error::invalid(format!(
                    "model '{name}': {field} parameter '{key}' must be a non-negative integer, \
                     got \"{value}\""
                ))
            })
        };
        let flag = || match value.trim() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(Error::invalid(format!(
                "model '{name}': {field} parameter '{key}' must be true or false, got \"{value}\""
            ))),
        };
        match key.as_str() {
            "precision_mode" => {
                o.fp16 = match value.trim() {
                    "FP16" => true,
                    "FP32" => false,
                    other => {
                        return Err(Error::invalid(format!(
                            "model '{name}': {field} precision_mode \"{other}\" is not \
                             supported (FP32 or FP16)"
                        )))
                    }
                }
            }
            "max_workspace_size_bytes" => o.max_workspace_size = Some(number()?),
            "trt_engine_cache_enable" => o.engine_cache = Some(flag()?),
            "trt_engine_cache_path" => o.engine_cache_path = Some(value.clone()),
            "trt_min_subgraph_size" => o.min_subgraph_size = Some(number()?),
            "trt_max_partition_iterations" => o.max_partition_iterations = Some(number()? as u32),
            other => {
                return Err(Error::invalid(format!(
                    "model '{name}': {field} has unknown parameter '{other}' (supported: \
                     precision_mode, max_workspace_size_bytes, trt_engine_cache_enable, \
                     trt_engine_cache_path, trt_min_subgraph_size, trt_max_partition_iterations)"
                )))
            }
        }
    }
    Ok(o)
}

/// How many CUDA devices this host has; an error saying why there are none usable (a build
/// without the `cuda` feature, no NVIDIA driver, a driver error).
pub fn device_count() -> std::result::Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this wasmtron build has no GPU support (rebuild with `--features cuda`)".to_owned())
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::driver;

#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::{result, sys};

    /// Loads the driver once: `Err` says why it cannot be used.
    pub(crate) fn driver() -> std::result::Result<(), String> {
        static INIT: std::sync::OnceLock<std::result::Result<(), String>> =
            std::sync::OnceLock::new();
        INIT.get_or_init(|| {
            // SAFETY: only probes whether the library can be opened.
            if !unsafe { sys::is_culib_present() } {
                return Err("this host has no NVIDIA driver (libcuda.so not found)".to_owned());
            }
            result::init().map_err(|e| format!("the NVIDIA driver does not start: {e}"))
        })
        .clone()
    }

    pub fn device_count() -> std::result::Result<usize, String> {
        driver()?;
        result::device::get_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| format!("the NVIDIA driver cannot count devices: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{
        model_optimization_policy::{execution_accelerators::Accelerator, ExecutionAccelerators},
        ModelInstanceGroup, ModelOptimizationPolicy,
    };

    fn group(kind: Kind, count: i32, gpus: Vec<i32>) -> ModelInstanceGroup {
        ModelInstanceGroup {
            kind: kind as i32,
            count,
            gpus,
            ..Default::default()
        }
    }

    #[test]
    fn cpu_groups_and_no_groups_place_on_the_cpu_here() {
        let mut config = ModelConfig {
            name: "m".into(),
            ..Default::default()
        };
        assert_eq!(placements(&config).unwrap(), vec![Placement::Cpu]);
        config.instance_group = vec![group(Kind::Cpu, 2, vec![]), group(Kind::Cpu, 0, vec![])];
        assert_eq!(placements(&config).unwrap(), vec![Placement::Cpu; 3]);
    }

    #[test]
    fn unset_groups_names_and_counts_get_tritons_defaults() {
        let mut config = ModelConfig {
            name: "m".into(),
            ..Default::default()
        };
        normalize_instance_groups(&mut config, DEFAULT_CPU_INSTANCE_COUNT);
        let [only] = config.instance_group.as_slice() else {
            panic!("{:?}", config.instance_group);
        };
        assert_eq!(only.name, "m");
        if device_count().unwrap_or(0) == 0 {
            assert_eq!((only.kind, only.count), (Kind::Cpu as i32, 2));
            assert_eq!(placements(&config).unwrap(), vec![Placement::Cpu; 2]);
        }
        let mut config = ModelConfig {
            name: "m".into(),
            instance_group: vec![group(Kind::Cpu, 0, vec![]), group(Kind::Cpu, 3, vec![])],
            ..Default::default()
        };
        normalize_instance_groups(&mut config, DEFAULT_CPU_INSTANCE_COUNT);
        let named: Vec<_> = config
            .instance_group
            .iter()
            .map(|g| (g.name.as_str(), g.count))
            .collect();
        assert_eq!(named, [("m_0", 2), ("m_1", 3)]);
        // A GPU group stays a GPU group, for placements to refuse by name on a CPU host.
        let mut config = ModelConfig {
            name: "m".into(),
            instance_group: vec![group(Kind::Gpu, 0, vec![])],
            ..Default::default()
        };
        normalize_instance_groups(&mut config, DEFAULT_CPU_INSTANCE_COUNT);
        assert_eq!(config.instance_group[0].kind, Kind::Gpu as i32);
        assert_eq!(config.instance_group[0].count, 1);
    }

    #[test]
    fn a_gpu_group_without_a_gpu_says_what_is_missing() {
        let config = ModelConfig {
            name: "m".into(),
            instance_group: vec![group(Kind::Gpu, 1, vec![0])],
            ..Default::default()
        };
        let Err(err) = placements(&config) else {
            return; // a host with a GPU and a GPU build: nothing to say
        };
        assert!(
            err.message.contains("instance_group[0] asks for KIND_GPU")
                && err.message.contains("KIND_CPU"),
            "{}",
            err.message
        );
        #[cfg(not(feature = "cuda"))]
        assert!(err.message.contains("--features cuda"), "{}", err.message);
    }

    fn accelerating(name: &str, params: &[(&str, &str)]) -> ModelConfig {
        ModelConfig {
            name: "m".into(),
            optimization: Some(ModelOptimizationPolicy {
                execution_accelerators: Some(ExecutionAccelerators {
                    gpu_execution_accelerator: vec![Accelerator {
                        name: name.into(),
                        parameters: params
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect(),
                    }],
                    cpu_execution_accelerator: vec![],
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn tensorrt_parameters_are_read_and_mistakes_named() {
        let a = accelerators(&accelerating(
            "tensorrt",
            &[
                ("precision_mode", "FP16"),
                ("max_workspace_size_bytes", "1073741824"),
                ("trt_engine_cache_enable", "true"),
            ],
        ))
        .unwrap();
        let o = a.tensorrt.unwrap();
        assert!(o.fp16 && o.engine_cache == Some(true));
        assert_eq!(o.max_workspace_size, Some(1 << 30));
        let err = accelerators(&accelerating("tensorrt", &[("precision", "FP16")])).unwrap_err();
        assert!(
            err.message.contains("unknown parameter 'precision'"),
            "{}",
            err.message
        );
        let err = accelerators(&accelerating("openvino", &[])).unwrap_err();
        assert!(
            err.message
                .contains("gpu_execution_accelerator[0] name 'openvino'"),
            "{}",
            err.message
        );
        assert_eq!(
            accelerators(&accelerating("cuda", &[])).unwrap(),
            Accelerators::default()
        );
    }

    #[test]
    fn tensorrt_engines_are_cached_in_the_version_directory_by_default() {
        let dir = std::env::temp_dir().join(format!("wasmtron-trt-{}", std::process::id()));
        let cache = TensorRtOptions::default().engine_cache_dir(&dir);
        assert_eq!(
            cache,
            Some(dir.join("trt_engine_cache").display().to_string())
        );
        assert!(dir.join("trt_engine_cache").is_dir());
        let off = TensorRtOptions {
            engine_cache: Some(false),
            ..Default::default()
        };
        assert_eq!(off.engine_cache_dir(&dir), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cuda_options_are_read_in_both_places_and_mistakes_named() {
        let mut config = accelerating(
            "cuda",
            &[
                ("cudnn_conv_algo_search", "HEURISTIC"),
                ("cudnn_conv_use_max_workspace", "0"),
                ("arena_extend_strategy", "1"),
            ],
        );
        for (k, v) in [
            ("cudnn_conv_algo_search", "2"),
            ("gpu_mem_limit", "4294967296"),
        ] {
            config.parameters.insert(
                k.into(),
                crate::proto::inference::ModelParameter {
                    string_value: v.into(),
                },
            );
        }
        let mut cuda = accelerators(&config).unwrap().cuda;
        cuda.sort();
        let want = [
            ("arena_extend_strategy", "kSameAsRequested"),
            ("cudnn_conv_algo_search", "HEURISTIC"),
            ("cudnn_conv_use_max_workspace", "0"),
            ("gpu_mem_limit", "4294967296"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            cuda, want,
            "the accelerator's value wins over the model parameter"
        );
        let cases = [
            (
                ("cudnn_conv_algo_search", "FAST"),
                "must be EXHAUSTIVE (0), HEURISTIC (1) or DEFAULT (2)",
            ),
            (("gpu_mem_limit", "lots"), "must be a number of bytes"),
            (("do_copy_in_default_stream", "2"), "must be 1 or 0"),
            (
                ("enable_cuda_graph", "1"),
                "CUDA graphs need inputs bound in GPU memory",
            ),
            (("cudnn_algo", "1"), "unknown CUDA parameter 'cudnn_algo'"),
        ];
        for ((k, v), want) in cases {
            let err = accelerators(&accelerating("cuda", &[(k, v)])).unwrap_err();
            assert!(err.message.contains(want), "{}", err.message);
            assert!(err.message.contains(&format!("'{k}'")), "{}", err.message);
        }
    }
}
