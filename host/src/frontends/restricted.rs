//! Triton's endpoint restriction (`--http-restricted-api` / `--grpc-restricted-protocol`):
//! groups of APIs that answer only requests carrying a shared-secret header. A lighter
//! alternative to tenants (or a second lock on top of them), e.g. for repository control.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// The API groups Triton names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiGroup {
    /// Server liveness and readiness, model readiness.
    Health,
    /// Server and model metadata.
    Metadata,
    /// Inference and generate.
    Inference,
    /// System and CUDA shared memory.
    SharedMemory,
    /// Model configuration.
    ModelConfig,
    /// Repository index, load and unload.
    ModelRepository,
    /// Statistics.
    Statistics,
    /// Trace settings.
    Trace,
    /// Log settings.
    Logging,
}

const GROUPS: [(&str, ApiGroup); 9] = [
    ("health", ApiGroup::Health),
    ("metadata", ApiGroup::Metadata),
    ("inference", ApiGroup::Inference),
    ("shared-memory", ApiGroup::SharedMemory),
    ("model-config", ApiGroup::ModelConfig),
    ("model-repository", ApiGroup::ModelRepository),
    ("statistics", ApiGroup::Statistics),
    ("trace", ApiGroup::Trace),
    ("logging", ApiGroup::Logging),
];

impl ApiGroup {
    /// The group an HTTP path belongs to; `None` for paths that are no API. The OpenAI routes
    /// (`/v1/...`) belong to groups too: `/v1/models` is metadata, the rest is inference.
    pub fn of_http_path(path: &str) -> Option<Self> {
        if let Some(v1) = path.strip_prefix("/v1/") {
            return Some(if v1 == "models" || v1.starts_with("models/") {
                ApiGroup::Metadata
            } else {
                ApiGroup::Inference
            });
        }
        let rest = path.strip_prefix("/v2")?;
        if rest.is_empty() || rest == "/" {
            return Some(ApiGroup::Metadata);
        }
        let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
        Some(match parts.as_slice() {
            ["health", ..] => ApiGroup::Health,
            ["repository", ..] => ApiGroup::ModelRepository,
            ["systemsharedmemory", ..] | ["cudasharedmemory", ..] => ApiGroup::SharedMemory,
            ["trace", ..] => ApiGroup::Trace,
            ["logging", ..] => ApiGroup::Logging,
            ["models", "stats"] => ApiGroup::Statistics,
            ["models", _] | ["models", _, "versions", _] => ApiGroup::Metadata,
            ["models", ..] => match parts.last().copied() {
                Some("ready") => ApiGroup::Health,
                Some("infer" | "generate" | "generate_stream") => ApiGroup::Inference,
                Some("config") => ApiGroup::ModelConfig,
                Some("stats" | "kv_cache") => ApiGroup::Statistics,
                Some("setting") => ApiGroup::Trace,
                _ => ApiGroup::Metadata,
            },
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        GROUPS
            .iter()
            .find(|(_, g)| *g == self)
            .map_or("", |(n, _)| n)
    }
}

/// The restricted groups and the header each needs.
#[derive(Debug, Clone, Default)]
pub struct Restrictions {
    /// Group → (header name, lower case; value).
    groups: HashMap<ApiGroup, (String, String)>,
}

impl Restrictions {
    /// Parses flag values `<api>,<api>,...:<key>=<value>`; `flag` names the option in errors,
    /// `header_prefix` is prepended to the key to form the header.
    pub fn parse(
        values: &[String],
        flag: &str,
        header_prefix: &str,
    ) -> std::result::Result<Self, String> {
        let mut groups = HashMap::new();
        for value in values {
            let (apis, secret) = value
                .rsplit_once(':')
                .and_then(|(apis, kv)| Some((apis, kv.split_once('=')?)))
                .filter(|(apis, (k, v))| !apis.is_empty() && !k.is_empty() && !v.is_empty())
                .ok_or_else(|| {
                    format!("{flag}: '{value}' must read <api>,<api>,...:<header>=<value>")
                })?;
            for api in apis.split(',').map(str::trim) {
                let group = GROUPS
                    .iter()
                    .find(|(n, _)| *n == api)
                    .map(|(_, g)| *g)
                    .ok_or_else(|| {
                        let known: Vec<&str> = GROUPS.iter().map(|(n, _)| *n).collect();
                        format!(
                            "{flag}: unknown API '{api}'; the APIs are {}",
                            known.join(", ")
                        )
                    })?;
                let key = format!("{header_prefix}{}", secret.0.to_ascii_lowercase());
                if groups.insert(group, (key, secret.1.to_owned())).is_some() {
                    return Err(format!(
                        "{flag}: API '{api}' can not be specified in multiple config groups"
                    ));
                }
            }
        }
        Ok(Self { groups })
    }

    /// Whether nothing is restricted.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Refuses a request to `group` unless `header` (a header lookup by lower-case name)
    /// gives the group's value.
    pub fn check<'a>(
        &self,
        group: ApiGroup,
        header: impl FnOnce(&str) -> Option<&'a str>,
    ) -> Result<()> {
        let Some((key, value)) = self.groups.get(&group) else {
            return Ok(());
        };
        if header(key) == Some(value.as_str()) {
            return Ok(());
        }
        Err(Error::permission_denied(format!(
            "the {} API is restricted: it needs the header '{key}' with the configured value",
            group.name()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_parse_and_are_checked() {
        let r = Restrictions::parse(
            &["model-repository,statistics:Admin-Key=s3cret".into()],
            "--http-restricted-api",
            "",
        )
        .unwrap();
        assert!(r.check(ApiGroup::Inference, |_| None).is_ok());
        let e = r.check(ApiGroup::ModelRepository, |_| None).unwrap_err();
        assert!(e.message.contains("model-repository API is restricted"));
        assert!(e.message.contains("'admin-key'"));
        assert!(r
            .check(ApiGroup::Statistics, |h| (h == "admin-key")
                .then_some("s3cret"))
            .is_ok());
        assert!(r.check(ApiGroup::Statistics, |_| Some("wrong")).is_err());

        let grpc = Restrictions::parse(
            &["inference:k=v".into()],
            "--grpc-restricted-protocol",
            "triton-grpc-protocol-",
        )
        .unwrap();
        let e = grpc.check(ApiGroup::Inference, |_| None).unwrap_err();
        assert!(e.message.contains("'triton-grpc-protocol-k'"));
    }

    #[test]
    fn bad_flag_values_are_refused_by_name() {
        let parse = |v: &str| Restrictions::parse(&[v.into()], "--http-restricted-api", "");
        assert!(parse("model-repository").unwrap_err().contains("must read"));
        assert!(parse("bogus:k=v")
            .unwrap_err()
            .contains("unknown API 'bogus'"));
        let twice = Restrictions::parse(
            &["health:a=1".into(), "metadata,health:b=2".into()],
            "--http-restricted-api",
            "",
        )
        .unwrap_err();
        assert!(twice.contains("API 'health' can not be specified in multiple config groups"));
    }

    #[test]
    fn http_paths_map_to_groups() {
        let g = ApiGroup::of_http_path;
        assert_eq!(g("/v2/health/ready"), Some(ApiGroup::Health));
        assert_eq!(g("/v2/models/m/versions/1/ready"), Some(ApiGroup::Health));
        assert_eq!(g("/v2"), Some(ApiGroup::Metadata));
        assert_eq!(g("/v2/models/m"), Some(ApiGroup::Metadata));
        assert_eq!(g("/v2/models/config"), Some(ApiGroup::Metadata));
        assert_eq!(g("/v2/models/ready/versions/1"), Some(ApiGroup::Metadata));
        assert_eq!(g("/v2/models/m/infer"), Some(ApiGroup::Inference));
        assert_eq!(g("/v2/models/m/generate_stream"), Some(ApiGroup::Inference));
        assert_eq!(g("/v2/models/m/config"), Some(ApiGroup::ModelConfig));
        assert_eq!(g("/v2/models/stats"), Some(ApiGroup::Statistics));
        assert_eq!(
            g("/v2/models/m/versions/2/stats"),
            Some(ApiGroup::Statistics)
        );
        assert_eq!(
            g("/v2/repository/models/m/load"),
            Some(ApiGroup::ModelRepository)
        );
        assert_eq!(
            g("/v2/cudasharedmemory/status"),
            Some(ApiGroup::SharedMemory)
        );
        assert_eq!(g("/v2/models/m/trace/setting"), Some(ApiGroup::Trace));
        assert_eq!(g("/v2/logging"), Some(ApiGroup::Logging));
        assert_eq!(g("/metrics"), None);
        assert_eq!(g("/v1/chat/completions"), Some(ApiGroup::Inference));
        assert_eq!(g("/v1/completions"), Some(ApiGroup::Inference));
        assert_eq!(g("/v1/models"), Some(ApiGroup::Metadata));
        assert_eq!(g("/v1/models/smollm2"), Some(ApiGroup::Metadata));
    }
}
