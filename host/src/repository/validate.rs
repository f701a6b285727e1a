//! Checks on a parsed configuration that need neither the model file nor a backend: names,
//! datatypes, dimensions, batch size, instance groups and dynamic batching. Messages name the
//! field at fault.

use std::collections::HashSet;

use super::ConfigError;
use crate::{
    proto::inference::{model_config::SchedulingChoice, ModelConfig, ModelDynamicBatching},
    tensor::DataType,
};

/// The backend that serves ONNX models.
pub const ONNXRUNTIME: &str = "onnxruntime";

/// Validates `config` for the model `model_name` and fills in the name when it is omitted.
pub fn validate(config: &mut ModelConfig, model_name: &str, file: &str) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        file: file.to_owned(),
        message,
    };
    if config.name.is_empty() {
        config.name = model_name.to_owned();
    } else if config.name != model_name {
        return Err(invalid(format!(
            "field 'name': \"{}\" does not match the model directory name \"{}\"",
            config.name, model_name
        )));
    }
    // The file is looked up in each version's folder: a path that climbs out of it (a
    // configuration sent with a load request may say anything) is refused.
    if !config.default_model_filename.is_empty() {
        crate::names::ModelFilePath::parse(&config.default_model_filename).map_err(|_| {
            invalid(format!(
                "field 'default_model_filename': \"{}\" must name a file or folder inside the \
                 version folder (plain names separated by '/', without '.' or '..')",
                config.default_model_filename.escape_debug()
            ))
        })?;
    }
    if config.max_batch_size < 0 {
        return Err(invalid(format!(
            "field 'max_batch_size': must be 0 (no batching) or positive, got {}",
            config.max_batch_size
        )));
    }
    let mut seen = HashSet::new();
    for (i, input) in config.input.iter().enumerate() {
        check_tensor(
            "input",
            i,
            &input.name,
            input.data_type,
            &input.dims,
            &mut seen,
        )
        .map_err(&invalid)?;
    }
    seen.clear();
    for (i, output) in config.output.iter().enumerate() {
        check_tensor(
            "output",
            i,
            &output.name,
            output.data_type,
            &output.dims,
            &mut seen,
        )
        .map_err(&invalid)?;
    }
    for (i, group) in config.instance_group.iter().enumerate() {
        if group.count < 0 {
            return Err(invalid(format!(
                "field 'instance_group[{i}].count': must not be negative, got {}",
                group.count
            )));
        }
    }
    for name in config.metric_tags.keys() {
        check_metric_tag(name).map_err(&invalid)?;
    }
    if let Some(SchedulingChoice::DynamicBatching(db)) = &config.scheduling_choice {
        check_dynamic_batching(db, config.max_batch_size).map_err(&invalid)?;
    }
    super::sequence::sequence_spec(config).map_err(&invalid)?;
    Ok(())
}

/// A `metric_tags` key becomes the label `_<key>` of the model's metrics (Triton's reporter
/// prefixes the underscore, so a tag never collides with the metrics' own labels): letters,
/// digits and '_', not starting with '_' (labels starting with `__` are Prometheus's own).
fn check_metric_tag(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with('_');
    if !valid {
        return Err(format!(
            "field 'metric_tags': '{name}' cannot name a metric label '_{name}' (letters, \
             digits and '_', not starting with '_')"
        ));
    }
    Ok(())
}

fn check_dynamic_batching(db: &ModelDynamicBatching, max_batch_size: i32) -> Result<(), String> {
    for size in &db.preferred_batch_size {
        if *size <= 0 || (max_batch_size > 0 && *size > max_batch_size) {
            return Err(format!(
                "field 'dynamic_batching.preferred_batch_size': {size} is not between 1 and \
                 max_batch_size ({max_batch_size})"
            ));
        }
    }
    let levels = db.priority_levels;
    if levels == 0 {
        if db.default_priority_level != 0 || !db.priority_queue_policy.is_empty() {
            return Err(
                "field 'dynamic_batching.priority_levels': must be set to use \
                        default_priority_level or priority_queue_policy"
                    .into(),
            );
        }
        return Ok(());
    }
    if !(1..=levels).contains(&db.default_priority_level) {
        return Err(format!(
            "field 'dynamic_batching.default_priority_level': {} is not between 1 and \
             priority_levels ({levels})",
            db.default_priority_level
        ));
    }
    if let Some(level) = db
        .priority_queue_policy
        .keys()
        .find(|l| !(1..=levels).contains(l))
    {
        return Err(format!(
            "field 'dynamic_batching.priority_queue_policy': level {level} is not between 1 \
             and priority_levels ({levels})"
        ));
    }
    Ok(())
}

fn check_tensor(
    kind: &str,
    index: usize,
    name: &str,
    data_type: i32,
    dims: &[i64],
    seen: &mut HashSet<String>,
) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("field '{kind}[{index}].name': must not be empty"));
    }
    if !seen.insert(name.to_owned()) {
        return Err(format!("{kind} '{name}' is declared twice"));
    }
    if DataType::from_config_value(data_type).is_none() {
        return Err(format!(
            "{kind} '{name}': field 'data_type' must be set to a valid type (TYPE_FP32, TYPE_INT64, TYPE_STRING, ...)"
        ));
    }
    if let Some(d) = dims.iter().find(|&&d| d < -1) {
        return Err(format!(
            "{kind} '{name}': field 'dims' has {d}; dimensions are -1 (variable) or non-negative"
        ));
    }
    Ok(())
}

/// The backend named by `backend` or implied by `platform`; `None` when neither says.
pub fn backend_name(config: &ModelConfig) -> Option<String> {
    if !config.backend.is_empty() {
        return Some(config.backend.clone());
    }
    match config.platform.as_str() {
        "" => None,
        "onnxruntime_onnx" => Some(ONNXRUNTIME.to_owned()),
        other => Some(other.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::ModelInput;

    #[test]
    fn fills_name_and_rejects_mismatch() {
        let mut c = ModelConfig::default();
        validate(&mut c, "m", "f").unwrap();
        assert_eq!(c.name, "m");
        let mut c = ModelConfig {
            name: "other".into(),
            ..Default::default()
        };
        let e = validate(&mut c, "m", "f").unwrap_err().to_string();
        assert!(e.contains("'name'") && e.contains("other"), "{e}");
    }

    #[test]
    fn rejects_missing_datatype_and_bad_dims() {
        let mut c = ModelConfig {
            input: vec![ModelInput {
                name: "x".into(),
                dims: vec![3],
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = validate(&mut c, "m", "f").unwrap_err().to_string();
        assert!(e.contains("input 'x'") && e.contains("data_type"), "{e}");
        c.input[0].data_type = DataType::Fp32.config_value();
        c.input[0].dims = vec![-2];
        let e = validate(&mut c, "m", "f").unwrap_err().to_string();
        assert!(e.contains("dims"), "{e}");
    }

    #[test]
    fn dynamic_batching_settings_must_fit_the_model() {
        let with = |db: ModelDynamicBatching| ModelConfig {
            max_batch_size: 8,
            scheduling_choice: Some(SchedulingChoice::DynamicBatching(db)),
            ..Default::default()
        };
        let error = |db| validate(&mut with(db), "m", "f").unwrap_err().to_string();
        let e = error(ModelDynamicBatching {
            preferred_batch_size: vec![4, 16],
            ..Default::default()
        });
        assert!(
            e.contains("'dynamic_batching.preferred_batch_size': 16 is not between 1 and max_batch_size (8)"),
            "{e}"
        );
        let e = error(ModelDynamicBatching {
            priority_levels: 2,
            default_priority_level: 3,
            ..Default::default()
        });
        assert!(
            e.contains("default_priority_level': 3 is not between 1 and priority_levels (2)"),
            "{e}"
        );
        let ok = ModelDynamicBatching {
            preferred_batch_size: vec![2, 8],
            priority_levels: 2,
            default_priority_level: 1,
            ..Default::default()
        };
        validate(&mut with(ok), "m", "f").unwrap();
    }
}
