//! Checks a request against the model configuration before it is queued, so that a bad request
//! fails fast with a message naming the model and tensor, and backends only see valid inputs.

use std::collections::HashSet;

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::ModelConfig,
    repository::sequence::state_output,
    tensor::{shape_string, DataType, Tensor},
};

/// Validates inputs and requested outputs; returns the request's batch size (1 for models
/// without batching).
pub fn check_request(config: &ModelConfig, request: &InferRequest) -> Result<usize> {
    let model = &config.name;
    let batching = config.max_batch_size > 0;
    let mut seen = HashSet::new();
    let mut batch: Option<i64> = None;
    for tensor in &request.inputs {
        let Some(declared) = config.input.iter().find(|i| i.name == tensor.name) else {
            let expected: Vec<&str> = config.input.iter().map(|i| i.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "unexpected inference input '{}' for model '{model}'; the model's inputs are: {}",
                tensor.name,
                expected.join(", ")
            )));
        };
        if !seen.insert(tensor.name.as_str()) {
            return Err(Error::invalid(format!(
                "input '{}' appears more than once in the request for model '{model}'",
                tensor.name
            )));
        }
        let expected_type = DataType::from_config_value(declared.data_type);
        if expected_type != Some(tensor.datatype) {
            return Err(Error::invalid(format!(
                "inference input '{}' data-type is '{}', but model '{model}' expects '{}'",
                tensor.name,
                tensor.datatype,
                expected_type.map_or("INVALID", |d| d.wire_name())
            )));
        }
        let mut expected_shape = declared.dims.clone();
        let dims = if batching {
            expected_shape.insert(0, -1);
            tensor.shape.get(1..)
        } else {
            Some(&tensor.shape[..])
        };
        let fits = dims.is_some_and(|dims| {
            dims.len() == declared.dims.len()
                && dims
                    .iter()
                    .zip(&declared.dims)
                    .all(|(&got, &want)| want == -1 || got == want)
        });
        if !fits || tensor.shape.iter().any(|&d| d < 0) {
            return Err(Error::invalid(format!(
                "unexpected shape for input '{}' for model '{model}'. Expected {}, got {}",
                tensor.name,
                shape_string(&expected_shape),
                shape_string(&tensor.shape)
            )));
        }
        if batching {
            let b = tensor.shape[0];
            if b < 1 || b > i64::from(config.max_batch_size) {
                return Err(Error::invalid(format!(
                    "inference request batch-size must be <= {} for '{model}', got {b} (input '{}')",
                    config.max_batch_size, tensor.name
                )));
            }
            match batch {
                Some(prev) if prev != b => {
                    return Err(Error::invalid(format!(
                        "all inputs of model '{model}' must have the same batch size; input '{}' has {b}, another has {prev}",
                        tensor.name
                    )))
                }
                _ => batch = Some(b),
            }
        }
        tensor.validate_size()?;
    }
    for declared in &config.input {
        if !declared.optional && !seen.contains(declared.name.as_str()) {
            return Err(Error::invalid(format!(
                "expected {} inputs but got {} inputs for model '{model}'; missing input '{}'",
                config.input.len(),
                request.inputs.len(),
                declared.name
            )));
        }
    }
    let mut asked = HashSet::new();
    for output in &request.outputs {
        if !asked.insert(output.name.as_str()) {
            return Err(Error::invalid(format!(
                "requested output '{}' appears more than once in the request for model '{model}'",
                output.name
            )));
        }
        if !config.output.iter().any(|o| o.name == output.name) {
            let expected: Vec<&str> = config.output.iter().map(|o| o.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "unexpected inference output '{}' for model '{model}'; the model's outputs are: {}",
                output.name,
                expected.join(", ")
            )));
        }
    }
    Ok(batch.map_or(1, |b| b as usize))
}

/// Checks what a backend returned against the configuration: exactly the requested outputs
/// (returned in the requested order), declared datatypes and dimensions, the request's batch
/// size, consistent data sizes and at most `max_bytes` in total.
pub fn check_outputs(
    config: &ModelConfig,
    requested: &[String],
    mut tensors: Vec<Tensor>,
    batch: Option<i64>,
    max_bytes: usize,
) -> Result<Vec<Tensor>> {
    let mut ordered = Vec::with_capacity(requested.len());
    let mut total = 0usize;
    for name in requested {
        let index = tensors
            .iter()
            .position(|t| &t.name == name)
            .ok_or_else(|| {
                Error::internal(format!("did not return the requested output '{name}'"))
            })?;
        let tensor = tensors.swap_remove(index);
        let declared = config
            .output
            .iter()
            .find(|o| &o.name == name)
            .map(|o| (o.data_type, o.dims.as_slice()))
            .or_else(|| state_output(config, name));
        let Some((data_type, dims)) = declared else {
            return Err(Error::internal(format!(
                "returned output '{name}' that config.pbtxt does not declare"
            )));
        };
        let want = DataType::from_config_value(data_type);
        if want != Some(tensor.datatype) {
            return Err(Error::internal(format!(
                "returned output '{name}' as {} but config.pbtxt declares {}",
                tensor.datatype,
                want.map_or("TYPE_INVALID", |d| d.config_name())
            )));
        }
        let mut expected = dims.to_vec();
        if config.max_batch_size > 0 {
            expected.insert(0, batch.unwrap_or(-1));
        }
        let fits = tensor.shape.len() == expected.len()
            && tensor
                .shape
                .iter()
                .zip(&expected)
                .all(|(&got, &want)| got >= 0 && (want == -1 || got == want));
        if !fits {
            return Err(Error::internal(format!(
                "returned output '{name}' with shape {} but config.pbtxt expects {}",
                shape_string(&tensor.shape),
                shape_string(&expected)
            )));
        }
        tensor.validate_size().map_err(|e| {
            Error::internal(format!(
                "returned a malformed output: {}",
                e.message.replacen("input", "output", 1)
            ))
        })?;
        total = total.saturating_add(tensor.data.len());
        if total > max_bytes {
            return Err(Error::internal(format!(
                "returned more than {} MiB of output (parameter max_output_mb)",
                max_bytes >> 20
            )));
        }
        ordered.push(tensor);
    }
    if let Some(extra) = tensors.first() {
        return Err(Error::internal(format!(
            "returned output '{}' that was not requested",
            extra.name
        )));
    }
    Ok(ordered)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelInput, ModelOutput};

    #[test]
    fn outputs_are_reordered_and_checked() {
        let mut c = config();
        c.output = vec![ModelOutput {
            name: "y".into(),
            data_type: DataType::Int32.config_value(),
            dims: vec![2],
            ..Default::default()
        }];
        let t = |shape: Vec<i64>, len: usize| Tensor {
            name: "y".into(),
            datatype: DataType::Int32,
            shape,
            data: vec![0u8; len].into(),
        };
        let ok =
            check_outputs(&c, &["y".into()], vec![t(vec![3, 2], 24)], Some(3), 1 << 20).unwrap();
        assert_eq!(ok.len(), 1);
        let e = check_outputs(&c, &["y".into()], vec![t(vec![2, 2], 16)], Some(3), 1 << 20)
            .unwrap_err();
        assert!(e.message.contains("expects [3,2]"), "{}", e.message);
        let e = check_outputs(&c, &["y".into()], vec![t(vec![3, 2], 20)], Some(3), 1 << 20)
            .unwrap_err();
        assert!(e.message.contains("malformed output"), "{}", e.message);
        let e = check_outputs(&c, &["y".into()], vec![t(vec![3, 2], 24)], Some(3), 10).unwrap_err();
        assert!(e.message.contains("max_output_mb"), "{}", e.message);
        let e = check_outputs(&c, &["y".into()], vec![], Some(3), 10).unwrap_err();
        assert!(
            e.message
                .contains("did not return the requested output 'y'"),
            "{}",
            e.message
        );
    }

    fn config() -> ModelConfig {
        ModelConfig {
            name: "m".into(),
            max_batch_size: 4,
            input: vec![ModelInput {
                name: "x".into(),
                data_type: DataType::Fp32.config_value(),
                dims: vec![-1, 2],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn request(shape: Vec<i64>, datatype: DataType, len: usize) -> InferRequest {
        InferRequest {
            model_name: "m".into(),
            inputs: vec![Tensor {
                name: "x".into(),
                datatype,
                shape,
                data: vec![0u8; len].into(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn accepts_batched_variable_shape() {
        assert_eq!(
            check_request(&config(), &request(vec![3, 5, 2], DataType::Fp32, 120)).unwrap(),
            3
        );
    }

    #[test]
    fn rejects_each_mismatch_with_a_named_reason() {
        let c = config();
        let e = check_request(&c, &request(vec![1, 5, 2], DataType::Int32, 40)).unwrap_err();
        assert!(e.message.contains("data-type is 'INT32'"), "{}", e.message);
        let e = check_request(&c, &request(vec![1, 5, 3], DataType::Fp32, 60)).unwrap_err();
        assert!(
            e.message.contains("Expected [-1,-1,2], got [1,5,3]"),
            "{}",
            e.message
        );
        let e = check_request(&c, &request(vec![5, 1, 2], DataType::Fp32, 40)).unwrap_err();
        assert!(
            e.message.contains("batch-size must be <= 4"),
            "{}",
            e.message
        );
        let e = check_request(&c, &request(vec![1, 1, 2], DataType::Fp32, 4)).unwrap_err();
        assert!(e.message.contains("needs 8 bytes"), "{}", e.message);
    }
}
