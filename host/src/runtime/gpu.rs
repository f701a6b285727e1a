//! Where model instances run (Triton's `instance_group`: CPU, or GPUs by device id) and the
//! GPU execution accelerators of `config.pbtxt`, for the ONNX Runtime backend; and, with the
//! `cuda` feature, the NVIDIA driver calls behind CUDA shared memory (cudarc, loaded at run
//! time, so a GPU build starts, and says clearly what is missing, on a host without a GPU).

use crate::{
    error::{Error, Result},
    proto::inference::{model_instance_group::Kind, ModelConfig},
};

/// Where one model instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On the CPU.
    Cpu,
    /// On the GPU with this CUDA device id.
    Gpu(i32),
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
        for device in devices {
            out.extend(std::iter::repeat_n(device, count));
        }
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
    /// `trt_engine_cache_enable`.
    pub engine_cache: bool,
    /// `trt_engine_cache_path`.
    pub engine_cache_path: Option<String>,
    /// `trt_min_subgraph_size`.
    pub min_subgraph_size: Option<usize>,
    /// `trt_max_partition_iterations`.
    pub max_partition_iterations: Option<u32>,
}

/// The TensorRT accelerator the configuration asks for on GPU instances, if any. `cuda` is
/// accepted as a name for the default (CUDA alone); unknown names and parameters, and CPU
/// accelerators, are refused by name.
pub fn gpu_accelerator(config: &ModelConfig) -> Result<Option<TensorRtOptions>> {
    let name = &config.name;
    let Some(acc) = config
        .optimization
        .as_ref()
        .and_then(|o| o.execution_accelerators.as_ref())
    else {
        return Ok(None);
    };
    if let Some(cpu) = acc.cpu_execution_accelerator.first() {
        return Err(Error::invalid(format!(
            "model '{name}': cpu_execution_accelerator '{}' is not supported (ONNX Runtime's \
             default CPU provider runs CPU instances)",
            cpu.name
        )));
    }
    let mut tensorrt = None;
    for (i, a) in acc.gpu_execution_accelerator.iter().enumerate() {
        let field = format!("optimization.execution_accelerators.gpu_execution_accelerator[{i}]");
        match a.name.as_str() {
            "tensorrt" => {
                let mut o = TensorRtOptions::default();
                for (key, value) in &a.parameters {
                    let number = || {
                        value.trim().parse::<usize>().map_err(|_| {
                            Error::invalid(format!(
                                "model '{name}': {field} parameter '{key}' must be a \
                                 non-negative integer, got \"{value}\""
                            ))
                        })
                    };
                    let flag = || match value.trim() {
                        "true" | "1" => Ok(true),
                        "false" | "0" => Ok(false),
                        _ => Err(Error::invalid(format!(
                            "model '{name}': {field} parameter '{key}' must be true or false, \
                             got \"{value}\""
                        ))),
                    };
                    match key.as_str() {
                        "precision_mode" => {
                            o.fp16 = match value.trim() {
                                "FP16" => true,
                                "FP32" => false,
                                other => {
                                    return Err(Error::invalid(format!(
                                        "model '{name}': {field} precision_mode \"{other}\" is \
                                         not supported (FP32 or FP16)"
                                    )))
                                }
                            }
                        }
                        "max_workspace_size_bytes" => o.max_workspace_size = Some(number()?),
                        "trt_engine_cache_enable" => o.engine_cache = flag()?,
                        "trt_engine_cache_path" => o.engine_cache_path = Some(value.clone()),
                        "trt_min_subgraph_size" => o.min_subgraph_size = Some(number()?),
                        "trt_max_partition_iterations" => {
                            o.max_partition_iterations = Some(number()? as u32)
                        }
                        other => {
                            return Err(Error::invalid(format!(
                                "model '{name}': {field} has unknown parameter '{other}' \
                                 (supported: precision_mode, max_workspace_size_bytes, \
                                 trt_engine_cache_enable, trt_engine_cache_path, \
                                 trt_min_subgraph_size, trt_max_partition_iterations)"
                            )))
                        }
                    }
                }
                tensorrt = Some(o);
            }
            "cuda" if a.parameters.is_empty() => {}
            other => {
                return Err(Error::invalid(format!(
                    "model '{name}': {field} name '{other}' is not supported (tensorrt, or cuda \
                     without parameters)"
                )))
            }
        }
    }
    Ok(tensorrt)
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
pub use cuda::IpcBuffer;

#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::{result, sys};

    /// Loads the driver once: `Err` says why it cannot be used.
    fn driver() -> std::result::Result<(), String> {
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

    /// Device memory another process exported with `cudaIpcGetMemHandle`, opened in this
    /// process (CUDA shared memory), and the primary context it lives in.
    pub struct IpcBuffer {
        ptr: sys::CUdeviceptr,
        context: sys::CUcontext,
        device: sys::CUdevice,
        len: usize,
    }

    // SAFETY: the pointer is a device address, valid in the context from any thread once the
    // context is made current there (every method does).
    unsafe impl Send for IpcBuffer {}
    unsafe impl Sync for IpcBuffer {}

    impl IpcBuffer {
        /// Opens a 64-byte `cudaIpcMemHandle_t` on `device_id`.
        pub fn open(handle: &[u8], device_id: i64, len: usize) -> Result<Self, String> {
            driver()?;
            let mut raw = sys::CUipcMemHandle_st { reserved: [0; 64] };
            if handle.len() != raw.reserved.len() {
                return Err(format!(
                    "raw_handle has {} bytes; a cudaIpcMemHandle_t has 64",
                    handle.len()
                ));
            }
            for (dst, src) in raw.reserved.iter_mut().zip(handle) {
                *dst = *src as std::ffi::c_char;
            }
            let ordinal = i32::try_from(device_id).map_err(|_| "bad device_id".to_owned())?;
            let device =
                result::device::get(ordinal).map_err(|e| format!("device {device_id}: {e}"))?;
            // SAFETY: `device` came from `device::get`; the context is released in Drop.
            let context = unsafe { result::primary_ctx::retain(device) }
                .map_err(|e| format!("device {device_id}: {e}"))?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: the context is valid; the handle is the 64 bytes the client sent, which
            // the driver checks.
            let opened = unsafe {
                result::ctx::set_current(context).and_then(|()| {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        raw,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                    .result()
                })
            };
            if let Err(e) = opened {
                // SAFETY: retained above.
                let _ = unsafe { result::primary_ctx::release(device) };
                return Err(format!("cannot open the CUDA IPC handle: {e}"));
            }
            Ok(Self {
                ptr,
                context,
                device,
                len,
            })
        }

        /// Copies `dst.len()` bytes at `offset` to the host.
        pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
            self.check(offset, dst.len())?;
            // SAFETY: the range lies inside the opened allocation.
            unsafe {
                result::ctx::set_current(self.context)
                    .and_then(|()| result::memcpy_dtoh_sync(dst, self.ptr + offset as u64))
            }
            .map_err(|e| format!("copy from the GPU failed: {e}"))
        }

        /// Copies `src` to `offset` on the device.
        pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
            self.check(offset, src.len())?;
            // SAFETY: the range lies inside the opened allocation.
            unsafe {
                result::ctx::set_current(self.context)
                    .and_then(|()| result::memcpy_htod_sync(self.ptr + offset as u64, src))
            }
            .map_err(|e| format!("copy to the GPU failed: {e}"))
        }

        fn check(&self, offset: usize, len: usize) -> Result<(), String> {
            match offset.checked_add(len) {
                Some(end) if end <= self.len => Ok(()),
                _ => Err(format!(
                    "{len} bytes at {offset} run past {} bytes",
                    self.len
                )),
            }
        }
    }

    impl Drop for IpcBuffer {
        fn drop(&mut self) {
            // SAFETY: opened and retained in `open`.
            unsafe {
                let _ = result::ctx::set_current(self.context);
                let _ = sys::cuIpcCloseMemHandle(self.ptr).result();
                let _ = result::primary_ctx::release(self.device);
            }
        }
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
        let o = gpu_accelerator(&accelerating(
            "tensorrt",
            &[
                ("precision_mode", "FP16"),
                ("max_workspace_size_bytes", "1073741824"),
                ("trt_engine_cache_enable", "true"),
            ],
        ))
        .unwrap()
        .unwrap();
        assert!(o.fp16 && o.engine_cache);
        assert_eq!(o.max_workspace_size, Some(1 << 30));
        let err = gpu_accelerator(&accelerating("tensorrt", &[("precision", "FP16")])).unwrap_err();
        assert!(
            err.message.contains("unknown parameter 'precision'"),
            "{}",
            err.message
        );
        let err = gpu_accelerator(&accelerating("openvino", &[])).unwrap_err();
        assert!(
            err.message
                .contains("gpu_execution_accelerator[0] name 'openvino'"),
            "{}",
            err.message
        );
        assert_eq!(gpu_accelerator(&accelerating("cuda", &[])).unwrap(), None);
    }
}
