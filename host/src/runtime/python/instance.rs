//! One execution instance of a Python model: an interpreter whose serving loop
//! (`_wasmtron.serve()`, one long turn on a fiber) waits inside the host for the next batch.
//! A batch is handed over by resuming that fiber on the scheduler's own thread, and the
//! fiber suspends again once the guest asks for the batch after it: no thread of its own, no
//! hand-off between threads, no source compiled per batch.

use std::{
    future::Future,
    pin::Pin,
    sync::{mpsc, Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use super::{
    batch_calls::BatchCalls,
    interpreter::{self, Interpreter},
    model::PythonModel,
    protocol::{self, Frame, ResponseHeader},
};
use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
    inference::InferRequest,
    runtime::backend::{ExecTimings, ModelInstance},
    tensor::Tensor,
};

/// A batch for the guest, and where its host side goes when the batch is answered.
struct Job {
    calls: BatchCalls,
    reply: mpsc::Sender<Result<BatchCalls>>,
}

/// What the instance and its serving loop share.
#[derive(Default)]
struct Inbox {
    /// The batch handed over, until the guest takes it.
    job: Option<Job>,
    /// The instance is being dropped: the loop ends (and `finalize()` runs).
    closed: bool,
    /// The guest waits for a batch and there is none.
    waiting: bool,
}

fn lock(inbox: &Mutex<Inbox>) -> std::sync::MutexGuard<'_, Inbox> {
    inbox.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The host side of a serving loop: the guest asks for the next batch ([`Op::Next`]
/// (protocol::Op::Next)), which waits (the fiber suspended) until the instance hands one over;
/// every other frame goes to the batch's own host side.
struct ServeDoor {
    model: Arc<PythonModel>,
    inbox: Arc<Mutex<Inbox>>,
    /// The batch the guest runs now.
    current: Option<Job>,
    /// Frames outside a batch (`finalize`'s log lines) go here.
    idle: BatchCalls,
    /// The interpreter's memory passed 3/4 of its cap: end the loop, start afresh.
    nearly_full: bool,
    /// Batches run by this interpreter.
    served: u64,
    rearm: Option<(Instant, Option<Cancellation>)>,
}

impl ServeDoor {
    /// Whether this interpreter should take no more batches.
    fn restart(&self) -> bool {
        self.nearly_full || (self.model.limits.fresh_instance_per_request && self.served > 0)
    }

    fn next(&mut self) -> Vec<u8> {
        if let Some(job) = self.current.take() {
            let _ = job.reply.send(Err(Error::internal(format!(
                "Python model '{}' asked for a new batch without answering this one",
                self.model.name
            ))));
        }
        let job = if self.restart() {
            if self.nearly_full {
                tracing::debug!(model = %self.model.name, "Python instance replaced: its memory passed 3/4 of memory_limit_mb");
            }
            None
        } else {
            lock(&self.inbox).job.take()
        };
        let Some(job) = job else {
            // The loop ends and `finalize()` runs, within a deadline of its own.
            self.rearm = Some((Instant::now() + self.model.timeout(), None));
            return Vec::new();
        };
        let ends = job
            .calls
            .deadline
            .unwrap_or_else(|| Instant::now() + self.model.timeout());
        self.rearm = Some((ends, job.calls.cancel.clone()));
        let frame = job.calls.batch.clone();
        self.current = Some(job);
        self.served += 1;
        frame
    }
}

impl interpreter::HostCalls for ServeDoor {
    fn poll_ready(&mut self, frame: &[u8], _cx: &mut Context<'_>) -> Poll<()> {
        if frame.first().copied().and_then(protocol::Op::of) != Some(protocol::Op::Next)
            || self.restart()
        {
            return Poll::Ready(());
        }
        let mut inbox = lock(&self.inbox);
        if inbox.job.is_some() || inbox.closed {
            inbox.waiting = false;
            Poll::Ready(())
        } else {
            // Resumed by the instance when it hands over a batch or closes.
            inbox.waiting = true;
            Poll::Pending
        }
    }

    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        match frame.first().copied().and_then(protocol::Op::of) {
            Some(protocol::Op::Next) => self.next(),
            Some(protocol::Op::Responses) => {
                let answer = match self.current.as_mut() {
                    Some(job) => job.calls.call(frame),
                    None => Vec::new(),
                };
                if let Some(job) = self.current.take() {
                    self.model.health.record_success();
                    let _ = job.reply.send(Ok(job.calls));
                }
                answer
            }
            _ => match self.current.as_mut() {
                Some(job) => job.calls.call(frame),
                None => self.idle.call(frame),
            },
        }
    }

    fn memory(&mut self, nearly_full: bool) {
        self.nearly_full = nearly_full;
    }

    fn rearm(&mut self) -> Option<(Instant, Option<Cancellation>)> {
        self.rearm.take()
    }
}

/// A serving loop in progress: it ends with the interpreter, the loop's result and its host side.
type Serving = Pin<
    Box<
        dyn Future<
                Output = (
                    Interpreter,
                    std::result::Result<(), Error>,
                    Option<ServeDoor>,
                ),
            > + Send,
    >,
>;

/// One execution instance.
pub(super) struct PythonInstance {
    model: Arc<PythonModel>,
    index: usize,
    inbox: Arc<Mutex<Inbox>>,
    /// An interpreter that is not serving yet (the one the load started).
    live: Option<Interpreter>,
    serving: Option<Serving>,
    /// Its interpreter crashed and no replacement is up yet (counted in the model's health).
    down: bool,
}

impl PythonInstance {
    pub(super) fn new(
        model: Arc<PythonModel>,
        index: usize,
        live: Option<Interpreter>,
    ) -> Result<Self> {
        Ok(Self {
            model,
            index,
            inbox: Arc::default(),
            live,
            serving: None,
            down: false,
        })
    }

    /// Starts a serving loop on the live interpreter (or a new one).
    fn serve(&mut self) -> Result<Serving> {
        let mut interp = match self.live.take() {
            Some(interp) => interp,
            None => self.fresh()?,
        };
        let model = self.model.clone();
        let calls = ServeDoor {
            idle: BatchCalls::idle(model.clone()),
            model: model.clone(),
            inbox: self.inbox.clone(),
            current: None,
            nearly_full: false,
            served: 0,
            rearm: None,
        };
        Ok(Box::pin(async move {
            let (result, calls) = model
                .turn_with_async(&mut interp, "_wasmtron.serve()", calls, None, "execute")
                .await;
            (interp, result, calls)
        }))
    }

    /// A new interpreter with `model.py` loaded, which ends a crash's downtime.
    fn fresh(&mut self) -> Result<Interpreter> {
        let interp = self.model.start(self.index)?;
        if std::mem::take(&mut self.down) {
            self.model.health.record_up();
        }
        Ok(interp)
    }

    /// Runs the serving loop until the guest waits for a batch again; a loop that ended (a
    /// trap, a restart, the instance closing) answers the batch it was running, if any.
    fn drive(&mut self) -> Result<()> {
        loop {
            let mut serving = match self.serving.take() {
                Some(s) => s,
                None => self.serve()?,
            };
            let inbox = self.inbox.clone();
            match interpreter::drive(&mut serving, || lock(&inbox).waiting) {
                None => {
                    self.serving = Some(serving);
                    return Ok(());
                }
                Some((interp, result, calls)) => {
                    // The interpreter is dropped: a trapped or restarting one is never entered
                    // again.
                    drop(interp);
                    let mut calls = calls.ok_or_else(|| {
                        Error::internal("the Python backend lost its serving loop")
                    })?;
                    if let Some(f) = calls.idle.failure.take() {
                        tracing::warn!(model = %self.model.name, "finalize raised: {f}");
                    }
                    if let Err(e) = result {
                        // A crash (not an interpreter stopped because nobody waits): the
                        // model is not ready until a new one is up.
                        if e.code != crate::error::Code::Cancelled && !self.down {
                            self.down = true;
                            self.model.health.record_down();
                        }
                        if let Some(job) = calls.current.take() {
                            let _ = job.reply.send(Err(e));
                        }
                    }
                    let inbox = lock(&self.inbox);
                    if inbox.closed || inbox.job.is_none() {
                        return Ok(());
                    }
                    // A batch still waits: a fresh interpreter takes it.
                }
            }
        }
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
        // The serving loop is told to end: `finalize()` runs and the interpreter goes.
        lock(&self.inbox).closed = true;
        if self.serving.is_some() || self.live.is_some() {
            if let Err(e) = self.drive() {
                tracing::warn!(model = %self.model.name, "{}", e.message);
            }
        }
    }
}

/// The header of the guest's [`protocol::Op::Responses`] frame.
#[derive(serde::Deserialize)]
struct ResponsesHeader {
    #[serde(default)]
    responses: Option<Vec<Option<ResponseHeader>>>,
}

impl ModelInstance for PythonInstance {
    /// A crashed interpreter's replacement, started (`initialize` run) now.
    fn recover(&mut self) {
        if self.down && self.live.is_none() && self.serving.is_none() {
            match self.fresh() {
                Ok(interp) => self.live = Some(interp),
                Err(e) => tracing::warn!(model = %self.model.name, "{}", e.message),
            }
        }
    }

    /// A batch reaches `execute(requests)` as a list of requests, each with its own shapes,
    /// parameters and response.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let n = requests.len();
        let all = |e: Error| vec![Err(e); n];
        let model = self.model.clone();
        let start = Instant::now();
        let deadline = requests.iter().filter_map(|r| r.deadline).min();
        let own = start + model.timeout();
        let deadline = Some(deadline.map_or(own, |d| d.min(own)));
        let calls = BatchCalls::for_batch(model.clone(), requests, outputs, deadline);
        let (tx, rx) = mpsc::channel();
        lock(&self.inbox).job = Some(Job { calls, reply: tx });
        if let Err(e) = self.drive() {
            lock(&self.inbox).job = None;
            return (all(e), ExecTimings::default());
        }
        let calls = match rx.try_recv() {
            Ok(Ok(calls)) => calls,
            Ok(Err(e)) => return (all(e), ExecTimings::default()),
            Err(_) => {
                return (
                    all(Error::internal("the Python instance has stopped")),
                    ExecTimings::default(),
                )
            }
        };
        let ran = Instant::now();
        if let Some(err) = calls.refused_call {
            return (all(err), ExecTimings::default());
        }
        let answers = match self.answers(calls.responses.as_deref(), requests, outputs) {
            Ok(answers) => answers,
            Err(e) => all(e),
        };
        let timings = ExecTimings {
            compute_input: Duration::ZERO,
            compute_infer: ran - start,
            compute_output: ran.elapsed(),
            padded_rows: 0,
        };
        (answers, timings)
    }

    fn check_ready(&mut self) -> Option<bool> {
        self.model
            .checks_readiness()
            .then(|| self.run_readiness_check())
    }
}

/// The header of the guest's answer to a readiness check.
#[derive(serde::Deserialize)]
struct ReadyHeader {
    #[serde(default)]
    ready: Option<bool>,
}

impl PythonInstance {
    /// Runs the model's `is_ready()` between batches, within the model's execution deadline;
    /// anything but `True` (`False`, another value, an exception, a trap) is not ready.
    fn run_readiness_check(&mut self) -> bool {
        let deadline = Instant::now() + self.model.timeout();
        let calls = BatchCalls::for_readiness_check(self.model.clone(), deadline);
        let (tx, rx) = mpsc::channel();
        lock(&self.inbox).job = Some(Job { calls, reply: tx });
        if self.drive().is_err() {
            lock(&self.inbox).job = None;
            return false;
        }
        let Ok(Ok(calls)) = rx.try_recv() else {
            return false;
        };
        calls
            .responses
            .as_deref()
            .and_then(|frame| Frame::<ReadyHeader>::parse(frame).ok())
            .and_then(|frame| frame.header.ready)
            .unwrap_or(false)
    }

    /// Each request's answer from the guest's responses frame.
    fn answers(
        &self,
        frame: Option<&[u8]>,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> Result<Vec<Result<Vec<Tensor>>>> {
        let n = requests.len();
        let model = &self.model;
        let frame = frame.ok_or_else(|| {
            Error::internal(format!("Python model '{}' sent no responses", model.name))
        })?;
        let frame = Frame::<ResponsesHeader>::parse(frame)?;
        let Some(responses) = &frame.header.responses else {
            // A decoupled model answers through its response senders only.
            return Ok((0..n).map(|_| Ok(Vec::new())).collect());
        };
        if responses.len() != n {
            return Err(Error::internal(format!(
                "Python model '{}' returned {} responses for {n} requests",
                model.name,
                responses.len()
            )));
        }
        Ok(responses
            .iter()
            .zip(requests)
            .map(|(r, request)| {
                if r.as_ref().is_some_and(|r| r.reschedule) {
                    if !model.iterative {
                        return Err(Error::invalid(format!(
                            "Python model '{}' released a request for rescheduling, which \
                             needs 'sequence_batching {{ iterative_sequence: true }}' in its \
                             configuration",
                            model.name
                        )));
                    }
                    request.reschedule.set();
                    return Ok(Vec::new());
                }
                let Some(r) = r else {
                    if model.decoupled {
                        // Its stream has ended: the senders sent what it had.
                        return Ok(Vec::new());
                    }
                    return Err(Error::internal(format!(
                        "Python model '{}' returned None instead of an InferenceResponse",
                        model.name
                    )));
                };
                if let Some(e) = &r.error {
                    return Err(protocol::from_triton_code(&e.code, e.message.clone()));
                }
                let tensors = r
                    .outputs
                    .iter()
                    .map(|t| frame.tensor(t))
                    .collect::<Result<Vec<_>>>()?;
                if !r.parameters.is_empty() {
                    request
                        .reply_parameters
                        .set(protocol::parameters_from_json(&r.parameters)?);
                }
                model.outputs(outputs, tensors)
            })
            .collect())
    }
}
