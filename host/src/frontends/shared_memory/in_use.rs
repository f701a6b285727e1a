//! Regions in use by requests. Unregistering a region that a request still uses only marks
//! it, as Triton does ("will be unregistered after in-flight requests complete"): it stays
//! listed and usable until the last request using it lets go, which removes it. A request
//! holds every region it reads inputs from or will write outputs to, from its decoding to its
//! last response.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use super::{Key, Region};

/// The registry's map, shared with the holds so that the last one can remove a region.
pub(super) type Regions = Mutex<std::collections::BTreeMap<Key, Arc<Region>>>;

pub(super) fn lock(
    regions: &Regions,
) -> MutexGuard<'_, std::collections::BTreeMap<Key, Arc<Region>>> {
    regions.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How many requests use a region and whether it was unregistered meanwhile; changed only
/// under the registry's lock, so a release and an unregister never miss each other.
#[derive(Debug, Default)]
pub(super) struct Usage {
    users: usize,
    awaiting_unregister: bool,
}

impl Usage {
    /// Whether a region may be removed now; otherwise it is marked for its last user.
    pub(super) fn unregister(&mut self) -> bool {
        self.awaiting_unregister = self.users > 0;
        self.users == 0
    }
}

/// One request's use of one region.
struct Hold {
    registry: Weak<Regions>,
    key: Key,
    region: Arc<Region>,
}

impl Hold {
    /// Counts a use of `region`; called with the registry locked.
    pub(super) fn start(registry: &Arc<Regions>, key: Key, region: Arc<Region>) -> Self {
        region.usage().users += 1;
        Self {
            registry: Arc::downgrade(registry),
            key,
            region,
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let Some(registry) = self.registry.upgrade() else {
            return;
        };
        let mut regions = lock(&registry);
        let remove = {
            let mut usage = self.region.usage();
            usage.users = usage.users.saturating_sub(1);
            usage.users == 0 && usage.awaiting_unregister
        };
        if remove
            && regions
                .get(&self.key)
                .is_some_and(|r| Arc::ptr_eq(r, &self.region))
        {
            regions.remove(&self.key);
            tracing::info!(region = %self.key.1, "unregistered shared memory after its last request");
        }
    }
}

/// The regions one request uses; dropping it lets them go.
#[derive(Default)]
pub struct HeldRegions(Vec<Hold>);

impl HeldRegions {
    pub(super) fn push(&mut self, registry: &Arc<Regions>, key: Key, region: Arc<Region>) {
        self.0.push(Hold::start(registry, key, region));
    }

    /// Adds `other`'s regions to these.
    pub fn extend(&mut self, other: HeldRegions) {
        self.0.extend(other.0);
    }
}
