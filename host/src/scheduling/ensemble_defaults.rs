//! Values an ensemble gives its optional inputs when a request leaves them out: a parameter
//! `input_default:<input>` in the ensemble's configuration, read as the input's datatype and
//! repeated to its dims (a variable dimension holds one element). This is how the TensorRT-LLM
//! ensemble answers with the prompt unless told otherwise (`exclude_input_in_output` defaults
//! to false, as in TensorRT-LLM) while the composing decoder keeps its own default for other
//! callers.

use bytes::Bytes;

use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, DataType, Tensor},
};

/// The prefix of the parameters that give an input's default.
pub const PREFIX: &str = "input_default:";

/// The default tensors a configuration gives, checked: each names an optional input, and its
/// value reads as that input's datatype.
pub fn of(config: &ModelConfig) -> Result<Vec<Tensor>> {
    let mut defaults = Vec::new();
    for (key, value) in &config.parameters {
        let Some(name) = key.strip_prefix(PREFIX) else {
            continue;
        };
        let refuse = |why: String| {
            Error::invalid(format!("model '{}': parameter '{key}': {why}", config.name))
                .with_field(key.as_str())
        };
        let input = config
            .input
            .iter()
            .find(|i| i.name == name)
            .ok_or_else(|| refuse(format!("'{name}' is not an input of the model")))?;
        if !input.optional {
            return Err(refuse(format!(
                "input '{name}' is required (only an optional input takes a default)"
            )));
        }
        let datatype = DataType::from_config_value(input.data_type)
            .ok_or_else(|| refuse(format!("input '{name}' has no datatype")))?;
        let mut shape: Vec<i64> = input.dims.iter().map(|&d| d.max(1)).collect();
        if config.max_batch_size > 0 {
            shape.insert(0, 1);
        }
        let count = shape.iter().product::<i64>().max(1) as usize;
        let element = element(datatype, value.string_value.trim()).map_err(|why| {
            refuse(format!(
                "'{}' is not a {} value ({why})",
                value.string_value,
                datatype.config_name()
            ))
        })?;
        let data: Vec<u8> = element
            .iter()
            .copied()
            .cycle()
            .take(element.len() * count)
            .collect();
        defaults.push(Tensor {
            name: name.to_owned(),
            datatype,
            shape,
            data: Bytes::from(data),
        });
    }
    Ok(defaults)
}

/// Refuses `input_default:` parameters in a model that is not an ensemble (only an ensemble
/// fills its inputs): never silently ignored.
pub fn refuse_outside_ensembles(config: &ModelConfig) -> Result<()> {
    match config.parameters.keys().find(|k| k.starts_with(PREFIX)) {
        Some(key) => Err(Error::invalid(format!(
            "model '{}': parameter '{key}' gives an ensemble's optional input a default; this \
             model is not an ensemble",
            config.name
        ))
        .with_field(key.as_str())),
        None => Ok(()),
    }
}

/// One element of `datatype` read from `text`, as its little-endian bytes (a BYTES element
/// with its length prefix).
fn element(datatype: DataType, text: &str) -> std::result::Result<Vec<u8>, String> {
    fn num<T: std::str::FromStr>(text: &str) -> std::result::Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        text.parse::<T>().map_err(|e| e.to_string())
    }
    Ok(match datatype {
        DataType::Bool => match text.to_ascii_lowercase().as_str() {
            "true" | "1" => vec![1],
            "false" | "0" => vec![0],
            _ => return Err("true or false".into()),
        },
        DataType::Uint8 => num::<u8>(text)?.to_le_bytes().to_vec(),
        DataType::Int8 => num::<i8>(text)?.to_le_bytes().to_vec(),
        DataType::Uint16 => num::<u16>(text)?.to_le_bytes().to_vec(),
        DataType::Int16 => num::<i16>(text)?.to_le_bytes().to_vec(),
        DataType::Uint32 => num::<u32>(text)?.to_le_bytes().to_vec(),
        DataType::Int32 => num::<i32>(text)?.to_le_bytes().to_vec(),
        DataType::Uint64 => num::<u64>(text)?.to_le_bytes().to_vec(),
        DataType::Int64 => num::<i64>(text)?.to_le_bytes().to_vec(),
        DataType::Fp32 => num::<f32>(text)?.to_le_bytes().to_vec(),
        DataType::Fp64 => num::<f64>(text)?.to_le_bytes().to_vec(),
        DataType::Fp16 => half::f16::from_f32(num::<f32>(text)?)
            .to_le_bytes()
            .to_vec(),
        DataType::Bf16 => half::bf16::from_f32(num::<f32>(text)?)
            .to_le_bytes()
            .to_vec(),
        DataType::Bytes => {
            let mut out = Vec::with_capacity(4 + text.len());
            push_bytes_element(&mut out, text.as_bytes());
            out
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelInput, ModelParameter};

    fn config(optional: bool, value: &str) -> ModelConfig {
        ModelConfig {
            name: "ens".into(),
            input: vec![ModelInput {
                name: "exclude_input_in_output".into(),
                data_type: DataType::Bool.config_value(),
                dims: vec![1, 1],
                optional,
                ..Default::default()
            }],
            parameters: [(
                format!("{PREFIX}exclude_input_in_output"),
                ModelParameter {
                    string_value: value.into(),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_default_is_the_inputs_type_and_shape() {
        let d = of(&config(true, "false")).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].shape, [1, 1]);
        assert_eq!(d[0].data.as_ref(), [0]);
        let e = of(&config(false, "false")).unwrap_err();
        assert!(e.message.contains("is required"), "{}", e.message);
        let e = of(&config(true, "maybe")).unwrap_err();
        assert!(e.message.contains("not a TYPE_BOOL value"), "{}", e.message);
    }
}
