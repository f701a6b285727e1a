//! Tensors as they travel between frontends, schedulers and backends: a datatype, a shape and
//! the raw little-endian bytes (BYTES elements carry a 4-byte little-endian length prefix, exactly
//! as on the wire, so no layer needs to re-encode them).

use bytes::Bytes;

use crate::error::{Error, Result};

/// The tensor element types of the KServe v2 protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// One byte, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    Uint8,
    /// Unsigned 16-bit integer.
    Uint16,
    /// Unsigned 32-bit integer.
    Uint32,
    /// Unsigned 64-bit integer.
    Uint64,
    /// Signed 8-bit integer.
    Int8,
    /// Signed 16-bit integer.
    Int16,
    /// Signed 32-bit integer.
    Int32,
    /// Signed 64-bit integer.
    Int64,
    /// IEEE half precision.
    Fp16,
    /// IEEE single precision.
    Fp32,
    /// IEEE double precision.
    Fp64,
    /// Variable-length byte strings (`TYPE_STRING` in `config.pbtxt`).
    Bytes,
    /// bfloat16.
    Bf16,
}

const ALL: [DataType; 14] = [
    DataType::Bool,
    DataType::Uint8,
    DataType::Uint16,
    DataType::Uint32,
    DataType::Uint64,
    DataType::Int8,
    DataType::Int16,
    DataType::Int32,
    DataType::Int64,
    DataType::Fp16,
    DataType::Fp32,
    DataType::Fp64,
    DataType::Bytes,
    DataType::Bf16,
];

impl DataType {
    /// The protocol name, e.g. `FP32` or `BYTES`.
    pub fn wire_name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
            DataType::Bf16 => "BF16",
        }
    }

    /// Parses a protocol name (`FP32`, `BYTES`, ...).
    pub fn from_wire(name: &str) -> Option<Self> {
        ALL.into_iter().find(|d| d.wire_name() == name)
    }

    /// The `config.pbtxt` enum value (`inference.DataType`).
    pub fn config_value(self) -> i32 {
        match self {
            DataType::Bool => 1,
            DataType::Uint8 => 2,
            DataType::Uint16 => 3,
            DataType::Uint32 => 4,
            DataType::Uint64 => 5,
            DataType::Int8 => 6,
            DataType::Int16 => 7,
            DataType::Int32 => 8,
            DataType::Int64 => 9,
            DataType::Fp16 => 10,
            DataType::Fp32 => 11,
            DataType::Fp64 => 12,
            DataType::Bytes => 13,
            DataType::Bf16 => 14,
        }
    }

    /// Converts a `config.pbtxt` enum value; `None` for `TYPE_INVALID` or unknown values.
    pub fn from_config_value(value: i32) -> Option<Self> {
        ALL.into_iter().find(|d| d.config_value() == value)
    }

    /// The `config.pbtxt` spelling, e.g. `TYPE_FP32`.
    pub fn config_name(self) -> &'static str {
        match self {
            DataType::Bytes => "TYPE_STRING",
            DataType::Bool => "TYPE_BOOL",
            DataType::Uint8 => "TYPE_UINT8",
            DataType::Uint16 => "TYPE_UINT16",
            DataType::Uint32 => "TYPE_UINT32",
            DataType::Uint64 => "TYPE_UINT64",
            DataType::Int8 => "TYPE_INT8",
            DataType::Int16 => "TYPE_INT16",
            DataType::Int32 => "TYPE_INT32",
            DataType::Int64 => "TYPE_INT64",
            DataType::Fp16 => "TYPE_FP16",
            DataType::Fp32 => "TYPE_FP32",
            DataType::Fp64 => "TYPE_FP64",
            DataType::Bf16 => "TYPE_BF16",
        }
    }

    /// Bytes per element; `None` for BYTES, whose elements vary in size.
    pub fn element_size(self) -> Option<usize> {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => Some(1),
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => Some(2),
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => Some(4),
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => Some(8),
            DataType::Bytes => None,
        }
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.wire_name())
    }
}

/// Number of elements of a shape; an error for negative dimensions or overflow.
pub fn element_count(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}

/// Formats a shape the way Triton's messages do: `[1,16]`.
pub fn shape_string(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(","))
}

/// A named tensor with its raw data.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Tensor name as declared by the model.
    pub name: String,
    /// Element type.
    pub datatype: DataType,
    /// Full shape, including the batch dimension for batching models.
    pub shape: Vec<i64>,
    /// Row-major little-endian data; BYTES elements are 4-byte-length-prefixed.
    pub data: Bytes,
}

impl Tensor {
    /// Checks that `data` holds exactly the elements `shape` calls for.
    pub fn validate_size(&self) -> Result<()> {
        let count = element_count(&self.shape).ok_or_else(|| {
            Error::invalid(format!(
                "input '{}' has an invalid shape {}",
                self.name,
                shape_string(&self.shape)
            ))
        })?;
        match self.datatype.element_size() {
            Some(size) => {
                let expected = count.saturating_mul(size);
                if self.data.len() != expected {
                    return Err(Error::invalid(format!(
                        "input '{}' with shape {} and datatype {} needs {} bytes of data, got {}",
                        self.name,
                        shape_string(&self.shape),
                        self.datatype,
                        expected,
                        self.data.len()
                    )));
                }
            }
            None => {
                let found = count_bytes_elements(&self.data).ok_or_else(|| {
                    Error::invalid(format!(
                        "input '{}': BYTES data is malformed (each element needs a 4-byte little-endian length prefix followed by that many bytes)",
                        self.name
                    ))
                })?;
                if found != count {
                    return Err(Error::invalid(format!(
                        "input '{}' with shape {} needs {} BYTES elements, got {}",
                        self.name,
                        shape_string(&self.shape),
                        count,
                        found
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Counts length-prefixed BYTES elements; `None` if the buffer is malformed.
pub fn count_bytes_elements(data: &[u8]) -> Option<usize> {
    let mut count = 0;
    let mut rest = data;
    while !rest.is_empty() {
        let (len, tail) = split_len_prefix(rest)?;
        rest = tail.get(len..)?;
        count += 1;
    }
    Some(count)
}

/// Iterates over the elements of a length-prefixed BYTES buffer (stops at malformed data).
pub fn bytes_elements(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let (len, tail) = split_len_prefix(rest)?;
        let element = tail.get(..len)?;
        rest = &tail[len..];
        Some(element)
    })
}

fn split_len_prefix(data: &[u8]) -> Option<(usize, &[u8])> {
    let prefix: [u8; 4] = data.get(..4)?.try_into().ok()?;
    Some((u32::from_le_bytes(prefix) as usize, &data[4..]))
}

/// Appends one BYTES element (length prefix + bytes) to `out`.
pub fn push_bytes_element(out: &mut Vec<u8>, element: &[u8]) {
    out.extend_from_slice(&(element.len() as u32).to_le_bytes());
    out.extend_from_slice(element);
}

/// A tensor as Triton's trace files write it at the `TENSORS` level:
/// `{"name":…,"data":"1,2,3","shape":"1,3","dtype":"INT32"}` — the values joined by commas in
/// one string, BYTES elements in quotes, FP16 and BF16 left empty (as Triton leaves them).
pub fn trace_json(t: &Tensor) -> String {
    use std::fmt::Write as _;
    fn join<const N: usize, T: std::fmt::Display>(
        data: &[u8],
        read: impl Fn([u8; N]) -> T,
    ) -> String {
        let mut out = String::new();
        for (i, chunk) in data.chunks_exact(N).enumerate() {
            if i > 0 {
                out.push(',');
            }
            if let Ok(bytes) = <[u8; N]>::try_from(chunk) {
                let _ = write!(out, "{}", read(bytes));
            }
        }
        out
    }
    let data = match t.datatype {
        DataType::Bool => join(&t.data, |[b]: [u8; 1]| u8::from(b != 0)),
        DataType::Uint8 => join(&t.data, u8::from_le_bytes),
        DataType::Int8 => join(&t.data, i8::from_le_bytes),
        DataType::Uint16 => join(&t.data, u16::from_le_bytes),
        DataType::Int16 => join(&t.data, i16::from_le_bytes),
        DataType::Uint32 => join(&t.data, u32::from_le_bytes),
        DataType::Int32 => join(&t.data, i32::from_le_bytes),
        DataType::Uint64 => join(&t.data, u64::from_le_bytes),
        DataType::Int64 => join(&t.data, i64::from_le_bytes),
        DataType::Fp32 => join(&t.data, f32::from_le_bytes),
        DataType::Fp64 => join(&t.data, f64::from_le_bytes),
        DataType::Fp16 | DataType::Bf16 => String::new(),
        DataType::Bytes => bytes_elements(&t.data)
            .map(|e| format!("\"{}\"", String::from_utf8_lossy(e)))
            .collect::<Vec<_>>()
            .join(","),
    };
    let shape: Vec<String> = t.shape.iter().map(i64::to_string).collect();
    serde_json::json!({
        "name": t.name,
        "data": data,
        "shape": shape.join(","),
        "dtype": t.datatype.wire_name(),
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_and_config_names_round_trip() {
        for d in ALL {
            assert_eq!(DataType::from_wire(d.wire_name()), Some(d));
            assert_eq!(DataType::from_config_value(d.config_value()), Some(d));
        }
        assert_eq!(DataType::from_wire("STRING"), None);
        assert_eq!(DataType::from_config_value(0), None);
    }

    #[test]
    fn bytes_elements_are_counted_and_validated() {
        let mut buf = Vec::new();
        push_bytes_element(&mut buf, b"hello");
        push_bytes_element(&mut buf, b"");
        assert_eq!(count_bytes_elements(&buf), Some(2));
        let items: Vec<&[u8]> = bytes_elements(&buf).collect();
        assert_eq!(items, vec![&b"hello"[..], &b""[..]]);
        assert_eq!(count_bytes_elements(&buf[..6]), None);
    }

    #[test]
    fn size_mismatch_names_the_tensor() {
        let t = Tensor {
            name: "INPUT0".into(),
            datatype: DataType::Int32,
            shape: vec![1, 16],
            data: Bytes::from(vec![0u8; 60]),
        };
        let err = t.validate_size().unwrap_err();
        assert!(err.message.contains("INPUT0") && err.message.contains("64"));
    }

    #[test]
    fn tensors_are_traced_as_triton_writes_them() {
        let ints = Tensor {
            name: "INPUT0".into(),
            datatype: DataType::Int32,
            shape: vec![1, 3],
            data: [1i32, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let v: serde_json::Value = serde_json::from_str(&trace_json(&ints)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"name": "INPUT0", "data": "1,-2,3", "shape": "1,3",
                               "dtype": "INT32"})
        );
        let mut buf = Vec::new();
        push_bytes_element(&mut buf, b"a b");
        push_bytes_element(&mut buf, b"c");
        let strings = Tensor {
            name: "S".into(),
            datatype: DataType::Bytes,
            shape: vec![2],
            data: Bytes::from(buf),
        };
        let v: serde_json::Value = serde_json::from_str(&trace_json(&strings)).unwrap();
        assert_eq!(v["data"], "\"a b\",\"c\"");
    }
}
