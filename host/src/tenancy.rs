//! Tenants: who may use the server and for which models. Read from the server config file
//! (`--config wasmtron.toml`); without one the server is single-tenant and open, as before.
//!
//! ```toml
//! [[tenant]]
//! name = "alpha"
//! api_keys = ["sha256:9f86d0…"]   # `wasmtron hash-key` prints the line for a key
//! infer = ["alpha_*", "shared"]     # models it may infer with: names, or prefixes ending in *
//! see = ["public_*"]                # models it may see (metadata, config, stats, index) besides
//! load = ["alpha_*"]                # models it may load and unload
//!
//! [tenant.quotas]                  # each optional; over one: 429 / RESOURCE_EXHAUSTED
//! max_concurrent_requests = 8
//! requests_per_second = 100.0
//! burst = 20
//! max_request_bytes = 1048576
//!
//! [tenant.wasm]                    # defaults for the stages it may load; their configs may
//! execution_timeout_ms = 2000       # lower them, and fail to load if they ask for more
//! memory_limit_mb = 128
//!
//! [[tenant]]
//! name = "ops"
//! api_keys = ["sha256:…"]
//! admin = true                      # everything, including log and trace settings
//! ```
//!
//! A tenant sees the models it may infer with or load, and those of `see`. Keys are stored
//! only as SHA-256 digests: the file can be read without revealing a key.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError, RwLock,
    },
    time::{Duration, Instant},
};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Code, Error, Result};

/// Prefix of a stored key digest.
const SHA256: &str = "sha256:";

/// Why the config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    /// The file could not be read.
    #[error("cannot read the server config file '{path}': {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("server config file '{path}': {message}")]
    Syntax {
        /// The file.
        path: String,
        /// What the parser said, with the line.
        message: String,
    },
    /// A value that does not make sense, naming the tenant and field.
    #[error("server config file '{path}': {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tenant: Vec<TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    api_keys: Vec<String>,
    #[serde(default)]
    admin: bool,
    #[serde(default)]
    infer: Vec<String>,
    #[serde(default)]
    see: Vec<String>,
    #[serde(default)]
    load: Vec<String>,
    #[serde(default)]
    quotas: QuotaLimits,
    #[serde(default)]
    wasm: WasmLimits,
    /// Its share of a busy model against other tenants' (default 1).
    weight: Option<f64>,
}

/// A tenant's `[tenant.quotas]`: each limit is off when absent.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QuotaLimits {
    /// Inference requests the tenant may have in the server at once.
    pub max_concurrent_requests: Option<usize>,
    /// Sustained inference requests per second (a token bucket refilled at this rate).
    pub requests_per_second: Option<f64>,
    /// Requests allowed at once above the rate (the bucket's size); default: one second's worth,
    /// at least 1.
    pub burst: Option<f64>,
    /// Largest inference request body, in bytes (after decompression).
    pub max_request_bytes: Option<usize>,
    /// Requests the tenant may have waiting in one model's queue.
    pub max_queued_requests: Option<usize>,
    /// Requests in a row failing in one model (a stage's trap, deadline or memory cap) after
    /// which the tenant's requests to it are held back (default 5).
    pub backoff_after_failures: Option<u32>,
    /// The first hold-back in milliseconds (default 1000); it doubles with each further
    /// failure, up to 30 s (or this, if longer).
    pub backoff_ms: Option<u64>,
}

/// A tenant's `[tenant.wasm]`: defaults for the Wasm stages it may load (its `load`
/// patterns), which a stage's `config.pbtxt` may lower but not raise.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WasmLimits {
    /// Wall-clock deadline of one call into the stage (`execution_timeout_ms`).
    pub execution_timeout_ms: Option<u64>,
    /// Most linear memory an instance may grow to (`memory_limit_mb`).
    pub memory_limit_mb: Option<u64>,
}

/// Model names a permission covers: exact names, prefixes written `name*`, or `*` for all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelPatterns(Vec<String>);

impl ModelPatterns {
    fn new(patterns: Vec<String>, field: &str) -> std::result::Result<Self, String> {
        for p in &patterns {
            let body = p.strip_suffix('*').unwrap_or(p);
            if p.is_empty() || body.contains('*') {
                return Err(format!(
                    "{field}: \"{p}\" is not a model name or a prefix ending in a single *"
                ));
            }
        }
        Ok(Self(patterns))
    }

    /// Whether `model` is covered.
    pub fn matches(&self, model: &str) -> bool {
        self.0.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => p == model,
        })
    }
}

/// One tenant and what it may do.
#[derive(Debug)]
pub struct Tenant {
    /// Its name (in error messages, logs and metrics).
    pub name: String,
    /// May do everything.
    pub admin: bool,
    infer: ModelPatterns,
    see: ModelPatterns,
    load: ModelPatterns,
    limits: QuotaLimits,
    wasm: WasmLimits,
    weight: f64,
    /// Counters that outlive a reload of the config file while the tenant keeps its name.
    live: Arc<Live>,
}

/// What a tenant is using and has used: in-flight requests, its rate bucket, its figures,
/// and the models its requests keep failing in.
#[derive(Debug)]
struct Live {
    in_flight: AtomicUsize,
    bucket: Mutex<Bucket>,
    usage: Mutex<BTreeMap<String, ModelUsage>>,
    backoffs: Mutex<HashMap<String, Backoff>>,
}

/// Failures in a row after which a tenant's requests to a model are held back, unless
/// `quotas.backoff_after_failures` says otherwise.
pub const BACKOFF_AFTER_FAILURES: u32 = 5;
/// The first hold-back unless `quotas.backoff_ms` says otherwise; it doubles with every further
/// failure, up to [`BACKOFF_MAX`].
pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// The longest hold-back (unless the first is longer).
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// One tenant's run of backend failures with one model (a stage that traps, runs past its
/// deadline or out of memory on its requests). After some in a row its
/// requests to that model are refused for a while instead of run, so that a crash loop burns
/// no more of the CPU the other tenants share. Requests go through again when a hold-back
/// ends; the next failure holds them back twice as long, a success ends the run. Other
/// tenants' requests to the same model are not affected.
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
    until: Option<Instant>,
    last_error: String,
}

/// What became of a tenant's inference requests to one model, for the metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelUsage {
    /// Requests answered successfully.
    pub success: u64,
    /// Their summed duration, in microseconds.
    pub success_us: u64,
    /// Failed requests by reason (`PERMISSION_DENIED`, `QUOTA`, `REJECTED`, `INVALID`,
    /// `BACKEND`, `CANCELED`).
    pub failures: BTreeMap<&'static str, u64>,
}

/// The failure reason label of an error code.
fn reason(code: Code) -> &'static str {
    match code {
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "QUOTA",
        Code::Unavailable => "REJECTED",
        Code::Cancelled => "CANCELED",
        Code::Internal => "BACKEND",
        Code::Unauthenticated => "UNAUTHENTICATED",
        Code::InvalidArg | Code::NotFound | Code::AlreadyExists | Code::Unsupported => "INVALID",
    }
}

/// One inference request being accounted to its tenant; see [`Caller::track`].
#[derive(Debug)]
pub struct Tracked {
    tenant: Option<Arc<Tenant>>,
    model: String,
    started: Instant,
}

impl Tracked {
    /// Records the outcome: `Ok` or the error's code.
    pub fn finish(mut self, outcome: std::result::Result<(), Code>) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: std::result::Result<(), Code>) {
        let Some(tenant) = self.tenant.take() else {
            return;
        };
        // A name the tenant may not use, or that does not exist, is not a label: clients
        // choose it, and every new label value would be kept for good.
        let model = match outcome {
            Err(Code::PermissionDenied | Code::NotFound) => String::new(),
            _ => std::mem::take(&mut self.model),
        };
        let mut usage = tenant
            .live
            .usage
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = usage.entry(model).or_default();
        match outcome {
            Ok(()) => {
                entry.success += 1;
                entry.success_us +=
                    u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
            }
            Err(code) => *entry.failures.entry(reason(code)).or_default() += 1,
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // Dropped unfinished: the client went away.
        self.record(Err(Code::Cancelled));
    }
}

/// The request-rate token bucket.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
}

/// An admitted inference request; dropping it gives its concurrency slot back.
#[derive(Debug)]
pub struct Admission(Option<Arc<Tenant>>);

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.live.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Tenant {
    /// Its share of a busy model: turns in proportion to the weights of the tenants waiting.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// Requests it may have waiting in one model's queue.
    pub fn max_queued_requests(&self) -> Option<usize> {
        self.limits.max_queued_requests
    }

    /// Takes a concurrency slot and a rate token for a request of `bytes`, or says which
    /// quota it is over.
    fn admit(self: &Arc<Self>, bytes: usize) -> Result<Admission> {
        let limits = &self.limits;
        let over = |what: String| {
            Error::resource_exhausted(format!(
                "tenant '{}' is over its quota: {what}; retry later",
                self.name
            ))
        };
        if let Some(max) = limits.max_request_bytes {
            if bytes > max {
                return Err(Error::resource_exhausted(format!(
                    "the request of {bytes} bytes is larger than tenant '{}' may send \
                     (quotas.max_request_bytes = {max})",
                    self.name
                )));
            }
        }
        let in_flight = self.live.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        // From here on, dropping the admission gives the slot back.
        let admission = Admission(Some(self.clone()));
        if let Some(max) = limits.max_concurrent_requests {
            if in_flight > max {
                return Err(over(format!(
                    "{max} concurrent requests (quotas.max_concurrent_requests)"
                )));
            }
        }
        if let Some(rate) = limits.requests_per_second {
            let burst = limits.burst.unwrap_or(rate).max(1.0);
            let mut bucket = self
                .live
                .bucket
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            let elapsed = now.saturating_duration_since(bucket.refilled).as_secs_f64();
            bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
            bucket.refilled = now;
            if bucket.tokens < 1.0 {
                return Err(over(format!(
                    "{rate} requests per second with a burst of {burst} \
                     (quotas.requests_per_second, quotas.burst)"
                )));
            }
            bucket.tokens -= 1.0;
        }
        Ok(admission)
    }
}

/// Who sent a request.
#[derive(Debug, Clone)]
pub enum Caller {
    /// The server runs without tenants: everyone may do everything.
    Anyone,
    /// An authenticated tenant.
    Tenant(Arc<Tenant>),
}

impl PartialEq for Caller {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Caller::Anyone, Caller::Anyone) => true,
            (Caller::Tenant(a), Caller::Tenant(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// What a caller wants to do with a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelAction {
    /// Run an inference.
    Infer,
    /// Read its metadata, configuration, readiness or statistics, or find it in the index.
    See,
    /// Load or unload it.
    Load,
}

impl ModelAction {
    fn verb(self) -> &'static str {
        match self {
            ModelAction::Infer => "infer with",
            ModelAction::See => "see",
            ModelAction::Load => "load or unload",
        }
    }
}

impl Caller {
    /// The tenant's name, if there is one.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Anyone => None,
            Caller::Tenant(t) => Some(&t.name),
        }
    }

    /// Whether the caller may do `action` with `model`.
    pub fn may(&self, action: ModelAction, model: &str) -> bool {
        let Caller::Tenant(t) = self else {
            return true;
        };
        t.admin
            || match action {
                ModelAction::Infer => t.infer.matches(model),
                ModelAction::Load => t.load.matches(model),
                ModelAction::See => {
                    t.see.matches(model) || t.infer.matches(model) || t.load.matches(model)
                }
            }
    }

    /// [`Caller::may`] as an error naming the tenant, the action and the model. The answer
    /// does not depend on whether the model exists, so it reveals nothing about other
    /// tenants' models.
    pub fn require(&self, action: ModelAction, model: &str) -> Result<()> {
        if self.may(action, model) {
            return Ok(());
        }
        Err(Error::permission_denied(format!(
            "tenant '{}' may not {} model '{model}'",
            self.tenant().unwrap_or_default(),
            action.verb()
        )))
    }

    /// Admits an inference request of `bytes` under the tenant's quotas (concurrency, rate,
    /// size): the returned [`Admission`] holds a concurrency slot until dropped. The error
    /// (429 / RESOURCE_EXHAUSTED) names the quota.
    pub fn admit(&self, bytes: usize) -> Result<Admission> {
        match self {
            Caller::Anyone => Ok(Admission(None)),
            Caller::Tenant(t) => t.admit(bytes),
        }
    }

    /// Starts accounting an inference request with `model` to the caller's tenant (nothing
    /// without tenants); [`Tracked::finish`] records how it ended.
    pub fn track(&self, model: &str) -> Tracked {
        let (tenant, model) = match self {
            // Nothing to account, and nothing to allocate on the request path.
            Caller::Anyone => (None, String::new()),
            Caller::Tenant(t) => (Some(t.clone()), model.to_owned()),
        };
        Tracked {
            tenant,
            model,
            started: Instant::now(),
        }
    }

    /// Refuses the request while the tenant's requests to `model` are held back after failing
    /// in a row (503 / UNAVAILABLE, saying for how long and why).
    pub fn check_backoff(&self, model: &str) -> Result<()> {
        let Caller::Tenant(t) = self else {
            return Ok(());
        };
        let backoffs = t
            .live
            .backoffs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(b) = backoffs.get(model) else {
            return Ok(());
        };
        match b.until {
            Some(until) if until > Instant::now() => Err(Error::unavailable(format!(
                "tenant '{}': its last {} requests to model '{model}' failed in the model (last: \
                 {}); its requests to it are held back for {} ms more",
                t.name,
                b.failures,
                b.last_error,
                until.saturating_duration_since(Instant::now()).as_millis()
            ))),
            _ => Ok(()),
        }
    }

    /// Records how a request to `model` ended for the backoff: a failure in the model itself
    /// ([`Code::Internal`]: a trap, a deadline, a memory cap) counts, a success ends the run,
    /// anything else (bad input, a full queue) changes nothing.
    pub fn record_outcome(&self, model: &str, outcome: std::result::Result<(), &Error>) {
        let Caller::Tenant(t) = self else {
            return;
        };
        let mut backoffs = t
            .live
            .backoffs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(()) => {
                backoffs.remove(model);
            }
            Err(e) if e.code == Code::Internal => {
                let after = t
                    .limits
                    .backoff_after_failures
                    .unwrap_or(BACKOFF_AFTER_FAILURES);
                let first = t
                    .limits
                    .backoff_ms
                    .map_or(BACKOFF_FIRST, Duration::from_millis);
                let b = backoffs.entry(model.to_owned()).or_default();
                b.failures = b.failures.saturating_add(1);
                b.last_error = abbreviate_message(&e.message);
                if b.failures >= after {
                    let doublings = (b.failures - after).min(5);
                    let hold = first
                        .saturating_mul(1 << doublings)
                        .min(BACKOFF_MAX.max(first));
                    b.until = Some(Instant::now() + hold);
                }
            }
            Err(_) => {}
        }
    }

    /// Refuses callers that are not administrators (`what` names the API).
    pub fn require_admin(&self, what: &str) -> Result<()> {
        match self {
            Caller::Tenant(t) if !t.admin => Err(Error::permission_denied(format!(
                "tenant '{}' may not use {what}: it is for administrators",
                t.name
            ))),
            _ => Ok(()),
        }
    }
}

/// The tenants of a server and their keys, replaced as a whole when the config file is
/// reloaded (SIGHUP): requests already admitted finish under the tenants they started with.
#[derive(Debug, Default)]
pub struct Tenancy {
    current: RwLock<Arc<TenantSet>>,
}

/// One reading of the config file.
#[derive(Debug, Default)]
struct TenantSet {
    /// Key digest (lower-case hex) → tenant.
    keys: HashMap<String, Arc<Tenant>>,
    /// Every tenant, in the file's order.
    tenants: Vec<Arc<Tenant>>,
}

/// What a reload changed, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// Tenants in the file now.
    pub tenants: usize,
    /// Keys valid now.
    pub keys: usize,
    /// Keys valid before that are not any more.
    pub revoked_keys: usize,
}

/// One tenant's figures for the metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantUsage {
    /// The tenant.
    pub tenant: String,
    /// Inference requests it has in the server now.
    pub in_flight: usize,
    /// Per model (empty: names it may not use or that do not exist).
    pub models: BTreeMap<String, ModelUsage>,
}

/// The digest line stored in the config file for `key`.
pub fn hash_key(key: &str) -> String {
    format!("{SHA256}{}", hex(&Sha256::digest(key.as_bytes())))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Tenancy {
    /// Reads the server config file.
    pub fn load(path: &Path) -> std::result::Result<Self, TenancyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TenancyError::Io {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text, &shown)
    }

    /// Parses the text of a server config file; `path` is only used in messages.
    pub fn parse(text: &str, path: &str) -> std::result::Result<Self, TenancyError> {
        let set = TenantSet::parse(text, path, &TenantSet::default())?;
        Ok(Self {
            current: RwLock::new(Arc::new(set)),
        })
    }

    /// Reads the config file again and puts it in force: new keys work and removed keys are
    /// refused from the next request on. Tenants that keep their name keep their counters
    /// (in-flight requests, rate bucket, metrics). A file with an error changes nothing.
    pub fn reload(&self, path: &Path) -> std::result::Result<Reloaded, TenancyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TenancyError::Io {
            path: shown.clone(),
            source,
        })?;
        self.reload_text(&text, &shown)
    }

    /// [`Tenancy::reload`] from text; `path` is only used in messages.
    pub fn reload_text(
        &self,
        text: &str,
        path: &str,
    ) -> std::result::Result<Reloaded, TenancyError> {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let set = TenantSet::parse(text, path, &current)?;
        let revoked_keys = current
            .keys
            .keys()
            .filter(|k| !set.keys.contains_key(*k))
            .count();
        let report = Reloaded {
            tenants: set.tenants.len(),
            keys: set.keys.len(),
            revoked_keys,
        };
        *current = Arc::new(set);
        Ok(report)
    }

    fn set(&self) -> Arc<TenantSet> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl TenantSet {
    /// Parses a config file; tenants named as in `previous` keep its counters.
    fn parse(
        text: &str,
        path: &str,
        previous: &TenantSet,
    ) -> std::result::Result<Self, TenancyError> {
        let file: File = toml::from_str(text).map_err(|e| TenancyError::Syntax {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let invalid = |message: String| TenancyError::Invalid {
            path: path.to_owned(),
            message,
        };
        if file.tenant.is_empty() {
            return Err(invalid(
                "no [[tenant]]: a config file with no tenants would refuse every request"
                    .to_owned(),
            ));
        }
        let mut keys: HashMap<String, Arc<Tenant>> = HashMap::new();
        let mut tenants = Vec::new();
        let mut names = Vec::new();
        for (i, entry) in file.tenant.into_iter().enumerate() {
            let field = |f: &str| format!("tenant[{i}] ('{}').{f}", entry.name);
            if entry.name.is_empty() {
                return Err(invalid(format!("tenant[{i}].name: must not be empty")));
            }
            if names.contains(&entry.name) {
                return Err(invalid(format!(
                    "{}: another tenant has this name",
                    field("name")
                )));
            }
            names.push(entry.name.clone());
            if entry.api_keys.is_empty() {
                return Err(invalid(format!(
                    "{}: give at least one key digest (wasmtron hash-key KEY prints one)",
                    field("api_keys")
                )));
            }
            let patterns =
                |list: Vec<String>, f: &str| ModelPatterns::new(list, &field(f)).map_err(&invalid);
            let q = &entry.quotas;
            let positive = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v > 0.0);
            if !positive(q.requests_per_second) || !positive(q.burst) {
                return Err(invalid(format!(
                    "{}: requests_per_second and burst must be positive numbers",
                    field("quotas")
                )));
            }
            if !positive(entry.weight) {
                return Err(invalid(format!(
                    "{}: must be a positive number",
                    field("weight")
                )));
            }
            if entry.wasm.execution_timeout_ms == Some(0) || entry.wasm.memory_limit_mb == Some(0) {
                return Err(invalid(format!(
                    "{}: limits must be positive; leave one out for the server's default",
                    field("wasm")
                )));
            }
            if q.max_concurrent_requests == Some(0)
                || q.max_request_bytes == Some(0)
                || q.max_queued_requests == Some(0)
                || q.backoff_after_failures == Some(0)
                || q.backoff_ms == Some(0)
            {
                return Err(invalid(format!(
                    "{}: a limit of 0 would refuse every request; leave it out for no limit",
                    field("quotas")
                )));
            }
            let burst = q.burst.or(q.requests_per_second).unwrap_or(1.0).max(1.0);
            let live = match previous.tenants.iter().find(|t| t.name == entry.name) {
                Some(old) => old.live.clone(),
                None => Arc::new(Live {
                    in_flight: AtomicUsize::new(0),
                    bucket: Mutex::new(Bucket {
                        tokens: burst,
                        refilled: Instant::now(),
                    }),
                    usage: Mutex::new(BTreeMap::new()),
                    backoffs: Mutex::new(HashMap::new()),
                }),
            };
            let tenant = Arc::new(Tenant {
                name: entry.name.clone(),
                admin: entry.admin,
                infer: patterns(entry.infer, "infer")?,
                see: patterns(entry.see, "see")?,
                load: patterns(entry.load, "load")?,
                limits: entry.quotas.clone(),
                wasm: entry.wasm,
                weight: entry.weight.unwrap_or(1.0),
                live,
            });
            tenants.push(tenant.clone());
            for key in entry.api_keys {
                let digest = key
                    .strip_prefix(SHA256)
                    .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
                    .ok_or_else(|| {
                        invalid(format!(
                            "{}: \"{}\" is not a key digest \"sha256:<64 hex digits>\"; store \
                             keys hashed (wasmtron hash-key KEY prints the line)",
                            field("api_keys"),
                            abbreviate(&key)
                        ))
                    })?
                    .to_ascii_lowercase();
                if let Some(other) = keys.insert(digest, tenant.clone()) {
                    return Err(invalid(format!(
                        "{}: a key is listed for tenant '{}' too",
                        field("api_keys"),
                        other.name
                    )));
                }
            }
        }
        Ok(Self { keys, tenants })
    }
}

impl Tenancy {
    /// The `[tenant.wasm]` limits that apply to the stage `model`: those of every tenant whose
    /// `load` patterns cover it (administrators' blanket permission does not count).
    pub fn stage_limits(&self, model: &str) -> Vec<(String, WasmLimits)> {
        self.set()
            .tenants
            .iter()
            .filter(|t| t.wasm != WasmLimits::default() && t.load.matches(model))
            .map(|t| (t.name.clone(), t.wasm))
            .collect()
    }

    /// Every tenant's figures, for the metrics.
    pub fn usage(&self) -> Vec<TenantUsage> {
        self.set()
            .tenants
            .iter()
            .map(|t| TenantUsage {
                tenant: t.name.clone(),
                in_flight: t.live.in_flight.load(Ordering::Acquire),
                models: t
                    .live
                    .usage
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
            })
            .collect()
    }

    /// The caller an `Authorization` header value (`Bearer <key>`) belongs to.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Caller> {
        let Some(value) = authorization else {
            return Err(Error::unauthenticated(
                "this server requires an API key: send the header 'Authorization: Bearer <key>'",
            ));
        };
        let key = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                Error::unauthenticated(
                    "the Authorization header must read 'Bearer <key>' (an API key)",
                )
            })?;
        let digest = hex(&Sha256::digest(key.as_bytes()));
        self.set()
            .keys
            .get(&digest)
            .map(|t| Caller::Tenant(t.clone()))
            .ok_or_else(|| Error::unauthenticated("the API key is not valid (unknown or revoked)"))
    }
}

/// An error message short enough to quote in another.
fn abbreviate_message(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// A config value in a message without printing a whole secret.
fn abbreviate(s: &str) -> String {
    match s.char_indices().nth(12) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> String {
        format!(
            r#"
            [[tenant]]
            name = "alpha"
            api_keys = ["{}"]
            infer = ["alpha_*", "shared"]
            see = ["catalog"]

            [[tenant]]
            name = "ops"
            api_keys = ["{}", "{}"]
            admin = true
            "#,
            hash_key("alpha-key"),
            hash_key("ops-key"),
            hash_key("ops-key-2")
                .to_uppercase()
                .replace("SHA256:", "sha256:"),
        )
    }

    #[test]
    fn keys_name_their_tenant_and_permissions_follow_patterns() {
        let t = Tenancy::parse(&config(), "w.toml").unwrap();
        let alpha = t.authenticate(Some("Bearer alpha-key")).unwrap();
        assert_eq!(alpha.tenant(), Some("alpha"));
        assert!(alpha.may(ModelAction::Infer, "alpha_one"));
        assert!(alpha.may(ModelAction::Infer, "shared"));
        assert!(!alpha.may(ModelAction::Infer, "shared_other"));
        assert!(!alpha.may(ModelAction::Infer, "catalog"));
        assert!(alpha.may(ModelAction::See, "catalog") && alpha.may(ModelAction::See, "alpha_x"));
        assert!(!alpha.may(ModelAction::Load, "alpha_one"));
        let e = alpha.require(ModelAction::Infer, "beta").unwrap_err();
        assert_eq!(e.code, Code::PermissionDenied);
        assert_eq!(e.message, "tenant 'alpha' may not infer with model 'beta'");
        assert!(alpha.require_admin("the logging API").is_err());
        let ops = t.authenticate(Some("Bearer ops-key-2")).unwrap();
        assert!(ops.may(ModelAction::Load, "anything") && ops.require_admin("x").is_ok());
        assert!(Caller::Anyone.may(ModelAction::Load, "x"));
    }

    #[test]
    fn quotas_trip_at_their_numbers() {
        let text = format!(
            "[[tenant]]\nname = \"q\"\napi_keys = [\"{}\"]\n[tenant.quotas]\n\
             max_concurrent_requests = 2\nrequests_per_second = 0.001\nburst = 3\n\
             max_request_bytes = 100\n",
            hash_key("k")
        );
        let t = Tenancy::parse(&text, "w.toml").unwrap();
        let q = t.authenticate(Some("Bearer k")).unwrap();
        let e = q.admit(101).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(
            e.message.contains("quotas.max_request_bytes = 100"),
            "{}",
            e.message
        );
        let first = q.admit(100).unwrap();
        let second = q.admit(1).unwrap();
        let e = q.admit(1).unwrap_err();
        assert!(e.message.contains("2 concurrent requests"), "{}", e.message);
        drop(first);
        // A slot is free again, and the bucket holds its third and last token.
        let third = q.admit(1).unwrap();
        drop((second, third));
        let e = q.admit(1).unwrap_err();
        assert!(e.message.contains("requests per second"), "{}", e.message);
        assert!(Caller::Anyone.admit(usize::MAX).is_ok());
    }

    #[test]
    fn requests_are_accounted_per_tenant_and_model() {
        let t = Tenancy::parse(&config(), "w.toml").unwrap();
        let alpha = t.authenticate(Some("Bearer alpha-key")).unwrap();
        alpha.track("alpha_one").finish(Ok(()));
        alpha
            .track("alpha_one")
            .finish(Err(Code::ResourceExhausted));
        alpha.track("secret").finish(Err(Code::PermissionDenied));
        drop(alpha.track("alpha_one"));
        Caller::Anyone.track("x").finish(Ok(()));
        let usage = t.usage();
        let a = usage.iter().find(|u| u.tenant == "alpha").unwrap();
        let one = &a.models["alpha_one"];
        assert_eq!(one.success, 1);
        assert_eq!(one.failures["QUOTA"], 1);
        assert_eq!(one.failures["CANCELED"], 1);
        assert_eq!(a.models[""].failures["PERMISSION_DENIED"], 1);
        assert!(!a.models.contains_key("secret"));
        assert!(usage
            .iter()
            .find(|u| u.tenant == "ops")
            .unwrap()
            .models
            .is_empty());
    }

    #[test]
    fn a_reload_revokes_removed_keys_and_keeps_counters_of_kept_tenants() {
        let t = Tenancy::parse(&config(), "w.toml").unwrap();
        let alpha = t.authenticate(Some("Bearer alpha-key")).unwrap();
        let admitted = alpha.admit(1).unwrap();
        alpha.track("alpha_one").finish(Ok(()));

        // alpha's key is rotated, ops loses its second key; a broken file changes nothing.
        let next = config()
            .replace(&hash_key("alpha-key"), &hash_key("alpha-key-2"))
            .replace(", \"sha256:", "]\n#\"sha256:");
        assert!(t.reload_text("[[tenant]]\nname = 3", "w.toml").is_err());
        assert!(t.authenticate(Some("Bearer alpha-key")).is_ok());
        let report = t.reload_text(&next, "w.toml").unwrap();
        assert_eq!(
            report,
            Reloaded {
                tenants: 2,
                keys: 2,
                revoked_keys: 2
            }
        );
        let e = t.authenticate(Some("Bearer alpha-key")).unwrap_err();
        assert_eq!(e.code, Code::Unauthenticated);
        assert!(e.message.contains("revoked"));
        assert!(t.authenticate(Some("Bearer ops-key-2")).is_err());
        assert!(t.authenticate(Some("Bearer ops-key")).is_ok());
        let alpha = t.authenticate(Some("Bearer alpha-key-2")).unwrap();
        assert_eq!(alpha.tenant(), Some("alpha"));
        // The request admitted before the reload still counts, and so do the figures.
        let usage = t.usage();
        assert_eq!(usage[0].in_flight, 1);
        assert_eq!(usage[0].models["alpha_one"].success, 1);
        drop(admitted);
        assert_eq!(t.usage()[0].in_flight, 0);
    }

    #[test]
    fn a_tenant_whose_requests_keep_failing_in_a_model_is_held_back() {
        let t = Tenancy::parse(&config(), "w.toml").unwrap();
        let alpha = t.authenticate(Some("Bearer alpha-key")).unwrap();
        let ops = t.authenticate(Some("Bearer ops-key")).unwrap();
        let trap = Error::internal("stage 'alpha_x' trapped: unreachable");
        for _ in 0..BACKOFF_AFTER_FAILURES - 1 {
            alpha.record_outcome("alpha_x", Err(&trap));
            // Bad input is the client's fault, not the model's: it does not count.
            alpha.record_outcome("alpha_x", Err(&Error::invalid("bad shape")));
        }
        assert!(alpha.check_backoff("alpha_x").is_ok());
        alpha.record_outcome("alpha_x", Err(&trap));
        let e = alpha.check_backoff("alpha_x").unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(
            e.message
                .contains("last 5 requests to model 'alpha_x' failed")
                && e.message.contains("trapped: unreachable")
                && e.message.contains("held back"),
            "{}",
            e.message
        );
        // Other models of the tenant, and other tenants on the same model, go on.
        assert!(alpha.check_backoff("alpha_y").is_ok());
        assert!(ops.check_backoff("alpha_x").is_ok());
        assert!(Caller::Anyone.check_backoff("alpha_x").is_ok());
        // A success ends the run.
        alpha.record_outcome("alpha_x", Ok(()));
        assert!(alpha.check_backoff("alpha_x").is_ok());
    }

    #[test]
    fn missing_malformed_and_unknown_keys_are_unauthenticated() {
        let t = Tenancy::parse(&config(), "w.toml").unwrap();
        for header in [
            None,
            Some("alpha-key"),
            Some("Bearer nope"),
            Some("Basic abc"),
        ] {
            let e = t.authenticate(header).unwrap_err();
            assert_eq!(e.code, Code::Unauthenticated, "{header:?}");
        }
    }

    #[test]
    fn config_errors_name_the_tenant_and_field() {
        let cases = [
            ("", "no [[tenant]]"),
            ("[[tenant]]\nname = \"a\"\napi_keys = [\"secret\"]", "tenant[0] ('a').api_keys: \"secret\" is not a key digest"),
            ("[[tenant]]\nname = \"a\"\napi_keys = []", "tenant[0] ('a').api_keys: give at least one"),
            (
                &format!("[[tenant]]\nname = \"a\"\napi_keys = [\"{}\"]\ninfer = [\"a*b\"]", hash_key("k")),
                "tenant[0] ('a').infer: \"a*b\" is not a model name",
            ),
            (
                &format!(
                    "[[tenant]]\nname = \"a\"\napi_keys = [\"{k}\"]\n[[tenant]]\nname = \"b\"\napi_keys = [\"{k}\"]",
                    k = hash_key("k")
                ),
                "tenant[1] ('b').api_keys: a key is listed for tenant 'a' too",
            ),
            ("[[tenant]]\nname = \"a\"\napi_keys = []\ncolour = 1", "unknown field `colour`"),
            (
                &format!("[[tenant]]\nname = \"a\"\napi_keys = [\"{}\"]\n[tenant.quotas]\nburst = -1", hash_key("k")),
                "tenant[0] ('a').quotas: requests_per_second and burst must be positive",
            ),
        ];
        for (text, want) in cases {
            let e = Tenancy::parse(text, "w.toml").unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
