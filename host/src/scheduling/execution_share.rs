//! The server's executions, shared among tenants by weight.
//!
//! Fair queueing puts a tenant's request at the front of a model's queue, but without more a
//! tenant that floods keeps every instance of its models busy: another tenant's request then
//! waits for a running execution to end and, on a machine with few cores, competes with the
//! flood's executions for the CPU while it runs. So while several tenants are active, each may
//! run at most its weighted part of `slots` executions at once (at least one), server-wide,
//! across all models; a tenant alone may run as many as its instances allow. A tenant counts
//! as active while an execution of its runs and for [`ACTIVE_WINDOW`] after it last asked for
//! one: a tenant that sends a request now and then keeps its part reserved between requests,
//! which is what bounds its latency while another floods. The price is that a flooding tenant
//! gets only its part of the slots while anyone else is active, even when that other tenant
//! is idle between requests.
//!
//! Executions without a tenant (a server without `--config`) and calls a stage makes while it
//! runs (the stage's own execution holds the slot) never wait here.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError, Weak},
    time::{Duration, Instant},
};

/// How long after its last request a tenant keeps its part of the slots.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(1);

/// Something with work held back by the share: woken when an execution ends.
pub trait Wake: Send + Sync {
    /// Look again whether the held-back work may run.
    fn wake(&self);
}

/// A tenant's use of the slots.
#[derive(Debug)]
struct Usage {
    running: usize,
    weight: f64,
    /// When it last asked for, started or ended an execution.
    seen: Instant,
}

impl Usage {
    fn active(&self, now: Instant, window: Duration) -> bool {
        self.running > 0 || now.saturating_duration_since(self.seen) < window
    }
}

#[derive(Default)]
struct State {
    tenants: HashMap<String, Usage>,
    /// Schedulers whose queued work waits for a tenant's part to free up.
    waiting: Vec<Weak<dyn Wake>>,
}

/// The executions of one server, divided among the active tenants by weight.
pub struct ExecutionShare {
    slots: usize,
    window: Duration,
    state: Mutex<State>,
}

impl std::fmt::Debug for ExecutionShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutionShare")
            .field("slots", &self.slots)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // Nothing panics while this lock is held.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ExecutionShare {
    /// A share of `slots` executions (0: no share, tenants are not held back).
    pub fn new(slots: usize) -> Self {
        Self::with_window(slots, ACTIVE_WINDOW)
    }

    /// The same with another activity window (tests).
    pub fn with_window(slots: usize, window: Duration) -> Self {
        Self {
            slots,
            window,
            state: Mutex::new(State::default()),
        }
    }

    /// The slots divided among tenants (0: none, the share is off).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Opens the share for one scheduling decision: the answers of one [`Gate`] are
    /// consistent with each other, as nothing starts or ends while it is open (so an
    /// [`Execution`] must not be dropped by the thread holding it open).
    pub fn gate(self: &Arc<Self>) -> Gate<'_> {
        let now = Instant::now();
        let mut state = lock(&self.state);
        let window = self.window;
        state.tenants.retain(|_, u| u.active(now, window));
        let mut gate = Gate {
            share: self,
            state,
            now,
            active_weight: 0.0,
            active: 0,
        };
        for usage in gate.state.tenants.values() {
            gate.active_weight += usage.weight;
            gate.active += 1;
        }
        gate
    }

    fn end(&self, tenant: &str) {
        let waiting = {
            let mut state = lock(&self.state);
            if let Some(usage) = state.tenants.get_mut(tenant) {
                usage.running = usage.running.saturating_sub(1);
                usage.seen = Instant::now();
            }
            std::mem::take(&mut state.waiting)
        };
        // Woken outside the lock: a scheduler takes its own lock, then this one.
        for waiter in waiting.iter().filter_map(Weak::upgrade) {
            waiter.wake();
        }
    }
}

/// A weight fit for division: positive and finite, else 1.
fn sane(weight: f64) -> f64 {
    if weight.is_finite() && weight > 0.0 {
        weight
    } else {
        1.0
    }
}

/// The share, locked for one scheduling decision.
pub struct Gate<'a> {
    share: &'a Arc<ExecutionShare>,
    state: MutexGuard<'a, State>,
    now: Instant,
    /// Sum of the weights of the active tenants, and how many there are.
    active_weight: f64,
    active: usize,
}

impl Gate<'_> {
    /// Whether an execution for `tenant` (of `weight`) may start now. Asking makes the tenant
    /// active: it has work waiting.
    pub fn admits(&mut self, tenant: &str, weight: f64) -> bool {
        let running = self.usage(tenant, weight).map_or(0, |u| u.running);
        if self.share.slots == 0 || self.active <= 1 {
            return true;
        }
        let weight = sane(weight);
        let part = (self.share.slots as f64 * weight / self.active_weight + 1e-9).floor();
        running < (part as usize).max(1)
    }

    /// Starts an execution for `tenant`, which [`admits`](Self::admits) allowed; dropping
    /// the returned [`Execution`] ends it.
    pub fn start(&mut self, tenant: &str, weight: f64) -> Execution {
        if let Some(usage) = self.usage(tenant, weight) {
            usage.running += 1;
        }
        Execution {
            share: self.share.clone(),
            tenant: tenant.to_owned(),
        }
    }

    /// The tenant's entry, seen now; a tenant new to the window joins the active ones.
    fn usage(&mut self, tenant: &str, weight: f64) -> Option<&mut Usage> {
        let (now, weight) = (self.now, sane(weight));
        if !self.state.tenants.contains_key(tenant) {
            self.active_weight += weight;
            self.active += 1;
            self.state.tenants.insert(
                tenant.to_owned(),
                Usage {
                    running: 0,
                    weight,
                    seen: now,
                },
            );
        }
        let usage = self.state.tenants.get_mut(tenant)?;
        usage.seen = now;
        // A reloaded config may change it; the sums follow from the next gate.
        usage.weight = weight;
        Some(usage)
    }

    /// Wakes `waiter` when the next execution ends: its queued work was not admitted.
    pub fn wait(&mut self, waiter: Weak<dyn Wake>) {
        if !self.state.waiting.iter().any(|w| w.ptr_eq(&waiter)) {
            self.state.waiting.push(waiter);
        }
    }
}

/// A running execution's slot; dropping it gives the slot back and wakes held-back work.
#[derive(Debug)]
pub struct Execution {
    share: Arc<ExecutionShare>,
    tenant: String,
}

impl Drop for Execution {
    fn drop(&mut self) {
        self.share.end(&self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn share(slots: usize) -> Arc<ExecutionShare> {
        Arc::new(ExecutionShare::with_window(
            slots,
            Duration::from_secs(3600),
        ))
    }

    #[test]
    fn a_tenant_alone_may_use_every_instance() {
        let s = share(2);
        let running: Vec<Execution> = (0..5)
            .map(|_| {
                let mut g = s.gate();
                assert!(g.admits("a", 1.0));
                g.start("a", 1.0)
            })
            .collect();
        assert_eq!(running.len(), 5);
    }

    #[test]
    fn active_tenants_get_their_weighted_part_and_at_least_one() {
        let s = share(4);
        let mut g = s.gate();
        assert!(g.admits("b", 1.0), "b asks first: it becomes active");
        let a1 = g.start("a", 3.0);
        let a2 = g.start("a", 3.0);
        let a3 = g.start("a", 3.0);
        assert!(!g.admits("a", 3.0), "3/4 of 4 slots, all running");
        assert!(g.admits("b", 1.0));
        let b1 = g.start("b", 1.0);
        assert!(!g.admits("b", 1.0), "1/4 of 4 slots");
        assert!(g.admits("c", 1.0), "a newcomer gets at least one");
        drop(g);
        drop(a1);
        assert!(
            !s.gate().admits("a", 3.0),
            "a, b and c now share: a's part is 4 * 3/5 = 2"
        );
        drop((a2, a3, b1));
    }

    #[test]
    fn no_slots_means_no_share() {
        let s = share(0);
        let mut g = s.gate();
        g.admits("b", 1.0);
        let a = g.start("a", 1.0);
        assert!(g.admits("a", 1.0));
        drop(g);
        drop(a);
    }

    #[test]
    fn a_tenant_idle_for_the_window_gives_its_part_back() {
        let s = Arc::new(ExecutionShare::with_window(2, Duration::from_millis(50)));
        let mut g = s.gate();
        g.admits("b", 1.0);
        let a = g.start("a", 1.0);
        assert!(!g.admits("a", 1.0));
        drop(g);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            s.gate().admits("a", 1.0),
            "b has asked for nothing in the window"
        );
        drop(a);
    }

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_end_of_an_execution_wakes_the_held_back_once() {
        let s = share(2);
        let waiter = Arc::new(Counter(AtomicUsize::new(0)));
        let weak: Weak<dyn Wake> = Arc::downgrade(&(waiter.clone() as Arc<dyn Wake>));
        let a = {
            let mut g = s.gate();
            g.admits("b", 1.0);
            let a = g.start("a", 1.0);
            g.wait(weak.clone());
            g.wait(weak);
            a
        };
        drop(a);
        assert_eq!(waiter.0.load(Ordering::SeqCst), 1);
        let b = s.gate().start("b", 1.0);
        drop(b);
        assert_eq!(
            waiter.0.load(Ordering::SeqCst),
            1,
            "woken only when it asked"
        );
    }
}
