//! The host of all guest code, shared by the Wasm-stage and the Python backends (neither
//! imports the other): wasmtime's engine and its epoch ticker, the cache of compiled guest
//! code, the limits a guest runs under (memory, deadline through epochs, tables), how a trap
//! is explained, and the requests a guest's calls to other models become.

use std::{path::PathBuf, sync::Arc};

pub mod compile_cache;
pub mod engine;
pub mod guest_calls;
pub mod limits;
pub mod traps;

/// Guest code runs on the CPU: a configuration that asks for GPU instances of `what` (`Wasm
/// stages`, `Python models`) is refused naming the group; the models `caller` (`a stage`)
/// calls may run on GPUs.
pub fn refuse_gpu_instances(
    config: &crate::proto::inference::ModelConfig,
    what: &str,
    caller: &str,
) -> crate::error::Result<()> {
    let gpu = crate::proto::inference::model_instance_group::Kind::Gpu as i32;
    match config.instance_group.iter().position(|g| g.kind == gpu) {
        Some(i) => Err(crate::error::Error::invalid(format!(
            "model '{}': instance_group[{i}] is KIND_GPU, but {what} run on the CPU in the \
             sandbox; use kind: KIND_CPU (the ONNX models {caller} calls may run on GPUs)",
            config.name
        ))),
        None => Ok(()),
    }
}

/// The settings of the guest-code host (both backends that run guest code).
#[derive(Debug, Clone, Default)]
pub struct SandboxSettings {
    /// Where compiled guest code is cached (`--wasm-cache-dir`); `None` compiles every time.
    pub compile_cache_dir: Option<PathBuf>,
    /// The size that cache is kept under (least recently used code removed first); `None`:
    /// [`compile_cache::DEFAULT_MAX_BYTES`].
    pub compile_cache_max_bytes: Option<u64>,
}

impl SandboxSettings {
    /// The compile cache, when a directory is set and usable (one per directory and size,
    /// for the whole process).
    pub fn compile_cache(&self) -> Option<Arc<compile_cache::CompileCache>> {
        let dir = self.compile_cache_dir.as_deref()?;
        compile_cache::CompileCache::open(
            dir,
            self.compile_cache_max_bytes
                .unwrap_or(compile_cache::DEFAULT_MAX_BYTES),
        )
    }
}
