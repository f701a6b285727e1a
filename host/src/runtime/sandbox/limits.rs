//! The limits every guest runs under, Wasm stage or Python model: memory, fuel-free CPU time
//! through epochs (the deadline), table size, read from the model's `parameters` with safe
//! defaults and bounded by its tenant; and the memory limiter that enforces them and remembers
//! when it refused growth.

use wasmtime::ResourceLimiter;

use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    tenancy::WasmLimits,
};

/// Per-model sandbox settings (`parameters` in config.pbtxt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxLimits {
    /// `execution_timeout_ms`: wall-clock deadline of one `init` or `execute` call.
    pub execution_timeout_ms: u64,
    /// `memory_limit_mb`: the most linear memory an instance may grow to.
    pub memory_limit_mb: u64,
    /// `max_output_mb`: the most output bytes one request may return.
    pub max_output_mb: u64,
    /// `stderr_limit_kb`: how much of the stage's stdout/stderr is kept for error messages.
    pub stderr_limit_kb: u64,
    /// `max_consecutive_failures`: crashes in a row after which the model reports not ready.
    pub max_consecutive_failures: u64,
    /// `fresh_instance_per_request`: discard the instance after every request, so that no
    /// state can leak from one request to the next (costs one instantiation and `init`).
    pub fresh_instance_per_request: bool,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            execution_timeout_ms: 10_000,
            memory_limit_mb: 512,
            max_output_mb: 64,
            stderr_limit_kb: 16,
            max_consecutive_failures: 5,
            fresh_instance_per_request: false,
        }
    }
}

impl SandboxLimits {
    /// [`Self::from_config_within`] the limits of the tenants (`None`: no tenants), and
    /// whether any tenant bounds the model.
    pub fn for_model(
        config: &ModelConfig,
        tenancy: Option<&crate::tenancy::Tenancy>,
    ) -> Result<(Self, bool)> {
        let tenants = tenancy
            .map(|t| t.stage_limits(&config.name))
            .unwrap_or_default();
        Ok((
            Self::from_config_within(config, &tenants)?,
            !tenants.is_empty(),
        ))
    }

    /// Reads the limits from the configuration's parameters, within the `[tenant.wasm]`
    /// limits of the tenants that may load the model: theirs (the lowest) where the
    /// configuration says nothing, and an error naming the tenant where it asks for more.
    pub fn from_config_within(
        config: &ModelConfig,
        tenants: &[(String, WasmLimits)],
    ) -> Result<Self> {
        let mut limits = Self::from_config(config)?;
        // The lowest of one limit over the tenants that set it, with the tenant.
        let lowest = |get: fn(&WasmLimits) -> Option<u64>| {
            tenants
                .iter()
                .filter_map(|(t, w)| Some((t, get(w)?)))
                .min_by_key(|(_, v)| *v)
        };
        for (key, slot, cap) in [
            (
                "execution_timeout_ms",
                &mut limits.execution_timeout_ms,
                lowest(|w| w.execution_timeout_ms),
            ),
            (
                "memory_limit_mb",
                &mut limits.memory_limit_mb,
                lowest(|w| w.memory_limit_mb),
            ),
        ] {
            let Some((tenant, cap)) = cap else {
                continue;
            };
            if !config.parameters.contains_key(key) {
                *slot = cap;
            } else if *slot > cap {
                return Err(Error::invalid(format!(
                    "model '{}': parameter '{key}' is {} but tenant '{tenant}', which may load \
                     it, allows at most {cap} (wasm.{key} in the server config file)",
                    config.name, *slot
                )));
            }
        }
        Ok(limits)
    }

    /// Reads the limits from the configuration's parameters.
    pub fn from_config(config: &ModelConfig) -> Result<Self> {
        let mut limits = Self::default();
        for (key, slot) in [
            ("execution_timeout_ms", &mut limits.execution_timeout_ms),
            ("memory_limit_mb", &mut limits.memory_limit_mb),
            ("max_output_mb", &mut limits.max_output_mb),
            ("stderr_limit_kb", &mut limits.stderr_limit_kb),
            (
                "max_consecutive_failures",
                &mut limits.max_consecutive_failures,
            ),
        ] {
            if let Some(p) = config.parameters.get(key) {
                *slot = p
                    .string_value
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|v| *v > 0)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "model '{}': parameter '{key}' must be a positive integer, got \"{}\"",
                            config.name, p.string_value
                        ))
                    })?;
            }
        }
        if let Some(p) = config.parameters.get("fresh_instance_per_request") {
            limits.fresh_instance_per_request = match p.string_value.trim() {
                "true" => true,
                "false" => false,
                other => {
                    return Err(Error::invalid(format!(
                        "model '{}': parameter 'fresh_instance_per_request' must be \"true\" or \"false\", got \"{other}\"",
                        config.name
                    )))
                }
            };
        }
        Ok(limits)
    }

    /// Memory cap in bytes.
    pub fn memory_bytes(&self) -> usize {
        usize::try_from(self.memory_limit_mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }
}

/// Caps linear memory and table growth; records a refusal so the error can say why the stage
/// died.
pub struct MemoryCap {
    max_bytes: usize,
    /// Set when a growth request was refused.
    pub exceeded: bool,
    /// Bytes of linear memory the instance has grown to.
    linear_bytes: usize,
    /// Bytes of the arrays the stage holds on the host (`wasmtron:stage/ops`).
    pub held_bytes: usize,
}

impl MemoryCap {
    /// A cap of `max_bytes` for linear memory and held arrays together.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            exceeded: false,
            linear_bytes: 0,
            held_bytes: 0,
        }
    }

    /// Linear memory has grown past three quarters of the cap. Linear memory never shrinks,
    /// and some guest toolchains never free some buffers (componentize-py 0.25.1 keeps what a
    /// stage passes to the host and the bytes it returns), so such an instance is replaced
    /// between requests rather than left to fail one.
    pub fn nearly_full(&self) -> bool {
        self.linear_bytes > self.max_bytes / 4 * 3
    }

    /// What is left of the cap for new host arrays.
    pub fn available(&self) -> usize {
        self.max_bytes
            .saturating_sub(self.linear_bytes)
            .saturating_sub(self.held_bytes)
    }
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // Linear memory and held arrays share one cap.
        let linear = (self.linear_bytes + desired).saturating_sub(current);
        let allowed = linear.saturating_add(self.held_bytes) <= self.max_bytes;
        if allowed {
            self.linear_bytes = linear;
        } else {
            self.exceeded = true;
        }
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // The Python backend's interpreter starts with a table of ~47,000 functions.
        Ok(desired <= 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::ModelParameter;

    fn config(params: &[(&str, &str)]) -> ModelConfig {
        ModelConfig {
            name: "alpha_stage".into(),
            parameters: params
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        ModelParameter {
                            string_value: v.to_string(),
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn tenant_wasm_limits_are_defaults_that_configs_may_lower_but_not_raise() {
        let tenants = [
            (
                "alpha".to_owned(),
                WasmLimits {
                    execution_timeout_ms: Some(500),
                    memory_limit_mb: Some(64),
                },
            ),
            (
                "beta".to_owned(),
                WasmLimits {
                    execution_timeout_ms: Some(200),
                    memory_limit_mb: None,
                },
            ),
        ];
        let l = SandboxLimits::from_config_within(&config(&[]), &tenants).unwrap();
        assert_eq!((l.execution_timeout_ms, l.memory_limit_mb), (200, 64));
        let l = SandboxLimits::from_config_within(&config(&[("memory_limit_mb", "16")]), &tenants)
            .unwrap();
        assert_eq!(l.memory_limit_mb, 16);
        let e = SandboxLimits::from_config_within(&config(&[("memory_limit_mb", "128")]), &tenants)
            .unwrap_err();
        assert!(
            e.message
                .contains("'memory_limit_mb' is 128 but tenant 'alpha'")
                && e.message.contains("at most 64 (wasm.memory_limit_mb"),
            "{}",
            e.message
        );
        let l = SandboxLimits::from_config_within(&config(&[]), &[]).unwrap();
        assert_eq!(l, SandboxLimits::default());
    }
}
