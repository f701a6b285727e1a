//! A tenant's quotas (`[tenant.quotas]`) and stage limits (`[tenant.wasm]`), and the
//! admission that holds a concurrency slot and spends a rate token per request.

use std::{
    sync::{atomic::Ordering, Arc, PoisonError},
    time::Instant,
};

use serde::Deserialize;

use super::*;
use crate::error::{Error, Result};

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

/// The request-rate token bucket.
#[derive(Debug)]
pub(super) struct Bucket {
    pub(super) tokens: f64,
    pub(super) refilled: Instant,
}

/// An admitted inference request; dropping it gives its concurrency slots back. A request
/// that holds several sequences of a generation model (OpenAI's `n`, a list of prompts)
/// holds one slot per sequence ([`Admission::widen`]).
#[derive(Debug)]
pub struct Admission {
    tenant: Option<Arc<Tenant>>,
    units: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(t) = &self.tenant {
            t.activity.in_flight.fetch_sub(self.units, Ordering::AcqRel);
        }
    }
}

impl Admission {
    /// The admission of a request that no quota counts (no tenants).
    pub fn none() -> Self {
        Self {
            tenant: None,
            units: 0,
        }
    }

    /// Counts the request as `units` requests against its tenant's concurrency quota (at
    /// least the one it was admitted as), or says that the quota does not allow it; the
    /// admission is unchanged then.
    pub fn widen(&mut self, units: usize) -> Result<()> {
        let Some(t) = &self.tenant else {
            return Ok(());
        };
        let more = units.saturating_sub(self.units);
        if more == 0 {
            return Ok(());
        }
        let in_flight = t.activity.in_flight.fetch_add(more, Ordering::AcqRel) + more;
        if let Some(max) = t.limits.max_concurrent_requests {
            if in_flight > max {
                t.activity.in_flight.fetch_sub(more, Ordering::AcqRel);
                return Err(Error::resource_exhausted(format!(
                    "tenant '{}' is over its quota: the request runs {units} sequences, and \
                     {max} concurrent requests (quotas.max_concurrent_requests) count each \
                     sequence; retry later",
                    t.name
                )));
            }
        }
        self.units += more;
        Ok(())
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
    pub(super) fn admit(self: &Arc<Self>, bytes: usize) -> Result<Admission> {
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
        let in_flight = self.activity.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        // From here on, dropping the admission gives the slot back.
        let admission = Admission {
            tenant: Some(self.clone()),
            units: 1,
        };
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
                .activity
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
