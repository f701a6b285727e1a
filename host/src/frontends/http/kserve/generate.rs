//! Triton's generate extension: `POST …/generate` and `…/generate_stream` (server-sent
//! events). A request is one flat JSON object: each field named like a model input becomes
//! that input (a value or an array, shaped by the configuration), `parameters` and any other
//! field become request parameters. Each response is one flat object: `model_name`,
//! `model_version` and one field per output (a single element unwrapped).

use serde_json::{Map, Value};

use super::codec;
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, ParamValue},
    proto::inference::ModelConfig,
    tensor::{DataType, Tensor},
};

/// The shape a flat JSON value of `count` elements takes for a model input: the configured
/// dims with the one variable dimension (if any) taking up the rest, plus the batch dimension.
fn shape_for(name: &str, dims: &[i64], batching: bool, count: usize) -> Result<Vec<i64>> {
    let fixed: i64 = dims.iter().filter(|d| **d >= 0).product();
    let variable = dims.iter().filter(|d| **d < 0).count();
    let count = count as i64;
    let mut shape: Vec<i64> = match variable {
        0 if fixed == count => dims.to_vec(),
        0 if dims.is_empty() && count == 1 => Vec::new(),
        1 if fixed > 0 && count % fixed == 0 => dims
            .iter()
            .map(|d| if *d < 0 { count / fixed } else { *d })
            .collect(),
        _ if dims.is_empty() => vec![count],
        _ => {
            return Err(Error::invalid(format!(
                "generate: field '{name}' has {count} element(s), which does not fit the \
                 input's dims {dims:?}"
            )))
        }
    };
    if batching {
        shape.insert(0, 1);
    }
    Ok(shape)
}

/// Builds an inference request from a generate request object.
pub fn to_request(
    config: &ModelConfig,
    model: &str,
    version: Option<i64>,
    body: Value,
) -> Result<InferRequest> {
    let Value::Object(fields) = body else {
        return Err(Error::invalid(
            "generate: the request body must be a JSON object",
        ));
    };
    let mut parameters = Map::new();
    let mut inputs = Vec::new();
    for (key, value) in fields {
        if key == "parameters" {
            match value {
                Value::Object(p) => parameters.extend(p),
                _ => {
                    return Err(Error::invalid(
                        "generate: 'parameters' must be a JSON object",
                    ))
                }
            }
            continue;
        }
        let Some(input) = config.input.iter().find(|i| i.name == key) else {
            // Not an input: a request parameter, as Triton does.
            parameters.insert(key, value);
            continue;
        };
        let datatype = DataType::from_config_value(input.data_type).ok_or_else(|| {
            Error::invalid(format!("generate: input '{key}' has no valid datatype"))
        })?;
        let count = match &value {
            Value::Array(items) => items.len(),
            _ => 1,
        };
        let shape = shape_for(&key, &input.dims, config.max_batch_size > 0, count)?;
        let tensor = codec::json_tensor(&key, datatype, shape, &value)?;
        inputs.push(tensor);
    }
    Ok(InferRequest::new(model, version)
        .with_parameters(codec::parameters_from_json(
            Some(parameters),
            "the generate request",
        )?)
        .with_inputs(inputs))
}

/// For `…/generate`, which answers once: a model that takes a BOOL `stream` input (a
/// generation model or ensemble) and was not told is told `false`, so that it answers with one
/// response as TensorRT-LLM does when `stream` is not sent.
pub fn ask_for_one_response(config: &ModelConfig, request: &mut InferRequest) {
    let takes_stream = config.input.iter().any(|i| {
        i.name == "stream" && DataType::from_config_value(i.data_type) == Some(DataType::Bool)
    });
    if !takes_stream || request.inputs.iter().any(|t| t.name == "stream") {
        return;
    }
    let dims = config
        .input
        .iter()
        .find(|i| i.name == "stream")
        .map_or(&[1][..], |i| i.dims.as_slice());
    let mut shape: Vec<i64> = dims.iter().map(|&d| d.max(1)).collect();
    if config.max_batch_size > 0 {
        shape.insert(0, 1);
    }
    request.inputs.push(Tensor {
        name: "stream".into(),
        datatype: DataType::Bool,
        shape,
        data: vec![0u8].into(),
    });
}

/// The flat JSON object of one response.
pub fn to_json(response: &InferResponse) -> Value {
    let mut out = Map::new();
    out.insert("model_name".into(), response.model_name.clone().into());
    out.insert(
        "model_version".into(),
        response.model_version.to_string().into(),
    );
    for (key, value) in &response.parameters {
        if let ParamValue::String(s) = value {
            out.insert(key.clone(), s.clone().into());
        }
    }
    for t in &response.outputs {
        out.insert(t.name.clone(), flat_value(t));
    }
    Value::Object(out)
}

fn flat_value(t: &Tensor) -> Value {
    match codec::tensor_json_data(t) {
        Value::Array(mut items) if items.len() == 1 => items.remove(0),
        other => other,
    }
}
