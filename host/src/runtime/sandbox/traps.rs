//! Why guest code stopped, told the same way for every backend that runs it: a guest whose
//! batch nobody waits for any more is interrupted ([`Abandoned`], not a crash); one past its
//! deadline is interrupted by the epoch check ([`interruption`]); a trap is explained by the
//! limit it hit, or by what the guest printed ([`explain`]), and counted as a crash.

use std::time::Instant;

use super::limits::SandboxLimits;
use crate::{
    error::{Code, Error},
    runtime::backend::InstanceHealth,
};

/// Why the epoch check stopped a guest whose batch was cancelled (told apart from a crash).
#[derive(Debug)]
pub struct Abandoned;

impl std::fmt::Display for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cancelled: nobody waits for the answer")
    }
}

impl std::error::Error for Abandoned {}

/// What the epoch check (and a guest's own waits) stop a guest with: [`Abandoned`] once
/// nobody waits for its batch, wasmtime's interrupt once its time `ends`; `None`: it runs on.
pub fn interruption(abandoned: bool, ends: Instant) -> Option<wasmtime::Error> {
    if abandoned {
        Some(wasmtime::Error::new(Abandoned))
    } else if Instant::now() >= ends {
        Some(wasmtime::Trap::Interrupt.into())
    } else {
        None
    }
}

/// The guest that stopped, for [`explain`].
pub struct Stopped<'a> {
    /// How messages name it: `stage 'm'`, `Python model 'm'`.
    pub who: String,
    /// The limits it ran under.
    pub limits: &'a SandboxLimits,
    /// Its model's crash accounting.
    pub health: &'a InstanceHealth,
    /// It asked for more memory than its limit.
    pub memory_exceeded: bool,
    /// What it printed (kept within `stderr_limit_kb`).
    pub printed: String,
}

/// The error of a guest stopped by `err` during `during` (`init`, `execute`, …): cancelled
/// when nobody waits for it any more; else a crash, counted in its model's health and
/// explained by the deadline, the memory limit, or the trap and what the guest printed. The
/// instance is discarded either way.
pub fn explain(stopped: Stopped<'_>, err: &wasmtime::Error, during: &str) -> Error {
    let who = &stopped.who;
    if err.downcast_ref::<Abandoned>().is_some() {
        return Error::new(
            Code::Cancelled,
            format!(
                "{who} was interrupted during {during}: nobody waits for its answer any more; \
                 the instance was discarded"
            ),
        );
    }
    stopped.health.record_crash();
    let detail = if stopped.printed.is_empty() {
        String::new()
    } else {
        format!("; output: {}", stopped.printed)
    };
    let reason = if matches!(
        err.downcast_ref::<wasmtime::Trap>(),
        Some(wasmtime::Trap::Interrupt)
    ) {
        format!(
            "exceeded its execution deadline of {} ms (parameter execution_timeout_ms)",
            stopped.limits.execution_timeout_ms
        )
    } else if stopped.memory_exceeded {
        format!(
            "exceeded its memory limit of {} MiB (parameter memory_limit_mb)",
            stopped.limits.memory_limit_mb
        )
    } else {
        format!("trapped: {}", err.root_cause())
    };
    Error::internal(format!(
        "{who} {reason} during {during}; the instance was discarded{detail}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stopped<'a>(limits: &'a SandboxLimits, health: &'a InstanceHealth) -> Stopped<'a> {
        Stopped {
            who: "stage 'm'".into(),
            limits,
            health,
            memory_exceeded: false,
            printed: "boom".into(),
        }
    }

    #[test]
    fn an_abandoned_guest_did_not_crash_and_a_late_one_did() {
        let limits = SandboxLimits::default();
        let health = InstanceHealth::new(1);
        let far = Instant::now() + std::time::Duration::from_secs(3600);
        assert!(interruption(false, far).is_none());
        let cancelled = interruption(true, far).unwrap();
        let e = explain(stopped(&limits, &health), &cancelled, "execute");
        assert_eq!(e.code, Code::Cancelled);
        assert!(health.is_healthy(), "cancelling is not a crash");
        let late = interruption(false, Instant::now()).unwrap();
        let e = explain(stopped(&limits, &health), &late, "execute");
        assert_eq!(e.code, Code::Internal);
        assert!(
            e.message
                .contains("stage 'm' exceeded its execution deadline")
                && e.message.contains("during execute")
                && e.message.ends_with("; output: boom"),
            "{}",
            e.message
        );
        assert!(!health.is_healthy(), "a deadline is a crash");
    }

    #[test]
    fn memory_is_named_before_the_trap() {
        let limits = SandboxLimits::default();
        let health = InstanceHealth::default();
        let trap: wasmtime::Error = wasmtime::Trap::UnreachableCodeReached.into();
        let mut s = stopped(&limits, &health);
        s.memory_exceeded = true;
        assert!(explain(s, &trap, "init").message.contains("memory limit"));
        let e = explain(stopped(&limits, &health), &trap, "init");
        assert!(e.message.contains("trapped: "), "{}", e.message);
    }
}
