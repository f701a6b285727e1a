//! The default scheduler: a bounded queue per model version feeding one worker thread per
//! execution instance. Model code never runs on the async runtime; a full queue answers
//! UNAVAILABLE at once instead of growing without bound.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{atomic::Ordering::Relaxed, Arc},
    time::Instant,
};

use crossbeam_channel::{bounded, Sender, TrySendError};
use tokio::sync::oneshot;

use super::stats::{FailureReason, ModelStats};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    runtime::ModelInstance,
};

struct Job {
    request: InferRequest,
    outputs: Vec<String>,
    batch_size: u64,
    received: Instant,
    enqueued: Instant,
    reply: oneshot::Sender<Result<InferResponse>>,
}

/// Queue and workers of one model version. Dropping it lets the workers finish what is queued
/// and exit.
pub struct Scheduler {
    model: String,
    version: i64,
    sender: Sender<Job>,
    stats: Arc<ModelStats>,
}

impl Scheduler {
    /// Starts one worker thread per instance behind a queue of `queue_capacity` requests.
    pub fn start(
        model: &str,
        version: i64,
        instances: Vec<Box<dyn ModelInstance>>,
        queue_capacity: usize,
        stats: Arc<ModelStats>,
    ) -> Result<Self> {
        let (sender, receiver) = bounded::<Job>(queue_capacity.max(1));
        for (index, mut instance) in instances.into_iter().enumerate() {
            let receiver = receiver.clone();
            let stats = stats.clone();
            let model_name = model.to_owned();
            std::thread::Builder::new()
                .name(format!("{model}-v{version}-{index}"))
                .spawn(move || {
                    while let Ok(job) = receiver.recv() {
                        run_job(&model_name, version, instance.as_mut(), job, &stats);
                    }
                })
                .map_err(|e| {
                    Error::internal(format!("cannot start a worker for '{model}': {e}"))
                })?;
        }
        Ok(Self {
            model: model.to_owned(),
            version,
            sender,
            stats,
        })
    }

    /// Queues a validated request and waits for its response. `outputs` are the output names
    /// to return, in order; `received` is when the frontend took the request.
    pub async fn infer(
        &self,
        request: InferRequest,
        outputs: Vec<String>,
        batch_size: u64,
        received: Instant,
    ) -> Result<InferResponse> {
        let (reply, response) = oneshot::channel();
        let job = Job {
            request,
            outputs,
            batch_size,
            received,
            enqueued: Instant::now(),
            reply,
        };
        self.stats.pending.fetch_add(1, Relaxed);
        if let Err(err) = self.sender.try_send(job) {
            self.stats.pending.fetch_sub(1, Relaxed);
            self.stats
                .record_failure(FailureReason::Rejected, received.elapsed());
            return Err(match err {
                TrySendError::Full(_) => Error::unavailable(format!(
                    "model '{}' version {}: the request queue is full; retry later",
                    self.model, self.version
                )),
                TrySendError::Disconnected(_) => Error::unavailable(format!(
                    "model '{}' version {} is unloading",
                    self.model, self.version
                )),
            });
        }
        response.await.unwrap_or_else(|_| {
            Err(Error::internal(format!(
                "model '{}' version {}: the worker stopped before answering",
                self.model, self.version
            )))
        })
    }
}

fn run_job(
    model: &str,
    version: i64,
    instance: &mut dyn ModelInstance,
    job: Job,
    stats: &ModelStats,
) {
    stats.pending.fetch_sub(1, Relaxed);
    let started = Instant::now();
    let queued = started - job.enqueued;
    if job.request.deadline.is_some_and(|d| d <= started) {
        // Whoever sent it has given up waiting: running it would only delay the others.
        stats.record_failure(FailureReason::Rejected, job.received.elapsed());
        let _ = job.reply.send(Err(Error::unavailable(format!(
            "model '{model}' version {version}: the request reached its deadline while queued"
        ))));
        return;
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        instance.execute(&job.request, &job.outputs)
    }))
    .unwrap_or_else(|_| {
        Err(Error::internal(format!(
            "model '{model}' version {version}: the backend panicked"
        )))
    });
    let result = match outcome {
        Ok((outputs, timings)) => {
            stats.queue.record(queued);
            stats.compute_input.record(timings.compute_input);
            stats.compute_infer.record(timings.compute_infer);
            stats.compute_output.record(timings.compute_output);
            stats.record_execution(
                job.batch_size,
                timings.compute_input,
                timings.compute_infer,
                timings.compute_output,
            );
            stats.success.record(job.received.elapsed());
            stats.touch();
            Ok(InferResponse {
                model_name: model.to_owned(),
                model_version: version,
                id: job.request.id,
                parameters: Default::default(),
                outputs,
            })
        }
        Err(err) => {
            stats.record_failure(FailureReason::Backend, job.received.elapsed());
            Err(err)
        }
    };
    // The client may have gone away; its response is then simply dropped.
    let _ = job.reply.send(result);
}
