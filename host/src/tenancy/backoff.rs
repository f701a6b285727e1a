//! Holding a tenant back from a model its requests keep failing in.

use std::time::{Duration, Instant};

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
pub(super) struct Backoff {
    pub(super) failures: u32,
    pub(super) until: Option<Instant>,
    pub(super) last_error: String,
}
