//! The `wasmtron` binary: a command line shaped like `tritonserver`'s, the three listeners,
//! and the signal-driven drain.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::bail;
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

use crate::command_line::{BackendSettings, Cli, CompressionLevel};

mod command_line;
mod log_lines;
mod stage_cli;
mod subcommands;
mod trace_export;

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

/// The publisher of vLLM's KV-cache events, when `--kv-events-config` enables them.
async fn kv_events(
    cli: &Cli,
) -> anyhow::Result<Option<wasmtron::runtime::capabilities::kv_events::KvEvents>> {
    let Some(json) = cli.kv_events_config.as_deref() else {
        return Ok(None);
    };
    if cli.block_size == 0 {
        anyhow::bail!("--block-size must be at least 1");
    }
    let Some(config) = wasmtron::frontends::kv_events::KvEventsConfig::parse(json)? else {
        return Ok(None);
    };
    if config.hwm != 100_000 {
        tracing::warn!("--kv-events-config: hwm has no effect here (the queue is max_queue_size)");
    }
    let events = wasmtron::frontends::kv_events::start(&config, cli.block_size).await?;
    tracing::info!(endpoint = %config.endpoint, topic = %config.topic, block_size = cli.block_size, "publishing KV-cache events");
    Ok(Some(events))
}

fn main() -> anyhow::Result<()> {
    tune_malloc();
    // One TLS crypto provider for the process (aws-lc-rs, as the listeners use), so that
    // libraries that ask rustls for the default (the Redis cache's client) find it.
    let _ = tokio_rustls::rustls::crypto::aws_lc_rs::default_provider().install_default();
    let (cli, notes) = match command_line::parse(std::env::args_os()) {
        Ok(parsed) => parsed,
        Err(e) => match e.downcast::<clap::Error>() {
            // clap's own (help, version, a flag it does not know) exit as clap exits.
            Ok(clap_error) => clap_error.exit(),
            Err(e) => return Err(e),
        },
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = cli.http_thread_count.filter(|&n| n > 0) {
        runtime.worker_threads(threads);
    }
    runtime.enable_all().build()?.block_on(serve(cli, notes))
}

/// The binary: a subcommand, or the named steps of serving; `notes` are the flags accepted
/// with no effect, logged once logging runs.
async fn serve(mut cli: Cli, notes: Vec<String>) -> anyhow::Result<()> {
    if let Some(command) = cli.command.take() {
        return subcommands::run(command).await;
    }
    let tenancy = load_tenants(&cli)?;
    let (tracing_settings, trace_exporter) = start_tracing(&cli)?;
    let (backend, backend_notes) = BackendSettings::parse(&cli.backend_config)?;
    log_start_notes(&cli, notes.iter().chain(&backend_notes));
    let listening = listener_options(&cli, tenancy.clone(), tracing_settings)?;
    wasmtron::runtime::sandbox::engine::configure(
        wasmtron::runtime::sandbox::engine::EngineOptions {
            pooling_instances: cli.wasm_pooling_instances,
        },
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    let options = server_options(&cli, &backend, tenancy.clone()).await?;
    #[cfg(unix)]
    if let (Some(tenancy), Some(path)) = (&tenancy, &cli.config) {
        reload_tenants_on_sighup(tenancy.clone(), path.clone())?;
    }
    let server = Server::start(options)
        .await
        .map_err(|e| anyhow::anyhow!(e.message))?;
    check_models_started(&server, cli.exit_on_error).await?;
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

/// Logs what the command line left without effect: the flags accepted with none (`notes`),
/// `--load-model` outside explicit mode; and the threads that serve the protocols.
fn log_start_notes<'a>(cli: &Cli, notes: impl Iterator<Item = &'a String>) {
    for note in notes {
        tracing::info!("{note}");
    }
    let mode = match cli.model_control_mode {
        ControlMode::None => Some("none"),
        ControlMode::Poll => Some("poll"),
        ControlMode::Explicit => None,
    };
    if let Some(mode) = mode.filter(|_| !cli.load_model.is_empty()) {
        // As in Triton: the flag only takes effect in explicit mode.
        tracing::info!(
            "--load-model has no effect with --model-control-mode={mode}: every model of the \
             repository loads"
        );
    }
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    tracing::info!(
        threads,
        "HTTP, gRPC and metrics are served by the async runtime's threads"
    );
}

/// Logs every model's status once the server started; with `--exit-on-error` (Triton's
/// default) a model that failed to load stops the server, naming it, instead of leaving one
/// that is silently not ready.
async fn check_models_started(server: &Arc<Server>, exit_on_error: bool) -> anyhow::Result<()> {
    let mut failed = Vec::new();
    for entry in server.models().index(false) {
        let version = entry.version.map(|v| v.to_string()).unwrap_or_default();
        tracing::info!(model = %entry.name, version = %version, state = entry.state.as_str(), reason = %entry.reason, "model status");
        if entry.state == wasmtron::scheduling::model_manager::ModelState::Unavailable
            && !entry.reason.is_empty()
        {
            failed.push(format!("'{}': {}", entry.name, entry.reason));
        }
    }
    // Triton's --exit-on-error (on by default): a model that failed at start-up stops the
    // server, naming it, instead of leaving one that is silently not ready.
    if exit_on_error && !failed.is_empty() {
        server.drain(Duration::from_secs(5)).await;
        bail!(
            "failed to load {} (--exit-on-error=false serves the models that loaded): {}",
            if failed.len() == 1 {
                "a model"
            } else {
                "models"
            },
            failed.join("; ")
        );
    }
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
    // The starting level; the logging extension's log_verbose_level moves it at run time.
    let level = if cli.log_verbose > 0 { "debug" } else { "info" };
    let trace_options = trace_export::parse(&command_line::trace_config(cli))?;
    let log = log_lines::LogOptions {
        verbose: cli.log_verbose,
        info: cli.log_info,
        warning: cli.log_warning,
        error: cli.log_error,
        format: cli.log_format,
        file: cli.log_file.clone(),
    };
    let (tracing_settings, trace_exporter) = trace_export::init(level, &log, &trace_options)?;
    for (key, value) in &trace_options.settings {
        tracing_settings
            .configure(key, value)
            .map_err(|e| anyhow::anyhow!("--trace-config {key}={value}: {}", e.message))?;
    }
    Ok((Arc::new(tracing_settings), trace_exporter))
}

/// The converter to use: the one named (`none`: no converter, only cached conversions load),
/// else the default ([`wasmtron::runtime::conversion::default_python`]).
fn converter_python(named: Option<&std::path::Path>) -> Option<PathBuf> {
    match named {
        Some(p) if p.as_os_str() == "none" => None,
        Some(p) => Some(p.to_path_buf()),
        None => wasmtron::runtime::conversion::default_python(),
    }
}

/// The backends' settings from the command line, on top of `defaults`.
async fn runtime_options(
    cli: &Cli,
    backend: &BackendSettings,
    defaults: RuntimeOptions,
) -> anyhow::Result<RuntimeOptions> {
    use wasmtron::runtime::{conversion, generation, onnx, python, sandbox};
    let cache_dir = cli
        .wasm_cache_dir
        .clone()
        .or(defaults.sandbox.compile_cache_dir.clone());
    let mut options = RuntimeOptions {
        load: wasmtron::runtime::LoadContext {
            disable_auto_complete: cli.disable_auto_complete_config,
            forbid_repository_calls: !cli.allow_model_repository_calls,
            ..defaults.load
        },
        onnx: onnx::OnnxSettings {
            library: cli.onnxruntime_library.clone(),
            default_max_batch_size: backend.default_max_batch_size,
            allow_custom_op_libraries: cli.allow_custom_op_libraries,
        },
        sandbox: sandbox::SandboxSettings {
            compile_cache_dir: None,
            compile_cache_max_bytes: cli.wasm_cache_max_mb.map(|mb| mb.saturating_mul(1 << 20)),
        },
        python: python::PythonSettings {
            runtime: cli.python_runtime.clone(),
        },
        conversion: conversion::ConversionSettings {
            cache_dir: None,
            converter: converter_python(cli.converter_python.as_deref()).map(|python| {
                conversion::ConverterSettings {
                    sandbox: cli.converter_sandbox,
                    memory_mb: cli.converter_memory_mb,
                    convert_uploads: cli.convert_uploaded_models,
                    ..conversion::ConverterSettings::new(
                        python,
                        Duration::from_secs(cli.converter_timeout_secs.max(1)),
                    )
                }
            }),
        },
        generation: generation::GenerationSettings {
            kv_events: kv_events(cli).await?,
        },
    };
    options = options.with_cache_dir(cache_dir);
    Ok(options)
}

/// The server core's options from the command line, on top of [`ServerOptions::default`].
async fn server_options(
    cli: &Cli,
    backend: &BackendSettings,
    tenancy: Option<Arc<Tenancy>>,
) -> anyhow::Result<ServerOptions> {
    let defaults = ServerOptions::default();
    let (cache_bytes, redis, notes) = command_line::response_cache(cli)?;
    for note in notes {
        tracing::warn!("{note}");
    }
    let (remote_repositories, model_repositories) =
        open_repositories(&cli.model_repository, &std::env::temp_dir()).await?;
    Ok(ServerOptions {
        model_repositories,
        remote_repositories,
        control_mode: cli.model_control_mode,
        load_models: cli.load_model.clone(),
        strict_readiness: cli.strict_readiness,
        model_namespacing: cli.model_namespacing,
        runtime: runtime_options(cli, backend, defaults.runtime).await?,
        queue_capacity: cli.model_queue_capacity,
        response_cache_bytes: cache_bytes,
        response_cache_redis: match redis {
            Some(settings) => Some(Arc::new(
                wasmtron::scheduling::redis_cache::RedisCache::new(settings)
                    .map_err(|e| anyhow::anyhow!("--cache-config: {e}"))?,
            )),
            None => None,
        },
        load_threads: cli.model_load_thread_count as usize,
        poll_interval: Duration::from_secs(cli.repository_poll_secs.max(1)),
        limits: RequestLimits {
            max_rank: cli.max_tensor_rank,
            max_elements: cli.max_tensor_elements,
            max_string_bytes: cli.max_string_bytes,
            max_json_depth: cli.max_json_depth,
        },
        response_stall_timeout: Duration::from_secs(cli.response_stall_timeout_secs.max(1)),
        server_id: cli.id.clone(),
        latency_metrics: command_line::latency_metrics(cli)?,
        rate_limiter: command_line::rate_limiter(cli)?,
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
        allow_client_shm: cli.allow_client_shm,
        grpc_tls: command_line::grpc_tls(cli)?,
        http_tls: command_line::http_tls(cli)?,
        cpu_metrics: cli.allow_cpu_metrics,
        gpu_metrics: cli.allow_gpu_metrics,
        grpc_keepalive: Some((
            Duration::from_millis(cli.grpc_keepalive_time.max(1)),
            Duration::from_millis(cli.grpc_keepalive_timeout.max(1)),
        )),
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
