//! What backends read from a model's configuration the same way: the model file's name,
//! typed `parameters`, instance counts, whether it is decoupled or cached.

use std::path::{Path, PathBuf};

use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
};

/// The name of a version's model file: `default_model_filename`, or the backend's `default`.
pub fn model_file_name<'a>(config: &'a ModelConfig, default: &'a str) -> &'a str {
    if config.default_model_filename.is_empty() {
        default
    } else {
        config.default_model_filename.as_str()
    }
}

/// Whether the model's answers go to the response cache (`response_cache { enable: true }`).
pub fn caches_responses(config: &ModelConfig) -> bool {
    config.response_cache.as_ref().is_some_and(|c| c.enable)
}

/// The model file of a version: `default_model_filename` from the configuration, or the
/// backend's default name; an error naming the path when it is missing.
pub fn model_file(config: &ModelConfig, version_dir: &Path, default: &str) -> Result<PathBuf> {
    let path = version_dir.join(model_file_name(config, default));
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::invalid(format!(
            "model '{}': model file '{}' not found",
            config.name,
            path.display()
        )))
    }
}

/// A config.pbtxt `parameters` value parsed as `T` (spaces around it ignored), `None` when
/// absent; a value that does not parse is an error naming the model, the parameter and `what`
/// it must be.
pub fn parameter<T: std::str::FromStr>(
    config: &ModelConfig,
    key: &str,
    what: &str,
) -> Result<Option<T>> {
    config
        .parameters
        .get(key)
        .map(|p| {
            p.string_value.trim().parse::<T>().map_err(|_| {
                Error::invalid(format!(
                    "model '{}': parameter '{key}' must be {what}, got \"{}\"",
                    config.name, p.string_value
                ))
            })
        })
        .transpose()
}

/// Instances that take requests over all instance groups (a group's count of 0 means 1;
/// `passive` groups, which Triton loads but never schedules, are not started); 1 without
/// groups, 0 when every group is passive.
pub fn instance_count(config: &ModelConfig) -> usize {
    if config.instance_group.is_empty() {
        return 1;
    }
    config
        .instance_group
        .iter()
        .filter(|g| !g.passive)
        .map(|g| g.count.max(1) as usize)
        .sum()
}

/// Whether the model answers 0..N times per request (`model_transaction_policy.decoupled`).
pub fn is_decoupled(config: &ModelConfig) -> bool {
    config
        .model_transaction_policy
        .as_ref()
        .is_some_and(|p| p.decoupled)
}
