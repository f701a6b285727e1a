//! Our tensors to ONNX Runtime values and back; outputs kept in ONNX Runtime's memory
//! without a copy.

use bytes::Bytes;
use ort::{
    memory::Allocator,
    value::{DynTensor, DynTensorValueType, DynValue, Tensor as OrtTensor, ValueType},
};

use crate::runtime::buckets::{self};
use crate::{
    error::{Error, Result},
    tensor::{bytes_elements, element_count, push_bytes_element, shape_string, DataType, Tensor},
};

use super::*;

/// One ONNX Runtime input of `shape` from `parts` (one per request, concatenated along the
/// batch dimension). Where `shape` is larger than the parts (padding to a bucket), the rest
/// is zeros, or empty strings. With `reshape`, the model sees that shape (after the batch
/// dimension when `batching`) instead of the declared dims.
pub(super) fn to_ort_value(
    parts: &[&Tensor],
    shape: Vec<i64>,
    reshape: Option<&[i64]>,
    batching: bool,
    allocator: &Allocator,
) -> Result<DynValue> {
    let Some(first) = parts.first() else {
        return Err(Error::internal("no tensor to hand to ONNX Runtime"));
    };
    // Whether each part fills whole rows of `shape` (no padding inside a row).
    let whole_rows = if batching {
        parts.iter().all(|t| t.shape.get(1..) == shape.get(1..))
    } else {
        parts.len() == 1 && first.shape == shape
    };
    if !whole_rows && first.datatype == DataType::Bytes {
        return Err(Error::internal(format!(
            "input '{}': TYPE_STRING inputs are padded only along the batch dimension",
            first.name
        )));
    }
    let model_shape = |shape: &[i64]| -> Vec<i64> {
        match reshape {
            Some(reshape) => {
                let rows = shape.first().copied().filter(|_| batching);
                rows.into_iter().chain(reshape.iter().copied()).collect()
            }
            None => shape.to_vec(),
        }
    };
    if first.datatype == DataType::Bytes {
        let mut strings = parts
            .iter()
            .flat_map(|t| bytes_elements(&t.data))
            .map(|b| {
                if b.contains(&0) {
                    return Err(Error::invalid(format!(
                        "input '{}': ONNX string tensors cannot hold NUL bytes",
                        first.name
                    )));
                }
                std::str::from_utf8(b).map(str::to_owned).map_err(|_| {
                    Error::invalid(format!(
                        "input '{}': ONNX string tensors need UTF-8 text",
                        first.name
                    ))
                })
            })
            .collect::<Result<Vec<String>>>()?;
        // Padding rows of empty strings.
        strings.resize(
            element_count(&shape).unwrap_or(strings.len()),
            String::new(),
        );
        let value = OrtTensor::from_string_array((model_shape(&shape), strings.as_slice()))
            .map_err(|e| ort_error(&first.name, e))?;
        return Ok(value.into_dyn());
    }
    let size = first.datatype.element_size().unwrap_or(1);
    let total: usize = parts.iter().map(|t| t.data.len()).sum();
    for part in parts {
        if element_count(&part.shape).map(|n| n * size) != Some(part.data.len()) {
            return Err(Error::invalid(format!(
                "input '{}': {} bytes of data for shape {}",
                part.name,
                part.data.len(),
                shape_string(&part.shape)
            )));
        }
    }
    let bytes = element_count(&shape).map(|n| n * size).ok_or_else(|| {
        Error::invalid(format!(
            "input '{}': shape {} is not a tensor shape",
            first.name,
            shape_string(&shape)
        ))
    })?;
    let row_dims = buckets::dims(shape.get(usize::from(batching)..).unwrap_or_default());
    let fits = |part: &Tensor| {
        let d = buckets::dims(&part.shape);
        let inner = d.get(usize::from(batching)..).unwrap_or_default();
        inner.len() == row_dims.len() && inner.iter().zip(&row_dims).all(|(a, b)| a <= b)
    };
    if total > bytes || !parts.iter().all(|p| fits(p)) {
        return Err(Error::internal(format!(
            "input '{}': the batch's data does not fit shape {}",
            first.name,
            shape_string(&shape)
        )));
    }
    let mut value = DynTensor::new(
        allocator,
        to_element_type(first.datatype),
        model_shape(&shape),
    )
    .map_err(|e| ort_error(&first.name, e))?;
    if bytes > 0 {
        // SAFETY: the tensor was allocated in host memory (plain or pinned) for its shape and this element type,
        // which is `bytes` bytes.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(value.data_ptr_mut().cast::<u8>(), bytes) };
        if whole_rows {
            let mut offset = 0;
            for part in parts {
                dst[offset..offset + part.data.len()].copy_from_slice(&part.data);
                offset += part.data.len();
            }
            dst[total.min(bytes)..].fill(0);
        } else {
            dst.fill(0);
            let row_bytes = row_dims.iter().product::<usize>() * size;
            let mut offset = 0;
            for part in parts {
                let part_dims = buckets::dims(&part.shape);
                if !batching {
                    buckets::copy_corner(&part.data, &part_dims, dst, &row_dims, size);
                    continue;
                }
                let part_rows = part_dims.first().copied().unwrap_or(1);
                let target: Vec<usize> = std::iter::once(part_rows)
                    .chain(row_dims.iter().copied())
                    .collect();
                let end = offset + part_rows * row_bytes;
                if end > bytes {
                    return Err(Error::internal(format!(
                        "input '{}': the batch has more rows than shape {}",
                        first.name,
                        shape_string(&shape)
                    )));
                }
                buckets::copy_corner(&part.data, &part_dims, &mut dst[offset..end], &target, size);
                offset = end;
            }
        }
    }
    Ok(value.into_dyn())
}

pub(super) fn from_ort_value(name: &str, value: DynValue) -> Result<Tensor> {
    let (ty, shape) = match value.dtype() {
        ValueType::Tensor { ty, shape, .. } => (*ty, shape.iter().copied().collect::<Vec<i64>>()),
        other => {
            return Err(Error::internal(format!(
                "output '{name}' is not a tensor ({other:?})"
            )))
        }
    };
    let datatype = to_data_type(ty).ok_or_else(|| {
        Error::internal(format!(
            "output '{name}' has an unsupported element type {ty:?}"
        ))
    })?;
    let data = if datatype == DataType::Bytes {
        let (_, strings) = value
            .try_extract_strings()
            .map_err(|e| ort_error(name, e))?;
        let mut out = Vec::new();
        for s in &strings {
            push_bytes_element(&mut out, s.as_bytes());
        }
        Bytes::from(out)
    } else {
        let tensor = value
            .downcast::<DynTensorValueType>()
            .map_err(|e| ort_error(name, e))?;
        match tensor.size().unwrap_or(0) {
            0 => Bytes::new(),
            len => Bytes::from_owner(OutputMemory { tensor, len }),
        }
    };
    Ok(Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        data,
    })
}

/// An output tensor's own memory, answered as it is: the bytes (and every request's slice of
/// a batch) keep the ONNX Runtime value alive instead of copying it out.
pub(super) struct OutputMemory {
    pub(super) tensor: DynTensor,
    /// Its size in bytes, as ONNX Runtime reports it.
    pub(super) len: usize,
}
