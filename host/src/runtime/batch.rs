//! Several requests as one execution: inputs concatenated along the batch dimension, and the
//! outputs cut back into each request's rows. Used for backends that run one big tensor (ONNX
//! Runtime); Wasm stages receive the requests as a list instead.

use bytes::BytesMut;

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    tensor::{bytes_elements, element_count, DataType, Tensor},
};

/// Rows a request of a batching model contributes: the first dimension of its first input.
pub fn rows(request: &InferRequest) -> usize {
    request
        .inputs
        .first()
        .and_then(|t| t.shape.first())
        .map_or(1, |r| usize::try_from(*r).unwrap_or(0))
}

/// Whether two requests can run as one batch: the same inputs in the same order, with the same
/// datatypes and the same shapes apart from the batch dimension.
pub fn compatible(a: &InferRequest, b: &InferRequest) -> bool {
    compatible_but(a, b, &[])
}

/// [`compatible`], except that the inputs named in `ragged` (`allow_ragged_batch`) may differ
/// in shape.
pub fn compatible_but(a: &InferRequest, b: &InferRequest, ragged: &[String]) -> bool {
    a.inputs.len() == b.inputs.len()
        && a.inputs.iter().zip(&b.inputs).all(|(x, y)| {
            x.name == y.name
                && x.datatype == y.datatype
                && (ragged.contains(&x.name)
                    || (x.shape.len() == y.shape.len() && x.shape.get(1..) == y.shape.get(1..)))
        })
}

/// A batch run as one merged request: inputs concatenated along the batch dimension, `run`
/// once, and the outputs cut back into each request's rows (one request runs as it is).
pub fn execute_merged(
    requests: &[&InferRequest],
    outputs: &[String],
    mut run: impl FnMut(
        &InferRequest,
        &[String],
    ) -> Result<(Vec<Tensor>, crate::runtime::backend::ExecTimings)>,
) -> (
    Vec<Result<Vec<Tensor>>>,
    crate::runtime::backend::ExecTimings,
) {
    if let [one] = requests {
        return match run(one, outputs) {
            Ok((tensors, timings)) => (vec![Ok(tensors)], timings),
            Err(e) => (vec![Err(e)], Default::default()),
        };
    }
    let counts: Vec<usize> = requests.iter().map(|r| rows(r)).collect();
    let merged = merge(requests);
    match run(&merged, outputs) {
        Ok((tensors, timings)) => match split(&merged.model_name, tensors, &counts) {
            Ok(parts) => (parts.into_iter().map(Ok).collect(), timings),
            Err(e) => (vec![Err(e); requests.len()], timings),
        },
        Err(e) => (vec![Err(e); requests.len()], Default::default()),
    }
}

/// One request holding every request's inputs, concatenated along the batch dimension (in
/// order). The requests must be [`compatible`].
pub fn merge(requests: &[&InferRequest]) -> InferRequest {
    let first = requests[0];
    let inputs = first
        .inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let mut data = BytesMut::new();
            let mut rows = 0;
            for r in requests {
                let t = &r.inputs[i];
                data.extend_from_slice(&t.data);
                rows += t.shape.first().copied().unwrap_or(1);
            }
            let mut shape = input.shape.clone();
            if let Some(d) = shape.first_mut() {
                *d = rows;
            }
            Tensor {
                name: input.name.clone(),
                datatype: input.datatype,
                shape,
                data: data.freeze(),
            }
        })
        .collect();
    InferRequest {
        model_name: first.model_name.clone(),
        model_version: first.model_version,
        inputs,
        outputs: first.outputs.clone(),
        deadline: requests.iter().filter_map(|r| r.deadline).min(),
        responses: None,
        callers: requests.iter().flat_map(|r| r.callers.clone()).collect(),
        cancel: crate::cancellation::Cancellation::child_of_all(
            requests.iter().map(|r| r.cancel.clone()),
        ),
        ..Default::default()
    }
}

/// Cuts the outputs of a merged execution back into `rows.len()` responses of `rows[i]` rows.
/// An output whose first dimension is not the batch's total is an error of the model.
pub fn split(model: &str, outputs: Vec<Tensor>, rows: &[usize]) -> Result<Vec<Vec<Tensor>>> {
    let total: usize = rows.iter().sum();
    let mut per_request: Vec<Vec<Tensor>> = vec![Vec::with_capacity(outputs.len()); rows.len()];
    for output in outputs {
        let batch = output.shape.first().copied().unwrap_or(-1);
        if usize::try_from(batch).ok() != Some(total) {
            return Err(Error::internal(format!(
                "model '{model}': output '{}' has {batch} rows for a batch of {total}; it \
                 cannot be split between the batched requests",
                output.name
            )));
        }
        let offsets = row_offsets(model, &output, total)?;
        let mut row = 0;
        for (i, n) in rows.iter().enumerate() {
            let mut shape = output.shape.clone();
            shape[0] = *n as i64;
            per_request[i].push(Tensor {
                name: output.name.clone(),
                datatype: output.datatype,
                shape,
                data: output.data.slice(offsets[row]..offsets[row + n]),
            });
            row += n;
        }
    }
    Ok(per_request)
}

/// The first `rows` rows of `t` (an execution's output without its padding rows).
pub fn first_rows(model: &str, t: Tensor, rows: usize) -> Result<Tensor> {
    let total = t.shape.first().and_then(|&r| usize::try_from(r).ok());
    let Some(total) = total.filter(|&total| total >= rows) else {
        return Err(Error::internal(format!(
            "model '{model}': output '{}' has fewer rows than the {rows} requested",
            t.name
        )));
    };
    let offsets = row_offsets(model, &t, total)?;
    let mut shape = t.shape;
    shape[0] = rows as i64;
    Ok(Tensor {
        data: t.data.slice(0..offsets[rows]),
        shape,
        ..t
    })
}

/// Byte offset of the start of every row, plus the end: `rows + 1` entries; an error of the
/// model when its output's data does not match its shape.
fn row_offsets(model: &str, t: &Tensor, rows: usize) -> Result<Vec<usize>> {
    raw_row_offsets(t, rows).ok_or_else(|| {
        Error::internal(format!(
            "model '{model}': output '{}' holds data that does not match its shape",
            t.name
        ))
    })
}

fn raw_row_offsets(t: &Tensor, rows: usize) -> Option<Vec<usize>> {
    let per_row = element_count(t.shape.get(1..)?)?;
    if let Some(size) = t.datatype.element_size() {
        let row_bytes = per_row * size;
        if row_bytes * rows != t.data.len() {
            return None;
        }
        return Some((0..=rows).map(|r| r * row_bytes).collect());
    }
    debug_assert_eq!(t.datatype, DataType::Bytes);
    let mut offsets = Vec::with_capacity(rows + 1);
    offsets.push(0);
    let mut offset = 0;
    let mut in_row = 0;
    for element in bytes_elements(&t.data) {
        offset += 4 + element.len();
        in_row += 1;
        if in_row == per_row {
            offsets.push(offset);
            in_row = 0;
        }
    }
    if per_row == 0 {
        offsets.resize(rows + 1, 0);
    }
    (offsets.len() == rows + 1 && offset == t.data.len()).then_some(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::push_bytes_element;

    fn fp32(shape: &[i64], values: &[f32]) -> Tensor {
        Tensor {
            name: "x".into(),
            datatype: DataType::Fp32,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    fn strings(shape: &[i64], items: &[&str]) -> Tensor {
        let mut data = Vec::new();
        for s in items {
            push_bytes_element(&mut data, s.as_bytes());
        }
        Tensor {
            name: "s".into(),
            datatype: DataType::Bytes,
            shape: shape.to_vec(),
            data: data.into(),
        }
    }

    fn request(inputs: Vec<Tensor>) -> InferRequest {
        InferRequest {
            inputs,
            ..Default::default()
        }
    }

    #[test]
    fn merging_then_splitting_gives_every_request_its_own_rows() {
        let a = request(vec![fp32(&[1, 2], &[1.0, 2.0]), strings(&[1, 1], &["one"])]);
        let b = request(vec![
            fp32(&[2, 2], &[3.0, 4.0, 5.0, 6.0]),
            strings(&[2, 1], &["two", "three"]),
        ]);
        assert!(compatible(&a, &b));
        let merged = merge(&[&a, &b]);
        assert_eq!(merged.inputs[0].shape, [3, 2]);
        assert_eq!(merged.inputs[1].shape, [3, 1]);
        let parts = split("m", merged.inputs.clone(), &[1, 2]).unwrap();
        assert_eq!(parts[0], a.inputs);
        assert_eq!(parts[1], b.inputs);
    }

    #[test]
    fn shapes_must_agree_apart_from_the_batch_dimension() {
        let a = request(vec![fp32(&[1, 2], &[1.0, 2.0])]);
        let b = request(vec![fp32(&[1, 3], &[1.0, 2.0, 3.0])]);
        assert!(!compatible(&a, &b));
    }

    #[test]
    fn an_output_without_the_batch_rows_is_an_error() {
        let err = split("m", vec![fp32(&[2, 1], &[1.0, 2.0])], &[1, 2]).unwrap_err();
        assert!(err
            .message
            .contains("output 'x' has 2 rows for a batch of 3"));
    }
}
