//! A decoupled Python model whose `execute` is `async def`, run as Triton runs it: each
//! batch's coroutine is started in the background and the instance takes the next batch while
//! earlier ones await (`asyncio.sleep`, `async_exec`), so several batches overlap on one
//! interpreter. The interpreter has a thread of its own ([`BackgroundInstance`]): between
//! batches it waits there for what the guest's event loop waits for — a batch, an answer of a
//! call into another model, a timer — and the scheduler's worker only hands batches over.
//!
//! A batch is taken as soon as the guest's loop is free: the worker then moves on, and the
//! batch's requests stay open (their response senders live in the batch's host side) until its
//! coroutine has returned. An error it raised reaches each request that had not sent its
//! final flag; a request whose own timeout passes first gets an error and is closed. At most
//! [`MAX_IN_FLIGHT`] batches run at once per instance; more wait in the queue.

use std::{
    collections::{HashMap, VecDeque},
    sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use super::{
    batch_calls::BatchCalls,
    interpreter::{self, HostCalls as _, Interpreter},
    model::PythonModel,
    protocol::{self, Frame, Op, ResponseHeader},
};
use crate::{
    cancellation::Cancellation,
    error::{Code, Error, Result},
    inference::{InferRequest, StreamedResponse},
    runtime::backend::{ExecTimings, ModelInstance},
    tensor::Tensor,
};

/// The most batches one instance runs at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// How often streams of calls into decoupled models are looked at while a coroutine awaits
/// one (nothing signals their responses).
const STREAM_TICK: Duration = Duration::from_millis(2);

/// A batch (or readiness check) for the guest, and where the answer goes: a batch is answered
/// when the guest takes it (`None`), a readiness check when the guest has run it.
struct Job {
    calls: BatchCalls,
    probe: bool,
    reply: mpsc::Sender<Result<Option<BatchCalls>>>,
}

/// What the instance, its thread and the calls in flight share.
#[derive(Default)]
struct Inbox {
    jobs: VecDeque<Job>,
    /// The instance is being dropped.
    closed: bool,
    /// The guest waits for something to happen ([`Op::Events`]).
    waiting: bool,
    /// Until when it waits, at most.
    wake_at: Option<Instant>,
    /// The guest has [`MAX_IN_FLIGHT`] batches already: a new one does not wake it.
    full: bool,
    /// A call into another model has its answer.
    poked: bool,
}

#[derive(Default)]
struct Shared {
    inbox: Mutex<Inbox>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn poke(&self) {
        self.lock().poked = true;
        self.changed.notify_all();
    }

    /// Blocks the instance's thread while the guest waits and nothing it waits for happened.
    fn wait_for_change(&self) {
        let mut inbox = self.lock();
        loop {
            if !inbox.waiting
                || inbox.closed
                || inbox.poked
                || (!inbox.jobs.is_empty() && !inbox.full)
            {
                inbox.poked = false;
                return;
            }
            let now = Instant::now();
            inbox = match inbox.wake_at {
                Some(at) if at <= now => return,
                Some(at) => {
                    self.changed
                        .wait_timeout(inbox, at - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => self
                    .changed
                    .wait(inbox)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Answers every queued job with `error`.
    fn fail_queued(&self, error: &Error) {
        for job in self.lock().jobs.drain(..) {
            let _ = job.reply.send(Err(error.clone()));
        }
    }
}

/// How long a batch whose requests were all cancelled keeps running: time for a model that
/// checks `request.is_cancelled()` to answer with its own error; then its task is cancelled.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// A batch the guest runs.
struct InFlight {
    calls: BatchCalls,
    /// A readiness check's reply, sent with the guest's answer.
    probe: Option<mpsc::Sender<Result<Option<BatchCalls>>>>,
    /// When its requests were first seen all cancelled.
    cancelled_at: Option<Instant>,
}

impl InFlight {
    /// When the batch is closed: its requests' own timeout, or the end of its grace once
    /// they were all cancelled.
    fn due(&mut self) -> Option<Instant> {
        let slots = &self.calls.slots;
        if self.cancelled_at.is_none()
            && self.probe.is_none()
            && !slots.is_empty()
            && slots
                .iter()
                .all(super::batch_calls::RequestSlot::is_cancelled)
        {
            self.cancelled_at = Some(Instant::now());
        }
        let grace = self.cancelled_at.map(|at| at + CANCEL_GRACE);
        self.calls.deadline.into_iter().chain(grace).min()
    }
}

/// Sends `error` to each request of a batch that ended without its answers, and closes them.
fn fail(batch: InFlight, error: &Error) {
    if let Some(reply) = batch.probe {
        let _ = reply.send(Err(error.clone()));
        return;
    }
    for slot in &batch.calls.slots {
        if let Some(sink) = &slot.sink {
            let response = StreamedResponse {
                error: Some(error.clone()),
                last: true,
                ..Default::default()
            };
            // A reader that takes nothing is not waited for.
            let _ = sink.send_blocking(response, Some(Instant::now()));
        }
    }
}

/// The header of the guest's answer to a background batch: an error per request that had
/// not sent its final flag when `execute` raised.
#[derive(serde::Deserialize)]
struct EndedHeader {
    #[serde(default)]
    responses: Vec<Option<ResponseHeader>>,
}

/// The host side of a background serving loop.
struct BackgroundCalls {
    model: Arc<PythonModel>,
    shared: Arc<Shared>,
    batches: HashMap<u64, InFlight>,
    /// The batch the guest's frames belong to ([`Op::Select`]).
    selected: u64,
    next_id: u64,
    /// Frames outside a batch (`finalize`'s log lines).
    idle: BatchCalls,
    /// Until when the guest's current [`Op::Events`] waits.
    events_until: Option<Option<Instant>>,
    /// Batches closed by the host whose tasks the guest is to cancel.
    dropped: Vec<u64>,
    /// When the instance was told to close: batches in flight get until the execution
    /// timeout to end.
    closing_since: Option<Instant>,
    nearly_full: bool,
    served: u64,
}

impl BackgroundCalls {
    fn restart(&self) -> bool {
        self.nearly_full || (self.model.limits.fresh_instance_per_request && self.served > 0)
    }

    fn can_take(&self, inbox: &Inbox) -> bool {
        !inbox.jobs.is_empty()
            && !inbox.closed
            && self.batches.len() < MAX_IN_FLIGHT
            && !self.restart()
    }

    /// Whether the loop should end: the instance closes (once its batches ended, or their
    /// time is up) or starts afresh (once its batches ended).
    fn closing(&mut self, inbox: &Inbox) -> bool {
        if inbox.closed {
            let since = *self.closing_since.get_or_insert_with(Instant::now);
            return self.batches.is_empty() || since.elapsed() >= self.model.timeout();
        }
        self.restart() && self.batches.is_empty()
    }

    /// Whether a call a coroutine awaits has something for it; and whether one is a stream.
    fn calls_ready(&mut self) -> (bool, bool) {
        let mut streams = false;
        for batch in self.batches.values_mut() {
            let (ready, stream) = batch.calls.awaited_ready();
            if ready {
                return (true, stream);
            }
            streams |= stream;
        }
        (false, streams)
    }

    /// Closes the batches whose requests' own timeout has passed, or which nobody has
    /// waited for since [`CANCEL_GRACE`]; the guest is told to cancel their tasks.
    fn expire(&mut self) {
        let now = Instant::now();
        let due: Vec<u64> = self
            .batches
            .iter_mut()
            .filter_map(|(id, b)| b.due().is_some_and(|d| d <= now).then_some(*id))
            .collect();
        for id in due {
            if let Some(batch) = self.batches.remove(&id) {
                let error = if batch.cancelled_at.is_some() {
                    tracing::info!(
                        model = %self.model.name,
                        "a background batch whose requests were all cancelled {} s ago was \
                         stopped",
                        CANCEL_GRACE.as_secs()
                    );
                    Error::new(Code::Cancelled, "the request was cancelled")
                } else {
                    Error::unavailable(format!(
                        "the request's timeout passed while model '{}' was still working on it",
                        self.model.name
                    ))
                };
                fail(batch, &error);
                self.dropped.push(id);
            }
        }
    }

    /// The earliest time a batch is due to close.
    fn next_due(&mut self) -> Option<Instant> {
        self.batches.values_mut().filter_map(InFlight::due).min()
    }

    fn events(&mut self) -> Vec<u8> {
        self.events_until = None;
        self.expire();
        let shared = self.shared.clone();
        let inbox = shared.lock();
        let batches = self.can_take(&inbox);
        let closing = self.closing(&inbox);
        drop(inbox);
        let (calls, _) = self.calls_ready();
        let cancel = std::mem::take(&mut self.dropped);
        serde_json::json!({
            "batches": batches,
            "closing": closing,
            "calls": calls,
            "cancel": cancel,
        })
        .to_string()
        .into_bytes()
    }

    fn next(&mut self) -> Vec<u8> {
        let job = {
            let mut inbox = self.shared.lock();
            if self.can_take(&inbox) {
                inbox.jobs.pop_front()
            } else {
                None
            }
        };
        let Some(mut job) = job else {
            return Vec::new();
        };
        let id = self.next_id;
        self.next_id += 1;
        self.served += 1;
        let mut frame = id.to_le_bytes().to_vec();
        frame.extend_from_slice(&std::mem::take(&mut job.calls.batch));
        let probe = if job.probe {
            Some(job.reply)
        } else {
            // Taken: the scheduler's worker goes on with the next batch.
            let _ = job.reply.send(Ok(None));
            None
        };
        self.batches.insert(
            id,
            InFlight {
                calls: job.calls,
                probe,
                cancelled_at: None,
            },
        );
        frame
    }

    /// The guest's answer to the selected batch: the batch ends.
    fn ended(&mut self, frame: &[u8]) {
        let Some(mut batch) = self.batches.remove(&self.selected) else {
            return;
        };
        batch.calls.call(frame);
        if let Some(reply) = batch.probe.take() {
            let _ = reply.send(Ok(Some(batch.calls)));
            return;
        }
        self.model.health.record_success();
        let calls = &batch.calls;
        let errors: Vec<Option<Error>> = match &calls.refused_call {
            Some(e) => vec![Some(e.clone()); calls.slots.len()],
            None => calls
                .responses
                .as_deref()
                .and_then(|f| Frame::<EndedHeader>::parse(f).ok())
                .map(|f| {
                    f.header
                        .responses
                        .into_iter()
                        .map(|r| {
                            r.and_then(|r| r.error)
                                .map(|e| protocol::from_triton_code(&e.code, e.message))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        };
        for (slot, error) in calls.slots.iter().zip(errors) {
            if let (Some(sink), Some(error)) = (&slot.sink, error) {
                let response = StreamedResponse {
                    error: Some(error),
                    last: true,
                    ..Default::default()
                };
                let _ = sink.send_blocking(response, calls.deadline);
            }
        }
        // Dropping the host side closes the requests' streams.
    }

    /// The host side the guest's frame goes to: the selected batch's, or (outside batches, or for
    /// a batch that has ended) the idle one.
    fn route(&mut self, frame: &[u8]) -> Vec<u8> {
        let op = frame.first().copied().and_then(Op::of);
        if let Some(batch) = self.batches.get_mut(&self.selected) {
            return batch.calls.call(frame);
        }
        let batch_scoped = matches!(
            op,
            Some(
                Op::Send
                    | Op::Infer
                    | Op::Start
                    | Op::Wait
                    | Op::Poll
                    | Op::StreamOpen
                    | Op::StreamNext
                    | Op::StreamPoll
                    | Op::StreamCancel
                    | Op::Cancelled
                    | Op::Repository
            )
        );
        if self.selected != 0 && batch_scoped {
            let error = Error::new(
                Code::Cancelled,
                format!(
                    "model '{}': this batch has ended (its requests timed out, or the \
                     instance is closing)",
                    self.model.name
                ),
            );
            return self.idle.refuse(frame, &error);
        }
        self.idle.call(frame)
    }
}

impl interpreter::HostCalls for BackgroundCalls {
    fn poll_ready(
        &mut self,
        frame: &[u8],
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if frame.first().copied().and_then(Op::of) != Some(Op::Events) {
            return std::task::Poll::Ready(());
        }
        let until = *self.events_until.get_or_insert_with(|| {
            std::str::from_utf8(&frame[1..])
                .ok()
                .and_then(|ms| ms.trim().parse::<i64>().ok())
                .filter(|ms| *ms >= 0)
                .map(|ms| Instant::now() + Duration::from_millis(ms.unsigned_abs()))
        });
        self.expire();
        let (calls, streams) = self.calls_ready();
        let shared = self.shared.clone();
        let mut inbox = shared.lock();
        let now = Instant::now();
        if calls
            || !self.dropped.is_empty()
            || self.can_take(&inbox)
            || self.closing(&inbox)
            || until.is_some_and(|t| t <= now)
        {
            inbox.waiting = false;
            return std::task::Poll::Ready(());
        }
        let mut wake_at = until.into_iter().chain(self.next_due()).min();
        if streams {
            wake_at = Some(wake_at.map_or(now + STREAM_TICK, |t| t.min(now + STREAM_TICK)));
        }
        if inbox.closed {
            // Look again when the batches' time to end is up.
            let end = now + Duration::from_millis(100);
            wake_at = Some(wake_at.map_or(end, |t| t.min(end)));
        }
        inbox.wake_at = wake_at;
        inbox.full = self.batches.len() >= MAX_IN_FLIGHT;
        inbox.waiting = true;
        std::task::Poll::Pending
    }

    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        match frame.first().copied().and_then(Op::of) {
            Some(Op::Events) => self.events(),
            Some(Op::Next) => self.next(),
            Some(Op::Select) => {
                self.selected = std::str::from_utf8(&frame[1..])
                    .ok()
                    .and_then(|id| id.trim().parse().ok())
                    .unwrap_or(0);
                Vec::new()
            }
            Some(Op::Responses) => {
                self.ended(frame);
                Vec::new()
            }
            _ => self.route(frame),
        }
    }

    fn memory(&mut self, nearly_full: bool) {
        self.nearly_full = nearly_full;
    }

    /// Each stretch of guest code between two calls gets the execution timeout: a coroutine
    /// that spins is stopped like any turn, one that awaits costs nothing.
    fn rearm(&mut self) -> Option<(Instant, Option<Cancellation>)> {
        Some((Instant::now() + self.model.timeout(), None))
    }
}

/// A serving loop in progress.
type Serving = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = (
                    Interpreter,
                    std::result::Result<(), Error>,
                    Option<BackgroundCalls>,
                ),
            > + Send,
    >,
>;

fn serve(model: &Arc<PythonModel>, shared: &Arc<Shared>, mut interp: Interpreter) -> Serving {
    let model = model.clone();
    let calls = BackgroundCalls {
        idle: BatchCalls::idle(model.clone()),
        model: model.clone(),
        shared: shared.clone(),
        batches: HashMap::new(),
        selected: 0,
        next_id: 1,
        events_until: None,
        dropped: Vec::new(),
        closing_since: None,
        nearly_full: false,
        served: 0,
    };
    Box::pin(async move {
        let (result, calls) = model
            .turn_with_async(
                &mut interp,
                "_wasmtron.serve_background()",
                calls,
                None,
                "execute",
            )
            .await;
        (interp, result, calls)
    })
}

/// The instance's thread: runs serving loops (a fresh interpreter after one ends) until the
/// instance closes.
fn run(model: Arc<PythonModel>, index: usize, shared: Arc<Shared>, mut live: Option<Interpreter>) {
    loop {
        if live.is_none() {
            // A new interpreter starts when there is work for it.
            let mut inbox = shared.lock();
            while inbox.jobs.is_empty() && !inbox.closed {
                inbox = shared
                    .changed
                    .wait(inbox)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if inbox.closed {
                drop(inbox);
                shared.fail_queued(&closed(&model));
                return;
            }
        }
        let interp = match live.take().map_or_else(|| model.start(index), Ok) {
            Ok(interp) => interp,
            Err(e) => {
                shared.fail_queued(&e);
                continue;
            }
        };
        let mut serving = serve(&model, &shared, interp);
        let (interp, result, calls) = loop {
            if let Some(ended) = interpreter::drive(&mut serving, || shared.lock().waiting) {
                break ended;
            }
            shared.wait_for_change();
        };
        // A trapped or restarting interpreter is never entered again.
        drop(interp);
        if let Some(mut calls) = calls {
            if let Some(f) = calls.idle.failure.take() {
                tracing::warn!(model = %model.name, "finalize raised: {f}");
            }
            let error = match result {
                Err(e) => e,
                Ok(()) => closed(&model),
            };
            for (_, batch) in calls.batches.drain() {
                fail(batch, &error);
            }
        } else if let Err(e) = result {
            tracing::warn!(model = %model.name, "{}", e.message);
        }
        if shared.lock().closed {
            shared.fail_queued(&closed(&model));
            return;
        }
    }
}

fn closed(model: &PythonModel) -> Error {
    Error::unavailable(format!("model '{}' is being unloaded", model.name))
}

/// One execution instance of a model whose batches run in the background.
pub(super) struct BackgroundInstance {
    model: Arc<PythonModel>,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundInstance {
    pub(super) fn new(
        model: Arc<PythonModel>,
        index: usize,
        live: Option<Interpreter>,
    ) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("python-async".into())
            .spawn({
                let (model, shared) = (model.clone(), shared.clone());
                move || run(model, index, shared, live)
            })
            .map_err(|e| Error::internal(format!("cannot start a Python instance: {e}")))?;
        Ok(Self {
            model,
            shared,
            thread: Some(thread),
        })
    }

    /// Hands a job to the instance's thread and waits for its answer.
    fn submit(&self, calls: BatchCalls, probe: bool) -> Result<Option<BatchCalls>> {
        let (reply, answer) = mpsc::channel();
        {
            let mut inbox = self.shared.lock();
            if inbox.closed {
                return Err(closed(&self.model));
            }
            inbox.jobs.push_back(Job {
                calls,
                probe,
                reply,
            });
        }
        self.shared.changed.notify_all();
        answer
            .recv()
            .unwrap_or_else(|_| Err(Error::internal("the Python instance has stopped")))
    }
}

impl Drop for BackgroundInstance {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The header of the guest's answer to a readiness check.
#[derive(serde::Deserialize)]
struct ReadyHeader {
    #[serde(default)]
    ready: Option<bool>,
}

impl ModelInstance for BackgroundInstance {
    /// The batch is handed over; its requests are answered through their response senders.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let start = Instant::now();
        // Only the requests' own timeouts bound a batch that awaits; the execution timeout
        // bounds each stretch it runs.
        let deadline = requests.iter().filter_map(|r| r.deadline).min();
        let mut calls = BatchCalls::for_batch(self.model.clone(), requests, outputs, deadline);
        let shared = self.shared.clone();
        calls.wake = Some(Arc::new(move || shared.poke()));
        match self.submit(calls, false) {
            Ok(_) => (
                requests.iter().map(|_| Ok(Vec::new())).collect(),
                ExecTimings {
                    compute_infer: start.elapsed(),
                    ..Default::default()
                },
            ),
            Err(e) => (vec![Err(e); requests.len()], ExecTimings::default()),
        }
    }

    fn check_ready(&mut self) -> Option<bool> {
        if !self.model.checks_readiness() {
            return None;
        }
        let deadline = Instant::now() + self.model.timeout();
        let calls = BatchCalls::for_readiness_check(self.model.clone(), deadline);
        let ready = match self.submit(calls, true) {
            Ok(Some(calls)) => calls
                .responses
                .as_deref()
                .and_then(|frame| Frame::<ReadyHeader>::parse(frame).ok())
                .and_then(|frame| frame.header.ready)
                .unwrap_or(false),
            _ => false,
        };
        Some(ready)
    }
}
