//! Triton's rate limiter (`--rate-limit=execution_count`): a model instance runs an execution
//! only while it holds every resource its `instance_group { rate_limiter { resources } }`
//! names, and instances waiting for resources get them in proportion to `1 / priority` (an
//! instance of priority 2 gets half the turns of one of priority 1). A resource is per device
//! unless `global`; its amount comes from `--rate-limit-resource=<name>:<count>[:<device>]`,
//! or else is the most any instance asks for (as Triton sizes it), so each instance can run.
//!
//! Turns follow stride scheduling: each instance has a pass that grows by its priority with
//! every turn, and freed resources go to the waiting instance with the lowest pass that fits.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex, MutexGuard, PoisonError, Weak,
    },
};

use super::execution_share::Wake;
use crate::proto::inference::{model_instance_group::Kind, ModelConfig};

/// A resource's identity: its name, and the device it belongs to (none for a global one).
type ResourceKey = (String, Option<i32>);

/// What one instance needs to run an execution.
pub struct Claim {
    id: u64,
    limiter: Arc<RateLimiter>,
    resources: Vec<(ResourceKey, u64)>,
    /// At least 1; a turn adds it to the instance's pass.
    priority: u64,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("id", &self.id)
            .field("resources", &self.resources)
            .field("priority", &self.priority)
            .finish_non_exhaustive()
    }
}

/// The resources one execution holds; given back when dropped.
#[derive(Debug)]
pub struct Permit {
    claim: Arc<Claim>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.claim.limiter.give_back(&self.claim);
    }
}

struct Waiter {
    id: u64,
    wake: Weak<dyn Wake>,
}

#[derive(Default)]
struct State {
    /// How much of each resource there is.
    capacity: HashMap<ResourceKey, u64>,
    in_use: HashMap<ResourceKey, u64>,
    /// Each instance's pass (stride scheduling).
    pass: HashMap<u64, u64>,
    /// The pass of the last turn given: an instance that starts waiting starts from here,
    /// so time spent idle is not saved up as turns.
    now: u64,
    waiting: Vec<Waiter>,
    /// Instances given their resources while waiting, not yet picked up.
    granted: HashSet<u64>,
    /// Each live instance's needs and priority (kept here, not as claims, so that nothing
    /// of a claim is ever dropped while the lock is held).
    needs: HashMap<u64, Needs>,
}

#[derive(Clone)]
struct Needs {
    resources: Vec<(ResourceKey, u64)>,
    priority: u64,
}

/// The server's rate limiter.
pub struct RateLimiter {
    /// `--rate-limit-resource` amounts: name → (device or every device, count).
    declared: HashMap<String, Vec<(Option<i32>, u64)>>,
    next_id: AtomicU64,
    state: Mutex<State>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("declared", &self.declared)
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // Nothing panics while this lock is held.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RateLimiter {
    /// A limiter with the amounts `--rate-limit-resource` values give
    /// (`<name>:<count>[:<device>]`); a malformed value is refused with the reason.
    pub fn new(resources: &[String]) -> Result<Self, String> {
        let mut declared: HashMap<String, Vec<(Option<i32>, u64)>> = HashMap::new();
        for value in resources {
            let parts: Vec<&str> = value.split(':').collect();
            let parsed = match parts.as_slice() {
                [name, count] => count.parse().ok().map(|c| (name, None, c)),
                [name, count, device] => match (count.parse().ok(), device.parse().ok()) {
                    (Some(c), Some(d)) => Some((name, Some(d), c)),
                    _ => None,
                },
                _ => None,
            };
            let Some((name, device, count)) = parsed.filter(|(n, _, _)| !n.is_empty()) else {
                return Err(format!(
                    "--rate-limit-resource={value}: expected <name>:<count>[:<device>]"
                ));
            };
            declared
                .entry((*name).to_owned())
                .or_default()
                .push((device, count));
        }
        Ok(Self {
            declared,
            next_id: AtomicU64::new(1),
            state: Mutex::new(State::default()),
        })
    }

    /// How much of `name` a device has when `--rate-limit-resource` says (the value naming
    /// the device wins over one for every device).
    fn declared(&self, name: &str, device: Option<i32>) -> Option<u64> {
        let amounts = self.declared.get(name)?;
        let exact = amounts.iter().find(|(d, _)| *d == device && d.is_some());
        exact
            .or_else(|| amounts.iter().find(|(d, _)| d.is_none()))
            .map(|(_, c)| *c)
    }

    /// The claims of a version's `instances` instances, in the order the backend made them
    /// (each non-passive group in turn, its count per device). An instance that needs more
    /// of a resource than `--rate-limit-resource` gives is refused, naming the group.
    pub fn claims(
        self: &Arc<Self>,
        config: &ModelConfig,
        instances: usize,
    ) -> Result<Vec<Arc<Claim>>, String> {
        let mut per_instance = Vec::with_capacity(instances);
        for (i, group) in config.instance_group.iter().enumerate() {
            if group.passive {
                continue;
            }
            let devices: Vec<Option<i32>> =
                if group.kind == Kind::Gpu as i32 && !group.gpus.is_empty() {
                    group.gpus.iter().map(|&g| Some(g)).collect()
                } else if group.kind == Kind::Gpu as i32 {
                    vec![Some(0)]
                } else {
                    vec![None]
                };
            for device in devices {
                for _ in 0..group.count.max(1) {
                    per_instance.push((i, group.rate_limiter.clone(), device));
                }
            }
        }
        let mut claims = Vec::with_capacity(instances);
        let mut state = lock(&self.state);
        for index in 0..instances {
            // Instances beyond the groups (a backend's own default) take the first group's.
            let (group, limits, device) = per_instance
                .get(index)
                .or(per_instance.first())
                .cloned()
                .unwrap_or((0, None, None));
            let limits = limits.unwrap_or_default();
            let mut resources = Vec::new();
            for r in &limits.resources {
                // A CPU instance's per-device resources belong to device 0, as on Triton.
                let key = (r.name.clone(), (!r.global).then_some(device.unwrap_or(0)));
                let need = u64::from(r.count);
                match self.declared(&r.name, key.1) {
                    Some(have) if have < need => {
                        return Err(format!(
                            "model '{}': field 'instance_group[{group}].rate_limiter': an \
                             instance needs {need} of resource '{}' but --rate-limit-resource \
                             gives {have}",
                            config.name, r.name
                        ))
                    }
                    Some(have) => {
                        state.capacity.insert(key.clone(), have);
                    }
                    None => {
                        let cap = state.capacity.entry(key.clone()).or_default();
                        *cap = (*cap).max(need);
                    }
                }
                resources.push((key, need));
            }
            let claim = Arc::new(Claim {
                id: self.next_id.fetch_add(1, Relaxed),
                limiter: self.clone(),
                resources,
                priority: u64::from(limits.priority.max(1)),
            });
            state.needs.insert(
                claim.id,
                Needs {
                    resources: claim.resources.clone(),
                    priority: claim.priority,
                },
            );
            claims.push(claim);
        }
        Ok(claims)
    }

    fn fits(state: &State, resources: &[(ResourceKey, u64)]) -> bool {
        resources.iter().all(|(key, need)| {
            let used = state.in_use.get(key).copied().unwrap_or(0);
            let cap = state.capacity.get(key).copied().unwrap_or(0);
            used + need <= cap
        })
    }

    fn take(state: &mut State, id: u64, needs: &Needs) {
        for (key, need) in &needs.resources {
            *state.in_use.entry(key.clone()).or_default() += need;
        }
        let now = state.now;
        let pass = state.pass.entry(id).or_insert(now);
        *pass = (*pass).max(now) + needs.priority;
        let started = *pass - needs.priority;
        state.now = now.max(started);
    }

    /// The resources for one execution of `claim`'s instance, or `None` (then `wake` is
    /// called once they may be free).
    pub fn acquire(&self, claim: &Arc<Claim>, wake: Weak<dyn Wake>) -> Option<Permit> {
        let mut state = lock(&self.state);
        if state.granted.remove(&claim.id) {
            return Some(Permit {
                claim: claim.clone(),
            });
        }
        let mine = state
            .pass
            .get(&claim.id)
            .copied()
            .unwrap_or(0)
            .max(state.now);
        // A waiting instance with a lower pass goes first when it fits too.
        let ahead = state.waiting.iter().any(|w| {
            w.id != claim.id
                && state.pass.get(&w.id).copied().unwrap_or(0).max(state.now) < mine
                && state
                    .needs
                    .get(&w.id)
                    .is_some_and(|n| Self::fits(&state, &n.resources))
        });
        if !ahead && Self::fits(&state, &claim.resources) {
            state.waiting.retain(|w| w.id != claim.id);
            let needs = Needs {
                resources: claim.resources.clone(),
                priority: claim.priority,
            };
            Self::take(&mut state, claim.id, &needs);
            return Some(Permit {
                claim: claim.clone(),
            });
        }
        if !state.waiting.iter().any(|w| w.id == claim.id) {
            state.waiting.push(Waiter { id: claim.id, wake });
        }
        None
    }

    /// Whether `claim`'s instance waits for resources or was given them while it waited.
    pub fn pending(&self, claim: &Claim) -> bool {
        let state = lock(&self.state);
        state.granted.contains(&claim.id) || state.waiting.iter().any(|w| w.id == claim.id)
    }

    /// The instance has no work any more: it stops waiting, and resources given to it while
    /// it waited go to others.
    pub fn withdraw(&self, claim: &Claim) {
        let granted = {
            let mut state = lock(&self.state);
            state.waiting.retain(|w| w.id != claim.id);
            state.granted.remove(&claim.id)
        };
        if granted {
            self.give_back(claim);
        }
    }

    fn give_back(&self, claim: &Claim) {
        let mut state = lock(&self.state);
        for (key, need) in &claim.resources {
            if let Some(used) = state.in_use.get_mut(key) {
                *used = used.saturating_sub(*need);
            }
        }
        let woken = Self::hand_out(&mut state);
        drop(state);
        woken
            .iter()
            .filter_map(Weak::upgrade)
            .for_each(|w| w.wake());
    }

    /// Gives free resources to waiting instances, lowest pass first; returns whom to wake.
    fn hand_out(state: &mut State) -> Vec<Weak<dyn Wake>> {
        let now = state.now;
        state
            .waiting
            .sort_by_key(|w| state.pass.get(&w.id).copied().unwrap_or(0).max(now));
        let mut woken = Vec::new();
        let mut still = Vec::new();
        for w in std::mem::take(&mut state.waiting) {
            match state.needs.get(&w.id).cloned() {
                Some(needs) if Self::fits(state, &needs.resources) => {
                    Self::take(state, w.id, &needs);
                    state.granted.insert(w.id);
                    woken.push(w.wake);
                }
                Some(_) => still.push(w),
                None => {} // unloaded
            }
        }
        state.waiting = still;
        woken
    }
}

impl Claim {
    /// The resources for one execution, or `None` (then `wake` is called once they may be
    /// free).
    pub fn acquire(self: &Arc<Self>, wake: Weak<dyn Wake>) -> Option<Permit> {
        self.limiter.acquire(self, wake)
    }

    /// Whether the instance waits for resources or holds some given while it waited.
    pub fn pending(&self) -> bool {
        self.limiter.pending(self)
    }

    /// The instance has no work any more: it stops waiting and gives back what it was given.
    /// Wakes other schedulers: never call it while holding a scheduler's lock.
    pub fn withdraw(&self) {
        self.limiter.withdraw(self)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut state = lock(&self.limiter.state);
        state.needs.remove(&self.id);
        state.pass.remove(&self.id);
        state.waiting.retain(|w| w.id != self.id);
        state.granted.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repository::config::parse_text;
    use std::path::Path;

    struct Nobody;
    impl Wake for Nobody {
        fn wake(&self) {}
    }

    fn config(groups: &str) -> ModelConfig {
        parse_text(
            &format!("name: \"m\"\ninstance_group [ {groups} ]\n"),
            Path::new("m"),
        )
        .unwrap()
    }

    fn nobody() -> Weak<dyn Wake> {
        let w: Arc<dyn Wake> = Arc::new(Nobody);
        Arc::downgrade(&w)
    }

    #[test]
    fn an_instance_runs_only_while_the_resource_is_free() {
        let limiter = Arc::new(RateLimiter::new(&["R:1".into()]).unwrap());
        let g = "{ count: 1, kind: KIND_CPU, rate_limiter { resources [ { name: \"R\", count: 1 } ] } }";
        let a = limiter.claims(&config(g), 1).unwrap().remove(0);
        let b = limiter.claims(&config(g), 1).unwrap().remove(0);
        let held = limiter.acquire(&a, nobody()).unwrap();
        assert!(limiter.acquire(&b, nobody()).is_none());
        drop(held);
        // Freed while b waited: b got it.
        assert!(limiter.acquire(&b, nobody()).is_some());
    }

    #[test]
    fn priority_2_gets_half_the_turns_of_priority_1() {
        let limiter = Arc::new(RateLimiter::new(&[]).unwrap());
        let group = |p| {
            format!(
                "{{ count: 1, kind: KIND_CPU, rate_limiter {{ resources [ {{ name: \"R\", \
                 count: 1 }} ] priority: {p} }} }}"
            )
        };
        let a = limiter.claims(&config(&group(1)), 1).unwrap().remove(0);
        let b = limiter.claims(&config(&group(2)), 1).unwrap().remove(0);
        // Both always have work: whoever is given the resource runs, then asks again.
        let mut turns = (0, 0);
        let mut held = limiter.acquire(&a, nobody());
        for turn in 0..60 {
            let a_got = limiter.acquire(&a, nobody());
            let b_got = limiter.acquire(&b, nobody());
            assert!(a_got.is_none() && b_got.is_none());
            drop(held.take());
            // The freed resource went to one of the waiters.
            held = match (limiter.acquire(&a, nobody()), limiter.acquire(&b, nobody())) {
                (Some(p), None) => {
                    turns.0 += usize::from(turn >= 6);
                    Some(p)
                }
                (None, Some(p)) => {
                    turns.1 += usize::from(turn >= 6);
                    Some(p)
                }
                other => panic!("one turn at a time: {other:?}"),
            };
        }
        // Past the first turns (who starts), exactly two of a's for each of b's.
        assert_eq!(turns, (36, 18));
    }

    #[test]
    fn declared_amounts_bound_what_an_instance_may_ask_for() {
        let limiter = Arc::new(RateLimiter::new(&["R:2:0".into(), "R:1".into()]).unwrap());
        let g = "{ count: 1, kind: KIND_CPU, rate_limiter { resources [ { name: \"R\", count: 3 } ] } }";
        let e = limiter.claims(&config(g), 1).unwrap_err();
        assert!(
            e.contains("needs 3 of resource 'R' but --rate-limit-resource gives 2"),
            "{e}"
        );
        assert!(RateLimiter::new(&["R".into()]).is_err());
    }
}
