//! Compiles the protocol definitions in `proto/` with protox (pure Rust, no `protoc`) and writes
//! both the tonic/prost code and the descriptor set that `config.pbtxt` parsing reflects over.

use std::{env, fs, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // Default location of the ONNX Runtime library that `make onnxruntime` fetches.
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    if let Some(root) = manifest.parent() {
        let lib = root.join(".cache/onnxruntime/lib/libonnxruntime.so");
        println!("cargo:rustc-env=WASMTRON_DEFAULT_ORT_LIB={}", lib.display());
    }
    let files = ["proto/grpc_service.proto", "proto/model_config.proto"];
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out.join("inference_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        // Tensor payloads as `Bytes`: decoding slices them out of the received buffer instead
        // of copying every input once more.
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
