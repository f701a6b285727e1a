//! What the server tells about itself and its models, built once in the protocols' types:
//! its name, version and extensions, each model's metadata, configuration and statistics
//! ([`models`]) and the Prometheus metrics ([`metrics`]). The frontends serve them and the
//! in-process Python package returns them.

pub mod metrics;
pub mod models;

pub use models::{
    kv_cache_blocks, metadata_json, model_config, model_metadata, model_ready, model_statistics,
    stats_json,
};

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
