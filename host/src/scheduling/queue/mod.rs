//! The request queue of one model version and the batching decision over it: priority levels,
//! each with its queue policy (size limit, timeout, REJECT or DELAY), and the dynamic batcher's
//! rule for what to run next. Plain data, no threads or locks: the scheduler owns one behind a
//! mutex and its workers ask it what to do.

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use crate::{
    proto::inference::{
        model_config::SchedulingChoice, model_queue_policy::TimeoutAction, ModelConfig,
        ModelQueuePolicy,
    },
    repository::sequence::{sequence_spec, Strategy},
};

/// What happens to a request whose queue timeout expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnTimeout {
    /// Answer it with an error at once.
    Reject,
    /// Keep it, behind every request of the same or a higher priority that has not timed out.
    Delay,
}

/// The queue policy of one priority level (`ModelQueuePolicy`).
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicy {
    /// Requests this level may hold; 0 means no limit of its own.
    pub max_queue_size: usize,
    /// Timeout of a request that names none.
    pub default_timeout: Option<Duration>,
    /// Whether a request's `timeout` parameter may shorten the default.
    pub allow_timeout_override: bool,
    /// What an expired request gets.
    pub on_timeout: OnTimeout,
}

impl Default for QueuePolicy {
    fn default() -> Self {
        Self {
            max_queue_size: 0,
            default_timeout: None,
            allow_timeout_override: false,
            on_timeout: OnTimeout::Reject,
        }
    }
}

impl QueuePolicy {
    fn from_proto(p: &ModelQueuePolicy) -> Self {
        Self {
            max_queue_size: p.max_queue_size as usize,
            default_timeout: (p.default_timeout_microseconds > 0)
                .then(|| Duration::from_micros(p.default_timeout_microseconds)),
            allow_timeout_override: p.allow_timeout_override,
            on_timeout: if p.timeout_action == TimeoutAction::Delay as i32 {
                OnTimeout::Delay
            } else {
                OnTimeout::Reject
            },
        }
    }

    /// The timeout of a request that asked for `requested` (its `timeout` parameter): the
    /// request may shorten the default when the policy allows it, never lengthen it.
    pub fn timeout_for(&self, requested: Option<Duration>) -> Option<Duration> {
        match (
            requested.filter(|_| self.allow_timeout_override),
            self.default_timeout,
        ) {
            (Some(r), Some(d)) => Some(r.min(d)),
            (Some(r), None) => Some(r),
            (None, d) => d,
        }
    }
}

/// The inputs a configuration marks `allow_ragged_batch`, if any.
fn ragged_inputs(config: &ModelConfig) -> Option<std::sync::Arc<[String]>> {
    let names: Vec<String> = config
        .input
        .iter()
        .filter(|i| i.allow_ragged_batch)
        .map(|i| i.name.clone())
        .collect();
    (!names.is_empty()).then(|| names.into())
}

/// Preferred batch sizes as the queue uses them: positive, ascending, each once.
fn positive_sorted(sizes: &[i32]) -> Vec<usize> {
    let mut sizes: Vec<usize> = sizes
        .iter()
        .filter_map(|&s| usize::try_from(s).ok())
        .collect();
    sizes.retain(|&s| s > 0);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// How a model version schedules: the dynamic batcher's settings, or one request at a time.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    /// Largest batch (in rows); 1 means requests run one by one.
    pub max_batch_size: usize,
    /// Batch sizes to dispatch at once when they can be formed, ascending.
    pub preferred: Vec<usize>,
    /// How long the oldest request may wait for a batch to fill.
    pub max_queue_delay: Duration,
    /// Whether several requests may run as one batch.
    pub batching: bool,
    /// Answer requests in the order they arrived.
    pub preserve_ordering: bool,
    /// One policy per priority level; index 0 is priority 1, the highest.
    pub levels: Vec<QueuePolicy>,
    /// Level (index) of requests that name no priority.
    pub default_level: usize,
    /// The shapes the model's executions are padded to: with sequence padding, requests
    /// batch when their padded shapes agree.
    pub padding: Option<std::sync::Arc<crate::runtime::buckets::ShapeBuckets>>,
    /// Inputs with `allow_ragged_batch`: requests batch even when these differ in shape.
    pub ragged_inputs: Option<std::sync::Arc<[String]>>,
}

impl BatchPolicy {
    /// The policy a configuration asks for. `dynamic_batching` with `max_batch_size` > 0
    /// batches; without it requests run one at a time from a single FIFO level.
    pub fn from_config(config: &ModelConfig) -> Self {
        if let Ok(Some(sequences)) = sequence_spec(config) {
            // Requests of different sequences batch (one row each); requests of one sequence
            // never meet in a batch, as the sequence batcher sends them one after another.
            // The direct strategy forms its batches itself (one row per slot) and queues each
            // whole, to run at once.
            let direct = matches!(sequences.strategy, Strategy::Direct { .. });
            return Self {
                max_batch_size: config.max_batch_size.max(1) as usize,
                preferred: positive_sorted(&sequences.preferred_batch_sizes),
                max_queue_delay: if direct {
                    Duration::ZERO
                } else {
                    sequences.max_queue_delay
                },
                batching: config.max_batch_size > 0,
                ragged_inputs: ragged_inputs(config),
                ..Self::one_at_a_time()
            };
        }
        let Some(SchedulingChoice::DynamicBatching(db)) = &config.scheduling_choice else {
            return Self::one_at_a_time();
        };
        let count = db.priority_levels.max(1) as usize;
        let default = QueuePolicy::from_proto(&db.default_queue_policy.unwrap_or_default());
        let levels = (1..=count as u64)
            .map(|level| {
                db.priority_queue_policy
                    .get(&level)
                    .map(QueuePolicy::from_proto)
                    .unwrap_or_else(|| default.clone())
            })
            .collect();
        Self {
            max_batch_size: config.max_batch_size.max(1) as usize,
            preferred: positive_sorted(&db.preferred_batch_size),
            max_queue_delay: Duration::from_micros(db.max_queue_delay_microseconds),
            batching: config.max_batch_size > 0,
            preserve_ordering: db.preserve_ordering,
            levels,
            default_level: (db.default_priority_level.clamp(1, count as u64) - 1) as usize,
            padding: None,
            ragged_inputs: ragged_inputs(config),
        }
    }

    /// The default scheduler: one level, no timeouts, one request per execution.
    pub fn one_at_a_time() -> Self {
        Self {
            max_batch_size: 1,
            preferred: Vec::new(),
            max_queue_delay: Duration::ZERO,
            batching: false,
            preserve_ordering: false,
            levels: vec![QueuePolicy::default()],
            default_level: 0,
            padding: None,
            ragged_inputs: None,
        }
    }

    /// The level (index) of a request with priority `priority`: 0, or one beyond the
    /// configured levels, means the default level, as in Triton.
    pub fn level_of(&self, priority: u64) -> usize {
        match usize::try_from(priority) {
            Ok(p) if p >= 1 && p <= self.levels.len() => p - 1,
            _ => self.default_level,
        }
    }
}

/// What a queued request needs to be batched: its rows and a key saying which requests it can
/// share an execution with.
pub trait Batchable {
    /// Rows (the batch dimension) this request contributes.
    fn rows(&self) -> usize;
    /// Whether it can run in one execution with `other` (same inputs apart from the batch
    /// dimension, same outputs).
    fn fits_with(&self, other: &Self) -> bool;
    /// Whose request this is, for fair queueing: the tenant, its weight and how many requests
    /// it may have queued here. `None` (no tenants) shares one FIFO.
    fn share(&self) -> Option<Share<'_>> {
        None
    }
}

/// A tenant's claim on a queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its weight: a tenant of weight 2 gets twice the turns of one of weight 1.
    pub weight: f64,
    /// Most requests it may have in this queue (`quotas.max_queued_requests`).
    pub max_queued: Option<usize>,
}

/// A queued request.
#[derive(Debug)]
pub struct Entry<J> {
    /// The request and whatever answers it.
    pub job: J,
    /// When it entered the queue.
    pub enqueued: Instant,
    /// When its queue timeout expires.
    pub expires: Option<Instant>,
    /// Its virtual start time (start-time fair queueing): `waiting` is kept in this order.
    start: f64,
}

#[derive(Debug)]
struct Level<J> {
    policy: QueuePolicy,
    /// Ordered by virtual start time, which interleaves tenants fairly; FIFO within each.
    waiting: VecDeque<Entry<J>>,
    /// Timed out under a DELAY policy: served after every level's `waiting`.
    delayed: VecDeque<Entry<J>>,
    /// Virtual time: the start of the request taken last.
    now: f64,
    /// Per tenant, the virtual finish of its last queued request.
    finish: HashMap<String, f64>,
}

impl<J> Level<J> {
    /// Start-time fair queueing: a request starts at the later of the level's virtual time
    /// and its tenant's previous finish, and finishes 1/weight later. A tenant that floods
    /// the queue pushes only its own requests back; one that sends a request now and then
    /// gets it near the front.
    fn place(&mut self, tenant: &str, weight: f64) -> (f64, usize) {
        let last = self.finish.get(tenant).copied().unwrap_or(0.0);
        let start = self.now.max(last);
        match self.finish.get_mut(tenant) {
            Some(finish) => *finish = start + 1.0 / weight,
            None => {
                self.finish.insert(tenant.to_owned(), start + 1.0 / weight);
            }
        }
        // After every request that starts no later (FIFO among equals); usually at the back.
        let mut at = self.waiting.len();
        while at > 0 && self.waiting[at - 1].start > start {
            at -= 1;
        }
        (start, at)
    }

    /// The level's virtual clock moves with the requests it hands out; an empty level
    /// starts afresh.
    fn advance(&mut self, taken: &Entry<J>) {
        self.now = self.now.max(taken.start);
        if self.waiting.is_empty() {
            self.now = 0.0;
            self.finish.clear();
        }
    }
}

/// Why a request could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The model version's queue holds `capacity` requests already.
    Full {
        /// The server-wide bound per model version.
        capacity: usize,
    },
    /// The priority level's `max_queue_size` is reached.
    LevelFull {
        /// The level, 1-based as in config.pbtxt.
        priority: usize,
        /// Its `max_queue_size`.
        max: usize,
    },
    /// The tenant has its `quotas.max_queued_requests` in this queue already.
    TenantFull {
        /// The quota.
        max: usize,
    },
}

/// What a free worker should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Take this many requests from the front (in dispatch order) and run them as one batch.
    Run(usize),
    /// Nothing can run before this instant (a batch is filling, or a timeout is due); a new
    /// request may change that.
    WaitUntil(Instant),
    /// The queue is empty.
    Idle,
}

/// Priority levels of queued requests, bounded.
#[derive(Debug)]
pub struct RequestQueue<J> {
    levels: Vec<Level<J>>,
    len: usize,
    capacity: usize,
}

impl<J: Batchable> RequestQueue<J> {
    /// An empty queue with one level per policy, holding at most `capacity` requests (0: no
    /// cap but each level's `max_queue_size`, as in Triton).
    pub fn new(policies: &[QueuePolicy], capacity: usize) -> Self {
        Self {
            levels: policies
                .iter()
                .map(|policy| Level {
                    policy: policy.clone(),
                    waiting: VecDeque::new(),
                    delayed: VecDeque::new(),
                    now: 0.0,
                    finish: HashMap::new(),
                })
                .collect(),
            len: 0,
            capacity: if capacity == 0 { usize::MAX } else { capacity },
        }
    }

    /// Requests queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues a request at `level` (an index below the number of levels) with the request's
    /// own `timeout`, if it named one.
    pub fn push(
        &mut self,
        level: usize,
        job: J,
        timeout: Option<Duration>,
        now: Instant,
    ) -> Result<(), (J, Refusal)> {
        let level_index = level.min(self.levels.len() - 1);
        let lvl = &mut self.levels[level_index];
        if self.len >= self.capacity {
            return Err((
                job,
                Refusal::Full {
                    capacity: self.capacity,
                },
            ));
        }
        let max = lvl.policy.max_queue_size;
        if max > 0 && lvl.waiting.len() + lvl.delayed.len() >= max {
            return Err((
                job,
                Refusal::LevelFull {
                    priority: level_index + 1,
                    max,
                },
            ));
        }
        let share = job.share();
        if let Some(Share {
            tenant,
            max_queued: Some(max),
            ..
        }) = share
        {
            let mine = self
                .iter()
                .filter(|e| e.job.share().is_some_and(|s| s.tenant == tenant))
                .count();
            if mine >= max {
                return Err((job, Refusal::TenantFull { max }));
            }
        }
        let (tenant, weight) = share.map_or(("", 1.0), |s| (s.tenant, s.weight));
        let lvl = &mut self.levels[level_index];
        let (start, at) = lvl.place(tenant, weight.max(f64::MIN_POSITIVE));
        let expires = lvl.policy.timeout_for(timeout).map(|t| now + t);
        lvl.waiting.insert(
            at,
            Entry {
                job,
                enqueued: now,
                expires,
                start,
            },
        );
        self.len += 1;
        Ok(())
    }

    /// Applies the timeouts due at `now`: REJECT levels give their expired requests back (to
    /// be answered with an error), DELAY levels move them behind the others.
    pub fn expire(&mut self, now: Instant) -> Vec<J> {
        let mut rejected = Vec::new();
        for lvl in &mut self.levels {
            if !lvl
                .waiting
                .iter()
                .any(|e| e.expires.is_some_and(|t| t <= now))
            {
                continue;
            }
            let mut kept = VecDeque::with_capacity(lvl.waiting.len());
            for mut entry in lvl.waiting.drain(..) {
                if entry.expires.is_none_or(|t| t > now) {
                    kept.push_back(entry);
                } else if lvl.policy.on_timeout == OnTimeout::Reject {
                    rejected.push(entry.job);
                } else {
                    entry.expires = None;
                    lvl.delayed.push_back(entry);
                }
            }
            lvl.waiting = kept;
        }
        self.len -= rejected.len();
        rejected
    }

    /// Queued requests in dispatch order: every level's punctual requests by priority, then
    /// the delayed ones by priority.
    pub fn iter(&self) -> impl Iterator<Item = &Entry<J>> {
        self.levels
            .iter()
            .flat_map(|l| l.waiting.iter())
            .chain(self.levels.iter().flat_map(|l| l.delayed.iter()))
    }

    /// Removes the first `n` requests in dispatch order.
    pub fn take(&mut self, n: usize) -> Vec<Entry<J>> {
        self.take_among(n, |_| true)
    }

    /// Removes the first `n` requests in dispatch order among those `eligible` picks; the
    /// others keep their places.
    pub fn take_among(&mut self, n: usize, mut eligible: impl FnMut(&J) -> bool) -> Vec<Entry<J>> {
        let mut taken = Vec::with_capacity(n);
        for delayed in [false, true] {
            for lvl in &mut self.levels {
                let q = if delayed {
                    &mut lvl.delayed
                } else {
                    &mut lvl.waiting
                };
                let before = taken.len();
                let mut at = 0;
                while taken.len() < n && at < q.len() {
                    if !eligible(&q[at].job) {
                        at += 1;
                    } else if let Some(e) = q.remove(at) {
                        taken.push(e);
                    }
                }
                if !delayed && taken.len() > before {
                    if let Some(last) = taken.last() {
                        lvl.advance(last);
                    }
                }
            }
        }
        self.len -= taken.len();
        taken
    }

    /// Removes the first queued request that `pred` picks (a request whose client left).
    pub fn remove_where(&mut self, pred: impl Fn(&J) -> bool) -> Option<J> {
        for lvl in &mut self.levels {
            for q in [&mut lvl.waiting, &mut lvl.delayed] {
                if let Some(pos) = q.iter().position(|e| pred(&e.job)) {
                    self.len -= 1;
                    return q.remove(pos).map(|e| e.job);
                }
            }
        }
        None
    }

    /// Removes every request (shutdown).
    pub fn drain(&mut self) -> Vec<J> {
        let n = self.len;
        self.take(n).into_iter().map(|e| e.job).collect()
    }

    /// When the next queue timeout is due, if any is.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.levels
            .iter()
            .flat_map(|l| l.waiting.iter())
            .filter_map(|e| e.expires)
            .min()
    }

    /// The dynamic batcher's rule, Triton's. Starting from the first request in dispatch
    /// order, gather the requests after it that fit with it, in order, up to
    /// `max_batch_size` rows, stopping at the first that does not fit. Remember the longest
    /// prefix that adds up to a preferred size, or (found none) the prefix before the batch
    /// would grow past the largest preferred size. Until the oldest request has waited
    /// `max_queue_delay`, run that prefix at once; otherwise run everything gathered at once
    /// when a request that does not fit waits behind it, when it has reached the largest
    /// preferred size (`max_batch_size` without preferred sizes) or once the delay is over;
    /// else wait for more requests until then.
    pub fn decide(&self, policy: &BatchPolicy, now: Instant) -> Decision {
        self.decide_among(policy, now, |_| true)
    }

    /// The same rule over the requests `eligible` picks, as if the others were not queued
    /// ([`Decision::Idle`] when it picks none).
    pub fn decide_among(
        &self,
        policy: &BatchPolicy,
        now: Instant,
        mut eligible: impl FnMut(&J) -> bool,
    ) -> Decision {
        let mut entries = self.iter().filter(|e| eligible(&e.job));
        let Some(first) = entries.next() else {
            return Decision::Idle;
        };
        if !policy.batching {
            return Decision::Run(1);
        }
        let largest_preferred = policy
            .preferred
            .last()
            .copied()
            .unwrap_or(policy.max_batch_size)
            .min(policy.max_batch_size);
        let mut rows = first.job.rows();
        let mut count = 1;
        let mut oldest = first.enqueued;
        let mut best_prefix = policy.preferred.contains(&rows).then_some(1);
        let mut blocked = false;
        for entry in entries {
            let r = entry.job.rows();
            if rows + r > largest_preferred && best_prefix.is_none() {
                // What is gathered is as close to a preferred size as it gets.
                best_prefix = Some(count);
            }
            if !entry.job.fits_with(&first.job) || rows + r > policy.max_batch_size {
                blocked = true;
                break;
            }
            rows += r;
            count += 1;
            oldest = oldest.min(entry.enqueued);
            if policy.preferred.contains(&rows) {
                best_prefix = Some(count);
            }
        }
        let due = oldest + policy.max_queue_delay;
        // Without a delay a preferred prefix still goes first, as on Triton.
        let delay_over = !policy.max_queue_delay.is_zero() && now >= due;
        match best_prefix {
            Some(n) if !delay_over => Decision::Run(n),
            _ if blocked || rows >= largest_preferred || now >= due => Decision::Run(count),
            _ => Decision::WaitUntil(self.next_expiry().map_or(due, |t| t.min(due))),
        }
    }
}

#[cfg(test)]
mod tests;
