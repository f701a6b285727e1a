//! A request's identity in the response cache, in memory or in Redis: a hash of the model,
//! version, what the version was loaded from (its files' and configuration's SHA-256, so a
//! model loaded again from other files never finds the answers of the old ones, on this server
//! or any other sharing a Redis), tenants, inputs and the outputs asked for (and how: a class
//! count changes the answer; how a frontend encodes an output does not).

use sha2::{Digest, Sha256};

use crate::inference::{InferRequest, ParamValue};

/// A request's identity in the cache.
pub type Key = [u8; 32];

/// The key of `request` to `model` version `version`, loaded as `generation`, for `tenants`
/// (their names, or none).
pub fn key(
    model: &str,
    version: i64,
    generation: &[u8; 32],
    request: &InferRequest,
    tenants: &[String],
) -> Key {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(model.as_bytes());
    field(&version.to_le_bytes());
    field(generation);
    field(&(tenants.len() as u64).to_le_bytes());
    for tenant in tenants {
        field(tenant.as_bytes());
    }
    field(&(request.inputs.len() as u64).to_le_bytes());
    for input in &request.inputs {
        field(input.name.as_bytes());
        field(input.datatype.wire_name().as_bytes());
        field(&(input.shape.len() as u64).to_le_bytes());
        for d in &input.shape {
            field(&d.to_le_bytes());
        }
        field(&input.data);
    }
    field(&(request.outputs.len() as u64).to_le_bytes());
    // The outputs asked for, and how they are asked (a class count changes the answer;
    // how a frontend encodes an output does not).
    for output in &request.outputs {
        field(output.name.as_bytes());
        let classes = output.parameters.get(crate::classification::PARAMETER);
        field(classes.map(param_text).unwrap_or_default().as_bytes());
    }
    h.finalize().into()
}

fn param_text(value: &ParamValue) -> String {
    match value {
        ParamValue::Bool(b) => format!("b{b}"),
        ParamValue::Int(i) => format!("i{i}"),
        ParamValue::Uint(u) => format!("u{u}"),
        ParamValue::Double(d) => format!("d{d}"),
        ParamValue::String(s) => format!("s{s}"),
    }
}
