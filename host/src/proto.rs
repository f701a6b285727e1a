//! Wire types generated from `proto/` (package `inference`), shared by the gRPC frontend and the
//! repository layer, which parses `config.pbtxt` straight into [`inference::ModelConfig`].
#![allow(missing_docs, clippy::all)]

/// The `inference` protobuf package: Triton's gRPC service and model configuration schema.
pub mod inference {
    tonic::include_proto!("inference");
}

/// Encoded `FileDescriptorSet` of the protos, for reflection (text format, JSON).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/inference_descriptor.bin"));
