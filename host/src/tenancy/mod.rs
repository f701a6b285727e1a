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
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError, RwLock,
    },
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

use crate::error::{Code, Error, Result};

mod backoff;
mod file;
mod patterns;
mod quotas;
mod usage;

use backoff::Backoff;
pub use backoff::{BACKOFF_AFTER_FAILURES, BACKOFF_FIRST, BACKOFF_MAX};
use file::{abbreviate_message, hex};
pub use file::{hash_key, TenancyError};
pub use patterns::ModelPatterns;
use quotas::Bucket;
pub use quotas::{Admission, QuotaLimits, WasmLimits};
pub use usage::{ModelUsage, TenantUsage, Tracked};

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
    activity: Arc<Activity>,
}

/// What a tenant is using and has used: in-flight requests, its rate bucket, its figures,
/// and the models its requests keep failing in.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    bucket: Mutex<Bucket>,
    usage: Mutex<BTreeMap<String, ModelUsage>>,
    backoffs: Mutex<HashMap<String, Backoff>>,
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
            Caller::Anyone => Ok(Admission::none()),
            Caller::Tenant(t) => t.admit(bytes),
        }
    }

    /// The largest request body the caller may send: its tenant's `max_request_bytes`, if it
    /// has one. Frontends read bodies up to this (and refuse a larger `Content-Length` before
    /// reading anything).
    pub fn max_request_bytes(&self) -> Option<usize> {
        match self {
            Caller::Anyone => None,
            Caller::Tenant(t) => t.limits.max_request_bytes,
        }
    }

    /// The refusal of a request of `bytes` over [`Caller::max_request_bytes`].
    pub fn request_too_large(&self, bytes: usize) -> Option<Error> {
        let max = self.max_request_bytes()?;
        (bytes > max).then(|| {
            Error::resource_exhausted(format!(
                "the request of {bytes} bytes is larger than tenant '{}' may send \
                 (quotas.max_request_bytes = {max})",
                self.tenant().unwrap_or_default()
            ))
        })
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
            .activity
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
            .activity
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
                in_flight: t.activity.in_flight.load(Ordering::Acquire),
                models: t
                    .activity
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
