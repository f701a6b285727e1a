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
    error::{Error, Result},
    inference::InferRequest,
    runtime::{ExecTimings, ModelInstance},
    tensor::Tensor,
};

/// Work for an instance's thread.
type Job = Box<dyn FnOnce(&mut Option<Interpreter>) + Send>;

/// One execution instance: a thread that owns the interpreter.
pub(super) struct PythonInstance {
    model: Arc<PythonModel>,
    index: usize,
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
            .spawn(move || {
                let mut live = live;
                while let Ok(job) = rx.recv() {
                    job(&mut live);
                }
                // Unloaded: `finalize()` within the deadline, then the interpreter is dropped.
                if let Some(mut interp) = live.take() {
                    let door = BatchDoor::idle(owner.clone());
                    match owner.turn(&mut interp, "_wasmtron.finalize()", door, "finalize") {
                        Ok(door) => {
                            if let Some(f) = door.failure {
                                tracing::warn!(model = %owner.name, "finalize raised: {f}");
                            }
                        }
                        Err(e) => tracing::warn!(model = %owner.name, "{}", e.message),
                    }
                }
            })
            .map_err(|e| Error::internal(format!("cannot start a Python instance thread: {e}")))?;
        Ok(Self {
            model,
            index,
            jobs: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
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
        let index = self.index;
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |live: &mut Option<Interpreter>| {
            let result = (|| {
                let mut interp = match live.take() {
                    Some(i) => i,
                    None => model.start(index)?,
                };
                let door = match model.turn(&mut interp, "_wasmtron.execute()", door, "execute") {
                    Ok(door) => door,
                    // The interpreter is dropped: a trapped instance is never entered again.
                    Err(e) => return Err(e),
                };
                if interp.nearly_full() {
                    tracing::debug!(model = %model.name, "Python instance replaced: its memory passed 3/4 of memory_limit_mb");
                } else if !model.limits.fresh_instance_per_request {
                    *live = Some(interp);
                }
                model.health.record_success();
                Ok(door)
            })();
            let _ = tx.send(result);
        });
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
