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

/// An integer type's range, as i128.
fn integer_range(datatype: DataType) -> Option<(i128, i128)> {
    Some(match datatype {
        DataType::Int8 => (i8::MIN.into(), i8::MAX.into()),
        DataType::Int16 => (i16::MIN.into(), i16::MAX.into()),
        DataType::Int32 => (i32::MIN.into(), i32::MAX.into()),
        DataType::Int64 => (i64::MIN.into(), i64::MAX.into()),
        DataType::Uint8 => (0, u8::MAX.into()),
        DataType::Uint16 => (0, u16::MAX.into()),
        DataType::Uint32 => (0, u32::MAX.into()),
        DataType::Uint64 => (0, u64::MAX.into()),
        _ => return None,
    })
}

fn read_integer(datatype: DataType, b: &[u8]) -> i128 {
    let mut a = [0u8; 8];
    a[..b.len()].copy_from_slice(b);
    let signed = matches!(
        datatype,
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64
    );
    if signed && b.last().is_some_and(|&hi| hi & 0x80 != 0) {
        a[b.len()..].fill(0xff);
        i128::from(i64::from_le_bytes(a))
    } else if signed {
        i128::from(i64::from_le_bytes(a))
    } else {
        i128::from(u64::from_le_bytes(a))
    }
}

/// Converts integer inputs sent as another integer type than the model declares (a
/// TensorRT-LLM client's UINT32 `max_tokens` for an INT32 input), when every value fits; a
/// value that does not is refused naming the input. Other types are left for
/// [`check_request`] to judge.
pub fn convert_integer_inputs(config: &ModelConfig, request: &mut InferRequest) -> Result<()> {
    let model = &config.name;
    for tensor in &mut request.inputs {
        let Some(declared) = config.input.iter().find(|i| i.name == tensor.name) else {
            continue;
        };
        let Some(want) = DataType::from_config_value(declared.data_type) else {
            continue;
        };
        if want == tensor.datatype {
            continue;
        }
        let (Some((lo, hi)), Some(_)) = (integer_range(want), integer_range(tensor.datatype))
        else {
            continue;
        };
        let (from, to) = (
            tensor.datatype.element_size().unwrap_or(1),
            want.element_size().unwrap_or(1),
        );
        if tensor.data.len() % from != 0 {
            // The size check names this.
            continue;
        }
        let mut out = Vec::with_capacity(tensor.data.len() / from * to);
        for b in tensor.data.chunks_exact(from) {
            let v = read_integer(tensor.datatype, b);
            if v < lo || v > hi {
                return Err(Error::invalid(format!(
                    "inference input '{}' of model '{model}' is {} and holds {v}, which does                      not fit the model's type {}",
                    tensor.name,
                    tensor.datatype.wire_name(),
                    want.wire_name()
                )));
            }
            out.extend_from_slice(&(v as i64).to_le_bytes()[..to]);
        }
        tensor.datatype = want;
        tensor.data = out.into();
    }
    Ok(())
}

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
    fn integers_of_another_type_are_converted_when_they_fit() {
        let mut c = config();
        c.input[0].data_type = DataType::Int32.config_value();
        let mut r = request(vec![1, 5, 2], DataType::Uint32, 40);
        r.inputs[0].data = (0..10u32)
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into();
        convert_integer_inputs(&c, &mut r).unwrap();
        assert_eq!(r.inputs[0].datatype, DataType::Int32);
        check_request(&c, &r).unwrap();
        let mut r = request(vec![1, 5, 2], DataType::Int64, 80);
        r.inputs[0].data = (-5..5i64)
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into();
        convert_integer_inputs(&c, &mut r).unwrap();
        assert_eq!(&r.inputs[0].data[..4], &(-5i32).to_le_bytes());
        // A value out of range, and a float, are refused.
        let mut r = request(vec![1, 1, 1], DataType::Uint32, 4);
        r.inputs[0].data = u32::MAX.to_le_bytes().to_vec().into();
        let e = convert_integer_inputs(&c, &mut r).unwrap_err();
        assert!(e.message.contains("holds 4294967295"), "{}", e.message);
        let mut r = request(vec![1, 5, 2], DataType::Fp32, 40);
        convert_integer_inputs(&c, &mut r).unwrap();
        assert!(check_request(&c, &r).is_err());
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
