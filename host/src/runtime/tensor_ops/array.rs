//! The host-held array and the budget operations allocate from.

use super::invalid;
use crate::{
    error::{Error, Result},
    tensor::DataType,
};

/// A dense tensor held by the host: row-major, little-endian elements of a fixed-size datatype.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    /// Element type (never BYTES).
    pub datatype: DataType,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// `shape.product() * element size` bytes.
    pub data: Vec<u8>,
}

/// How many bytes an operation may still allocate; operations ask before allocating, so a
/// result that would not fit fails without having been built.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    available: usize,
}

impl Budget {
    /// A budget of `available` bytes.
    pub fn new(available: usize) -> Self {
        Self { available }
    }

    /// No limit (tests, trusted callers).
    pub fn unlimited() -> Self {
        Self::new(usize::MAX)
    }

    /// Takes `bytes` from the budget, or fails naming the operation.
    pub fn take(&mut self, op: &str, bytes: usize) -> Result<()> {
        if bytes > self.available {
            return Err(Error::resource_exhausted(format!(
                "ops.{op}: the result needs {bytes} bytes but only {} are left of the stage's \
                 memory limit (parameter memory_limit_mb counts linear memory and held arrays)",
                self.available
            )));
        }
        self.available -= bytes;
        Ok(())
    }

    /// Takes the bytes of `count` elements of `datatype`, checking the multiplication.
    pub fn take_elements(&mut self, op: &str, count: usize, datatype: DataType) -> Result<usize> {
        let size = datatype.element_size().unwrap_or(1);
        let bytes = count
            .checked_mul(size)
            .ok_or_else(|| invalid(op, "the result is too large"))?;
        self.take(op, bytes)?;
        Ok(bytes)
    }
}

/// Element count of a shape, or an error naming the operation.
pub(super) fn count(op: &str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| invalid(op, "the shape is too large"))
}

impl Array {
    /// An array from raw elements, checking that their size matches the shape.
    pub fn from_data(datatype: DataType, shape: &[i64], data: Vec<u8>) -> Result<Self> {
        let op = "array.from-data";
        let Some(size) = datatype.element_size() else {
            return Err(invalid(op, "BYTES (string) tensors cannot be arrays"));
        };
        let shape = shape
            .iter()
            .map(|&d| {
                usize::try_from(d).map_err(|_| invalid(op, format!("dimension {d} is negative")))
            })
            .collect::<Result<Vec<usize>>>()?;
        let expected = count(op, &shape)?
            .checked_mul(size)
            .ok_or_else(|| invalid(op, "the shape is too large"))?;
        if data.len() != expected {
            return Err(invalid(
                op,
                format!(
                    "shape {shape:?} of {datatype} needs {expected} bytes but the data has {}",
                    data.len()
                ),
            ));
        }
        Ok(Self {
            datatype,
            shape,
            data,
        })
    }

    /// A fp32 array.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        let mut data = vec![0u8; values.len() * 4];
        for (out, v) in data.chunks_exact_mut(4).zip(values) {
            out.copy_from_slice(&v.to_le_bytes());
        }
        Self {
            datatype: DataType::Fp32,
            shape,
            data,
        }
    }

    /// An int64 array.
    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Self {
        let mut data = vec![0u8; values.len() * 8];
        for (out, v) in data.chunks_exact_mut(8).zip(values) {
            out.copy_from_slice(&v.to_le_bytes());
        }
        Self {
            datatype: DataType::Int64,
            shape,
            data,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape as the protocol writes it.
    pub fn shape_i64(&self) -> Vec<i64> {
        self.shape.iter().map(|&d| d as i64).collect()
    }

    /// Every element as f32 (integers and doubles converted as `as` does).
    pub fn to_f32(&self) -> Vec<f32> {
        let d = &self.data;
        match self.datatype {
            DataType::Fp32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DataType::Uint8 | DataType::Bool => d.iter().map(|&v| f32::from(v)).collect(),
            _ => (0..self.len())
                .map(|i| read_f64(self.datatype, d, i) as f32)
                .collect(),
        }
    }
}

/// Element `i` of raw data as f64.
pub(super) fn read_f64(datatype: DataType, data: &[u8], i: usize) -> f64 {
    let at = |n: usize| &data[i * n..(i + 1) * n];
    match datatype {
        DataType::Bool | DataType::Uint8 => f64::from(data[i]),
        DataType::Int8 => f64::from(data[i] as i8),
        DataType::Uint16 => f64::from(u16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Int16 => f64::from(i16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Fp16 => f64::from(half::f16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Bf16 => f64::from(half::bf16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Uint32 => f64::from(u32::from_le_bytes(at(4).try_into().unwrap_or_default())),
        DataType::Int32 => f64::from(i32::from_le_bytes(at(4).try_into().unwrap_or_default())),
        DataType::Fp32 => f64::from(f32::from_le_bytes(at(4).try_into().unwrap_or_default())),
        DataType::Uint64 => u64::from_le_bytes(at(8).try_into().unwrap_or_default()) as f64,
        DataType::Int64 => i64::from_le_bytes(at(8).try_into().unwrap_or_default()) as f64,
        DataType::Fp64 => f64::from_le_bytes(at(8).try_into().unwrap_or_default()),
        DataType::Bytes => 0.0,
    }
}

/// Element `i` of integer raw data exactly (bool and all integer types).
pub(super) fn read_i128(datatype: DataType, data: &[u8], i: usize) -> Option<i128> {
    let at = |n: usize| &data[i * n..(i + 1) * n];
    Some(match datatype {
        DataType::Bool | DataType::Uint8 => i128::from(data[i]),
        DataType::Int8 => i128::from(data[i] as i8),
        DataType::Uint16 => i128::from(u16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Int16 => i128::from(i16::from_le_bytes([at(2)[0], at(2)[1]])),
        DataType::Uint32 => i128::from(u32::from_le_bytes(at(4).try_into().ok()?)),
        DataType::Int32 => i128::from(i32::from_le_bytes(at(4).try_into().ok()?)),
        DataType::Uint64 => i128::from(u64::from_le_bytes(at(8).try_into().ok()?)),
        DataType::Int64 => i128::from(i64::from_le_bytes(at(8).try_into().ok()?)),
        _ => return None,
    })
}
