//! Triton's generate extension: `POST …/generate` and `…/generate_stream` (server-sent
//! events). A request is one flat JSON object: each field named like a model input becomes
//! that input (a value or an array, shaped by the configuration), `id` (unless an input has
//! that name) the request's id, `parameters` and any other field request parameters; a field
//! given twice is refused, naming the first repeated in the order sent. Each response is one
//! flat object: `model_name`, `model_version`, the request's `id` when it had one, and one
//! field per output (a single element unwrapped).

use std::collections::{BTreeMap, HashSet};

use serde_json::{value::RawValue, Map, Value};

use super::{codec, json_data::json_to_bytes};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, ParamValue, Parameters},
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

/// Builds an inference request from a generate request body, read straight from its bytes:
/// each field stays the text it was sent as until it is decoded into its input's tensor (no
/// `Value` tree of the whole body).
pub fn to_request(
    config: &ModelConfig,
    model: &str,
    version: Option<i64>,
    body: &[u8],
) -> Result<InferRequest> {
    let Fields(fields) = serde_json::from_slice(body).map_err(|e| {
        Error::invalid(format!(
            "generate: the request body must be a JSON object: {e}"
        ))
    })?;
    let mut seen = HashSet::new();
    for (key, _) in &fields {
        if !seen.insert(key.as_str()) {
            // Triton's words.
            let kind = if config.input.iter().any(|i| i.name == *key) {
                "input"
            } else {
                "parameter"
            };
            return Err(Error::invalid(format!(
                "{kind} '{key}' already exists in request"
            )));
        }
    }
    let mut parameters = Parameters::new();
    let mut inputs = Vec::new();
    let mut id = String::new();
    for (key, value) in fields {
        if key == "id" && !config.input.iter().any(|i| i.name == key) {
            id = serde_json::from_str::<String>(value.get())
                .map_err(|_| Error::invalid("generate: 'id' must be a string"))?;
            continue;
        }
        if key == "parameters" {
            let nested: BTreeMap<String, &RawValue> = serde_json::from_str(value.get())
                .map_err(|_| Error::invalid("generate: 'parameters' must be a JSON object"))?;
            for (key, value) in nested {
                let v = codec::parameter_from_raw(&key, value, "the generate request")?;
                parameters.insert(key, v);
            }
            continue;
        }
        let Some(input) = config.input.iter().find(|i| i.name == key) else {
            // Not an input: a request parameter, as Triton does.
            let v = codec::parameter_from_raw(&key, value, "the generate request")?;
            parameters.insert(key, v);
            continue;
        };
        let datatype = DataType::from_config_value(input.data_type).ok_or_else(|| {
            Error::invalid(format!("generate: input '{key}' has no valid datatype"))
        })?;
        let shape = shape_for(
            &key,
            &input.dims,
            config.max_batch_size > 0,
            top_level_count(value),
        )?;
        let data = json_to_bytes(&key, datatype, &shape, value.get())?;
        inputs.push(Tensor {
            name: key,
            datatype,
            shape,
            data,
        });
    }
    Ok(InferRequest::new(model, version)
        .with_id(id)
        .with_parameters(parameters)
        .with_inputs(inputs))
}

/// A JSON object's fields in the order sent, repeats included (a map would keep one).
struct Fields<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Fields<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Fields<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Fields<'a>, A::Error> {
                let mut fields = Vec::new();
                while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                    fields.push(entry);
                }
                Ok(Fields(fields))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// How many elements a field holds at its top level: a list's length (counted without
/// keeping anything), else 1.
fn top_level_count(raw: &RawValue) -> usize {
    struct Count;
    impl<'de> serde::de::Visitor<'de> for Count {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
            let mut n = 0;
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                n += 1;
            }
            Ok(n)
        }
    }
    if !raw.get().starts_with('[') {
        return 1;
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    serde::Deserializer::deserialize_seq(&mut de, Count).unwrap_or(1)
}

/// A model that takes a BOOL `stream` input (a generation model or ensemble) and was not told
/// is told what the endpoint asks for: `false` for `…/generate`, which answers once (what
/// TensorRT-LLM does when `stream` is not sent, on every protocol), `true` for
/// `…/generate_stream`, whose name asks for the tokens as they come.
pub fn default_stream(config: &ModelConfig, request: &mut InferRequest, stream: bool) {
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
        data: vec![u8::from(stream)].into(),
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
    if !response.id.is_empty() {
        out.insert("id".into(), response.id.clone().into());
    }
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
