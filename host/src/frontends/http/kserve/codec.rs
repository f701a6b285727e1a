//! The KServe v2 HTTP inference body: JSON tensors (nested or flat) and the binary tensor data
//! extension (`Inference-Header-Content-Length`, `binary_data_size`, BYTES length prefixes,
//! `binary_data_output`), in both directions.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, value::RawValue, Map, Value};

use crate::{
    error::{Error, Result},
    frontends::shared_memory::{output_parameters, SharedInputs},
    inference::{InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput},
    limits::RequestLimits,
    proto::inference::ModelConfig,
    tensor::{bytes_elements, element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// Header giving the length of the JSON part of a binary request or response.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Deserialize)]
struct JsonRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow)]
    inputs: Vec<JsonInput<'a>>,
    #[serde(default)]
    outputs: Option<Vec<JsonOutput>>,
}

#[derive(Deserialize)]
struct JsonInput<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    /// Left as text and decoded straight into tensor bytes once the datatype and shape are
    /// known: a `serde_json::Value` per element would take ~16x the body's size in memory.
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct JsonOutput {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// Converts JSON parameters; `what` names their owner in errors.
pub fn parameters_from_json(map: Option<Map<String, Value>>, what: &str) -> Result<Parameters> {
    let mut out = Parameters::new();
    for (key, value) in map.unwrap_or_default() {
        let v = match value {
            Value::Bool(b) => ParamValue::Bool(b),
            Value::String(s) => ParamValue::String(s),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    ParamValue::Int(i)
                } else if let Some(u) = n.as_u64() {
                    ParamValue::Uint(u)
                } else {
                    ParamValue::Double(n.as_f64().unwrap_or_default())
                }
            }
            other => {
                return Err(Error::invalid(format!(
                    "parameter '{key}' of {what} must be a bool, number or string, got {other}"
                )))
            }
        };
        out.insert(key, v);
    }
    Ok(out)
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
        let params = parameters_from_json(input.parameters, &format!("input '{}'", input.name))?;
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
            parameters_from_json(output.parameters, &format!("output '{}'", output.name))?;
        outputs.push(RequestedOutput {
            name: output.name,
            parameters,
        });
    }
    Ok(InferRequest::new(model_name, model_version)
        .with_id(parsed.id.unwrap_or_default())
        .with_parameters(parameters_from_json(parsed.parameters, "the request")?)
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

/// A tensor from JSON data (nested or flat) of the given datatype and shape.
pub fn json_tensor(
    name: &str,
    datatype: DataType,
    shape: Vec<i64>,
    value: &Value,
) -> Result<Tensor> {
    let data = json_to_bytes(name, datatype, &shape, &value.to_string())?;
    Ok(Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        data,
    })
}

/// A tensor's elements as a flat JSON array (BYTES as strings where they are UTF-8).
pub fn tensor_json_data(tensor: &Tensor) -> Value {
    bytes_to_json(tensor)
}

/// Decodes JSON tensor data (nested arrays or flat) of `datatype` into little-endian bytes,
/// element by element, refusing more elements than `shape` holds as soon as they appear.
fn json_to_bytes(name: &str, datatype: DataType, shape: &[i64], json: &str) -> Result<Bytes> {
    if matches!(datatype, DataType::Fp16 | DataType::Bf16) {
        return Err(Error::invalid(format!(
            "input '{name}': datatype {datatype} cannot be sent as JSON; use the binary tensor data extension"
        )));
    }
    let expected = element_count(shape).unwrap_or(usize::MAX);
    // Each element takes at least two characters of JSON, so the text bounds the allocation.
    let capacity = expected.min(json.len() / 2 + 1);
    let mut leaves = Leaves {
        name,
        datatype,
        expected,
        count: 0,
        out: Vec::with_capacity(capacity.saturating_mul(datatype.element_size().unwrap_or(8))),
        error: None,
    };
    let mut de = serde_json::Deserializer::from_str(json);
    let parsed =
        serde::de::DeserializeSeed::deserialize(&mut leaves, &mut de).and_then(|()| de.end());
    if let Some(err) = leaves.error {
        return Err(err);
    }
    parsed.map_err(|e| {
        Error::invalid(format!(
            "input '{name}': 'data' is not valid JSON tensor data: {e}"
        ))
    })?;
    if leaves.count != expected {
        return Err(Error::invalid(format!(
            "unexpected number of elements for input '{name}': shape {} needs {expected}, the JSON data has {}",
            shape_string(shape),
            leaves.count
        )));
    }
    Ok(leaves.out.into())
}

/// A visitor that walks nested JSON arrays and appends each leaf as one element.
struct Leaves<'n> {
    name: &'n str,
    datatype: DataType,
    expected: usize,
    count: usize,
    out: Vec<u8>,
    /// Our own error, kept whole (serde would only carry its text).
    error: Option<Error>,
}

/// A leaf as the JSON text it came from, for error messages.
enum Leaf<'v> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'v str),
}

impl std::fmt::Display for Leaf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leaf::Bool(b) => write!(f, "{b}"),
            Leaf::Int(i) => write!(f, "{i}"),
            Leaf::Uint(u) => write!(f, "{u}"),
            Leaf::Float(x) => write!(f, "{}", json!(x)),
            Leaf::Str(s) => write!(f, "{}", json!(s)),
        }
    }
}

impl Leaves<'_> {
    fn push<E: serde::de::Error>(&mut self, leaf: Leaf<'_>) -> std::result::Result<(), E> {
        self.count += 1;
        if self.count > self.expected {
            return Err(self.fail(Error::invalid(format!(
                "unexpected number of elements for input '{}': its shape holds {}, the JSON data has more",
                self.name, self.expected
            ))));
        }
        let (datatype, out) = (self.datatype, &mut self.out);
        macro_rules! int {
            ($t:ty) => {{
                let v: Option<$t> = match leaf {
                    Leaf::Int(i) => <$t>::try_from(i).ok(),
                    Leaf::Uint(u) => <$t>::try_from(u).ok(),
                    _ => None,
                };
                v.map(|v| out.extend_from_slice(&v.to_le_bytes()))
            }};
        }
        let float = match leaf {
            Leaf::Int(i) => Some(i as f64),
            Leaf::Uint(u) => Some(u as f64),
            Leaf::Float(x) => Some(x),
            _ => None,
        };
        let stored = match datatype {
            DataType::Bool => match leaf {
                Leaf::Bool(b) => {
                    out.push(u8::from(b));
                    Some(())
                }
                _ => None,
            },
            DataType::Int8 => int!(i8),
            DataType::Int16 => int!(i16),
            DataType::Int32 => int!(i32),
            DataType::Int64 => int!(i64),
            DataType::Uint8 => int!(u8),
            DataType::Uint16 => int!(u16),
            DataType::Uint32 => int!(u32),
            DataType::Uint64 => int!(u64),
            DataType::Fp32 => float.map(|x| out.extend_from_slice(&(x as f32).to_le_bytes())),
            DataType::Fp64 => float.map(|x| out.extend_from_slice(&x.to_le_bytes())),
            DataType::Bytes => match leaf {
                Leaf::Str(s) => {
                    push_bytes_element(out, s.as_bytes());
                    Some(())
                }
                _ => None,
            },
            // Refused before decoding starts.
            DataType::Fp16 | DataType::Bf16 => None,
        };
        match stored {
            Some(()) => Ok(()),
            None => Err(self.fail(Error::invalid(format!(
                "input '{}' of datatype {datatype}: element {leaf} is not a valid {datatype} value",
                self.name
            )))),
        }
    }

    fn fail<E: serde::de::Error>(&mut self, err: Error) -> E {
        let e = E::custom(&err.message);
        self.error = Some(err);
        e
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut Leaves<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut Leaves<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tensor elements, as a flat or nested array")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        while seq.next_element_seed(&mut *self)?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<(), E> {
        self.push(Leaf::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<(), E> {
        self.push(Leaf::Int(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<(), E> {
        self.push(Leaf::Uint(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<(), E> {
        self.push(Leaf::Float(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(), E> {
        self.push(Leaf::Str(v))
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        let message = format!(
            "input '{}' of datatype {}: element null is not a valid {} value",
            self.name, self.datatype, self.datatype
        );
        Err(self.fail(Error::invalid(message)))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> std::result::Result<(), A::Error> {
        let message = format!(
            "input '{}': 'data' must be an array of elements, not an object",
            self.name
        );
        Err(self.fail(Error::invalid(message)))
    }
}

fn bytes_to_json(tensor: &Tensor) -> Value {
    let d = &tensor.data;
    macro_rules! nums {
        ($t:ty, $n:expr) => {
            d.chunks_exact($n)
                .map(|c| {
                    let mut a = [0u8; $n];
                    a.copy_from_slice(c);
                    json!(<$t>::from_le_bytes(a))
                })
                .collect()
        };
    }
    let values: Vec<Value> = match tensor.datatype {
        DataType::Bool => d.iter().map(|&b| json!(b != 0)).collect(),
        DataType::Int8 => nums!(i8, 1),
        DataType::Int16 => nums!(i16, 2),
        DataType::Int32 => nums!(i32, 4),
        DataType::Int64 => nums!(i64, 8),
        DataType::Uint8 => nums!(u8, 1),
        DataType::Uint16 => nums!(u16, 2),
        DataType::Uint32 => nums!(u32, 4),
        DataType::Uint64 => nums!(u64, 8),
        DataType::Fp32 => nums!(f32, 4),
        DataType::Fp64 => nums!(f64, 8),
        DataType::Fp16 => d
            .chunks_exact(2)
            .map(|c| json!(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        DataType::Bf16 => d
            .chunks_exact(2)
            .map(|c| json!(half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        DataType::Bytes => bytes_elements(d)
            .map(|b| json!(String::from_utf8_lossy(b)))
            .collect(),
    };
    Value::Array(values)
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
        if let Some(req) = requested {
            if req.parameters.contains_key("classification") {
                return Err(Error::unsupported(format!(
                    "output '{}': the classification extension is not supported",
                    tensor.name
                )));
            }
        }
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
            entry.insert("data".into(), bytes_to_json(tensor));
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
    use crate::frontends::shared_memory::no_shared_inputs;

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
