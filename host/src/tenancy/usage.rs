//! What each tenant's requests did, per model, for the metrics.

use std::{
    collections::BTreeMap,
    sync::{Arc, PoisonError},
    time::Instant,
};

use super::*;
use crate::error::Code;

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
        Code::Internal | Code::Unknown => "BACKEND",
        Code::Unauthenticated => "UNAUTHENTICATED",
        Code::InvalidArg | Code::NotFound | Code::AlreadyExists | Code::Unsupported => "INVALID",
    }
}

/// One inference request being accounted to its tenant; see [`Caller::track`].
#[derive(Debug)]
pub struct Tracked {
    pub(super) tenant: Option<Arc<Tenant>>,
    pub(super) model: String,
    pub(super) started: Instant,
}

impl Tracked {
    /// Accounts the request under `model` (once the model it names is known).
    pub fn name_model(&mut self, model: &str) {
        if self.tenant.is_some() {
            model.clone_into(&mut self.model);
        }
    }

    /// Records the outcome, `Ok` or the error's code, if none was recorded yet.
    pub fn finish(&mut self, outcome: std::result::Result<(), Code>) {
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
            .activity
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
