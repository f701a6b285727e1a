//! What the server core starts from ([`ServerOptions`]): the repositories, how models are
//! loaded, the backends' settings, queues, caches and limits. Every entry point (the binary's
//! flags, the Python package) starts from its defaults.

use std::{path::PathBuf, sync::Arc, time::Duration};

use crate::{limits::RequestLimits, runtime::RuntimeOptions};

/// The `name` server metadata answers by default: Triton's (`--id`'s default), which Triton's
/// clients, scripts and QA tests compare it with; the version says which server it is.
pub const DEFAULT_SERVER_ID: &str = "triton";

/// How the set of loaded models may change (`--model-control-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlMode {
    /// Load everything at start; the load/unload API is refused.
    None,
    /// Load what `--load-model` names; the load/unload API decides the rest.
    Explicit,
    /// Load everything and follow changes in the repository.
    Poll,
}

/// Everything the server core needs to start.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Repository roots.
    pub model_repositories: Vec<PathBuf>,
    /// Remote repositories (object storage), synced once already; searched after the roots
    /// and synced again before every poll and explicit load.
    pub remote_repositories: Vec<Arc<crate::repository::remote::Mirror>>,
    /// Model control mode.
    pub control_mode: ControlMode,
    /// Models to load at start in explicit mode (`*` for all).
    pub load_models: Vec<String>,
    /// Ready only when every model is ready.
    pub strict_readiness: bool,
    /// Each repository root a namespace of its own (Triton's `--model-namespacing`): roots
    /// may hold models of the same name (see `ModelRepository`).
    pub model_namespacing: bool,
    /// Backend settings.
    pub runtime: RuntimeOptions,
    /// Queue capacity per model version (0: no cap).
    pub queue_capacity: usize,
    /// Bytes of answers the response cache keeps (`--cache-config local,size=N`); 0: none.
    pub response_cache_bytes: usize,
    /// The response cache in Redis (`--cache-config redis,…`), instead of in memory.
    pub response_cache_redis: Option<Arc<super::redis_cache::RedisCache>>,
    /// Models loaded at once at start-up and on each poll (`--model-load-thread-count`).
    pub load_threads: usize,
    /// Poll interval in poll mode.
    pub poll_interval: Duration,
    /// What one request may ask for (rank, elements, string length, JSON depth).
    pub limits: RequestLimits,
    /// Executions that run at once while several tenants are active, divided among them by
    /// weight (`--execution-slots`; 0: no share).
    pub execution_slots: usize,
    /// How long a streamed response waits for a reader that takes nothing before its request
    /// is cancelled (`--response-stall-timeout-secs`).
    pub response_stall_timeout: Duration,
    /// The server's identifier: the `name` of its metadata (Triton's `--id`,
    /// [`DEFAULT_SERVER_ID`] unless set).
    pub server_id: String,
    /// The latency metrics models record (`--metrics-config`).
    pub latency_metrics: super::latency::LatencyMetrics,
    /// The rate limiter (`--rate-limit=execution_count`), if on.
    pub rate_limiter: Option<Arc<super::rate_limiter::RateLimiter>>,
}

impl Default for ServerOptions {
    /// The defaults of every entry point (the binary's flags, the Python package): no
    /// repository yet, everything loaded at start, strict readiness, batch size 4 for
    /// auto-completed models, compiled stages cached in the user's cache, 1,024 queued
    /// requests per model, a poll every 15 s, the default request limits, no tenants, and
    /// streamed requests cancelled after 10 s of a reader taking nothing.
    fn default() -> Self {
        Self {
            model_repositories: Vec::new(),
            remote_repositories: Vec::new(),
            control_mode: ControlMode::None,
            load_models: Vec::new(),
            strict_readiness: true,
            model_namespacing: false,
            runtime: RuntimeOptions::for_server(),
            queue_capacity: 0,
            response_cache_bytes: 0,
            response_cache_redis: None,
            load_threads: 4,
            poll_interval: Duration::from_secs(15),
            limits: RequestLimits::default(),
            execution_slots: 0,
            response_stall_timeout: Duration::from_secs(10),
            server_id: DEFAULT_SERVER_ID.to_owned(),
            latency_metrics: Default::default(),
            rate_limiter: None,
        }
    }
}

impl ServerOptions {
    /// Serves the tenants of `tenancy` (or everyone, `None`). With tenants, executions are
    /// shared among them: `slots` at once (default: one per core); without, nothing is shared.
    pub fn with_tenancy(
        mut self,
        tenancy: Option<Arc<crate::tenancy::Tenancy>>,
        slots: Option<usize>,
    ) -> Self {
        self.execution_slots = match (&tenancy, slots) {
            (None, _) => 0,
            (Some(_), Some(slots)) => slots,
            (Some(_), None) => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        self.runtime.load.tenancy = tenancy;
        self
    }
}
