//! Our types to the WIT contract's and back: datatypes, tensors, errors, request parameters.

use super::*;

pub(super) fn to_wit_datatype(d: DataType) -> wit::Datatype {
    match d {
        DataType::Bool => wit::Datatype::Bool,
        DataType::Uint8 => wit::Datatype::Uint8,
        DataType::Uint16 => wit::Datatype::Uint16,
        DataType::Uint32 => wit::Datatype::Uint32,
        DataType::Uint64 => wit::Datatype::Uint64,
        DataType::Int8 => wit::Datatype::Int8,
        DataType::Int16 => wit::Datatype::Int16,
        DataType::Int32 => wit::Datatype::Int32,
        DataType::Int64 => wit::Datatype::Int64,
        DataType::Fp16 => wit::Datatype::Fp16,
        DataType::Fp32 => wit::Datatype::Fp32,
        DataType::Fp64 => wit::Datatype::Fp64,
        DataType::Bf16 => wit::Datatype::Bf16,
        DataType::Bytes => wit::Datatype::Bytes,
    }
}

pub(super) fn from_wit_datatype(d: wit::Datatype) -> DataType {
    match d {
        wit::Datatype::Bool => DataType::Bool,
        wit::Datatype::Uint8 => DataType::Uint8,
        wit::Datatype::Uint16 => DataType::Uint16,
        wit::Datatype::Uint32 => DataType::Uint32,
        wit::Datatype::Uint64 => DataType::Uint64,
        wit::Datatype::Int8 => DataType::Int8,
        wit::Datatype::Int16 => DataType::Int16,
        wit::Datatype::Int32 => DataType::Int32,
        wit::Datatype::Int64 => DataType::Int64,
        wit::Datatype::Fp16 => DataType::Fp16,
        wit::Datatype::Fp32 => DataType::Fp32,
        wit::Datatype::Fp64 => DataType::Fp64,
        wit::Datatype::Bf16 => DataType::Bf16,
        wit::Datatype::Bytes => DataType::Bytes,
    }
}

pub(super) fn to_wit_tensor(t: &Tensor) -> wit::Tensor {
    wit::Tensor {
        name: t.name.clone(),
        datatype: to_wit_datatype(t.datatype),
        shape: t.shape.clone(),
        data: t.data.to_vec(),
    }
}

pub(super) fn from_wit_tensor(t: wit::Tensor) -> Tensor {
    Tensor {
        name: t.name,
        datatype: from_wit_datatype(t.datatype),
        shape: t.shape,
        data: t.data.into(),
    }
}

pub(super) fn to_wit_error(e: Error) -> wit::Error {
    let code = match e.code {
        Code::InvalidArg | Code::AlreadyExists | Code::Cancelled => wit::ErrorCode::InvalidArgument,
        Code::NotFound => wit::ErrorCode::NotFound,
        Code::Unavailable => wit::ErrorCode::Unavailable,
        Code::Unsupported => wit::ErrorCode::Unsupported,
        Code::Internal | Code::Unknown => wit::ErrorCode::Internal,
        // A stage's call refused by access control: the stage sees an unfitting request.
        Code::Unauthenticated | Code::PermissionDenied => wit::ErrorCode::InvalidArgument,
        Code::ResourceExhausted => wit::ErrorCode::Unavailable,
    };
    wit::Error {
        code,
        message: e.message,
    }
}

pub(super) fn from_wit_error(model: &str, e: wit::Error) -> Error {
    let code = match e.code {
        wit::ErrorCode::InvalidArgument => Code::InvalidArg,
        wit::ErrorCode::NotFound => Code::NotFound,
        wit::ErrorCode::Unavailable => Code::Unavailable,
        wit::ErrorCode::Unsupported => Code::Unsupported,
        wit::ErrorCode::Internal => Code::Internal,
    };
    // A guest names the request field at fault by starting its message with it, quoted
    // ('text_input' is empty): the WIT error has no field of its own.
    let field = quoted_start(&e.message).map(str::to_owned);
    let error = Error::new(code, format!("stage '{model}': {}", e.message));
    match field {
        Some(field) => error.with_field(field),
        None => error,
    }
}

/// The name a message starts with in single quotes, when it is a plain name (letters,
/// digits, `_`, `.`, `-`, `[`, `]`).
fn quoted_start(message: &str) -> Option<&str> {
    let rest = message.strip_prefix('\'')?;
    let name = &rest[..rest.find('\'')?];
    let plain = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '[' | ']'));
    plain.then_some(name)
}

pub(super) fn wit_parameters(request: &InferRequest) -> Vec<wit::Parameter> {
    request
        .parameters
        .iter()
        .map(|(key, value)| wit::Parameter {
            key: key.clone(),
            value: match value {
                ParamValue::Bool(b) => wit::ParamValue::Bool(*b),
                ParamValue::Int(i) => wit::ParamValue::Int(*i),
                ParamValue::Uint(u) => match i64::try_from(*u) {
                    Ok(i) => wit::ParamValue::Int(i),
                    Err(_) => wit::ParamValue::Double(*u as f64),
                },
                ParamValue::Double(d) => wit::ParamValue::Double(*d),
                ParamValue::String(s) => wit::ParamValue::String(s.clone()),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_names_the_field_by_starting_its_message_with_it() {
        let error = |message: &str| {
            from_wit_error(
                "tok",
                wit::Error {
                    code: wit::ErrorCode::InvalidArgument,
                    message: message.into(),
                },
            )
        };
        let e = error("'text_input' is empty: the prompt needs some text");
        assert_eq!(e.field.as_deref(), Some("text_input"));
        assert_eq!(e.code, Code::InvalidArg);
        assert!(
            e.message.starts_with("stage 'tok': 'text_input' is empty"),
            "{e:?}"
        );
        assert_eq!(
            error("'messages[0].role' is unknown").field.as_deref(),
            Some("messages[0].role")
        );
        for unnamed in [
            "the prompt is empty",
            "'two words' are not a name",
            "''",
            "'unclosed",
        ] {
            assert_eq!(error(unnamed).field, None, "{unnamed}");
        }
    }
}
