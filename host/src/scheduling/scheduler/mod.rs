//! The scheduler of one model version: a bounded, prioritised [`RequestQueue`] shared by one
//! worker thread per execution instance. A free worker asks the queue what to run (the dynamic
//! batcher's decision when `dynamic_batching` is configured, else the next request), runs it
//! on its instance and answers every request of the batch. Model code never runs on the async
//! runtime; a full queue answers UNAVAILABLE at once instead of growing without bound.
//!
//! One shared queue rather than one per instance: an idle instance always takes the oldest
//! work, and a batch can gather requests that arrived while every instance was busy.

use std::{
    collections::BTreeMap,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use super::{
    execution_share::{Execution, ExecutionShare, Wake, ACTIVE_WINDOW},
    queue::{BatchPolicy, Batchable, Decision, Entry, Refusal, RequestQueue, Share},
    rate_limiter::{Claim, Permit},
    readiness,
    stats::{FailureReason, ModelStats},
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    runtime::{batch, buckets::ShapeBuckets, ExecTimings, ModelInstance},
    tenancy::Caller,
    tensor::Tensor,
};

struct Job {
    request: InferRequest,
    outputs: Vec<String>,
    rows: u64,
    received: Instant,
    /// Arrival order, for `preserve_ordering`.
    seq: u64,
    /// The model's sequence padding, when requests batch by their padded shapes.
    padding: Option<Arc<ShapeBuckets>>,
    /// The model's ragged inputs, which may differ in shape within a batch.
    ragged: Option<Arc<[String]>>,
    reply: oneshot::Sender<Result<InferResponse>>,
    /// The instance that must run it (a sequence's, whose instance may keep its state).
    instance: Option<usize>,
    /// A request of a client, counted as an inference; not the filler row of an idle
    /// sequence slot, which counts only in its execution's batch size (as on Triton).
    counted: bool,
}

impl Batchable for Job {
    fn rows(&self) -> usize {
        self.rows as usize
    }
    /// Requests asking for different outputs batch too, as on Triton: the batch computes
    /// every output any of them asked for and each gets its own.
    fn fits_with(&self, other: &Self) -> bool {
        match (&self.padding, &self.ragged) {
            (Some(p), _) => p.compatible(&self.request, &other.request),
            (None, Some(r)) => batch::compatible_but(&self.request, &other.request, r),
            (None, None) => batch::compatible(&self.request, &other.request),
        }
    }
    fn share(&self) -> Option<Share<'_>> {
        // A stage's call for a batch of several tenants queues as the first of them.
        match self.request.callers.first()? {
            Caller::Tenant(t) => Some(Share {
                tenant: &t.name,
                weight: t.weight(),
                max_queued: t.max_queued_requests(),
            }),
            Caller::Anyone => None,
        }
    }
}

impl Job {
    /// Whose part of the server's executions it runs in: its tenant's, or none for work
    /// without a tenant and for calls a stage makes while it runs (the stage holds the slot).
    fn slot_owner(&self) -> Option<Share<'_>> {
        if self.request.from_stage {
            return None;
        }
        self.share()
    }
}

struct State {
    queue: RequestQueue<Job>,
    closed: bool,
    next_seq: u64,
    /// The model's own readiness checks, run by a free instance before queued batches.
    checks: readiness::Checks,
    /// Triton's test hook `TRITONSERVER_DELAY_SCHEDULER`: nothing runs until this many
    /// requests are queued (0: off; once reached, off for good).
    hold_until_queued: usize,
}

/// What a free worker does next.
enum Work {
    Batch(Taken),
    /// Run the model's readiness check.
    ReadinessCheck,
}

/// Responses held back until every earlier request has been answered (`preserve_ordering`).
struct Reorder<T> {
    next: u64,
    held: BTreeMap<u64, T>,
}

impl<T> Default for Reorder<T> {
    fn default() -> Self {
        Self {
            next: 0,
            held: BTreeMap::new(),
        }
    }
}

impl<T> Reorder<T> {
    /// Takes the answer to request `seq` and gives back every answer that may leave now, in
    /// arrival order.
    fn release(&mut self, seq: u64, answer: T) -> Vec<T> {
        self.held.insert(seq, answer);
        let mut ready = Vec::new();
        while let Some(answer) = self.held.remove(&self.next) {
            ready.push(answer);
            self.next += 1;
        }
        ready
    }
}

/// An answer and where it goes (held back while `preserve_ordering` waits for earlier ones).
type Delivery = (
    oneshot::Sender<Result<InferResponse>>,
    Result<InferResponse>,
);

struct WorkQueue {
    model: String,
    version: i64,
    policy: BatchPolicy,
    /// The same policy without waiting, used while shutting down.
    drain_policy: BatchPolicy,
    state: Mutex<State>,
    work: Condvar,
    stats: Arc<ModelStats>,
    reorder: Option<Mutex<Reorder<Delivery>>>,
    /// The server's executions, shared among tenants.
    share: Arc<ExecutionShare>,
    /// This, for the share to wake when a tenant's held-back work may run.
    this: std::sync::Weak<WorkQueue>,
    /// Whether requests pinned to an instance were ever queued: then every worker is woken
    /// for new work, as the one woken may not be allowed to take it.
    pinned: AtomicBool,
}

impl Wake for WorkQueue {
    fn wake(&self) {
        // Under the lock: a worker that found its work held back is already waiting.
        let _state = lock(&self.state);
        self.work.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic never happens while these locks are held (model code runs outside them).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Queue and workers of one model version. Dropping it lets the workers finish what is queued
/// (without waiting for batches to fill) and exit.
pub struct Scheduler {
    shared: Arc<WorkQueue>,
    instances: usize,
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.close();
    }
}

/// The refusal for a request whose tenant is held back from its model (see
/// [`crate::tenancy::Caller::check_backoff`]).
fn held_back(request: &InferRequest) -> Option<Error> {
    request
        .callers
        .iter()
        .find_map(|c| c.check_backoff(&request.model_name).err())
}

/// Every output the requests of a batch asked for, the first request's first, in order.
fn outputs_of<'a>(asked: impl Iterator<Item = &'a Vec<String>>) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for name in asked.flatten() {
        if !all.contains(name) {
            all.push(name.clone());
        }
    }
    all
}

/// The outputs one request asked for, in its order, from what its batch computed (`wanted`).
fn own_outputs(asked: &[String], wanted: &[String], mut computed: Vec<Tensor>) -> Vec<Tensor> {
    if asked == wanted {
        return computed;
    }
    asked
        .iter()
        .filter_map(|name| {
            let at = computed.iter().position(|t| &t.name == name)?;
            Some(computed.swap_remove(at))
        })
        .collect()
}

/// `TRITONSERVER_DELAY_SCHEDULER`, the number of queued requests Triton's QA tests ask the
/// batcher to wait for before it runs anything (0 when unset or not a number).
fn delay_scheduler() -> usize {
    std::env::var("TRITONSERVER_DELAY_SCHEDULER")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A request parameter as a non-negative integer.
fn uint_param(request: &InferRequest, key: &str) -> Option<u64> {
    request.parameters.get(key)?.as_u64()
}

impl Scheduler {
    /// Stops taking requests: what is queued runs at once (batches no longer wait to fill),
    /// then the workers exit. Called when the version is unloaded or replaced.
    pub fn close(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.work.notify_all();
    }

    /// Starts one worker thread per instance behind a queue of at most `queue_capacity` (0: none)
    /// requests, scheduling by `policy`; executions for tenants wait for their part of `share`.
    /// As on Triton, the environment variable `TRITONSERVER_DELAY_SCHEDULER=N` (a test hook)
    /// holds the first executions until `N` requests are queued.
    pub fn start(
        model: &str,
        version: i64,
        instances: Vec<Box<dyn ModelInstance>>,
        policy: BatchPolicy,
        queue_capacity: usize,
        stats: Arc<ModelStats>,
        limits: ExecutionLimits,
    ) -> Result<Self> {
        let ExecutionLimits { share, claims } = limits;
        let drain_policy = BatchPolicy {
            max_queue_delay: Duration::ZERO,
            preferred: Vec::new(),
            ..policy.clone()
        };
        let shared = Arc::new_cyclic(|this| WorkQueue {
            model: model.to_owned(),
            version,
            state: Mutex::new(State {
                queue: RequestQueue::new(&policy.levels, queue_capacity),
                closed: false,
                next_seq: 0,
                checks: Default::default(),
                hold_until_queued: delay_scheduler(),
            }),
            reorder: policy.preserve_ordering.then(Default::default),
            policy,
            drain_policy,
            work: Condvar::new(),
            stats,
            share,
            this: this.clone(),
            pinned: AtomicBool::new(false),
        });
        let mut claims = claims.into_iter();
        let count = instances.len();
        for (index, instance) in instances.into_iter().enumerate() {
            let shared = shared.clone();
            let claim = claims.next();
            std::thread::Builder::new()
                .name(format!("{model}-v{version}-{index}"))
                .spawn(move || shared.work_loop(index, instance, claim))
                .map_err(|e| {
                    Error::internal(format!("cannot start a worker for '{model}': {e}"))
                })?;
        }
        Ok(Self {
            shared,
            instances: count,
        })
    }

    /// How many instances run the model's requests.
    pub fn instance_count(&self) -> usize {
        self.instances
    }

    /// Readiness checks run the model's own check on an instance
    /// ([`ModelInstance::check_ready`]).
    pub fn enable_readiness_checks(&self) {
        lock(&self.shared.state).checks.enabled = true;
    }

    /// The model's own readiness check, run on a free instance (its answer waited for at
    /// most 5 s, as on Triton); `None` when the model has none.
    pub async fn check_readiness(&self) -> Option<bool> {
        let ask = {
            let mut state = lock(&self.shared.state);
            if !state.checks.enabled {
                return None;
            }
            if state.closed {
                return Some(false);
            }
            let (ask, wake) = state.checks.ask();
            if wake {
                // Every idle worker looks; a busy one takes it after its batch.
                self.shared.work.notify_all();
            }
            ask
        };
        Some(readiness::answer(ask).await)
    }

    /// Queues a validated request and waits for its response. `outputs` are the output names
    /// to return, in order; `rows` its batch size; `received` is when the frontend took it.
    /// The request parameters `priority` and `timeout` (microseconds) choose its priority
    /// level and shorten its queue timeout where the model's queue policy allows.
    pub async fn infer(
        &self,
        request: InferRequest,
        outputs: Vec<String>,
        rows: u64,
        received: Instant,
    ) -> Result<InferResponse> {
        self.infer_on(request, outputs, rows, received, None).await
    }

    /// [`Self::infer`], run by instance `instance` (of [`Self::instance_count`]) when given,
    /// batched only with requests that instance may run.
    pub async fn infer_on(
        &self,
        request: InferRequest,
        outputs: Vec<String>,
        rows: u64,
        received: Instant,
        instance: Option<usize>,
    ) -> Result<InferResponse> {
        let s = &self.shared;
        let level = s
            .policy
            .level_of(uint_param(&request, "priority").unwrap_or(0));
        let timeout = uint_param(&request, "timeout").map(Duration::from_micros);
        let (reply, response) = oneshot::channel();
        request.trace.mark("QUEUE_START");
        request.trace.tensors("TENSOR_QUEUE_INPUT", &request.inputs);
        let (refused, seq) = {
            let mut state = lock(&s.state);
            if state.closed {
                drop(state);
                s.stats
                    .record_failure(FailureReason::Rejected, received.elapsed());
                return Err(Error::unavailable(format!(
                    "model '{}' version {} is unloading",
                    s.model, s.version
                )));
            }
            let seq = state.next_seq;
            let job = Job {
                request,
                outputs,
                rows: rows.max(1),
                received,
                seq,
                reply,
                padding: s
                    .policy
                    .padding
                    .clone()
                    .filter(|p| p.sequence_multiple.is_some()),
                ragged: s.policy.ragged_inputs.clone(),
                instance: instance.filter(|&i| i < self.instances),
                counted: true,
            };
            let pushed = state.queue.push(level, job, timeout, Instant::now());
            if pushed.is_ok() {
                state.next_seq += 1;
                s.stats.pending.fetch_add(1, Relaxed);
            }
            (pushed.err(), seq)
        };
        if let Some((job, refusal)) = refused {
            let tenant = job.share().map(|share| share.tenant.to_owned());
            s.stats
                .record_failure(FailureReason::Rejected, received.elapsed());
            return Err(Error::unavailable(match refusal {
                Refusal::Full { capacity } => format!(
                    "model '{}' version {}: the request queue is full ({capacity} requests); \
                     retry later",
                    s.model, s.version
                ),
                Refusal::LevelFull { priority, max } => format!(
                    "model '{}' version {}: the queue of priority level {priority} is full \
                     (max_queue_size {max}); retry later",
                    s.model, s.version
                ),
                Refusal::TenantFull { max } => {
                    return Err(Error::resource_exhausted(format!(
                        "tenant '{}' has {max} requests queued for model '{}' already \
                         (quotas.max_queued_requests); retry later",
                        tenant.as_deref().unwrap_or_default(),
                        s.model
                    )))
                }
            }));
        }
        if instance.is_some() {
            s.pinned.store(true, Relaxed);
        }
        s.wake_for_work();
        // If the caller goes away (client disconnect, gRPC cancel, a failed ensemble step),
        // this future is dropped and the guard takes the request out of the queue.
        let mut guard = Waiting {
            shared: s,
            seq,
            answered: false,
        };
        let result = response.await;
        guard.answered = true;
        result.unwrap_or_else(|_| {
            Err(Error::internal(format!(
                "model '{}' version {}: the worker stopped before answering",
                s.model, s.version
            )))
        })
    }
}

impl Scheduler {
    /// Turns off the `TRITONSERVER_DELAY_SCHEDULER` hold of this queue: the sequence
    /// batcher's direct strategy holds its slots instead, as Triton's does.
    pub fn skip_delay_hook(&self) {
        lock(&self.shared.state).hold_until_queued = 0;
        self.shared.work.notify_all();
    }

    /// Runs a batch formed outside the queue as one execution of instance `instance`: every
    /// member is queued at once (one row each, nothing else pinned there to join them) and
    /// the answers come back in the members' order. The direct sequence strategy forms such
    /// batches from its slots. A member not `counted` is a filler row.
    pub async fn infer_batch_on(
        &self,
        instance: usize,
        members: Vec<BatchMember>,
    ) -> Vec<Result<InferResponse>> {
        let s = &self.shared;
        let count = members.len();
        let mut replies = Vec::with_capacity(count);
        let mut seqs = Vec::with_capacity(count);
        let refused = {
            let mut state = lock(&s.state);
            if state.closed {
                Some(Error::unavailable(format!(
                    "model '{}' version {} is unloading",
                    s.model, s.version
                )))
            } else {
                let mut refused = None;
                for member in members {
                    let (reply, response) = oneshot::channel();
                    member.request.trace.mark("QUEUE_START");
                    let seq = state.next_seq;
                    let job = Job {
                        request: member.request,
                        outputs: member.outputs,
                        rows: 1,
                        received: member.received,
                        seq,
                        reply,
                        padding: None,
                        ragged: s.policy.ragged_inputs.clone(),
                        instance: Some(instance.min(self.instances.saturating_sub(1))),
                        counted: member.counted,
                    };
                    let level = s.policy.default_level;
                    match state.queue.push(level, job, None, Instant::now()) {
                        Ok(()) => {
                            state.next_seq += 1;
                            s.stats.pending.fetch_add(1, Relaxed);
                            replies.push(response);
                            seqs.push(seq);
                        }
                        Err(_) => {
                            refused = Some(Error::unavailable(format!(
                                "model '{}' version {}: the request queue is full; retry later",
                                s.model, s.version
                            )));
                            break;
                        }
                    }
                }
                refused
            }
        };
        s.pinned.store(true, Relaxed);
        s.wake_for_work();
        // Dropped unanswered (the sequence batcher shutting down), they leave the queue.
        let mut guards: Vec<Waiting<'_>> = seqs
            .iter()
            .map(|&seq| Waiting {
                shared: s,
                seq,
                answered: false,
            })
            .collect();
        let answered = futures::future::join_all(replies).await;
        for guard in &mut guards {
            guard.answered = true;
        }
        let mut results: Vec<Result<InferResponse>> = answered
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|_| {
                    Err(Error::internal(format!(
                        "model '{}' version {}: the worker stopped before answering",
                        s.model, s.version
                    )))
                })
            })
            .collect();
        if let Some(err) = refused {
            // Those queued already ran; the rest get the refusal.
            results.resize(count, Err(err));
        }
        results
    }
}

/// One row of a batch formed outside the queue ([`Scheduler::infer_batch_on`]).
pub struct BatchMember {
    /// The request, one row.
    pub request: InferRequest,
    /// The outputs to return, in order.
    pub outputs: Vec<String>,
    /// When the frontend took it.
    pub received: Instant,
    /// A request of a client (false for a filler row: no answer is counted for it, and
    /// it counts only in the batch size).
    pub counted: bool,
}

/// What bounds a model's executions beyond its instances: the server's share among tenants,
/// and each instance's claim on the rate limiter's resources (none without it).
pub struct ExecutionLimits {
    /// The server's executions, shared among tenants.
    pub share: Arc<ExecutionShare>,
    /// One claim per instance, in instance order; empty without the rate limiter.
    pub claims: Vec<Arc<Claim>>,
}

/// A batch a worker took, with what lets it run: its tenant's slot and its resources.
struct Taken {
    batch: Vec<Entry<Job>>,
    execution: Option<Execution>,
    permit: Option<Permit>,
}

/// A queued request whose caller is waiting; dropped unanswered, it leaves the queue.
struct Waiting<'a> {
    shared: &'a WorkQueue,
    seq: u64,
    answered: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let s = self.shared;
        let removed = lock(&s.state).queue.remove_where(|j| j.seq == self.seq);
        if let Some(job) = removed {
            s.stats.pending.fetch_sub(1, Relaxed);
            let err = Error::new(crate::error::Code::Cancelled, "the request was cancelled");
            s.fail(job, FailureReason::Canceled, err);
        }
    }
}

mod worker;

#[cfg(test)]
mod tests;
