//! The KServe v2 HTTP inference body: JSON tensors (nested or flat) and the binary tensor data
//! extension (`Inference-Header-Content-Length`, `binary_data_size`, BYTES length prefixes,
//! `binary_data_output`), in both directions.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, value::RawValue, Map, Value};

use crate::{
    error::{Error, Result},
    frontends::shared_memory::{output_parameters, SharedInputs},
    inference::{InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput},
    limits::RequestLimits,
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, shape_string, DataType, Tensor},
};

use super::json_data::json_to_bytes;
pub use super::json_data::{json_tensor, output_json_data, tensor_json_data};

/// Request parameters as sent: each value stays its JSON text until it is known to be a
/// scalar (a parameter that is a large list must not become a `Value` tree first).
pub type RawParameters<'a> = BTreeMap<String, &'a RawValue>;

/// Header giving the length of the JSON part of a binary request or response.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Deserialize)]
struct JsonRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default, borrow)]
    parameters: Option<RawParameters<'a>>,
    #[serde(borrow)]
    inputs: Vec<JsonInput<'a>>,
    #[serde(default, borrow)]
    outputs: Option<Vec<JsonOutput<'a>>>,
}

#[derive(Deserialize)]
struct JsonInput<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default, borrow)]
    parameters: Option<RawParameters<'a>>,
    /// Left as text and decoded straight into tensor bytes once the datatype and shape are
    /// known: a `serde_json::Value` per element would take ~16x the body's size in memory.
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct JsonOutput<'a> {
    name: String,
    #[serde(default, borrow)]
    parameters: Option<RawParameters<'a>>,
}

/// Converts parameters as sent; `what` names their owner in errors.
pub fn parameters_from_raw(map: Option<RawParameters<'_>>, what: &str) -> Result<Parameters> {
    map.unwrap_or_default()
        .into_iter()
        .map(|(key, raw)| Ok((key.clone(), parameter_from_raw(&key, raw, what)?)))
        .collect()
}

/// One parameter: a bool, number or string, read only once its text shows it is one.
pub fn parameter_from_raw(key: &str, raw: &RawValue, what: &str) -> Result<ParamValue> {
    let text = raw.get();
    let refuse = || {
        let shown: String = text.chars().take(64).collect();
        let more = if shown.len() < text.len() { "…" } else { "" };
        Error::invalid(format!(
            "parameter '{key}' of {what} must be a bool, number or string, got {shown}{more}"
        ))
    };
    if text.starts_with(['[', '{']) || text == "null" {
        return Err(refuse());
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|e| Error::invalid(format!("parameter '{key}' of {what}: {e}")))?;
    Ok(match value {
        Value::Bool(b) => ParamValue::Bool(b),
        Value::String(s) => ParamValue::String(s),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => ParamValue::Int(i),
            (None, Some(u)) => ParamValue::Uint(u),
            _ => ParamValue::Double(n.as_f64().unwrap_or_default()),
        },
        _ => return Err(refuse()),
    })
}

fn parameters_to_json(params: &Parameters) -> Map<String, Value> {
    params
        .iter()
        .map(|(k, v)| {
            let v = match v {
                ParamValue::Bool(b) => json!(b),
                ParamValue::Int(i) => json!(i),
                ParamValue::Uint(u) => json!(u),
                ParamValue::Double(d) => json!(d),
                ParamValue::String(s) => json!(s),
            };
            (k.clone(), v)
        })
        .collect()
}

/// Decodes an inference request body. `json_length` is the value of
/// `Inference-Header-Content-Length` when present; `Some(0)` is a raw binary request, which
/// needs the model configuration to know the input.
pub fn decode_request(
    model_name: &str,
    model_version: Option<i64>,
    body: Bytes,
    json_length: Option<usize>,
    config: Option<&ModelConfig>,
    limits: &RequestLimits,
    shared: SharedInputs<'_>,
) -> Result<InferRequest> {
    if json_length == Some(0) {
        return decode_raw_binary(model_name, model_version, body, config);
    }
    let split = json_length.unwrap_or(body.len());
    if split > body.len() {
        return Err(Error::invalid(format!(
            "Inference-Header-Content-Length is {split} but the request body has only {} bytes",
            body.len()
        )));
    }
    let header = body.slice(..split);
    let binary = body.slice(split..);
    limits.check_json_depth(&header)?;
    let parsed: JsonRequest = serde_json::from_slice(&header)
        .map_err(|e| Error::invalid(format!("failed to parse the request JSON buffer: {e}")))?;
    let mut offset = 0usize;
    let mut inputs = Vec::with_capacity(parsed.inputs.len());
    for input in parsed.inputs {
        let params = parameters_from_raw(input.parameters, &format!("input '{}'", input.name))?;
        let datatype = DataType::from_wire(&input.datatype).ok_or_else(|| {
            Error::invalid(format!(
                "input '{}' has unknown datatype '{}' (expected one of BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BF16, BYTES)",
                input.name, input.datatype
            ))
        })?;
        if let Some(d) = input.shape.iter().find(|&&d| d < 0) {
            return Err(Error::invalid(format!(
                "input '{}' has a negative dimension {d} in shape {}",
                input.name,
                shape_string(&input.shape)
            )));
        }
        limits.check_shape(&format!("input '{}'", input.name), &input.shape)?;
        let in_shared_memory = shared(&input.name, &params)?;
        let data = match (in_shared_memory, params.get("binary_data_size")) {
            (Some(data), size) => {
                if input.data.is_some() || size.is_some() {
                    return Err(Error::invalid(format!(
                        "input '{}' names a shared memory region and also carries data; send one or the other",
                        input.name
                    )));
                }
                data
            }
            (None, Some(size)) => {
                let size = size.as_i64().filter(|s| *s >= 0).ok_or_else(|| {
                    Error::invalid(format!(
                        "input '{}': parameter 'binary_data_size' must be a non-negative integer",
                        input.name
                    ))
                })? as usize;
                if input.data.is_some() {
                    return Err(Error::invalid(format!(
                        "input '{}' has both 'data' and 'binary_data_size'",
                        input.name
                    )));
                }
                let end = offset.checked_add(size).filter(|&e| e <= binary.len()).ok_or_else(|| {
                    Error::invalid(format!(
                        "input '{}': binary_data_size {size} runs past the end of the request body (only {} binary bytes left)",
                        input.name,
                        binary.len() - offset
                    ))
                })?;
                let slice = binary.slice(offset..end);
                offset = end;
                slice
            }
            (None, None) => {
                let value = input.data.ok_or_else(|| {
                    Error::invalid(format!(
                        "input '{}' has neither 'data' nor a 'binary_data_size' or 'shared_memory_region' parameter",
                        input.name
                    ))
                })?;
                json_to_bytes(&input.name, datatype, &input.shape, value.get())?
            }
        };
        inputs.push(Tensor {
            name: input.name,
            datatype,
            shape: input.shape,
            data,
        });
    }
    if offset != binary.len() {
        return Err(Error::invalid(format!(
            "the request body has {} binary bytes after the JSON header but the inputs' binary_data_size add up to {offset}",
            binary.len()
        )));
    }
    let mut outputs = Vec::new();
    for output in parsed.outputs.unwrap_or_default() {
        let parameters =
            parameters_from_raw(output.parameters, &format!("output '{}'", output.name))?;
        outputs.push(RequestedOutput {
            name: output.name,
            parameters,
        });
    }
    Ok(InferRequest::new(model_name, model_version)
        .with_id(parsed.id.unwrap_or_default())
        .with_parameters(parameters_from_raw(parsed.parameters, "the request")?)
        .with_inputs(inputs)
        .with_outputs(outputs))
}

/// `Inference-Header-Content-Length: 0`: the whole body is the data of the model's single
/// input, at batch size 1, and every output comes back binary.
fn decode_raw_binary(
    model_name: &str,
    model_version: Option<i64>,
    body: Bytes,
    config: Option<&ModelConfig>,
) -> Result<InferRequest> {
    let config = config.ok_or_else(|| {
        Error::not_found(format!(
            "Request for unknown model: '{model_name}' is not found"
        ))
    })?;
    let [input] = config.input.as_slice() else {
        return Err(Error::invalid(format!(
            "a raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one input; '{model_name}' has {}",
            config.input.len()
        )));
    };
    let datatype = DataType::from_config_value(input.data_type)
        .ok_or_else(|| Error::internal(format!("input '{}' has no datatype", input.name)))?;
    let mut shape = input.dims.clone();
    let variable: Vec<usize> = (0..shape.len()).filter(|&i| shape[i] == -1).collect();
    if datatype == DataType::Bytes {
        shape = vec![1];
        let mut data = Vec::with_capacity(body.len() + 4);
        push_bytes_element(&mut data, &body);
        return Ok(raw_request(
            model_name,
            model_version,
            config,
            &input.name,
            datatype,
            shape,
            data.into(),
        ));
    }
    if variable.len() > 1 {
        return Err(Error::invalid(format!(
            "a raw binary request needs at most one variable dimension; input '{}' has dims {}",
            input.name,
            shape_string(&input.dims)
        )));
    }
    let element = datatype.element_size().unwrap_or(1);
    let fixed: i64 = shape.iter().filter(|&&d| d != -1).product();
    if let Some(&i) = variable.first() {
        let per = fixed.max(1) as usize * element;
        if !body.len().is_multiple_of(per) {
            return Err(Error::invalid(format!(
                "raw binary request of {} bytes does not divide into elements of input '{}'",
                body.len(),
                input.name
            )));
        }
        shape[i] = (body.len() / per) as i64;
    }
    Ok(raw_request(
        model_name,
        model_version,
        config,
        &input.name,
        datatype,
        shape,
        body,
    ))
}

fn raw_request(
    model_name: &str,
    model_version: Option<i64>,
    config: &ModelConfig,
    input: &str,
    datatype: DataType,
    mut shape: Vec<i64>,
    data: Bytes,
) -> InferRequest {
    if config.max_batch_size > 0 {
        shape.insert(0, 1);
    }
    let mut parameters = Parameters::new();
    parameters.insert("binary_data_output".into(), ParamValue::Bool(true));
    InferRequest::new(model_name, model_version)
        .with_parameters(parameters)
        .with_inputs(vec![Tensor {
            name: input.to_owned(),
            datatype,
            shape,
            data,
        }])
}

/// An encoded response body and the JSON length header when it carries binary data.
pub struct EncodedResponse {
    /// The body in parts, in order: the JSON, then each binary output's data as the model
    /// gave it (not copied: a large output goes to the socket from the tensor's own buffer).
    pub parts: Vec<Bytes>,
    /// `Some(len)` when binary data follows `len` bytes of JSON.
    pub json_length: Option<usize>,
}

/// Encodes a response; outputs go binary when the request asked (`binary_data` per output,
/// `binary_data_output` for the rest). Unsupported output parameters are refused.
pub fn encode_response(
    parameters: &Parameters,
    requested_all: &[RequestedOutput],
    response: &InferResponse,
) -> Result<EncodedResponse> {
    let default_binary = parameters
        .get("binary_data_output")
        .and_then(ParamValue::as_bool)
        .unwrap_or(false);
    let mut outputs = Vec::with_capacity(response.outputs.len());
    let mut binary = Vec::new();
    for tensor in &response.outputs {
        let requested = requested_all.iter().find(|o| o.name == tensor.name);
        let as_binary = requested
            .and_then(|o| o.parameters.get("binary_data"))
            .and_then(ParamValue::as_bool)
            .unwrap_or(default_binary);
        let mut entry = Map::new();
        entry.insert("name".into(), json!(tensor.name));
        entry.insert("datatype".into(), json!(tensor.datatype.wire_name()));
        entry.insert("shape".into(), json!(tensor.shape));
        if let Some(shared) = output_parameters(requested_all, &tensor.name, tensor.data.len()) {
            // Written to the client's shared memory already (SystemSharedMemory::write_outputs).
            entry.insert(
                "parameters".into(),
                Value::Object(parameters_to_json(&shared)),
            );
        } else if as_binary {
            entry.insert(
                "parameters".into(),
                json!({"binary_data_size": tensor.data.len()}),
            );
            binary.push(tensor.data.clone());
        } else {
            entry.insert("data".into(), output_json_data(tensor)?);
        }
        outputs.push(Value::Object(entry));
    }
    let mut body = Map::new();
    body.insert("model_name".into(), json!(response.model_name));
    body.insert(
        "model_version".into(),
        json!(response.model_version.to_string()),
    );
    if !response.id.is_empty() {
        body.insert("id".into(), json!(response.id));
    }
    if !response.parameters.is_empty() {
        body.insert(
            "parameters".into(),
            Value::Object(parameters_to_json(&response.parameters)),
        );
    }
    body.insert("outputs".into(), Value::Array(outputs));
    let header = serde_json::to_vec(&Value::Object(body))
        .map_err(|e| Error::internal(format!("cannot encode the response: {e}")))?;
    let json_length = header.len();
    let has_binary = !binary.is_empty();
    let mut parts = Vec::with_capacity(1 + binary.len());
    parts.push(Bytes::from(header));
    parts.extend(binary);
    Ok(EncodedResponse {
        parts,
        json_length: has_binary.then_some(json_length),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{frontends::shared_memory::no_shared_inputs, tensor::bytes_elements};

    /// Decodes a JSON request body with the default limits.
    fn decode_json(body: &'static [u8]) -> Result<InferRequest> {
        let limits = RequestLimits::default();
        decode_request(
            "m",
            None,
            Bytes::from_static(body),
            None,
            None,
            &limits,
            &no_shared_inputs,
        )
    }

    #[test]
    fn nested_json_flattens_and_round_trips() {
        let body = br#"{"id":"7","inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[[1,2],[3,-4]]}],
            "outputs":[{"name":"y","parameters":{"binary_data":false}}]}"#;
        let req = decode_json(body).unwrap();
        assert_eq!(req.id, "7");
        assert_eq!(req.inputs[0].data.len(), 16);
        let resp = InferResponse {
            model_name: "m".into(),
            model_version: 1,
            last: false,
            id: "7".into(),
            parameters: Default::default(),
            outputs: vec![Tensor {
                name: "y".into(),
                ..req.inputs[0].clone()
            }],
        };
        let enc = encode_response(&req.parameters, &req.outputs, &resp).unwrap();
        assert_eq!(enc.json_length, None);
        assert_eq!(enc.parts.len(), 1);
        let v: Value = serde_json::from_slice(&enc.parts[0]).unwrap();
        assert_eq!(v["outputs"][0]["data"], json!([1, 2, 3, -4]));
        assert_eq!(v["model_version"], "1");
    }

    #[test]
    fn binary_outputs_follow_the_json_from_the_tensors_own_buffers() {
        let data = Bytes::from(vec![7u8; 16]);
        let tensor = |name: &str| Tensor {
            name: name.into(),
            datatype: crate::tensor::DataType::Fp32,
            shape: vec![1, 4],
            data: data.clone(),
        };
        let resp = InferResponse {
            model_name: "m".into(),
            model_version: 1,
            last: false,
            id: String::new(),
            parameters: Default::default(),
            outputs: vec![tensor("a"), tensor("b")],
        };
        let mut parameters = Parameters::default();
        parameters.insert("binary_data_output".into(), ParamValue::Bool(true));
        let enc = encode_response(&parameters, &[], &resp).unwrap();
        assert_eq!(enc.parts.len(), 3);
        let json_length = enc.json_length.unwrap();
        assert_eq!(json_length, enc.parts[0].len());
        assert_eq!(enc.parts[1].len() + enc.parts[2].len(), 32);
        // The same memory, not a copy.
        assert_eq!(enc.parts[1].as_ptr(), data.as_ptr());
        let v: Value = serde_json::from_slice(&enc.parts[0]).unwrap();
        assert_eq!(v["outputs"][1]["parameters"]["binary_data_size"], 16);
    }

    #[test]
    fn json_data_is_decoded_element_by_element() {
        let decode = |data: &str, datatype: &str, shape: &str| {
            let body = format!(
                r#"{{"inputs":[{{"name":"x","shape":{shape},"datatype":"{datatype}","data":{data}}}]}}"#
            );
            decode_request(
                "m",
                None,
                body.into(),
                None,
                None,
                &RequestLimits::default(),
                &no_shared_inputs,
            )
        };
        let t = &decode("[[1, 2.5], [-3, 4e1]]", "FP32", "[2,2]")
            .unwrap()
            .inputs[0];
        let floats: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(floats, [1.0, 2.5, -3.0, 40.0]);
        let t = &decode(r#"["a\"b", "é"]"#, "BYTES", "[2]").unwrap().inputs[0];
        let items: Vec<&[u8]> = bytes_elements(&t.data).collect();
        assert_eq!(items, [&b"a\"b"[..], "é".as_bytes()]);
        assert_eq!(
            decode("[true, false]", "BOOL", "[2]").unwrap().inputs[0].data[..],
            [1, 0]
        );
        // More elements than the shape holds: refused at the first extra one.
        let e = decode("[1, 2, 3]", "INT32", "[2]").unwrap_err();
        assert!(
            e.message
                .contains("its shape holds 2, the JSON data has more"),
            "{}",
            e.message
        );
        let e = decode("[1, null]", "INT32", "[2]").unwrap_err();
        assert!(
            e.message.contains("element null is not a valid INT32"),
            "{}",
            e.message
        );
        let e = decode("[1.5]", "INT64", "[1]").unwrap_err();
        assert!(
            e.message.contains("element 1.5 is not a valid INT64"),
            "{}",
            e.message
        );
        let e = decode(r#"{"a": 1}"#, "INT32", "[1]").unwrap_err();
        assert!(e.message.contains("not an object"), "{}", e.message);
        let e = decode("[1]", "FP16", "[1]").unwrap_err();
        assert!(
            e.message.contains("binary tensor data extension"),
            "{}",
            e.message
        );
    }

    #[test]
    fn binary_inputs_are_bounds_checked() {
        let header = br#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&[0u8; 4]);
        let err = decode_request(
            "m",
            None,
            body.into(),
            Some(header.len()),
            None,
            &RequestLimits::default(),
            &no_shared_inputs,
        )
        .unwrap_err();
        assert!(
            err.message.contains("binary_data_size 8"),
            "{}",
            err.message
        );
    }

    #[test]
    fn wrong_element_type_and_count_are_named() {
        let body = br#"{"inputs":[{"name":"x","shape":[2],"datatype":"INT8","data":[1,300]}]}"#;
        let err = decode_json(body).unwrap_err();
        assert!(err.message.contains("300"), "{}", err.message);
        let body = br#"{"inputs":[{"name":"x","shape":[3],"datatype":"INT8","data":[1,2]}]}"#;
        let err = decode_json(body).unwrap_err();
        assert!(err.message.contains("needs 3"), "{}", err.message);
    }
}
