//! Between ONNX element types and ours, and a model's input and output signatures.

use ort::value::{Outlet, TensorElementType, ValueType};

use crate::tensor::DataType;

pub(super) fn to_data_type(ty: TensorElementType) -> Option<DataType> {
    Some(match ty {
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Uint16 => DataType::Uint16,
        TensorElementType::Uint32 => DataType::Uint32,
        TensorElementType::Uint64 => DataType::Uint64,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        TensorElementType::String => DataType::Bytes,
        TensorElementType::Bfloat16 => DataType::Bf16,
        _ => return None,
    })
}

pub(super) fn to_element_type(dt: DataType) -> TensorElementType {
    match dt {
        DataType::Bool => TensorElementType::Bool,
        DataType::Uint8 => TensorElementType::Uint8,
        DataType::Uint16 => TensorElementType::Uint16,
        DataType::Uint32 => TensorElementType::Uint32,
        DataType::Uint64 => TensorElementType::Uint64,
        DataType::Int8 => TensorElementType::Int8,
        DataType::Int16 => TensorElementType::Int16,
        DataType::Int32 => TensorElementType::Int32,
        DataType::Int64 => TensorElementType::Int64,
        DataType::Fp16 => TensorElementType::Float16,
        DataType::Fp32 => TensorElementType::Float32,
        DataType::Fp64 => TensorElementType::Float64,
        DataType::Bytes => TensorElementType::String,
        DataType::Bf16 => TensorElementType::Bfloat16,
    }
}

/// A tensor of the ONNX model's signature: name, datatype and full shape (-1 = dynamic).
pub(super) struct Signature {
    pub(super) name: String,
    pub(super) datatype: Option<DataType>,
    pub(super) shape: Vec<i64>,
    /// An initializer that is an input too: a request may leave it out (the stored value is
    /// used), and a configuration need not declare it.
    pub(super) initializer: bool,
}

pub(super) fn signatures(outlets: &[Outlet]) -> Vec<Signature> {
    outlets
        .iter()
        .map(|o| signature(o.name(), o.dtype()))
        .collect()
}

/// The model's inputs as Triton's ONNX Runtime backend sees them: its graph inputs and its
/// initializers that are inputs too (a request may give them or leave the stored value).
pub(super) fn input_signatures(session: &ort::session::Session) -> Vec<Signature> {
    let mut inputs = signatures(session.inputs());
    for initializer in session.overridable_initializers() {
        if !inputs.iter().any(|s| s.name == initializer.name()) {
            inputs.push(Signature {
                initializer: true,
                ..signature(initializer.name(), initializer.dtype())
            });
        }
    }
    inputs
}

fn signature(name: &str, dtype: &ValueType) -> Signature {
    match dtype {
        ValueType::Tensor { ty, shape, .. } => Signature {
            name: name.to_owned(),
            datatype: to_data_type(*ty),
            shape: shape.iter().copied().collect(),
            initializer: false,
        },
        _ => Signature {
            name: name.to_owned(),
            datatype: None,
            shape: vec![],
            initializer: false,
        },
    }
}
