//! The server config file: parsing, checking and reloading the tenants, and API keys as
//! SHA-256 digests.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::{atomic::AtomicUsize, Arc, Mutex, PoisonError, RwLock},
    time::Instant,
};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::*;

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
    pub(super) tenant: Vec<TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    pub(super) name: String,
    pub(super) api_keys: Vec<String>,
    #[serde(default)]
    pub(super) admin: bool,
    #[serde(default)]
    pub(super) infer: Vec<String>,
    #[serde(default)]
    pub(super) see: Vec<String>,
    #[serde(default)]
    pub(super) load: Vec<String>,
    #[serde(default)]
    pub(super) quotas: QuotaLimits,
    #[serde(default)]
    pub(super) wasm: WasmLimits,
    /// Its share of a busy model against other tenants' (default 1).
    pub(super) weight: Option<f64>,
}

/// The digest line stored in the config file for `key`.
pub fn hash_key(key: &str) -> String {
    format!("{SHA256}{}", hex(&Sha256::digest(key.as_bytes())))
}

pub(super) fn hex(bytes: &[u8]) -> String {
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

    pub(super) fn set(&self) -> Arc<TenantSet> {
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
            let activity = match previous.tenants.iter().find(|t| t.name == entry.name) {
                Some(old) => old.activity.clone(),
                None => Arc::new(Activity {
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
                activity,
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

/// An error message short enough to quote in another.
pub(super) fn abbreviate_message(s: &str) -> String {
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
