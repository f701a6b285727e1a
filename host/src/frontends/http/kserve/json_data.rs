//! KServe v2 JSON tensor data: nested or flat arrays of a datatype's elements, read leaf by
//! leaf into little-endian bytes (refusing extra elements as they appear) and written back.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::{
    error::{Error, Result},
    tensor::{bytes_elements, element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// A tensor from JSON tensor data (nested or flat, as text) of the given datatype and shape.
pub fn json_tensor(name: &str, datatype: DataType, shape: Vec<i64>, json: &str) -> Result<Tensor> {
    let data = json_to_bytes(name, datatype, &shape, json)?;
    Ok(Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        data,
    })
}

/// A tensor's elements as a flat JSON array (BYTES as strings where they are UTF-8).
pub fn tensor_json_data(tensor: &Tensor) -> Value {
    bytes_to_json(tensor)
}

/// An output's elements as a flat JSON array, exactly: a BYTES element that is not UTF-8
/// cannot be a JSON string without changing its bytes, so it is refused (as on Triton, whose
/// clients fail on such an answer), naming the output and how to get it.
pub fn output_json_data(tensor: &Tensor) -> Result<Value> {
    if tensor.datatype == DataType::Bytes {
        if let Some(i) = bytes_elements(&tensor.data).position(|b| std::str::from_utf8(b).is_err())
        {
            return Err(Error::invalid(format!(
                "output '{}': element {i} is not valid UTF-8, so it cannot be written as JSON; \
                 ask for the output as binary data (\"binary_data\": true)",
                tensor.name
            )));
        }
    }
    Ok(bytes_to_json(tensor))
}

/// Decodes JSON tensor data (nested arrays or flat) of `datatype` into little-endian bytes,
/// element by element, refusing more elements than `shape` holds as soon as they appear.
pub(super) fn json_to_bytes(
    name: &str,
    datatype: DataType,
    shape: &[i64],
    json: &str,
) -> Result<Bytes> {
    if matches!(datatype, DataType::Fp16 | DataType::Bf16) {
        return Err(Error::invalid(format!(
            "input '{name}': datatype {datatype} cannot be sent as JSON; use the binary tensor data extension"
        )));
    }
    let expected = element_count(shape).unwrap_or(usize::MAX);
    // Each element takes at least two characters of JSON, so the text bounds the allocation.
    let capacity = expected.min(json.len() / 2 + 1);
    let mut leaves = Leaves {
        name,
        datatype,
        expected,
        count: 0,
        out: Vec::with_capacity(capacity.saturating_mul(datatype.element_size().unwrap_or(8))),
        error: None,
    };
    let mut de = serde_json::Deserializer::from_str(json);
    let parsed =
        serde::de::DeserializeSeed::deserialize(&mut leaves, &mut de).and_then(|()| de.end());
    if let Some(err) = leaves.error {
        return Err(err);
    }
    parsed.map_err(|e| {
        Error::invalid(format!(
            "input '{name}': 'data' is not valid JSON tensor data: {e}"
        ))
    })?;
    if leaves.count != expected {
        return Err(Error::invalid(format!(
            "unexpected number of elements for input '{name}': shape {} needs {expected}, the JSON data has {}",
            shape_string(shape),
            leaves.count
        )));
    }
    Ok(leaves.out.into())
}

/// A visitor that walks nested JSON arrays and appends each leaf as one element.
struct Leaves<'n> {
    name: &'n str,
    datatype: DataType,
    expected: usize,
    count: usize,
    out: Vec<u8>,
    /// Our own error, kept whole (serde would only carry its text).
    error: Option<Error>,
}

/// A leaf as the JSON text it came from, for error messages.
enum Leaf<'v> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'v str),
}

impl std::fmt::Display for Leaf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leaf::Bool(b) => write!(f, "{b}"),
            Leaf::Int(i) => write!(f, "{i}"),
            Leaf::Uint(u) => write!(f, "{u}"),
            Leaf::Float(x) => write!(f, "{}", json!(x)),
            Leaf::Str(s) => write!(f, "{}", json!(s)),
        }
    }
}

impl Leaves<'_> {
    fn push<E: serde::de::Error>(&mut self, leaf: Leaf<'_>) -> std::result::Result<(), E> {
        self.count += 1;
        if self.count > self.expected {
            return Err(self.fail(Error::invalid(format!(
                "unexpected number of elements for input '{}': its shape holds {}, the JSON data has more",
                self.name, self.expected
            ))));
        }
        let (datatype, out) = (self.datatype, &mut self.out);
        macro_rules! int {
            ($t:ty) => {{
                let v: Option<$t> = match leaf {
                    Leaf::Int(i) => <$t>::try_from(i).ok(),
                    Leaf::Uint(u) => <$t>::try_from(u).ok(),
                    _ => None,
                };
                v.map(|v| out.extend_from_slice(&v.to_le_bytes()))
            }};
        }
        let float = match leaf {
            Leaf::Int(i) => Some(i as f64),
            Leaf::Uint(u) => Some(u as f64),
            Leaf::Float(x) => Some(x),
            _ => None,
        };
        let stored = match datatype {
            DataType::Bool => match leaf {
                Leaf::Bool(b) => {
                    out.push(u8::from(b));
                    Some(())
                }
                _ => None,
            },
            DataType::Int8 => int!(i8),
            DataType::Int16 => int!(i16),
            DataType::Int32 => int!(i32),
            DataType::Int64 => int!(i64),
            DataType::Uint8 => int!(u8),
            DataType::Uint16 => int!(u16),
            DataType::Uint32 => int!(u32),
            DataType::Uint64 => int!(u64),
            DataType::Fp32 => float.map(|x| out.extend_from_slice(&(x as f32).to_le_bytes())),
            DataType::Fp64 => float.map(|x| out.extend_from_slice(&x.to_le_bytes())),
            DataType::Bytes => match leaf {
                Leaf::Str(s) => {
                    push_bytes_element(out, s.as_bytes());
                    Some(())
                }
                _ => None,
            },
            // Refused before decoding starts.
            DataType::Fp16 | DataType::Bf16 => None,
        };
        match stored {
            Some(()) => Ok(()),
            None => Err(self.fail(Error::invalid(format!(
                "input '{}' of datatype {datatype}: element {leaf} is not a valid {datatype} value",
                self.name
            )))),
        }
    }

    fn fail<E: serde::de::Error>(&mut self, err: Error) -> E {
        let e = E::custom(&err.message);
        self.error = Some(err);
        e
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut Leaves<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut Leaves<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tensor elements, as a flat or nested array")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        while seq.next_element_seed(&mut *self)?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<(), E> {
        self.push(Leaf::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<(), E> {
        self.push(Leaf::Int(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<(), E> {
        self.push(Leaf::Uint(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<(), E> {
        self.push(Leaf::Float(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<(), E> {
        self.push(Leaf::Str(v))
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        let message = format!(
            "input '{}' of datatype {}: element null is not a valid {} value",
            self.name, self.datatype, self.datatype
        );
        Err(self.fail(Error::invalid(message)))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> std::result::Result<(), A::Error> {
        let message = format!(
            "input '{}': 'data' must be an array of elements, not an object",
            self.name
        );
        Err(self.fail(Error::invalid(message)))
    }
}

fn bytes_to_json(tensor: &Tensor) -> Value {
    let d = &tensor.data;
    macro_rules! nums {
        ($t:ty, $n:expr) => {
            d.chunks_exact($n)
                .map(|c| {
                    let mut a = [0u8; $n];
                    a.copy_from_slice(c);
                    json!(<$t>::from_le_bytes(a))
                })
                .collect()
        };
    }
    let values: Vec<Value> = match tensor.datatype {
        DataType::Bool => d.iter().map(|&b| json!(b != 0)).collect(),
        DataType::Int8 => nums!(i8, 1),
        DataType::Int16 => nums!(i16, 2),
        DataType::Int32 => nums!(i32, 4),
        DataType::Int64 => nums!(i64, 8),
        DataType::Uint8 => nums!(u8, 1),
        DataType::Uint16 => nums!(u16, 2),
        DataType::Uint32 => nums!(u32, 4),
        DataType::Uint64 => nums!(u64, 8),
        DataType::Fp32 => nums!(f32, 4),
        DataType::Fp64 => nums!(f64, 8),
        DataType::Fp16 => d
            .chunks_exact(2)
            .map(|c| json!(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        DataType::Bf16 => d
            .chunks_exact(2)
            .map(|c| json!(half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        DataType::Bytes => bytes_elements(d)
            .map(|b| json!(String::from_utf8_lossy(b)))
            .collect(),
    };
    Value::Array(values)
}
