//! Triton's classification extension: an output requested with the parameter
//! `classification: k` is answered, for each batch row, as its `k` highest values, highest
//! first, a BYTES tensor of `"<value>:<index>"` strings, `":<label>"` added where the output's
//! `label_filename` names one (line `index` of that file). Values are written as C's `%f` for
//! floating types and as integers otherwise, as Triton writes them.

use std::{collections::HashMap, path::Path, sync::Arc};

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    names::ModelFilePath,
    proto::inference::ModelConfig,
    tensor::{push_bytes_element, DataType, Tensor},
};

/// The request parameter that asks for classes.
pub const PARAMETER: &str = "classification";

/// Each output's labels (from `label_filename`), by output name.
pub type Labels = HashMap<String, Arc<[String]>>;

/// Reads the label files `config`'s outputs name, relative to the model's folder `model_dir`;
/// the error names the output and the file.
pub fn read_labels(config: &ModelConfig, model_dir: &Path) -> std::result::Result<Labels, String> {
    let mut labels = Labels::new();
    for output in config
        .output
        .iter()
        .filter(|o| !o.label_filename.is_empty())
    {
        let file = &output.label_filename;
        let path = ModelFilePath::parse(file).map_err(|_| {
            format!(
                "output '{}': field 'label_filename' must name a file in the model's folder \
                 (a relative path without '.' or '..'), got '{file}'",
                output.name
            )
        })?;
        let text = std::fs::read_to_string(model_dir.join(path.to_path())).map_err(|e| {
            format!(
                "output '{}': cannot read its label_filename '{file}': {e}",
                output.name
            )
        })?;
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        labels.insert(output.name.clone(), lines.into());
    }
    Ok(labels)
}

/// The outputs `request` asks classes of, with how many; a count that is not a positive
/// integer is refused naming the output.
pub fn requested(request: &InferRequest) -> Result<Vec<(String, usize)>> {
    let mut asked = Vec::new();
    for output in &request.outputs {
        let Some(value) = output.parameters.get(PARAMETER) else {
            continue;
        };
        let count = value
            .as_u64()
            .filter(|&k| k > 0)
            .and_then(|k| usize::try_from(k).ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "output '{}': parameter '{PARAMETER}' must be a positive integer (the number \
                     of classes to return)",
                    output.name
                ))
            })?;
        asked.push((output.name.clone(), count));
    }
    Ok(asked)
}

/// The outputs asked for classes, checked before anything runs: each must be one whose type
/// gives classes (numbers); an output the configuration does not list is checked on its
/// answer.
pub fn check_types(
    config: &ModelConfig,
    classes: Vec<(String, usize)>,
) -> Result<Vec<(String, usize)>> {
    for (name, _) in &classes {
        let declared = config
            .output
            .iter()
            .find(|o| o.name == *name)
            .and_then(|o| DataType::from_config_value(o.data_type));
        if let Some(
            datatype @ (DataType::Bytes | DataType::Bool | DataType::Fp16 | DataType::Bf16),
        ) = declared
        {
            return Err(Error::invalid(format!(
                "output '{name}': class results are not available for type {}",
                datatype.wire_name()
            )));
        }
    }
    Ok(classes)
}

/// `tensor` as its `k` top classes per batch row (`batched`: the first dimension is the
/// batch), with `labels` when the output has them.
pub fn classify(
    tensor: &Tensor,
    k: usize,
    batched: bool,
    labels: Option<&[String]>,
) -> Result<Tensor> {
    let size = match tensor.datatype {
        DataType::Bool | DataType::Bytes | DataType::Fp16 | DataType::Bf16 => None,
        other => other.element_size(),
    }
    .ok_or_else(|| {
        Error::invalid(format!(
            "output '{}': class results are not available for type {}",
            tensor.name,
            tensor.datatype.wire_name()
        ))
    })?;
    let values = numbers(tensor.datatype, &tensor.data, size);
    let rows = if batched {
        tensor
            .shape
            .first()
            .and_then(|&r| usize::try_from(r).ok())
            .unwrap_or(1)
    } else {
        1
    };
    let per_row = values.len().checked_div(rows).unwrap_or(0);
    let kept = k.min(per_row);
    let mut data = Vec::new();
    for row in values.chunks(per_row.max(1)).take(rows) {
        let mut order: Vec<usize> = (0..row.len()).collect();
        // Highest first; ties keep the lower index first (a stable sort).
        order.sort_by(|&a, &b| row[b].0.total_cmp(&row[a].0));
        for &index in order.iter().take(kept) {
            let mut text = format!("{}:{index}", row[index].1);
            if let Some(label) = labels.and_then(|l| l.get(index)) {
                text.push(':');
                text.push_str(label);
            }
            push_bytes_element(&mut data, text.as_bytes());
        }
    }
    let shape = if batched {
        vec![rows as i64, kept as i64]
    } else {
        vec![kept as i64]
    };
    Ok(Tensor {
        name: tensor.name.clone(),
        datatype: DataType::Bytes,
        shape,
        data: data.into(),
    })
}

/// Each element as a number to sort by and the text Triton writes for it.
fn numbers(datatype: DataType, data: &[u8], size: usize) -> Vec<(f64, String)> {
    data.chunks_exact(size)
        .map(|b| {
            macro_rules! int {
                ($t:ty) => {{
                    let v = <$t>::from_le_bytes(b.try_into().unwrap_or_default());
                    (v as f64, v.to_string())
                }};
            }
            match datatype {
                DataType::Uint8 => int!(u8),
                DataType::Uint16 => int!(u16),
                DataType::Uint32 => int!(u32),
                DataType::Uint64 => int!(u64),
                DataType::Int8 => int!(i8),
                DataType::Int16 => int!(i16),
                DataType::Int32 => int!(i32),
                DataType::Int64 => int!(i64),
                DataType::Fp64 => {
                    let v = f64::from_le_bytes(b.try_into().unwrap_or_default());
                    (v, format!("{v:.6}"))
                }
                _ => {
                    let v = f32::from_le_bytes(b.try_into().unwrap_or_default());
                    (f64::from(v), format!("{v:.6}"))
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::bytes_elements;

    fn fp32(shape: &[i64], values: &[f32]) -> Tensor {
        Tensor {
            name: "PROB".into(),
            datatype: DataType::Fp32,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        }
    }

    fn strings(t: &Tensor) -> Vec<String> {
        bytes_elements(&t.data)
            .map(|b| String::from_utf8(b.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn each_row_gets_its_top_classes_with_labels_as_triton_writes_them() {
        let t = fp32(&[2, 3], &[0.1, 0.7, 0.2, 0.5, 0.25, 0.25]);
        let labels: Vec<String> = ["cat", "dog"].map(String::from).to_vec();
        let c = classify(&t, 2, true, Some(&labels)).unwrap();
        assert_eq!(c.shape, [2, 2]);
        assert_eq!(c.datatype, DataType::Bytes);
        assert_eq!(
            strings(&c),
            [
                "0.700000:1:dog",
                "0.200000:2",
                "0.500000:0:cat",
                "0.250000:1:dog"
            ]
        );
        // More classes than there are: all of them; without batching, one row.
        let c = classify(&fp32(&[3], &[3.0, 1.0, 2.0]), 5, false, None).unwrap();
        assert_eq!(c.shape, [3]);
        assert_eq!(strings(&c), ["3.000000:0", "2.000000:2", "1.000000:1"]);
    }

    #[test]
    fn integers_are_written_as_integers_and_strings_are_refused() {
        let t = Tensor {
            name: "N".into(),
            datatype: DataType::Int32,
            shape: vec![3],
            data: [4i32, -1, 9]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        };
        assert_eq!(strings(&classify(&t, 1, false, None).unwrap()), ["9:2"]);
        let s = Tensor {
            datatype: DataType::Bytes,
            ..t
        };
        let e = classify(&s, 1, false, None).unwrap_err();
        assert!(
            e.message.contains("not available for type BYTES"),
            "{}",
            e.message
        );
    }
}
