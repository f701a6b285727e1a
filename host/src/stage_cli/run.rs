//! `wasmtron stage run`: executes a stage once, without a server, so that a stage author can
//! try a component against its config.pbtxt from the command line.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use serde_json::{json, Value};
use wasmtron::{
    frontends::http::codec,
    inference::InferResponse,
    inference::{InferRequest, RequestedOutput},
    proto::inference::ModelConfig,
    repository::{config, validate::validate},
    runtime::{self, request_check::check_request, RuntimeOptions},
    tensor::{push_bytes_element, DataType, Tensor},
};

/// Arguments of `wasmtron stage run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The stage component (`model.wasm`).
    wasm: PathBuf,
    /// Its config.pbtxt (default: `../config.pbtxt` beside the version folder, as in a repository).
    #[arg(long)]
    config: Option<PathBuf>,
    /// An input: `NAME=FILE`. `.json` holds `{"shape": [...], "datatype": "FP32", "data": [...]}`,
    /// `.npy` a NumPy array; any other file becomes one BYTES element (e.g. an image).
    #[arg(long = "input", value_name = "NAME=FILE")]
    inputs: Vec<String>,
    /// Outputs to return (default: all).
    #[arg(long = "output")]
    outputs: Vec<String>,
    /// Compiled-stage cache directory.
    #[arg(long)]
    wasm_cache_dir: Option<PathBuf>,
}

/// Runs the stage and prints its outputs as KServe v2 JSON.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let config_path = match &args.config {
        Some(p) => p.clone(),
        None => args
            .wasm
            .canonicalize()?
            .parent()
            .and_then(Path::parent)
            .map(|d| d.join("config.pbtxt"))
            .ok_or_else(|| {
                anyhow!(
                    "give --config: no config.pbtxt next to {}",
                    args.wasm.display()
                )
            })?,
    };
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let mut config: ModelConfig = config::parse_text(&text, &config_path)?;
    // As in a repository: the model is named after the folder above the version folder.
    let name = if config.name.is_empty() {
        config_path
            .canonicalize()
            .ok()
            .and_then(|p| Some(p.parent()?.file_name()?.to_str()?.to_owned()))
            .unwrap_or_else(|| "stage".to_owned())
    } else {
        config.name.clone()
    };
    validate(&mut config, &name, &config_path.display().to_string())?;
    config.backend = runtime::wasm::BACKEND.to_owned();
    config.instance_group.clear();
    let dir = args
        .wasm
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    config.default_model_filename = args
        .wasm
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or("model.wasm")
        .to_owned();
    let options = RuntimeOptions::default().with_cache_dir(
        args.wasm_cache_dir
            .clone()
            .or_else(runtime::sandbox::engine::default_cache_dir),
    );
    let mut loaded = runtime::load(config, dir, &options).map_err(|e| anyhow!(e.message))?;
    let config = loaded.config;
    let mut inputs = Vec::new();
    for spec in &args.inputs {
        let (input_name, file) = spec
            .split_once('=')
            .ok_or_else(|| anyhow!("--input {spec}: expected NAME=FILE"))?;
        inputs.push(read_input(input_name, Path::new(file), &config)?);
    }
    let request = InferRequest {
        model_name: name,
        inputs,
        outputs: args
            .outputs
            .iter()
            .map(|o| RequestedOutput {
                name: o.clone(),
                parameters: Default::default(),
            })
            .collect(),
        ..Default::default()
    };
    check_request(&config, &request).map_err(|e| anyhow!(e.message))?;
    let outputs: Vec<String> = if request.outputs.is_empty() {
        config.output.iter().map(|o| o.name.clone()).collect()
    } else {
        args.outputs.clone()
    };
    let instance = loaded
        .instances
        .first_mut()
        .ok_or_else(|| anyhow!("the stage has no instance"))?;
    let (tensors, timings) = instance
        .execute(&request, &outputs)
        .map_err(|e| anyhow!(e.message))?;
    let rendered = render(tensors);
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "outputs": rendered,
            "execute_us": timings.compute_infer.as_micros() as u64,
        }))?
    );
    Ok(())
}

fn read_input(name: &str, path: &Path, config: &ModelConfig) -> anyhow::Result<Tensor> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let batch = config.max_batch_size > 0;
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => {
            let v: Value = serde_json::from_slice(&bytes)?;
            let datatype = v["datatype"]
                .as_str()
                .and_then(DataType::from_wire)
                .ok_or_else(|| anyhow!("{}: missing or unknown \"datatype\"", path.display()))?;
            let shape: Vec<i64> =
                serde_json::from_value(v["shape"].clone()).with_context(|| {
                    format!("{}: \"shape\" must be a list of integers", path.display())
                })?;
            let body = json!({"inputs": [{"name": name, "shape": shape, "datatype": datatype.wire_name(), "data": v["data"]}]});
            let request = codec::decode_request(
                "stage",
                None,
                Bytes::from(body.to_string()),
                None,
                None,
                &wasmtron::limits::RequestLimits::default(),
                &wasmtron::frontends::shared_memory::no_shared_inputs,
            )
            .map_err(|e| anyhow!("{}: {}", path.display(), e.message))?;
            request
                .inputs
                .into_iter()
                .next()
                .ok_or_else(|| anyhow!("{}: no data", path.display()))
        }
        Some("npy") => {
            read_npy(name, &bytes).with_context(|| format!("cannot read {}", path.display()))
        }
        _ => {
            let mut data = Vec::with_capacity(bytes.len() + 4);
            push_bytes_element(&mut data, &bytes);
            Ok(Tensor {
                name: name.to_owned(),
                datatype: DataType::Bytes,
                shape: if batch { vec![1, 1] } else { vec![1] },
                data: data.into(),
            })
        }
    }
}

/// Reads a C-ordered, little-endian NumPy `.npy` array.
fn read_npy(name: &str, bytes: &[u8]) -> anyhow::Result<Tensor> {
    if bytes.get(..6) != Some(b"\x93NUMPY") {
        bail!("not a .npy file");
    }
    let major = bytes.get(6).copied().unwrap_or(0);
    let (len, start) = if major == 1 {
        let l = bytes
            .get(8..10)
            .ok_or_else(|| anyhow!("truncated header"))?;
        (u16::from_le_bytes([l[0], l[1]]) as usize, 10)
    } else {
        let l = bytes
            .get(8..12)
            .ok_or_else(|| anyhow!("truncated header"))?;
        (u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize, 12)
    };
    let header = std::str::from_utf8(
        bytes
            .get(start..start + len)
            .ok_or_else(|| anyhow!("truncated header"))?,
    )?;
    let field = |key: &str| -> anyhow::Result<&str> {
        let at = header
            .find(&format!("'{key}'"))
            .ok_or_else(|| anyhow!("header lacks '{key}'"))?;
        Ok(header[at + key.len() + 2..].trim_start_matches([':', ' ']))
    };
    if field("fortran_order")?.starts_with("True") {
        bail!("Fortran-ordered arrays are not supported; save with np.ascontiguousarray");
    }
    let descr = field("descr")?;
    let descr = descr
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or_default();
    let datatype = match descr {
        "|b1" => DataType::Bool,
        "|u1" => DataType::Uint8,
        "<u2" => DataType::Uint16,
        "<u4" => DataType::Uint32,
        "<u8" => DataType::Uint64,
        "|i1" => DataType::Int8,
        "<i2" => DataType::Int16,
        "<i4" => DataType::Int32,
        "<i8" => DataType::Int64,
        "<f2" => DataType::Fp16,
        "<f4" => DataType::Fp32,
        "<f8" => DataType::Fp64,
        other => bail!("unsupported dtype '{other}' (little-endian numbers and bool only)"),
    };
    let shape_text = field("shape")?;
    let shape_text = shape_text
        .trim_start_matches('(')
        .split(')')
        .next()
        .unwrap_or_default();
    let shape: Vec<i64> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i64>())
        .collect::<Result<_, _>>()?;
    let data = Bytes::copy_from_slice(&bytes[start + len..]);
    let tensor = Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        data,
    };
    tensor.validate_size().map_err(|e| anyhow!(e.message))?;
    Ok(tensor)
}

/// The outputs as the HTTP frontend renders them.
fn render(outputs: Vec<Tensor>) -> Value {
    let response = InferResponse {
        model_name: String::new(),
        model_version: 0,
        last: false,
        id: String::new(),
        parameters: Default::default(),
        outputs,
    };
    codec::encode_response(&Default::default(), &[], &response)
        .ok()
        .and_then(|e| serde_json::from_slice::<Value>(e.parts.first()?).ok())
        .map(|v| v["outputs"].clone())
        .unwrap_or(Value::Null)
}
