//! A model's workers: each takes what the queue gives it (a batch, or the model's readiness
//! check), runs it on its instance and answers every request of the batch — or puts a
//! rescheduled request back, or fails it naming why.

use super::*;

impl WorkQueue {
    /// Wakes a worker for new work (every worker when some work is pinned to one).
    pub(super) fn wake_for_work(&self) {
        if self.pinned.load(Relaxed) {
            self.work.notify_all();
        } else {
            self.work.notify_one();
        }
    }

    pub(super) fn work_loop(
        &self,
        index: usize,
        mut instance: Box<dyn ModelInstance>,
        claim: Option<Arc<Claim>>,
    ) {
        while let Some(work) = self.next_batch(index, claim.as_ref()) {
            match work {
                Work::Batch(taken) => {
                    self.run_batch(instance.as_mut(), taken);
                    // A crashed guest's replacement starts now, its batch answered.
                    if catch_unwind(AssertUnwindSafe(|| instance.recover())).is_err() {
                        tracing::warn!(model = %self.model, "an instance's recovery panicked");
                    }
                }
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
    pub(super) fn next_batch(&self, index: usize, claim: Option<&Arc<Claim>>) -> Option<Work> {
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

    pub(super) fn run_batch(&self, instance: &mut dyn ModelInstance, taken: Taken) {
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
        let rows_of = |counted_only: bool| -> u64 {
            jobs.iter()
                .zip(&results)
                .filter(|((j, _), r)| r.is_ok() && (j.counted || !counted_only))
                .map(|((j, _), _)| j.rows)
                .sum()
        };
        let succeeded = rows_of(true);
        if succeeded > 0 {
            self.stats.record_execution_with_fillers(
                rows_of(false),
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
    pub(super) fn reschedule(&self, job: Job) {
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

    pub(super) fn succeed(
        &self,
        job: Job,
        queued: Duration,
        timings: &ExecTimings,
        outputs: Vec<Tensor>,
    ) {
        if job.counted {
            self.record_success(&job, queued, timings);
        }
        let Job {
            mut request,
            reply,
            seq,
            ..
        } = job;
        // On an ordered stream, the answer's place is now.
        if let Some(sink) = &request.responses {
            sink.stamp_final();
        }
        let response = InferResponse {
            model_name: self.model.clone(),
            model_version: self.version,
            parameters: request.reply_parameters.take(),
            id: std::mem::take(&mut request.id),
            outputs,
            last: false,
        };
        // The request (its trace span with it) ends before its answer leaves, so whoever
        // waits for the answer finds the trace complete.
        drop(request);
        self.deliver(seq, reply, Ok(response));
    }

    fn record_success(&self, job: &Job, queued: Duration, timings: &ExecTimings) {
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
    }

    pub(super) fn fail(&self, job: Job, reason: FailureReason, err: Error) {
        if job.counted {
            self.stats.record_failure(reason, job.received.elapsed());
        }
        let Job {
            request,
            reply,
            seq,
            ..
        } = job;
        if let Some(sink) = &request.responses {
            sink.stamp_final();
        }
        drop(request);
        self.deliver(seq, reply, Err(err));
    }

    /// Sends a response, or with `preserve_ordering` holds it until every earlier request has
    /// been answered. A client that went away simply does not get its response.
    pub(super) fn deliver(
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
