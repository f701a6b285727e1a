//! What each fuzz target does with one input. Kept apart from the `fuzz_target!` wrappers so
//! that `tests/fuzz_regressions.rs` replays saved inputs through exactly the same code on the
//! stable toolchain. Every function must return normally for any input: errors are fine,
//! panics (and the properties asserted here) are the bugs.

use std::{path::Path, sync::OnceLock};

use bytes::Bytes;
use prost::Message;
use wasmtron::{
    frontends::{
        grpc,
        http::{codec, generate},
    },
    inference::{InferResponse, Parameters},
    limits::RequestLimits,
    proto::inference::{ModelConfig, ModelInferRequest},
    repository::{config, sequence::sequence_spec, validate::validate},
    runtime::request_check::check_request,
    tenancy::{ModelAction, Tenancy},
    tensor::{bytes_elements, count_bytes_elements, push_bytes_element, DataType, Tensor},
};

/// `config.pbtxt` text (first byte 0) or the load API's JSON config (otherwise): parsing,
/// the checks made at load, and a JSON round trip of whatever was accepted.
pub fn config_pbtxt(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let parsed = if mode == 0 {
        config::parse_text(text, Path::new("config.pbtxt"))
    } else {
        config::parse_json(text)
    };
    let Ok(mut model) = parsed else {
        return;
    };
    let before = model.clone();
    let rendered = config::to_json(&before);
    let again = config::parse_json(&rendered.to_string());
    assert_eq!(
        again.as_ref().ok(),
        Some(&before),
        "config does not survive a JSON round trip: {rendered}"
    );
    let name = if model.name.is_empty() {
        "fuzz".to_owned()
    } else {
        model.name.clone()
    };
    if validate(&mut model, &name, "config.pbtxt").is_ok() {
        let _ = sequence_spec(&model);
    }
}

/// A model whose one input the raw binary form fills; the first input byte picks which.
fn models() -> &'static [ModelConfig; 3] {
    static MODELS: OnceLock<[ModelConfig; 3]> = OnceLock::new();
    MODELS.get_or_init(|| {
        let parse = |text: &str| {
            config::parse_text(text, Path::new("fuzz")).unwrap_or_else(|e| panic!("{e}"))
        };
        [
            parse(
                r#"name: "m" max_batch_size: 8
                   input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
                   output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]"#,
            ),
            parse(
                r#"name: "m" max_batch_size: 0
                   input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
                   output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]"#,
            ),
            parse(
                r#"name: "m" max_batch_size: 4
                   input [ { name: "INPUT0", data_type: TYPE_INT8, dims: [ 2, -1 ] } ]
                   output [ { name: "OUTPUT0", data_type: TYPE_INT8, dims: [ 2, -1 ] } ]"#,
            ),
        ]
    })
}

/// The HTTP inference body. Input: a mode byte (which model, and whether
/// `Inference-Header-Content-Length` is absent, 0, or the next two bytes), then the body.
/// Whatever decodes is checked against the model and echoed back through the response
/// encoder, as a backend's outputs would be.
pub fn http_infer_body(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let model = &models()[usize::from(mode % 3)];
    let (json_length, body) = match (mode / 3) % 3 {
        0 => (None, rest),
        1 => (Some(0), rest),
        _ => match rest {
            [a, b, body @ ..] => (Some(usize::from(u16::from_le_bytes([*a, *b]))), body),
            _ => return,
        },
    };
    let limits = RequestLimits::default();
    let Ok(request) = codec::decode_request(
        "m",
        None,
        Bytes::copy_from_slice(body),
        json_length,
        Some(model),
        &limits,
        &wasmtron::frontends::shared_memory::no_shared_inputs,
    ) else {
        return;
    };
    if check_request(model, &request).is_err() || limits.check_request(&request).is_err() {
        return;
    }
    // Valid inputs come back as outputs, as from an identity model.
    let outputs = request
        .inputs
        .iter()
        .map(|t| Tensor {
            name: "OUTPUT0".into(),
            ..t.clone()
        })
        .collect();
    let response = InferResponse {
        model_name: "m".into(),
        model_version: 1,
        last: false,
        id: request.id.clone(),
        parameters: Parameters::new(),
        outputs,
    };
    let _ = codec::encode_response(&request.parameters, &request.outputs, &response);
}

/// A gRPC `ModelInferRequest` as protobuf bytes: decoding, the request limits, and the
/// response encoder over whatever tensors are well formed.
pub fn grpc_infer_request(data: &[u8]) {
    let Ok(message) = ModelInferRequest::decode(data) else {
        return;
    };
    let Ok(request) = grpc::decode_request(
        message,
        &wasmtron::frontends::shared_memory::no_shared_inputs,
    ) else {
        return;
    };
    if RequestLimits::default().check_request(&request).is_err() {
        return;
    }
    let outputs: Vec<Tensor> = request
        .inputs
        .into_iter()
        .filter(|t| t.validate_size().is_ok())
        .collect();
    let _ = grpc::encode_response(
        InferResponse {
            model_name: request.model_name,
            model_version: 1,
            last: false,
            id: request.id,
            parameters: Parameters::new(),
            outputs,
        },
        &request.outputs,
    );
}

/// BYTES elements (4-byte little-endian length, then the bytes): counting, iterating and
/// re-encoding agree, and well-formed UTF-8 elements survive the JSON form of the HTTP API.
pub fn bytes_codec(data: &[u8]) {
    let elements: Vec<&[u8]> = bytes_elements(data).collect();
    let mut encoded = Vec::with_capacity(data.len());
    for e in &elements {
        push_bytes_element(&mut encoded, e);
    }
    match count_bytes_elements(data) {
        Some(n) => {
            assert_eq!(n, elements.len(), "count and iteration disagree");
            assert_eq!(encoded, data, "re-encoding changes well-formed BYTES data");
        }
        None => assert!(
            data.starts_with(&encoded) && encoded.len() < data.len(),
            "iteration of malformed BYTES data must stop before the malformed element"
        ),
    }
    let tensor = Tensor {
        name: "TEXT".into(),
        datatype: DataType::Bytes,
        shape: vec![elements.len() as i64],
        data: Bytes::from(encoded),
    };
    let json = codec::tensor_json_data(&tensor);
    if elements.iter().all(|e| std::str::from_utf8(e).is_ok()) {
        let back = codec::json_tensor(
            "TEXT",
            DataType::Bytes,
            tensor.shape.clone(),
            &json.to_string(),
        )
        .unwrap_or_else(|e| panic!("JSON form of BYTES data does not decode: {}", e.message));
        assert_eq!(back, tensor, "BYTES data changes through its JSON form");
    }
}

/// The server config file (`--config`, TOML). Input: the file's text, then after a NUL byte an
/// `Authorization` header value and after another a model name. Whatever parses must reload
/// onto itself unchanged (no key revoked), and answer who the header belongs to and what
/// that caller may do with the model without panicking.
pub fn tenancy_toml(data: &[u8]) {
    let mut fields = data.splitn(3, |&b| b == 0);
    let Ok(text) = std::str::from_utf8(fields.next().unwrap_or_default()) else {
        return;
    };
    let header = fields.next().and_then(|h| std::str::from_utf8(h).ok());
    let model = fields
        .next()
        .and_then(|m| std::str::from_utf8(m).ok())
        .unwrap_or("m");
    let Ok(tenancy) = Tenancy::parse(text, "wasmtron.toml") else {
        return;
    };
    let tenants = tenancy.usage().len();
    let again = tenancy
        .reload_text(text, "wasmtron.toml")
        .unwrap_or_else(|e| panic!("an accepted config does not reload onto itself: {e}"));
    assert_eq!(
        again.revoked_keys, 0,
        "reloading the same config revokes keys"
    );
    assert_eq!(
        again.tenants, tenants,
        "reloading the same config changes the tenants"
    );
    let _ = tenancy.stage_limits(model);
    if let Ok(caller) = tenancy.authenticate(header) {
        for action in [ModelAction::Infer, ModelAction::Load, ModelAction::See] {
            let _ = caller.may(action, model);
        }
        let _ = caller.admit(data.len());
    }
}

/// The generate extension's request body (JSON), against the first byte's model: the request
/// it becomes passes or fails the model's checks and the request limits without panicking.
pub fn generate_request(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let model = &models()[usize::from(mode % 3)];
    let Ok(request) = generate::to_request(model, "m", None, rest) else {
        return;
    };
    let _ = check_request(model, &request);
    let _ = RequestLimits::default().check_request(&request);
}

/// A name, `file:` key or shared-memory key from a request (the input as text): whatever
/// the one validator accepts stays inside the folder it is joined to. A model name and a
/// shared-memory name are one normal path component; a `file:` key is only normal components,
/// and joining it below a folder never climbs out of it.
pub fn request_names(data: &[u8]) {
    use std::path::Component;
    use wasmtron::names::{ModelFilePath, ModelName, ShmKey};

    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let one_component = |name: &str| {
        let mut parts = Path::new(name).components();
        matches!(parts.next(), Some(Component::Normal(c)) if c == name) && parts.next().is_none()
    };
    if let Ok(name) = ModelName::parse(text) {
        assert!(one_component(name.as_str()), "model name {text:?} accepted");
        assert!(!name.as_str().contains('\0'));
    }
    if let Ok(key) = ShmKey::parse(text) {
        assert!(one_component(key.file_name()), "shm key {text:?} accepted");
    }
    if let Ok(path) = ModelFilePath::parse(text) {
        let relative = path.to_path();
        assert!(
            relative
                .components()
                .all(|c| matches!(c, Component::Normal(_))),
            "file key {text:?} accepted as {relative:?}"
        );
        assert_eq!(relative.components().count(), path.parts().len());
        let base = Path::new("/staging");
        assert!(base.join(&relative).starts_with(base));
    }
}
