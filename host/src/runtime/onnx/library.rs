//! Finding and loading the ONNX Runtime library, once per process.

use std::{path::PathBuf, sync::OnceLock};

use ort::environment::Environment;

use super::OnnxSettings;
use crate::error::{Error, Result};

/// Path baked in at build time: the library `make` fetches into the workspace cache.
pub(super) const BUILD_TIME_LIBRARY: Option<&str> = option_env!("WASMTRON_DEFAULT_ORT_LIB");

pub(super) static ENVIRONMENT: OnceLock<std::result::Result<Environment, String>> = OnceLock::new();

/// Where to find `libonnxruntime.so`: the explicit option, `ORT_DYLIB_PATH`, next to the
/// executable, then the copy `make` fetched when this binary was built.
pub(super) fn library_path(settings: &OnnxSettings) -> PathBuf {
    if let Some(path) = &settings.library {
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

pub(crate) fn environment(settings: &OnnxSettings) -> Result<Environment> {
    ENVIRONMENT
        .get_or_init(|| {
            let path = library_path(settings);
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
