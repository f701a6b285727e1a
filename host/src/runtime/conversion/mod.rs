//! PyTorch and TensorFlow models of a Triton repository, served on ONNX Runtime: a model whose
//! configuration names `pytorch_libtorch` (TorchScript `model.pt`), `torch_aoti` (an
//! ExportedProgram `model.pt2`) or `tensorflow_savedmodel` (`model.savedmodel/`) is converted
//! to ONNX once, with the tensor names Triton's backend for that platform gives it, checked
//! against the framework on generated inputs, and kept in the server's cache beside a manifest
//! (source hash, framework version, exporter, opset, the check). The next load takes the cached
//! file and needs no framework.
//!
//! The conversion runs `convert.py` (beside this file) in a Python environment that has the
//! framework (`--converter-python`), confined ([`confine`]: no network, no file outside its
//! scratch folder, an unprivileged user, resource and time limits), since the framework reads
//! the model file exactly as Triton's backend would load it, and a framework's reader can run
//! code the file carries. Files a client sent with a load request are not converted at all
//! unless the operator allows it (`--convert-uploaded-models`).

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub mod confine;

use super::backend::LoadContext;
use crate::{
    error::{Error, Result},
    private_dir,
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::DataType,
};

/// The converter, run by the converter environment's Python.
const SCRIPT: &str = include_str!("convert.py");

/// How long one conversion may take when `--converter-timeout-secs` does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The ONNX opset conversions target (ONNX Runtime 1.31 runs up to 23).
const OPSET: u32 = 17;

/// A framework whose models are served by conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framework {
    /// TorchScript (`pytorch_libtorch`, or `backend: "pytorch"`).
    TorchScript,
    /// A `torch.export` ExportedProgram archive (`torch_aoti`).
    ExportedProgram,
    /// A TensorFlow SavedModel (`tensorflow_savedmodel`, or `backend: "tensorflow"`).
    SavedModel,
}

impl Framework {
    /// The framework a configuration's backend or platform name stands for, if converted.
    pub fn of(backend: &str) -> Option<Self> {
        match backend {
            "pytorch_libtorch" | "pytorch" => Some(Self::TorchScript),
            "torch_aoti" => Some(Self::ExportedProgram),
            "tensorflow_savedmodel" | "tensorflow" => Some(Self::SavedModel),
            _ => None,
        }
    }

    /// The model file Triton's backend reads when `default_model_filename` does not say.
    pub fn default_file(self) -> &'static str {
        match self {
            Self::TorchScript => "model.pt",
            Self::ExportedProgram => "model.pt2",
            Self::SavedModel => "model.savedmodel",
        }
    }

    /// The platform name the converter is told.
    fn platform(self) -> &'static str {
        match self {
            Self::TorchScript => "pytorch_libtorch",
            Self::ExportedProgram => "torch_aoti",
            Self::SavedModel => "tensorflow_savedmodel",
        }
    }

    /// What the converter environment needs for it.
    fn needs(self) -> &'static str {
        match self {
            Self::TorchScript | Self::ExportedProgram => "torch, onnx and onnxruntime",
            Self::SavedModel => "tensorflow, tf2onnx and onnxruntime",
        }
    }
}

/// The converter environment's Python when none is named: `WASMTRON_CONVERTER_PYTHON`, else
/// the `.venv-convert` that `make convert-env` made beside the sources, if it exists.
pub fn default_python() -> Option<PathBuf> {
    if let Some(python) = std::env::var_os("WASMTRON_CONVERTER_PYTHON") {
        return Some(PathBuf::from(python));
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let made = manifest
        .parent()
        .unwrap_or(manifest)
        .join(".venv-convert")
        .join("bin")
        .join("python");
    made.is_file().then_some(made)
}

/// The converter's address-space limit when `--converter-memory-mb` does not say: importing
/// torch alone reserves about 4 GB.
pub const DEFAULT_MEMORY_MB: u64 = 12 << 10;

/// The conversion backend's settings: where conversions are cached, and the converter.
#[derive(Debug, Clone, Default)]
pub struct ConversionSettings {
    /// Where conversions are kept (`converted/` in the server's cache directory); `None`:
    /// nothing can be converted or served converted.
    pub cache_dir: Option<PathBuf>,
    /// Converts PyTorch and TensorFlow models to ONNX at load (`--converter-python`); `None`:
    /// only conversions already cached are served.
    pub converter: Option<ConverterSettings>,
}

/// How conversions run: the converter environment's Python, how it is confined, and what it
/// may take.
#[derive(Debug, Clone)]
pub struct ConverterSettings {
    /// A Python interpreter with the frameworks, onnx and onnxruntime.
    pub python: PathBuf,
    /// The most one conversion may take.
    pub timeout: Duration,
    /// How the converter is confined (`--converter-sandbox`).
    pub sandbox: confine::Sandbox,
    /// The converter's address-space limit in MiB (`--converter-memory-mb`).
    pub memory_mb: u64,
    /// Whether files a client sent with a load request are converted too
    /// (`--convert-uploaded-models`); by default only models the operator placed are.
    pub convert_uploads: bool,
}

impl ConverterSettings {
    /// The converter `python` with the default confinement and limits.
    pub fn new(python: PathBuf, timeout: Duration) -> Self {
        Self {
            python,
            timeout,
            sandbox: confine::Sandbox::default(),
            memory_mb: DEFAULT_MEMORY_MB,
            convert_uploads: false,
        }
    }
}

/// One output's check against the framework.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Check {
    /// The output's name.
    pub output: String,
    /// Within tolerance on every sample.
    pub ok: bool,
    /// The largest absolute difference from the framework's answer.
    #[serde(default)]
    pub max_abs_error: Option<f64>,
    /// The bound it was held to.
    #[serde(default)]
    pub tolerance: String,
    /// How many generated inputs it was checked on.
    #[serde(default)]
    pub samples: u32,
}

/// What a conversion did, kept beside the converted model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// The source's file name in the version folder.
    pub source: String,
    /// SHA-256 of the source (every file of a directory, by relative path).
    pub source_sha256: String,
    /// The platform it was converted as.
    pub platform: String,
    /// The framework and its version (`torch 2.15.0`).
    pub framework: String,
    /// The exporter that wrote the ONNX model.
    pub exporter: String,
    /// The ONNX opset.
    pub opset: u32,
    /// How the configuration's tensor names were matched to the model's.
    #[serde(default)]
    pub notes: Vec<String>,
    /// The check of each output against the framework.
    pub checks: Vec<Check>,
    /// How long converting and checking took.
    pub seconds: f64,
}

impl Manifest {
    /// One line for logs and the model's status.
    pub fn summary(&self) -> String {
        let worst = self
            .checks
            .iter()
            .filter_map(|c| c.max_abs_error)
            .fold(0.0f64, f64::max);
        let samples = self.checks.iter().map(|c| c.samples).max().unwrap_or(0);
        format!(
            "converted from {} ({}) to ONNX opset {} with {}; outputs checked against the \
             framework on {samples} generated inputs, max abs error {worst:.3e}",
            self.source, self.platform, self.opset, self.framework
        )
    }
}

/// A converted model ready to load.
#[derive(Debug)]
pub struct Converted {
    /// The ONNX file, in the cache.
    pub onnx: PathBuf,
    /// What the conversion did.
    pub manifest: Manifest,
    /// Taken from the cache rather than converted now.
    pub cached: bool,
}

/// The file (or SavedModel folder) a version's model is converted from, by name and path;
/// an error naming what is missing.
fn source_of(
    framework: Framework,
    config: &ModelConfig,
    version_dir: &Path,
) -> Result<(String, PathBuf)> {
    let name = &config.name;
    let file = super::model_config::model_file_name(config, framework.default_file()).to_owned();
    let source = version_dir.join(&file);
    let exists = match framework {
        Framework::SavedModel => source.is_dir(),
        _ => source.is_file(),
    };
    if !exists {
        return Err(Error::invalid(format!(
            "model '{name}': model file '{}' not found ({} reads {})",
            source.display(),
            framework.platform(),
            if framework == Framework::SavedModel {
                "a SavedModel directory"
            } else {
                "a file"
            }
        )));
    }
    if framework != Framework::SavedModel && (config.input.is_empty() || config.output.is_empty()) {
        return Err(Error::invalid(format!(
            "model '{name}': {} models need their inputs and outputs in config.pbtxt, as on \
             Triton (a TorchScript file does not say its tensors' types and shapes)",
            framework.platform()
        )));
    }
    Ok((file, source))
}

/// The converted ONNX model of a version: from the cache when this source and configuration
/// were converted before, else converted now (when a converter is configured).
pub fn convert(
    framework: Framework,
    config: &ModelConfig,
    version_dir: &Path,
    settings: &ConversionSettings,
    load: &LoadContext,
) -> Result<Converted> {
    let name = &config.name;
    let (file, source) = source_of(framework, config, version_dir)?;
    let source_sha256 = crate::content_hash::sha256_hex(&source)
        .map_err(|e| Error::invalid(format!("model '{name}': cannot read '{file}': {e}")))?;
    let job = Job::of(framework, config, &source);
    let key = cache_key(&source_sha256, &job);
    let root = settings.cache_dir.clone().ok_or_else(|| {
        Error::invalid(format!(
            "model '{name}': converting {file} needs a cache directory (--wasm-cache-dir, \
             WASMTRON_CACHE_DIR or HOME)"
        ))
    })?;
    let fail_cache = |e: std::io::Error| {
        Error::internal(format!(
            "model '{name}': conversion cache '{}': {e}",
            root.display()
        ))
    };
    private_dir::ensure_private(&root).map_err(fail_cache)?;
    let entry = root.join(&key);
    if let Some(manifest) = read_cached(&entry) {
        return Ok(Converted {
            onnx: entry.join("model.onnx"),
            manifest,
            cached: true,
        });
    }
    let Some(converter) = &settings.converter else {
        return Err(Error::invalid(format!(
            "model '{name}': platform '{}' is served by converting {file} to ONNX once, and no \
             conversion of this file is cached: start the server with --converter-python \
             <a Python with {}> (`make convert-env` makes one), or convert ahead of time with `wasmtron convert <repository> \
             --converter-python <python>` into the same cache",
            framework.platform(),
            framework.needs()
        )));
    };
    if load.sent_by_client && !converter.convert_uploads {
        return Err(Error::invalid(format!(
            "model '{name}': {file} came with the load request and would have to be converted \
             from {} to ONNX: the framework's reader runs code such a file may carry, so files \
             sent to the server are not converted unless it was started with \
             --convert-uploaded-models; send an ONNX model instead, or place the model in the \
             repository",
            framework.platform()
        )));
    }
    let scratch = private_dir::ScratchDir::new_in(&root, ".converting-").map_err(fail_cache)?;
    let (workspace, copied, output) =
        confine::Workspace::prepare(scratch.path(), &source).map_err(fail_cache)?;
    let started = Instant::now();
    let answer = run_converter(converter, &job.at(&copied, &output), scratch.path())
        .map_err(|e| Error::invalid(format!("model '{name}': converting {file}: {e}")))?;
    workspace.collect().map_err(fail_cache)?;
    let manifest = match answer {
        ConverterReply::Done(done) => Manifest {
            source: file.clone(),
            source_sha256,
            platform: framework.platform().to_owned(),
            framework: done.framework,
            exporter: done.exporter,
            opset: done.opset,
            notes: done.notes,
            checks: done.checks,
            seconds: started.elapsed().as_secs_f64(),
        },
        ConverterReply::Refused { reason, hint } => {
            return Err(Error::invalid(format!(
                "model '{name}': cannot convert {file} ({}) to ONNX: {}{}",
                framework.platform(),
                reason.trim_end_matches('.'),
                if hint.is_empty() {
                    String::new()
                } else {
                    format!(". Instead: {hint}")
                }
            )))
        }
    };
    let text = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::internal(format!("model '{name}': manifest: {e}")))?;
    private_dir::create_new_file(&scratch.path().join("manifest.json"))
        .and_then(|mut f| f.write_all(&text))
        .map_err(fail_cache)?;
    // Published whole or not at all: another load of the same model may have won the race,
    // and then its entry (the same conversion) stays.
    let kept = scratch.keep();
    if std::fs::rename(&kept, &entry).is_err() {
        let _ = std::fs::remove_dir_all(&kept);
    }
    Ok(Converted {
        onnx: entry.join("model.onnx"),
        manifest,
        cached: false,
    })
}

/// One model version that `wasmtron convert` looked at, and what became of it.
pub struct RepositoryConversion {
    /// The model's name.
    pub model: String,
    /// The version.
    pub version: i64,
    /// The conversion, or why there is none.
    pub outcome: Result<Converted>,
}

/// Converts every PyTorch and TensorFlow model version of a local repository (the versions
/// its version policy serves) into the cache; other models are left alone. An unreadable
/// `config.pbtxt` is reported as that model's outcome.
pub fn convert_repository(
    repository: &Path,
    settings: &ConversionSettings,
) -> std::io::Result<Vec<RepositoryConversion>> {
    let mut done = Vec::new();
    let mut models: Vec<PathBuf> = std::fs::read_dir(repository)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.pbtxt").is_file())
        .collect();
    models.sort();
    for dir in models {
        let folder = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let file = dir.join("config.pbtxt");
        let parsed = std::fs::read_to_string(&file)
            .map_err(|e| Error::invalid(e.to_string()))
            .and_then(|text| {
                let mut config = crate::repository::config::parse_text(&text, &file)
                    .map_err(|e| Error::invalid(e.to_string()))?;
                crate::repository::validate::validate(&mut config, &folder, "config.pbtxt")
                    .map_err(|e| Error::invalid(e.to_string()))?;
                Ok(config)
            });
        let config = match parsed {
            Ok(config) => config,
            Err(e) => {
                done.push(RepositoryConversion {
                    model: folder,
                    version: 0,
                    outcome: Err(e),
                });
                continue;
            }
        };
        let Some(framework) = crate::repository::validate::backend_name(&config)
            .as_deref()
            .and_then(Framework::of)
        else {
            continue;
        };
        let mut available: Vec<i64> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect();
        available.sort_unstable();
        for version in
            crate::repository::select_versions(config.version_policy.as_ref(), &available)
        {
            let outcome = convert(
                framework,
                &config,
                &dir.join(version.to_string()),
                settings,
                &LoadContext::default(),
            );
            done.push(RepositoryConversion {
                model: config.name.clone(),
                version,
                outcome,
            });
        }
    }
    Ok(done)
}

/// A cached conversion's manifest, when the entry is whole and ours.
fn read_cached(entry: &Path) -> Option<Manifest> {
    private_dir::check_private(entry).ok()?;
    if !entry.join("model.onnx").is_file() {
        return None;
    }
    let mut text = String::new();
    private_dir::open_owned_file(&entry.join("manifest.json"))
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    serde_json::from_str(&text).ok()
}

/// What the converter is asked to do.
#[derive(Debug, Serialize)]
struct Job {
    platform: &'static str,
    source: PathBuf,
    output: PathBuf,
    max_batch_size: i32,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    opset: u32,
    /// TensorFlow: the signature (`TF_SIGNATURE_DEF`) and graph tag (`TF_GRAPH_TAG`).
    #[serde(skip_serializing_if = "Option::is_none")]
    signature: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tag: Option<String>,
}

#[derive(Debug, Serialize)]
struct TensorSpec {
    name: String,
    data_type: String,
    dims: Vec<i64>,
}

impl TensorSpec {
    fn of(name: &str, data_type: i32, dims: &[i64], reshape: Option<&[i64]>) -> Self {
        Self {
            name: name.to_owned(),
            data_type: DataType::from_config_value(data_type)
                .map(|t| t.wire_name().to_owned())
                .unwrap_or_default(),
            // The model sees the reshaped tensor.
            dims: reshape.unwrap_or(dims).to_vec(),
        }
    }
}

impl Job {
    fn of(framework: Framework, config: &ModelConfig, source: &Path) -> Self {
        let input = |i: &ModelInput| {
            TensorSpec::of(
                &i.name,
                i.data_type,
                &i.dims,
                i.reshape.as_ref().map(|r| &r.shape[..]),
            )
        };
        let output = |o: &ModelOutput| {
            TensorSpec::of(
                &o.name,
                o.data_type,
                &o.dims,
                o.reshape.as_ref().map(|r| &r.shape[..]),
            )
        };
        Self {
            platform: framework.platform(),
            source: source.to_path_buf(),
            output: PathBuf::new(),
            max_batch_size: config.max_batch_size,
            inputs: config.input.iter().map(input).collect(),
            outputs: config.output.iter().map(output).collect(),
            opset: OPSET,
            signature: parameter(config, "TF_SIGNATURE_DEF"),
            tag: parameter(config, "TF_GRAPH_TAG"),
        }
    }

    /// The job run on the copy `source` of the model, writing `output`.
    fn at(mut self, source: &Path, output: &Path) -> Self {
        self.source = source.to_path_buf();
        self.output = output.to_path_buf();
        self
    }
}

/// A non-empty string parameter of the configuration.
fn parameter(config: &ModelConfig, key: &str) -> Option<String> {
    config
        .parameters
        .get(key)
        .map(|p| p.string_value.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// The parameters of Triton's PyTorch and TensorFlow backends that tune the framework's own
/// execution; a converted model runs on ONNX Runtime, where they have no effect.
/// (`TF_SIGNATURE_DEF` and `TF_GRAPH_TAG` choose what is converted, and are honoured.)
pub const FRAMEWORK_PARAMETERS: &[&str] = &[
    "DISABLE_OPTIMIZED_EXECUTION",
    "INFERENCE_MODE",
    "DISABLE_CUDNN",
    "ENABLE_WEIGHT_SHARING",
    "ENABLE_CACHE_CLEANING",
    "ENABLE_JIT_EXECUTOR",
    "ENABLE_JIT_PROFILING",
    "ENABLE_NVFUSER",
    "ENABLE_TENSOR_FUSER",
    "INTER_OP_THREAD_COUNT",
    "INTRA_OP_THREAD_COUNT",
    "TF_NUM_INTRA_THREADS",
    "TF_NUM_INTER_THREADS",
    "TF_USE_PER_SESSION_THREADS",
    "MAX_SESSION_SHARE_COUNT",
    "TF_INIT_OPS_FILE",
    "TF_SIGNATURE_DEF",
    "TF_GRAPH_TAG",
];

/// The cache entry's name: the source, what the configuration tells the converter (tensor
/// names, types, shapes, batching) and the converter itself.
fn cache_key(source_sha256: &str, job: &Job) -> String {
    let mut h = Sha256::new();
    h.update(source_sha256.as_bytes());
    h.update(job.platform.as_bytes());
    h.update(job.max_batch_size.to_le_bytes());
    for (kind, specs) in [("in", &job.inputs), ("out", &job.outputs)] {
        for s in specs {
            h.update(format!("{kind}\0{}\0{}\0{:?}\0", s.name, s.data_type, s.dims).as_bytes());
        }
    }
    h.update(job.opset.to_le_bytes());
    for choice in [&job.signature, &job.tag] {
        h.update(choice.as_deref().unwrap_or("").as_bytes());
        h.update([0]);
    }
    h.update(SCRIPT.as_bytes());
    crate::content_hash::hex(&h.finalize())
}

/// The converter's answer.
enum ConverterReply {
    Done(Done),
    Refused { reason: String, hint: String },
}

#[derive(Deserialize)]
struct Done {
    framework: String,
    exporter: String,
    opset: u32,
    #[serde(default)]
    notes: Vec<String>,
    checks: Vec<Check>,
}

#[derive(Deserialize)]
struct Reply {
    ok: bool,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    hint: String,
}

/// Runs the converter on `job` in `scratch` (its working, home and temporary directory),
/// confined ([`confine::command`]), for at most the configured time.
fn run_converter(
    converter: &ConverterSettings,
    job: &Job,
    scratch: &Path,
) -> std::result::Result<ConverterReply, String> {
    let input = serde_json::to_vec(job).map_err(|e| e.to_string())?;
    let mut child = confine::command(converter, SCRIPT, scratch)?
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "cannot start the converter '{}': {e}",
                converter.python.display()
            )
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&input).map_err(|e| e.to_string())?;
    }
    // Read on threads so that a chatty framework never blocks on a full pipe.
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = stdout.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let deadline = Instant::now() + converter.timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "the converter took longer than {} s (--converter-timeout-secs)",
                    converter.timeout.as_secs()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        tracing::debug!(target: "wasmtron::conversion", "{line}");
    }
    let Some(last) = stdout.lines().rev().find(|l| l.starts_with('{')) else {
        if let Some(why) = confine::explain_failure(converter, &stderr) {
            return Err(why);
        }
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(format!(
            "the converter ended ({status}) without an answer: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    };
    let reply: Reply = serde_json::from_str(last).map_err(|e| e.to_string())?;
    if !reply.ok {
        return Ok(ConverterReply::Refused {
            reason: reply.reason,
            hint: reply.hint,
        });
    }
    serde_json::from_str::<Done>(last)
        .map(ConverterReply::Done)
        .map_err(|e| format!("the converter's answer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platforms_that_are_converted() {
        assert_eq!(
            Framework::of("pytorch_libtorch"),
            Some(Framework::TorchScript)
        );
        assert_eq!(Framework::of("pytorch"), Some(Framework::TorchScript));
        assert_eq!(
            Framework::of("torch_aoti"),
            Some(Framework::ExportedProgram)
        );
        assert_eq!(
            Framework::of("tensorflow_savedmodel"),
            Some(Framework::SavedModel)
        );
        assert_eq!(Framework::of("onnxruntime"), None);
    }

    #[test]
    fn the_cache_key_follows_source_config_and_converter() {
        let config = |dims: Vec<i64>| ModelConfig {
            name: "m".into(),
            max_batch_size: 4,
            input: vec![ModelInput {
                name: "INPUT__0".into(),
                data_type: DataType::Fp32.config_value(),
                dims,
                ..Default::default()
            }],
            ..Default::default()
        };
        let job = |dims| Job::of(Framework::TorchScript, &config(dims), Path::new("x"));
        let a = cache_key("aa", &job(vec![3]));
        assert_eq!(a, cache_key("aa", &job(vec![3])));
        assert_ne!(a, cache_key("ab", &job(vec![3])));
        assert_ne!(a, cache_key("aa", &job(vec![-1])));
    }

    #[test]
    fn a_missing_converter_is_refused_with_the_way_out() {
        let dir = tempfile::tempdir().unwrap();
        let version = dir.path().join("1");
        std::fs::create_dir_all(&version).unwrap();
        std::fs::write(version.join("model.pt"), b"not torchscript").unwrap();
        let config = ModelConfig {
            name: "resnet".into(),
            platform: "pytorch_libtorch".into(),
            input: vec![ModelInput {
                name: "INPUT__0".into(),
                data_type: DataType::Fp32.config_value(),
                dims: vec![3],
                ..Default::default()
            }],
            output: vec![ModelOutput {
                name: "OUTPUT__0".into(),
                data_type: DataType::Fp32.config_value(),
                dims: vec![3],
                ..Default::default()
            }],
            ..Default::default()
        };
        let options = ConversionSettings {
            cache_dir: Some(dir.path().join("cache").join("converted")),
            ..Default::default()
        };
        let load = LoadContext::default();
        let e = convert(Framework::TorchScript, &config, &version, &options, &load)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("resnet") && e.contains("--converter-python") && e.contains("torch"),
            "{e}"
        );
        let e = convert(Framework::SavedModel, &config, &version, &options, &load)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.savedmodel") && e.contains("not found"),
            "{e}"
        );
    }
}
