//! The wire conversion: `ModelInferRequest` into an [`InferRequest`] (typed contents or raw
//! bytes, parameters) and an [`InferResponse`] into `ModelInferResponse`.

use crate::frontends::shared_memory::{output_parameters, SharedInputs};
use crate::{
    error::Error,
    inference::{InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput},
    proto::inference::{
        infer_parameter::ParameterChoice, model_infer_request::InferInputTensor,
        model_infer_response::InferOutputTensor,
    },
    tensor::{push_bytes_element, DataType, Tensor},
};

use super::*;

pub(super) fn params_from_proto(
    map: std::collections::HashMap<String, InferParameter>,
) -> Parameters {
    map.into_iter()
        .filter_map(|(k, v)| {
            let value = match v.parameter_choice? {
                ParameterChoice::BoolParam(b) => ParamValue::Bool(b),
                ParameterChoice::Int64Param(i) => ParamValue::Int(i),
                ParameterChoice::StringParam(s) => ParamValue::String(s),
                ParameterChoice::DoubleParam(d) => ParamValue::Double(d),
                ParameterChoice::Uint64Param(u) => ParamValue::Uint(u),
            };
            Some((k, value))
        })
        .collect()
}

pub(super) fn params_to_proto(
    params: &Parameters,
) -> std::collections::HashMap<String, InferParameter> {
    params
        .iter()
        .map(|(k, v)| {
            let choice = match v {
                ParamValue::Bool(b) => ParameterChoice::BoolParam(*b),
                ParamValue::Int(i) => ParameterChoice::Int64Param(*i),
                ParamValue::Uint(u) => ParameterChoice::Uint64Param(*u),
                ParamValue::Double(d) => ParameterChoice::DoubleParam(*d),
                ParamValue::String(s) => ParameterChoice::StringParam(s.clone()),
            };
            (
                k.clone(),
                InferParameter {
                    parameter_choice: Some(choice),
                },
            )
        })
        .collect()
}

/// Converts typed `contents` to raw little-endian bytes for the tensor's datatype.
fn contents_to_bytes(input: &InferInputTensor, datatype: DataType) -> Result<Vec<u8>, Error> {
    let c = input.contents.clone().unwrap_or_default();
    let name = &input.name;
    let range = |v: &dyn std::fmt::Display| {
        Error::invalid(format!(
            "input '{name}': value {v} does not fit datatype {datatype}"
        ))
    };
    let mut out = Vec::new();
    macro_rules! narrow {
        ($src:expr, $t:ty) => {
            for v in &$src {
                let x = <$t>::try_from(*v).map_err(|_| range(v))?;
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match datatype {
        DataType::Bool => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 => narrow!(c.int_contents, i8),
        DataType::Int16 => narrow!(c.int_contents, i16),
        DataType::Int32 => narrow!(c.int_contents, i32),
        DataType::Int64 => narrow!(c.int64_contents, i64),
        DataType::Uint8 => narrow!(c.uint_contents, u8),
        DataType::Uint16 => narrow!(c.uint_contents, u16),
        DataType::Uint32 => narrow!(c.uint_contents, u32),
        DataType::Uint64 => narrow!(c.uint64_contents, u64),
        DataType::Fp32 => c
            .fp32_contents
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DataType::Fp64 => c
            .fp64_contents
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DataType::Bytes => c
            .bytes_contents
            .iter()
            .for_each(|b| push_bytes_element(&mut out, b)),
        DataType::Fp16 | DataType::Bf16 => {
            return Err(Error::invalid(format!(
                "input '{name}': datatype {datatype} must be sent in raw_input_contents"
            )))
        }
    }
    Ok(out)
}

/// Decodes a `ModelInferRequest`. Inputs in shared memory (found by `shared`) have no entry
/// in `raw_input_contents`, as tritonclient sends them; every other input has one, in order.
pub fn decode_request(
    req: ModelInferRequest,
    shared: SharedInputs<'_>,
) -> Result<InferRequest, Error> {
    let version = crate::names::parse_version(&req.model_name, &req.model_version)?;
    let raw = !req.raw_input_contents.is_empty();
    let mut in_shared_memory = Vec::with_capacity(req.inputs.len());
    for input in &req.inputs {
        let params = params_from_proto(input.parameters.clone());
        in_shared_memory.push(shared(&input.name, &params)?);
    }
    let inline = in_shared_memory.iter().filter(|d| d.is_none()).count();
    if raw && req.raw_input_contents.len() != inline {
        return Err(Error::invalid(format!(
            "raw_input_contents has {} entries but the request has {inline} inputs not in shared memory; give one per such input, in order",
            req.raw_input_contents.len(),
        )));
    }
    let mut raw_contents = req.raw_input_contents.into_iter();
    let mut inputs = Vec::with_capacity(req.inputs.len());
    for (input, shared_data) in req.inputs.into_iter().zip(in_shared_memory) {
        let datatype = DataType::from_wire(&input.datatype).ok_or_else(|| {
            Error::invalid(format!(
                "input '{}' has unknown datatype '{}'",
                input.name, input.datatype
            ))
        })?;
        let data = if let Some(data) = shared_data {
            if input.contents.is_some() {
                return Err(Error::invalid(format!(
                    "input '{}' names a shared memory region and also has 'contents'; send one or the other",
                    input.name
                )));
            }
            data
        } else if raw {
            if input.contents.is_some() {
                return Err(Error::invalid(format!(
                    "input '{}' has 'contents' while the request uses raw_input_contents; use one or the other",
                    input.name
                )));
            }
            raw_contents.next().unwrap_or_default()
        } else {
            contents_to_bytes(&input, datatype)?.into()
        };
        inputs.push(Tensor {
            name: input.name,
            datatype,
            shape: input.shape,
            data,
        });
    }
    let outputs = req
        .outputs
        .into_iter()
        .map(|o| RequestedOutput {
            name: o.name,
            parameters: params_from_proto(o.parameters),
        })
        .collect();
    Ok(InferRequest::new(req.model_name, version)
        .with_id(req.id)
        .with_parameters(params_from_proto(req.parameters))
        .with_inputs(inputs)
        .with_outputs(outputs))
}

/// Encodes a response with every output in `raw_output_contents`, except those written to
/// shared memory: their entry is empty (so that the entries stay aligned with `outputs`) and
/// their parameters name the region.
pub fn encode_response(resp: InferResponse, requested: &[RequestedOutput]) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(resp.outputs.len());
    let mut raw = Vec::with_capacity(resp.outputs.len());
    for t in resp.outputs {
        let shared = output_parameters(requested, &t.name, t.data.len());
        outputs.push(InferOutputTensor {
            parameters: shared.as_ref().map(params_to_proto).unwrap_or_default(),
            name: t.name,
            datatype: t.datatype.wire_name().to_owned(),
            shape: t.shape,
            contents: None,
        });
        raw.push(if shared.is_some() {
            bytes::Bytes::new()
        } else {
            t.data
        });
    }
    ModelInferResponse {
        model_name: resp.model_name,
        model_version: resp.model_version.to_string(),
        id: resp.id,
        parameters: params_to_proto(&resp.parameters),
        outputs,
        raw_output_contents: raw,
    }
}
