//! One execution instance of a Python model: a thread of its own (the interpreter needs a
//! deep stack) that owns the interpreter, takes batches as jobs, and runs `finalize()` when the
//! instance is dropped.

use std::{
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use super::{
    door::BatchDoor,
    interpreter::{self, Interpreter},
    model::PythonModel,
    protocol::{self, Frame, ResponseHeader},
};
use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
    inference::InferRequest,
    runtime::{ExecTimings, ModelInstance},
    tensor::Tensor,
};

/// A batch for the instance's thread, and where its door goes when the batch is answered.
struct Job {
    door: BatchDoor,
    reply: mpsc::Sender<Result<BatchDoor>>,
}

/// The door of an interpreter's serving loop (`_wasmtron.serve()`, one long turn): the guest
/// asks for the next batch ([`Op::Next`](protocol::Op::Next)), which blocks here until one
/// comes, runs it, and sends its responses; every other frame goes to the batch's own door.
/// No turn (and no compilation of its source) per batch.
struct ServeDoor {
    model: Arc<PythonModel>,
    jobs: mpsc::Receiver<Job>,
    /// The batch the guest runs now.
    current: Option<Job>,
    /// A batch taken while no interpreter was running, for the next one.
    pending: Option<Job>,
    /// Frames outside a batch (`finalize`'s log lines) go here.
    idle: BatchDoor,
    /// The instance was dropped: no more batches.
    closed: bool,
    /// The interpreter's memory passed 3/4 of its cap: end the loop, start afresh.
    nearly_full: bool,
    /// Batches run by this interpreter.
    served: u64,
    rearm: Option<(Instant, Option<Cancellation>)>,
}

impl ServeDoor {
    /// Waits for a batch when none is pending; false once the instance is dropped.
    fn wait_for_job(&mut self) -> bool {
        if self.pending.is_none() {
            match self.jobs.recv() {
                Ok(job) => self.pending = Some(job),
                Err(_) => self.closed = true,
            }
        }
        self.pending.is_some()
    }

    /// Answers the batch in progress (or the pending one) with an error.
    fn fail(&mut self, e: Error) {
        if let Some(job) = self.current.take().or_else(|| self.pending.take()) {
            let _ = job.reply.send(Err(e));
        }
    }

    fn next(&mut self) -> Vec<u8> {
        if let Some(job) = self.current.take() {
            let _ = job.reply.send(Err(Error::internal(format!(
                "Python model '{}' asked for a new batch without answering this one",
                self.model.name
            ))));
        }
        let restart =
            self.nearly_full || (self.model.limits.fresh_instance_per_request && self.served > 0);
        let job = if restart {
            if self.nearly_full {
                tracing::debug!(model = %self.model.name, "Python instance replaced: its memory passed 3/4 of memory_limit_mb");
            }
            None
        } else if let Some(job) = self.pending.take() {
            Some(job)
        } else {
            match self.jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => {
                    self.closed = true;
                    None
                }
            }
        };
        let Some(job) = job else {
            // The loop ends and `finalize()` runs, within a deadline of its own.
            self.rearm = Some((Instant::now() + self.model.timeout(), None));
            return Vec::new();
        };
        let ends = job
            .door
            .deadline
            .unwrap_or_else(|| Instant::now() + self.model.timeout());
        self.rearm = Some((ends, job.door.cancel.clone()));
        let frame = job.door.batch.clone();
        self.current = Some(job);
        self.served += 1;
        frame
    }
}

impl interpreter::Door for ServeDoor {
    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        match frame.first().copied().and_then(protocol::Op::of) {
            Some(protocol::Op::Next) => self.next(),
            Some(protocol::Op::Responses) => {
                let answer = match self.current.as_mut() {
                    Some(job) => job.door.call(frame),
                    None => Vec::new(),
                };
                if let Some(job) = self.current.take() {
                    self.model.health.record_success();
                    let _ = job.reply.send(Ok(job.door));
                }
                answer
            }
            _ => match self.current.as_mut() {
                Some(job) => job.door.call(frame),
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

/// The instance's thread: interpreters started when a batch waits for one, each serving
/// batches until it traps, fills its memory or the instance is dropped.
fn serve(
    model: Arc<PythonModel>,
    index: usize,
    mut live: Option<Interpreter>,
    jobs: mpsc::Receiver<Job>,
) {
    let mut door = ServeDoor {
        idle: BatchDoor::idle(model.clone()),
        model: model.clone(),
        jobs,
        current: None,
        pending: None,
        closed: false,
        nearly_full: false,
        served: 0,
        rearm: None,
    };
    loop {
        let mut interp = match live.take() {
            Some(interp) => interp,
            None => {
                if !door.wait_for_job() {
                    return;
                }
                match model.start(index) {
                    Ok(interp) => interp,
                    Err(e) => {
                        door.fail(e);
                        continue;
                    }
                }
            }
        };
        door.nearly_full = false;
        door.served = 0;
        let (result, back) =
            model.turn_with(&mut interp, "_wasmtron.serve()", door, None, "execute");
        let Some(back) = back else {
            tracing::error!(model = %model.name, "the Python backend lost its serving loop");
            return;
        };
        door = back;
        if let Err(e) = result {
            // The interpreter is dropped: a trapped instance is never entered again.
            door.fail(e);
        }
        if let Some(f) = door.idle.failure.take() {
            tracing::warn!(model = %model.name, "finalize raised: {f}");
        }
        if door.closed {
            return;
        }
    }
}

/// One execution instance: a thread that owns the interpreter.
pub(super) struct PythonInstance {
    model: Arc<PythonModel>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PythonInstance {
    pub(super) fn new(
        model: Arc<PythonModel>,
        index: usize,
        live: Option<Interpreter>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let owner = model.clone();
        let thread = std::thread::Builder::new()
            .name(format!("python-{index}"))
            .stack_size(interpreter::THREAD_STACK_BYTES)
            .spawn(move || serve(owner, index, live, rx))
            .map_err(|e| Error::internal(format!("cannot start a Python instance thread: {e}")))?;
        Ok(Self {
            model,
            jobs: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
        // The serving loop sees the channel close, runs `finalize()` and ends.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let (mut results, timings) = self.execute_batch(&[request], outputs);
        let result = results
            .pop()
            .unwrap_or_else(|| Err(Error::internal("the Python model gave no result")));
        result.map(|t| (t, timings))
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
        let door = BatchDoor::for_batch(model.clone(), requests, outputs, deadline);
        let (tx, rx) = mpsc::channel();
        let job = Job { door, reply: tx };
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            return (
                all(Error::internal("the Python instance has stopped")),
                ExecTimings::default(),
            );
        }
        let door = match rx.recv() {
            Ok(Ok(door)) => door,
            Ok(Err(e)) => return (all(e), ExecTimings::default()),
            Err(_) => {
                return (
                    all(Error::internal("the Python instance has stopped")),
                    ExecTimings::default(),
                )
            }
        };
        let ran = Instant::now();
        if let Some(err) = door.refused_call {
            return (all(err), ExecTimings::default());
        }
        let answers = match self.answers(door.responses.as_deref(), n, outputs) {
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
}

impl PythonInstance {
    /// Each request's answer from the guest's responses frame.
    fn answers(
        &self,
        frame: Option<&[u8]>,
        n: usize,
        outputs: &[String],
    ) -> Result<Vec<Result<Vec<Tensor>>>> {
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
            .map(|r| {
                let Some(r) = r else {
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
                model.outputs(outputs, tensors)
            })
            .collect())
    }
}
