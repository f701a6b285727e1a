//! What the flags become: backend settings (`--backend-config`), TLS files, trace settings,
//! latency metrics and the response cache, read from [`Cli`](super::Cli) and checked.

use super::*;

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
