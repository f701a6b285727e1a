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
//! [[tenant]]
//! name = "ops"
//! api_keys = ["sha256:…"]
//! admin = true                      # everything, including log and trace settings
//! ```
//!
//! A tenant sees the models it may infer with or load, and those of `see`. Keys are stored
//! only as SHA-256 digests: the file can be read without revealing a key.

use std::{collections::HashMap, path::Path, sync::Arc};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Its name (in error messages, logs and metrics).
    pub name: String,
    /// May do everything.
    pub admin: bool,
    infer: ModelPatterns,
    see: ModelPatterns,
    load: ModelPatterns,
}

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The server runs without tenants: everyone may do everything.
    Anyone,
    /// An authenticated tenant.
    Tenant(Arc<Tenant>),
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

/// The tenants of a server and their keys.
#[derive(Debug, Default)]
pub struct Tenancy {
    /// Key digest (lower-case hex) → tenant.
    keys: HashMap<String, Arc<Tenant>>,
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
            let tenant = Arc::new(Tenant {
                name: entry.name.clone(),
                admin: entry.admin,
                infer: patterns(entry.infer, "infer")?,
                see: patterns(entry.see, "see")?,
                load: patterns(entry.load, "load")?,
            });
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
        Ok(Self { keys })
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
        self.keys
            .get(&digest)
            .map(|t| Caller::Tenant(t.clone()))
            .ok_or_else(|| Error::unauthenticated("the API key is not valid (unknown or revoked)"))
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
    use crate::error::Code;

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
        ];
        for (text, want) in cases {
            let e = Tenancy::parse(text, "w.toml").unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
