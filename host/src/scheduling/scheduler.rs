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

type Answer = (
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
    reorder: Option<Mutex<Reorder<Answer>>>,
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

impl WorkQueue {
    /// Wakes a worker for new work (every worker when some work is pinned to one).
    fn wake_for_work(&self) {
        if self.pinned.load(Relaxed) {
            self.work.notify_all();
        } else {
            self.work.notify_one();
        }
    }

    fn work_loop(
        &self,
        index: usize,
        mut instance: Box<dyn ModelInstance>,
        claim: Option<Arc<Claim>>,
    ) {
        while let Some(work) = self.next_batch(index, claim.as_ref()) {
            match work {
                Work::Batch(taken) => self.run_batch(instance.as_mut(), taken),
                Work::ReadinessCheck => {
                    // A check that panics or has nothing to run says "not ready".
                    let ready = catch_unwind(AssertUnwindSafe(|| instance.check_ready()))
                        .ok()
                        .flatten()
                        .unwrap_or(false);
                    lock(&self.state).checks.finish(ready);
                }
            }
        }
        if let Some(claim) = &claim {
            claim.withdraw();
        }
    }

    /// Waits until the queue says a batch should run on instance `index`, its tenant's part
    /// of the server's executions allows it and (with the rate limiter) the instance's
    /// resources are free, and takes it with its slot and resources (a readiness check asked
    /// for goes first); `None` once closed and empty.
    fn next_batch(&self, index: usize, claim: Option<&Arc<Claim>>) -> Option<Work> {
        let mut state = lock(&self.state);
        loop {
            if state.checks.start() {
                return Some(Work::ReadinessCheck);
            }
            if state.hold_until_queued > 0 {
                if state.queue.len() < state.hold_until_queued && !state.closed {
                    state = self
                        .work
                        .wait_timeout(state, Duration::from_millis(10))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    continue;
                }
                state.hold_until_queued = 0;
                self.work.notify_all();
            }
            let now = Instant::now();
            let expired = state.queue.expire(now);
            if !expired.is_empty() {
                self.stats.pending.fetch_sub(expired.len() as i64, Relaxed);
                for job in expired {
                    self.fail(
                        job,
                        FailureReason::Rejected,
                        Error::unavailable(format!(
                            "model '{}' version {}: the request timed out in the queue \
                             (queue policy timeout)",
                            self.model, self.version
                        )),
                    );
                }
            }
            let policy = if state.closed {
                &self.drain_policy
            } else {
                &self.policy
            };
            let (decision, taken) = {
                let mut gate = (self.share.slots() > 0).then(|| self.share.gate());
                // Requests of tenants over their part wait; the others may pass them.
                let mut eligible = |job: &Job| {
                    job.instance.is_none_or(|i| i == index)
                        && match (&mut gate, job.slot_owner()) {
                            (Some(gate), Some(s)) => gate.admits(s.tenant, s.weight),
                            _ => true,
                        }
                };
                let decision = state.queue.decide_among(policy, now, &mut eligible);
                // With the rate limiter, the instance runs only with its resources.
                let permit = match (&decision, claim) {
                    (Decision::Run(_), Some(c)) => c.acquire(self.this.clone()).map(Some),
                    _ => Some(None),
                };
                let taken = match (decision, permit) {
                    (Decision::Run(_), None) => None,
                    (Decision::Run(n), Some(permit)) => {
                        let batch = state.queue.take_among(n, &mut eligible);
                        let owner = batch.first().and_then(|e| e.job.slot_owner());
                        let execution = match (&mut gate, owner) {
                            (Some(gate), Some(s)) => Some(gate.start(s.tenant, s.weight)),
                            _ => None,
                        };
                        Some((batch, execution, permit))
                    }
                    (Decision::Idle, _) if !state.queue.is_empty() => {
                        if let Some(gate) = &mut gate {
                            gate.wait(self.this.clone());
                        }
                        None
                    }
                    _ => None,
                };
                (decision, taken)
            };
            match (decision, taken) {
                (Decision::Run(_), Some((batch, execution, permit))) => {
                    self.stats.pending.fetch_sub(batch.len() as i64, Relaxed);
                    if !state.queue.is_empty() {
                        // More work: another free worker may take it.
                        self.wake_for_work();
                    }
                    return Some(Work::Batch(Taken {
                        batch,
                        execution,
                        permit,
                    }));
                }
                _ if state.queue.is_empty() && claim.is_some_and(|c| c.pending()) => {
                    // No work left for resources it waits for or was given: let others have
                    // them. Withdrawing wakes other schedulers, so not under this lock.
                    drop(state);
                    if let Some(c) = claim {
                        c.withdraw();
                    }
                    state = lock(&self.state);
                }
                (Decision::WaitUntil(at), _) => {
                    let wait = at.saturating_duration_since(now);
                    state = self
                        .work
                        .wait_timeout(state, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                _ if state.queue.is_empty() && state.closed => return None,
                _ if state.queue.is_empty() => {
                    state = self
                        .work
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                _ => {
                    // Held back by the share: woken when an execution ends; the timeout only
                    // catches queue timeouts and tenants leaving the active window.
                    let wait = state
                        .queue
                        .next_expiry()
                        .map_or(ACTIVE_WINDOW, |t| t.saturating_duration_since(now))
                        .min(ACTIVE_WINDOW);
                    state = self
                        .work
                        .wait_timeout(state, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }

    fn run_batch(&self, instance: &mut dyn ModelInstance, taken: Taken) {
        let Taken {
            batch,
            execution,
            permit,
        } = taken;
        let started = Instant::now();
        let mut jobs = Vec::with_capacity(batch.len());
        for entry in batch {
            if entry.job.reply.is_closed() {
                // Its caller left between the queue and here: nothing to run it for.
                let err = Error::new(crate::error::Code::Cancelled, "the request was cancelled");
                self.fail(entry.job, FailureReason::Canceled, err);
            } else if entry.job.request.deadline.is_some_and(|d| d <= started) {
                // Whoever sent it has given up waiting: running it would only delay others.
                let err = Error::unavailable(format!(
                    "model '{}' version {}: the request reached its deadline while queued",
                    self.model, self.version
                ));
                self.fail(entry.job, FailureReason::Rejected, err);
            } else if let Some(err) = held_back(&entry.job.request) {
                // Its tenant's requests began failing in this model while it waited: it is
                // held back like those that arrive now, instead of crashing the stage again.
                self.fail(entry.job, FailureReason::Rejected, err);
            } else {
                jobs.push((entry.job, started - entry.enqueued));
            }
        }
        let Some((first, _)) = jobs.first() else {
            return;
        };
        let requests: Vec<&InferRequest> = jobs.iter().map(|(j, _)| &j.request).collect();
        // A batch is traced under its first request (the others' traces end at their queue).
        let span = crate::trace_span!(
            parent: &first.request.trace.0,
            "execute",
            model = %self.model,
            version = self.version,
            batch = requests.len()
        );
        let wanted = outputs_of(jobs.iter().map(|(j, _)| &j.outputs));
        let (results, timings) = catch_unwind(AssertUnwindSafe(|| {
            span.in_scope(|| instance.execute_batch(&requests, &wanted))
        }))
        .unwrap_or_else(|_| {
            let err = Error::internal(format!(
                "model '{}' version {}: the backend panicked",
                self.model, self.version
            ));
            (vec![Err(err); requests.len()], ExecTimings::default())
        });
        let ended = Instant::now();
        // The slot and the resources are free again as soon as the model is done.
        drop(execution);
        drop(permit);
        // Every traced request of the batch gets the execution's timestamps, as on Triton.
        for ((job, _), result) in jobs.iter().zip(&results) {
            let trace = &job.request.trace;
            if !trace.is_traced() {
                continue;
            }
            trace.mark_at("COMPUTE_START", started);
            trace.tensors("TENSOR_BACKEND_INPUT", &job.request.inputs);
            trace.mark_at("COMPUTE_INPUT_END", started + timings.compute_input);
            let output_start = ended.checked_sub(timings.compute_output).unwrap_or(started);
            trace.mark_at("COMPUTE_OUTPUT_START", output_start.max(started));
            if let Ok(outputs) = result {
                trace.tensors("TENSOR_BACKEND_OUTPUT", outputs);
            }
            trace.mark_at("COMPUTE_END", ended);
        }
        self.stats
            .padded_rows
            .fetch_add(timings.padded_rows, Relaxed);
        let succeeded: u64 = jobs
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((j, _), _)| j.rows)
            .sum();
        if succeeded > 0 {
            self.stats.record_execution(
                succeeded,
                timings.compute_input,
                timings.compute_infer,
                timings.compute_output,
            );
        }
        for ((job, queued), result) in jobs.into_iter().zip(results) {
            let again = job.request.reschedule.take();
            match result {
                Ok(_) if again => self.reschedule(job),
                Ok(outputs) => {
                    let outputs = own_outputs(&job.outputs, &wanted, outputs);
                    self.succeed(job, queued, &timings, outputs)
                }
                Err(err) => self.fail(job, FailureReason::Backend, err),
            }
        }
    }

    /// Queues a request its model released to run again (Triton's request rescheduling):
    /// it keeps its reply, its response stream and its order of arrival, and takes no new
    /// queue timeout.
    fn reschedule(&self, job: Job) {
        let level = self
            .policy
            .level_of(uint_param(&job.request, "priority").unwrap_or(0));
        let mut state = lock(&self.state);
        if state.closed {
            drop(state);
            let err = Error::unavailable(format!(
                "model '{}' version {} is unloading: a rescheduled request cannot run again",
                self.model, self.version
            ));
            self.fail(job, FailureReason::Rejected, err);
            return;
        }
        match state.queue.push(level, job, None, Instant::now()) {
            Ok(()) => {
                self.stats.pending.fetch_add(1, Relaxed);
                self.wake_for_work();
            }
            Err((job, _)) => {
                drop(state);
                let err = Error::unavailable(format!(
                    "model '{}' version {}: the queue is full, a rescheduled request cannot \
                     run again",
                    self.model, self.version
                ));
                self.fail(job, FailureReason::Rejected, err);
            }
        }
    }

    fn succeed(&self, job: Job, queued: Duration, timings: &ExecTimings, outputs: Vec<Tensor>) {
        self.stats.record_success(
            queued,
            timings.compute_input,
            timings.compute_infer,
            timings.compute_output,
            job.received.elapsed(),
        );
        if let Some(steps) = &job.request.step_durations {
            steps.add([
                queued,
                timings.compute_input,
                timings.compute_infer,
                timings.compute_output,
            ]);
        }
        let Job {
            mut request,
            reply,
            seq,
            ..
        } = job;
        let response = InferResponse {
            model_name: self.model.clone(),
            model_version: self.version,
            parameters: request.reply_parameters.take(),
            id: std::mem::take(&mut request.id),
            outputs,
        };
        // The request (its trace span with it) ends before its answer leaves, so whoever
        // waits for the answer finds the trace complete.
        drop(request);
        self.deliver(seq, reply, Ok(response));
    }

    fn fail(&self, job: Job, reason: FailureReason, err: Error) {
        self.stats.record_failure(reason, job.received.elapsed());
        let Job {
            request,
            reply,
            seq,
            ..
        } = job;
        drop(request);
        self.deliver(seq, reply, Err(err));
    }

    /// Sends a response, or with `preserve_ordering` holds it until every earlier request has
    /// been answered. A client that went away simply does not get its response.
    fn deliver(
        &self,
        seq: u64,
        reply: oneshot::Sender<Result<InferResponse>>,
        result: Result<InferResponse>,
    ) {
        let Some(reorder) = &self.reorder else {
            let _ = reply.send(result);
            return;
        };
        let ready = lock(reorder).release(seq, (reply, result));
        for (reply, result) in ready {
            let _ = reply.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenancy::{hash_key, Tenancy};
    use std::collections::HashMap;

    /// What the probe instances saw: executions running and the most at once, per tenant.
    #[derive(Default)]
    struct Seen {
        running: HashMap<String, usize>,
        most: HashMap<String, usize>,
        released: bool,
    }

    type Board = Arc<(Mutex<Seen>, Condvar)>;

    /// An instance that counts executions per tenant and holds tenant "a"'s until released.
    struct Probe(Board);

    impl ModelInstance for Probe {
        fn execute_batch(
            &mut self,
            requests: &[&InferRequest],
            outputs: &[String],
        ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
            batch::execute_merged(requests, outputs, |r, o| self.run(r, o))
        }
    }

    impl Probe {
        fn run(
            &mut self,
            request: &InferRequest,
            _: &[String],
        ) -> Result<(Vec<Tensor>, ExecTimings)> {
            let tenant = request.callers.first().and_then(Caller::tenant);
            let tenant = tenant.unwrap_or_default().to_owned();
            let (seen, released) = &*self.0;
            let mut s = lock(seen);
            let now = *s.running.entry(tenant.clone()).or_default() + 1;
            s.running.insert(tenant.clone(), now);
            let most = s.most.entry(tenant.clone()).or_default();
            *most = (*most).max(now);
            released.notify_all();
            while tenant == "a" && !s.released {
                s = released.wait(s).unwrap_or_else(PoisonError::into_inner);
            }
            if tenant == "b" {
                // Long enough for executions on other instances to overlap this one.
                drop(s);
                std::thread::sleep(Duration::from_millis(20));
                s = lock(seen);
            }
            *s.running.entry(tenant).or_default() -= 1;
            Ok((Vec::new(), ExecTimings::default()))
        }
    }

    fn tenants() -> (Caller, Caller) {
        let text = format!(
            "[[tenant]]\nname = \"a\"\napi_keys = [\"{}\"]\ninfer = [\"*\"]\n\
             [[tenant]]\nname = \"b\"\napi_keys = [\"{}\"]\ninfer = [\"*\"]\n",
            hash_key("a-key"),
            hash_key("b-key")
        );
        let t = Tenancy::parse(&text, "w.toml").unwrap();
        let caller = |key: &str| t.authenticate(Some(&format!("Bearer {key}"))).unwrap();
        (caller("a-key"), caller("b-key"))
    }

    /// A model of three probe instances under `share`.
    fn model(share: ExecutionShare) -> (Arc<Scheduler>, Board) {
        let board: Board = Default::default();
        (model_on(&board, Arc::new(share), Vec::new()), board)
    }

    /// A model of three probe instances on `board`, with `claims` from a rate limiter.
    fn model_on(
        board: &Board,
        share: Arc<ExecutionShare>,
        claims: Vec<Arc<Claim>>,
    ) -> Arc<Scheduler> {
        let instances: Vec<Box<dyn ModelInstance>> = (0..3)
            .map(|_| Box::new(Probe(board.clone())) as Box<dyn ModelInstance>)
            .collect();
        let scheduler = Scheduler::start(
            "m",
            1,
            instances,
            BatchPolicy::one_at_a_time(),
            100,
            Default::default(),
            ExecutionLimits { share, claims },
        )
        .unwrap();
        Arc::new(scheduler)
    }

    fn call(
        scheduler: &Arc<Scheduler>,
        caller: &Caller,
    ) -> tokio::task::JoinHandle<Result<InferResponse>> {
        let (scheduler, caller) = (scheduler.clone(), caller.clone());
        tokio::spawn(async move {
            let request = InferRequest {
                model_name: "m".into(),
                callers: vec![caller],
                ..Default::default()
            };
            scheduler
                .infer(request, Vec::new(), 1, Instant::now())
                .await
        })
    }

    /// Waits (up to a minute) until `tenant` has had `n` executions running at once.
    fn wait_for_most(board: &Board, tenant: &str, n: usize) -> usize {
        let (seen, changed) = &**board;
        let mut s = lock(seen);
        let until = Instant::now() + Duration::from_secs(60);
        while s.most.get(tenant).copied().unwrap_or(0) < n && Instant::now() < until {
            s = changed
                .wait_timeout(s, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        s.most.get(tenant).copied().unwrap_or(0)
    }

    fn release(board: &Board) {
        lock(&board.0).released = true;
        board.1.notify_all();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flooding_tenant_leaves_an_instance_to_an_active_one() {
        let (a, b) = tenants();
        let (m, board) = model(ExecutionShare::with_window(2, Duration::from_secs(3600)));
        call(&m, &b).await.unwrap().unwrap();
        let flood: Vec<_> = (0..6).map(|_| call(&m, &a)).collect();
        let held = board.clone();
        assert_eq!(
            tokio::task::spawn_blocking(move || wait_for_most(&held, "a", 1))
                .await
                .unwrap(),
            1
        );
        // a's execution is held: b can only be answered if a left it an instance.
        let answered = tokio::time::timeout(Duration::from_secs(60), call(&m, &b)).await;
        assert!(
            matches!(answered, Ok(Ok(Ok(_)))),
            "b waited behind a's flood"
        );
        release(&board);
        for r in flood {
            r.await.unwrap().unwrap();
        }
        assert_eq!(
            lock(&board.0).most["a"],
            1,
            "a ran beyond its part of 2 slots"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tenant_alone_uses_every_instance() {
        let (a, _) = tenants();
        let (m, board) = model(ExecutionShare::with_window(2, Duration::from_secs(3600)));
        let flood: Vec<_> = (0..6).map(|_| call(&m, &a)).collect();
        let held = board.clone();
        let most = tokio::task::spawn_blocking(move || wait_for_most(&held, "a", 3))
            .await
            .unwrap();
        release(&board);
        for r in flood {
            r.await.unwrap().unwrap();
        }
        assert_eq!(most, 3, "alone, a is not held to a part");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_models_sharing_one_resource_never_run_at_once() {
        use crate::scheduling::rate_limiter::RateLimiter;
        let (_, b) = tenants();
        let limiter = Arc::new(RateLimiter::new(&["R:1".into()]).unwrap());
        let config = crate::repository::config::parse_text(
            "name: \"m\"\ninstance_group [ { count: 3, kind: KIND_CPU, rate_limiter { \
             resources [ { name: \"R\", count: 1 } ] } } ]\n",
            std::path::Path::new("m"),
        )
        .unwrap();
        let board: Board = Default::default();
        let share = Arc::new(ExecutionShare::new(0));
        let models: Vec<_> = (0..2)
            .map(|_| {
                let claims = limiter.claims(&config, 3).unwrap();
                model_on(&board, share.clone(), claims)
            })
            .collect();
        let calls: Vec<_> = (0..12).map(|i| call(&models[i % 2], &b)).collect();
        for c in calls {
            c.await.unwrap().unwrap();
        }
        // Six instances with work, one resource: one execution at a time.
        assert_eq!(lock(&board.0).most["b"], 1);
    }

    #[test]
    fn answers_leave_in_arrival_order() {
        let mut r = Reorder::default();
        assert!(r.release(1, "b").is_empty(), "waits for request 0");
        assert!(r.release(2, "c").is_empty());
        assert_eq!(r.release(0, "a"), ["a", "b", "c"]);
        assert_eq!(r.release(3, "d"), ["d"]);
    }
}
