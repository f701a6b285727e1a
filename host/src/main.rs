//! The `wasmtron` binary: a command line shaped like `tritonserver`'s, the three listeners,
//! and the signal-driven drain.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{bail, Context};
use clap::{ArgAction, Parser};
use wasmtron::{
    frontends::{
        connections::ConnectionLimits,
        listeners::{Endpoint, ListenerOptions, Listeners},
        restricted::Restrictions,
    },
    limits::RequestLimits,
    repository::remote::open_repositories,
    runtime::RuntimeOptions,
    scheduling::server::{ControlMode, Server, ServerOptions},
    tenancy::Tenancy,
};

mod stage_cli;
mod trace_export;

/// A Triton-compatible inference server with sandboxed WebAssembly stages.
#[derive(Parser, Debug)]
#[command(name = "wasmtron", version, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Model repository: a directory, or object storage (`s3://bucket/path`,
    /// `s3://host:port/bucket/path`, `gs://bucket/path`, `as://account/container/path`, with
    /// the cloud's usual credential variables); repeat for several.
    #[arg(long = "model-repository", alias = "model-store", required = true)]
    model_repository: Vec<String>,
    /// HTTP port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// gRPC port (0 picks a free one).
    #[arg(long, default_value_t = 8001)]
    grpc_port: u16,
    /// Metrics port (0 picks a free one).
    #[arg(long, default_value_t = 8002)]
    metrics_port: u16,
    /// Address the HTTP service binds.
    #[arg(long, default_value = "0.0.0.0")]
    http_address: String,
    /// Address the gRPC service binds.
    #[arg(long, default_value = "0.0.0.0")]
    grpc_address: String,
    /// Address the metrics service binds.
    #[arg(long, default_value = "0.0.0.0")]
    metrics_address: String,
    /// Serve HTTP.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    allow_http: bool,
    /// Serve gRPC.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    allow_grpc: bool,
    /// Serve metrics.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    allow_metrics: bool,
    /// How models are loaded and unloaded.
    #[arg(long, value_enum, default_value_t = ControlMode::None)]
    model_control_mode: ControlMode,
    /// Model to load at start in explicit mode (`*` for all); repeatable.
    #[arg(long = "load-model")]
    load_model: Vec<String>,
    /// Seconds between repository scans in poll mode.
    #[arg(long, default_value_t = 15)]
    repository_poll_secs: u64,
    /// Seconds to wait for in-flight requests on shutdown.
    #[arg(long, default_value_t = 30)]
    exit_timeout_secs: u64,
    /// Seconds to keep serving new requests after SIGTERM, with readiness already false, so
    /// that load balancers stop sending before requests are refused.
    #[arg(long, default_value_t = 0)]
    drain_delay_secs: u64,
    /// Verbose logging level (0 = off).
    #[arg(long, default_value_t = 0)]
    log_verbose: u32,
    /// Ready only when every model is ready.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    strict_readiness: bool,
    /// Do not fill inputs, outputs and max_batch_size from the model file.
    #[arg(long, alias = "strict-model-config", default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    disable_auto_complete_config: bool,
    /// Backend settings, e.g. `default-max-batch-size=4` or `onnxruntime,default-max-batch-size=4`.
    #[arg(long = "backend-config")]
    backend_config: Vec<String>,
    /// Largest HTTP request body in bytes (before and after decompression).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    http_max_input_size: usize,
    /// Largest gRPC request message in bytes (larger ones are refused with OUT_OF_RANGE).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    grpc_max_message_size: usize,
    /// Seconds a new connection (HTTP, gRPC or metrics) has to send its first request's
    /// headers before it is closed.
    #[arg(long, default_value_t = ConnectionLimits::default().header_timeout.as_secs())]
    http_header_timeout_secs: u64,
    /// Seconds a connection with no request in flight stays open.
    #[arg(long, default_value_t = ConnectionLimits::default().idle_timeout.as_secs())]
    http_idle_timeout_secs: u64,
    /// Most connections open at once over all listeners; at the cap the longest-idle one makes
    /// room (default 0: three quarters of the open-files limit, which is raised to its hard
    /// limit at start).
    #[arg(long, default_value_t = 0)]
    max_connections: usize,
    /// Most dimensions a request tensor may have.
    #[arg(long, default_value_t = RequestLimits::default().max_rank)]
    max_tensor_rank: usize,
    /// Most elements one request tensor may have.
    #[arg(long, default_value_t = RequestLimits::default().max_elements)]
    max_tensor_elements: usize,
    /// Longest element of a BYTES request tensor, in bytes.
    #[arg(long, default_value_t = RequestLimits::default().max_string_bytes)]
    max_string_bytes: usize,
    /// Deepest nesting of arrays and objects in an HTTP request's JSON.
    #[arg(long, default_value_t = RequestLimits::default().max_json_depth)]
    max_json_depth: usize,
    /// Executions that run at once, server-wide, while several tenants are active: each gets
    /// its part by weight (at least one), a tenant alone is not held back (default: the number
    /// of cores; 0: no share). Only with --config.
    #[arg(long)]
    execution_slots: Option<usize>,
    /// Requests each model version may queue before answering UNAVAILABLE.
    #[arg(long, default_value_t = 1024)]
    model_queue_capacity: usize,
    /// Seconds a streamed response (server-sent events, a gRPC stream) waits for a client
    /// that reads nothing before its request is cancelled and its resources freed.
    #[arg(long, default_value_t = ServerOptions::default().response_stall_timeout.as_secs())]
    response_stall_timeout_secs: u64,
    /// Compress gRPC inference responses (gzip) for clients that accept it. Off by default,
    /// as in Triton: stock clients always offer gzip, and compressing large tensors costs more
    /// CPU than loopback or LAN transfer saves. low, medium and high all mean gzip here.
    #[arg(long, value_enum, default_value_t = CompressionLevel::None)]
    grpc_infer_response_compression_level: CompressionLevel,
    /// Preallocate slots for this many Wasm stage instances (wasmtime's pooling allocator:
    /// cheaper instantiation, e.g. with `fresh_instance_per_request`); 0 allocates on demand.
    #[arg(long, default_value_t = 0)]
    wasm_pooling_instances: u32,
    /// Directory for compiled Wasm stages (default: WASMTRON_CACHE_DIR, else ~/.cache/wasmtron).
    #[arg(long)]
    wasm_cache_dir: Option<PathBuf>,
    /// Keep that directory under this many MiB, removing the least recently used compiled
    /// stages first (default 2048; the stage just compiled always stays).
    #[arg(long)]
    wasm_cache_max_mb: Option<u64>,
    /// Path of libonnxruntime.so (default: ORT_DYLIB_PATH, next to the binary, or the copy `make` fetched).
    #[arg(long)]
    onnxruntime_library: Option<PathBuf>,
    /// Restrict HTTP API groups to requests with a header: `<api>,<api>,...:<key>=<value>`
    /// (APIs: health, metadata, inference, shared-memory, model-config, model-repository,
    /// statistics, trace, logging); repeatable.
    #[arg(long = "http-restricted-api")]
    http_restricted_api: Vec<String>,
    /// Restrict gRPC protocol groups the same way; the header is
    /// `triton-grpc-protocol-<key>`; repeatable.
    #[arg(long = "grpc-restricted-protocol")]
    grpc_restricted_protocol: Vec<String>,
    /// Server config file (TOML) naming the tenants, their hashed API keys and the models each
    /// may use; without one the server serves everyone.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Request tracing, as in Triton: `mode=opentelemetry`, `level=TIMESTAMPS|OFF`, `rate=N`
    /// (one request in N), `count=N`, `opentelemetry,url=HOST:PORT/v1/traces`,
    /// `opentelemetry,resource=KEY=VALUE`; repeatable. Needs a build with `--features otel`.
    #[arg(long = "trace-config")]
    trace_config: Vec<String>,
}

/// `--grpc-infer-response-compression-level`, Triton's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CompressionLevel {
    None,
    Low,
    Medium,
    High,
}

/// Tools besides serving.
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Work with WebAssembly stages.
    #[command(subcommand)]
    Stage(StageCommand),
    /// Print the line to store in the server config file for an API key (read from standard
    /// input when not given, so that it stays out of the shell history).
    HashKey {
        /// The key.
        key: Option<String>,
    },
}

#[derive(clap::Subcommand, Debug)]
enum StageCommand {
    /// Execute a stage once, without a server, and print its outputs as JSON.
    Run(stage_cli::run::RunArgs),
    /// Write a new stage, ready to build: source, config.pbtxt, a test input and the SDK.
    New(stage_cli::new::NewArgs),
    /// Build a stage with its language's toolchain into DIR/1/model.wasm.
    Build(stage_cli::build::BuildArgs),
}

fn default_max_batch_size(settings: &[String]) -> anyhow::Result<i32> {
    let mut value = 4;
    for setting in settings {
        let kv = setting.rsplit(',').next().unwrap_or(setting);
        if let Some(v) = kv.strip_prefix("default-max-batch-size=") {
            value = v.parse().with_context(|| {
                format!("--backend-config {setting}: default-max-batch-size must be an integer")
            })?;
        } else {
            bail!(
                "--backend-config {setting}: unknown setting (supported: default-max-batch-size=N)"
            );
        }
    }
    Ok(value)
}

/// Registers SIGTERM and SIGINT now and returns what waits for the first of them. Called
/// before the listeners start: a signal that came after the server said it was ready, but
/// before a handler existed, would end the process at once instead of draining it.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {},
                _ = interrupt.recv() => {},
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// Reloads the server config file on every SIGHUP: keys added or removed take effect for the
/// next request; a file with an error is reported and the tenants stay as they were.
#[cfg(unix)]
fn reload_tenants_on_sighup(tenancy: Arc<Tenancy>, path: PathBuf) -> anyhow::Result<()> {
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            let (tenancy, path) = (tenancy.clone(), path.clone());
            let reloaded = tokio::task::spawn_blocking(move || tenancy.reload(&path)).await;
            match reloaded {
                Ok(Ok(r)) => tracing::info!(
                    tenants = r.tenants,
                    keys = r.keys,
                    revoked_keys = r.revoked_keys,
                    "reloaded the server config file"
                ),
                Ok(Err(e)) => {
                    tracing::error!("{e}; the tenants and keys stay as they were")
                }
                Err(e) => tracing::error!("reloading the server config file failed: {e}"),
            }
        }
    });
    Ok(())
}

/// glibc allocator settings, each unless its `MALLOC_*` environment variable says otherwise;
/// called before any other thread exists.
///
/// Arenas: glibc gives threads that allocate at the same moment separate arenas, up to 8 per
/// core, and keeps what each arena once held. Model reloads start new worker threads while
/// requests run, so under traffic the arenas multiply and RSS creeps up with every reload
/// (soak: +1.1 MiB over 180 reloads, still rising; with 2 arenas +0.2 MiB, flat after
/// warm-up). Two arenas.
///
/// Large buffers: tensors of a few MiB (an image's planes, a batch's outputs) are allocated
/// and freed on every request. By default glibc serves them with fresh mmaps or hands the
/// freed top of the heap back to the kernel, so each request faults its pages in again: the
/// Rust `preprocess` stage took 838 µs per request served alone and 340 µs with another model
/// loaded beside it (which happened to keep the heap's top in use). Buffers under 8 MiB come
/// from the heap and up to 64 MiB of freed heap stays mapped: 334–357 µs either way.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (variable, parameter, value) in [
        ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, 2),
        ("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, 8 << 20),
        ("MALLOC_TRIM_THRESHOLD_", libc::M_TRIM_THRESHOLD, 64 << 20),
    ] {
        if std::env::var_os(variable).is_none() {
            // SAFETY: mallopt only sets an allocator parameter; no other thread runs yet.
            unsafe {
                libc::mallopt(parameter, value);
            }
        }
    }
}

fn main() -> anyhow::Result<()> {
    tune_malloc();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve())
}

/// The binary: a subcommand, or the named steps of serving.
async fn serve() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Stage(StageCommand::New(args))) => {
            if let Err(e) = stage_cli::new::new(args) {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
            return Ok(());
        }
        Some(Command::Stage(StageCommand::Build(args))) => {
            if let Err(e) =
                tokio::task::spawn_blocking(move || stage_cli::build::build(args)).await?
            {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
            return Ok(());
        }
        Some(Command::Stage(StageCommand::Run(args))) => {
            if let Err(e) = tokio::task::spawn_blocking(move || stage_cli::run::run(args)).await? {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
            return Ok(());
        }
        Some(Command::HashKey { key }) => {
            let key = match key {
                Some(k) => k,
                None => std::io::read_to_string(std::io::stdin())?,
            };
            let key = key.trim();
            if key.is_empty() {
                bail!("give a non-empty key");
            }
            println!("\"{}\"", wasmtron::tenancy::hash_key(key));
            return Ok(());
        }
        None => {}
    }
    let tenancy = load_tenants(&cli)?;
    let (tracing_settings, trace_exporter) = start_tracing(&cli)?;
    let listening = listener_options(&cli, tenancy.clone(), tracing_settings)?;
    wasmtron::runtime::wasm::engine::configure(wasmtron::runtime::wasm::engine::EngineOptions {
        pooling_instances: cli.wasm_pooling_instances,
    })
    .map_err(|e| anyhow::anyhow!(e.message))?;
    let options = server_options(&cli, tenancy.clone()).await?;
    #[cfg(unix)]
    if let (Some(tenancy), Some(path)) = (&tenancy, &cli.config) {
        reload_tenants_on_sighup(tenancy.clone(), path.clone())?;
    }
    let server = Server::start(options)
        .await
        .map_err(|e| anyhow::anyhow!(e.message))?;
    for entry in server.models().index(false) {
        let version = entry.version.map(|v| v.to_string()).unwrap_or_default();
        tracing::info!(model = %entry.name, version = %version, state = entry.state.as_str(), reason = %entry.reason, "model status");
    }
    // Before the first listener: from the moment a client can see the server, a signal drains.
    let shutdown = shutdown_signal()?;
    let listeners = Listeners::open(server.clone(), listening)
        .await
        .map_err(|e| anyhow::anyhow!(e.message))?;
    shutdown.await;
    drain(&cli, &server, listeners).await;
    drop(server);
    if let Some(exporter) = trace_exporter {
        exporter.shutdown();
    }
    tracing::info!("stopped");
    Ok(())
}

/// The tenants of `--config`, if given.
fn load_tenants(cli: &Cli) -> anyhow::Result<Option<Arc<Tenancy>>> {
    Ok(match &cli.config {
        Some(path) => Some(Arc::new(Tenancy::load(path).map_err(anyhow::Error::from)?)),
        None => None,
    })
}

/// Logging and request tracing (`--log-verbose`, `--trace-config`).
fn start_tracing(
    cli: &Cli,
) -> anyhow::Result<(
    Arc<wasmtron::frontends::trace::Tracing>,
    Option<trace_export::Exporter>,
)> {
    let level = if cli.log_verbose > 0 { "debug" } else { "info" };
    let trace_options = trace_export::parse(&cli.trace_config)?;
    let (tracing_settings, trace_exporter) = trace_export::init(level, &trace_options)?;
    for (key, value) in &trace_options.settings {
        tracing_settings
            .configure(key, value)
            .map_err(|e| anyhow::anyhow!("--trace-config {key}={value}: {}", e.message))?;
    }
    Ok((Arc::new(tracing_settings), trace_exporter))
}

/// The server core's options from the command line, on top of [`ServerOptions::default`].
async fn server_options(cli: &Cli, tenancy: Option<Arc<Tenancy>>) -> anyhow::Result<ServerOptions> {
    let defaults = ServerOptions::default();
    let (remote_repositories, model_repositories) =
        open_repositories(&cli.model_repository, &std::env::temp_dir()).await?;
    Ok(ServerOptions {
        model_repositories,
        remote_repositories,
        control_mode: cli.model_control_mode,
        load_models: cli.load_model.clone(),
        strict_readiness: cli.strict_readiness,
        runtime: RuntimeOptions {
            onnxruntime_library: cli.onnxruntime_library.clone(),
            disable_auto_complete: cli.disable_auto_complete_config,
            default_max_batch_size: default_max_batch_size(&cli.backend_config)?,
            wasm_cache_dir: cli
                .wasm_cache_dir
                .clone()
                .or(defaults.runtime.wasm_cache_dir),
            wasm_cache_max_bytes: cli.wasm_cache_max_mb.map(|mb| mb.saturating_mul(1 << 20)),
            ..defaults.runtime
        },
        queue_capacity: cli.model_queue_capacity,
        poll_interval: Duration::from_secs(cli.repository_poll_secs.max(1)),
        limits: RequestLimits {
            max_rank: cli.max_tensor_rank,
            max_elements: cli.max_tensor_elements,
            max_string_bytes: cli.max_string_bytes,
            max_json_depth: cli.max_json_depth,
        },
        response_stall_timeout: Duration::from_secs(cli.response_stall_timeout_secs.max(1)),
        ..ServerOptions::default()
    }
    .with_tenancy(tenancy, cli.execution_slots))
}

/// The listeners from the command line: addresses, size limits, restrictions, connections.
fn listener_options(
    cli: &Cli,
    tenancy: Option<Arc<Tenancy>>,
    tracing: Arc<wasmtron::frontends::trace::Tracing>,
) -> anyhow::Result<ListenerOptions> {
    let http_restrictions =
        Restrictions::parse(&cli.http_restricted_api, "--http-restricted-api", "")
            .map_err(anyhow::Error::msg)?;
    let grpc_restrictions = Restrictions::parse(
        &cli.grpc_restricted_protocol,
        "--grpc-restricted-protocol",
        "triton-grpc-protocol-",
    )
    .map_err(anyhow::Error::msg)?;
    let endpoint =
        |allowed: bool, address: &str, port: u16| allowed.then(|| Endpoint::new(address, port));
    Ok(ListenerOptions {
        http: endpoint(cli.allow_http, &cli.http_address, cli.http_port),
        grpc: endpoint(cli.allow_grpc, &cli.grpc_address, cli.grpc_port),
        metrics: endpoint(cli.allow_metrics, &cli.metrics_address, cli.metrics_port),
        http_max_input_size: cli.http_max_input_size,
        grpc_max_message_size: cli.grpc_max_message_size,
        grpc_compress_responses: cli.grpc_infer_response_compression_level
            != CompressionLevel::None,
        tenancy,
        http_restrictions,
        grpc_restrictions,
        tracing,
        connections: ConnectionLimits {
            header_timeout: Duration::from_secs(cli.http_header_timeout_secs.max(1)),
            idle_timeout: Duration::from_secs(cli.http_idle_timeout_secs.max(1)),
            max_connections: cli.max_connections,
        },
    })
}

/// After a signal: readiness off, the drain delay, in-flight requests finished within
/// `--exit-timeout-secs`, the listeners closed.
async fn drain(cli: &Cli, server: &Arc<Server>, listeners: Listeners) {
    let timeout = Duration::from_secs(cli.exit_timeout_secs);
    server.mark_unready();
    listeners.set_not_serving().await;
    if cli.drain_delay_secs > 0 {
        tracing::info!(
            "shutting down: not ready any more, still serving for {}s (--drain-delay-secs)",
            cli.drain_delay_secs
        );
        tokio::time::sleep(Duration::from_secs(cli.drain_delay_secs)).await;
    }
    tracing::info!(
        "shutting down: refusing new requests, waiting up to {}s for in-flight requests",
        timeout.as_secs()
    );
    let drained = server.drain(timeout).await;
    if !drained {
        tracing::warn!("exit timeout reached with requests still in flight");
    }
    if !listeners.close(Duration::from_secs(5)).await {
        tracing::warn!("frontends did not close in time");
    }
}
