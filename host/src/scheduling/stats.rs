//! Per-model-version counters: the single source for the statistics extension and for the
//! Prometheus `nv_*` metrics, so the two can never disagree.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

/// A count and the total nanoseconds spent over it.
#[derive(Debug, Default)]
pub struct DurationStat {
    count: AtomicU64,
    ns: AtomicU64,
}

impl DurationStat {
    /// Records one occurrence that took `d`.
    pub fn record(&self, d: Duration) {
        self.record_many(1, d);
    }
    /// Records `n` occurrences that took `d` together.
    pub fn record_many(&self, n: u64, d: Duration) {
        self.count.fetch_add(n, Relaxed);
        self.ns.fetch_add(d.as_nanos() as u64, Relaxed);
    }
    /// Occurrences so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
    /// Total nanoseconds so far.
    pub fn ns(&self) -> u64 {
        self.ns.load(Relaxed)
    }
}

/// Why a request failed, as Triton's `nv_inference_request_failure{reason}` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureReason {
    /// Refused by a full queue.
    Rejected,
    /// Cancelled by the client.
    Canceled,
    /// The backend failed.
    Backend,
    /// Anything else (e.g. an invalid request).
    Other,
}

impl FailureReason {
    /// Every reason, in label order.
    pub const ALL: [FailureReason; 4] = [
        FailureReason::Rejected,
        FailureReason::Canceled,
        FailureReason::Backend,
        FailureReason::Other,
    ];
    /// The metric label value.
    pub fn label(self) -> &'static str {
        match self {
            FailureReason::Rejected => "REJECTED",
            FailureReason::Canceled => "CANCELED",
            FailureReason::Backend => "BACKEND",
            FailureReason::Other => "OTHER",
        }
    }
}

/// Compute durations of the executions of one batch size.
#[derive(Debug, Default, Clone, Copy)]
pub struct BatchStat {
    /// Executions at this batch size.
    pub count: u64,
    /// Total ns preparing inputs.
    pub compute_input_ns: u64,
    /// Total ns in the engine.
    pub compute_infer_ns: u64,
    /// Total ns collecting outputs.
    pub compute_output_ns: u64,
}

/// Counters of one model version.
#[derive(Debug, Default)]
pub struct ModelStats {
    /// Successful requests and their end-to-end duration.
    pub success: DurationStat,
    /// Failed requests and their duration.
    pub fail: DurationStat,
    /// Time requests waited in the queue.
    pub queue: DurationStat,
    /// Input preparation per request.
    pub compute_input: DurationStat,
    /// Engine time per request.
    pub compute_infer: DurationStat,
    /// Output collection per request.
    pub compute_output: DurationStat,
    /// Inferences (batch of n counts n).
    pub inference_count: AtomicU64,
    /// Model executions.
    pub execution_count: AtomicU64,
    /// Milliseconds since the epoch of the last inference.
    pub last_inference_ms: AtomicU64,
    /// Requests queued and not yet executing.
    pub pending: AtomicI64,
    /// Rows of padding executions ran with to reach a batch bucket (not inferences).
    pub padded_rows: AtomicU64,
    /// Warm-up executions at load and their total time.
    pub warmup: DurationStat,
    /// Requests answered from the response cache, and the time their lookups took.
    pub cache_hit: DurationStat,
    /// Requests the response cache did not hold, and the time their lookups and the
    /// insertions of their answers took.
    pub cache_miss: DurationStat,
    /// The latency histogram and summaries `--metrics-config` turns on.
    pub latency: super::latency::ModelLatency,
    failures: [AtomicU64; 4],
    batches: Mutex<BTreeMap<u64, BatchStat>>,
    responses: Mutex<BTreeMap<u64, ResponseStat>>,
}

/// A count and total nanoseconds, as one of Triton's `StatisticDuration`s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Occurrences.
    pub count: u64,
    /// Their total nanoseconds.
    pub ns: u64,
}

impl Tally {
    fn add(&mut self, d: Duration) {
        self.count += 1;
        self.ns += d.as_nanos() as u64;
    }
}

/// The responses sent at one index of a decoupled model's requests (the first response of
/// each request is index 0), as Triton's `response_stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResponseStat {
    /// Time computing each response (since the request's previous response, or its start).
    pub compute_infer: Tally,
    /// Time handing each response's tensors to its stream.
    pub compute_output: Tally,
    /// Responses sent with outputs, and their whole time.
    pub success: Tally,
    /// Requests that failed at this index.
    pub fail: Tally,
    /// Responses sent without outputs.
    pub empty_response: Tally,
    /// Requests cancelled at this index (the client left).
    pub cancel: Tally,
}

/// How one response of a decoupled model ended, for [`ModelStats::record_response`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseOutcome {
    /// Sent, with outputs.
    Success,
    /// Sent, without outputs.
    Empty,
    /// The request failed instead.
    Fail,
    /// The request was cancelled instead.
    Cancel,
}

impl ModelStats {
    /// Counters that also record the latency distributions in `latency`.
    pub fn with_latency(latency: super::latency::ModelLatency) -> Self {
        Self {
            latency,
            ..Self::default()
        }
    }

    /// Records a failed request.
    pub fn record_failure(&self, reason: FailureReason, elapsed: Duration) {
        self.fail.record(elapsed);
        let index = FailureReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(3);
        self.failures[index].fetch_add(1, Relaxed);
        self.touch();
    }

    /// Records a successful request: its queue and compute times and its end-to-end time.
    pub fn record_success(
        &self,
        queue: Duration,
        input: Duration,
        infer: Duration,
        output: Duration,
        elapsed: Duration,
    ) {
        self.queue.record(queue);
        self.compute_input.record(input);
        self.compute_infer.record(infer);
        self.compute_output.record(output);
        self.success.record(elapsed);
        self.latency
            .record_success(queue, input, infer, output, elapsed);
        self.touch();
    }

    /// Failures with the given reason.
    pub fn failures(&self, reason: FailureReason) -> u64 {
        let index = FailureReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(3);
        self.failures[index].load(Relaxed)
    }

    /// Records one model execution over `batch_size` inferences.
    pub fn record_execution(
        &self,
        batch_size: u64,
        input: Duration,
        infer: Duration,
        output: Duration,
    ) {
        self.record_execution_with_fillers(batch_size, batch_size, input, infer, output);
    }

    /// Records one model execution of `batch_size` rows, of which `inferences` were requests
    /// (the others filler rows of idle sequence slots: in the batch statistics, as on Triton,
    /// but not in the inference count).
    pub fn record_execution_with_fillers(
        &self,
        batch_size: u64,
        inferences: u64,
        input: Duration,
        infer: Duration,
        output: Duration,
    ) {
        self.execution_count.fetch_add(1, Relaxed);
        self.inference_count.fetch_add(inferences, Relaxed);
        if let Ok(mut batches) = self.batches.lock() {
            let entry = batches.entry(batch_size).or_default();
            entry.count += 1;
            entry.compute_input_ns += input.as_nanos() as u64;
            entry.compute_infer_ns += infer.as_nanos() as u64;
            entry.compute_output_ns += output.as_nanos() as u64;
        }
    }

    /// Per response index of decoupled requests: how the responses went.
    pub fn response_stats(&self) -> Vec<(u64, ResponseStat)> {
        self.responses
            .lock()
            .map(|r| r.iter().map(|(k, v)| (*k, *v)).collect())
            .unwrap_or_default()
    }

    /// Records response `index` of a decoupled model's request: `compute` since its previous
    /// response (or its start), `output` handing it over.
    pub fn record_response(
        &self,
        index: u64,
        outcome: ResponseOutcome,
        compute: Duration,
        output: Duration,
    ) {
        let Ok(mut responses) = self.responses.lock() else {
            return;
        };
        let stat = responses.entry(index).or_default();
        match outcome {
            ResponseOutcome::Success => {
                stat.compute_infer.add(compute);
                stat.compute_output.add(output);
                stat.success.add(compute + output);
            }
            ResponseOutcome::Empty => {
                stat.compute_infer.add(compute);
                stat.compute_output.add(output);
                stat.empty_response.add(compute + output);
            }
            ResponseOutcome::Fail => stat.fail.add(compute),
            ResponseOutcome::Cancel => stat.cancel.add(compute),
        }
    }

    /// Per-batch-size execution statistics.
    pub fn batch_stats(&self) -> Vec<(u64, BatchStat)> {
        self.batches
            .lock()
            .map(|b| b.iter().map(|(k, v)| (*k, *v)).collect())
            .unwrap_or_default()
    }

    /// Marks now as the time of the last inference.
    pub fn touch(&self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.last_inference_ms.store(now, Relaxed);
    }
}

/// Times the responses of one request to a decoupled model, for its `response_stats`.
pub(crate) struct ResponseClock {
    stats: Arc<ModelStats>,
    index: u64,
    since: Instant,
    started: Instant,
}

impl ResponseClock {
    pub(crate) fn new(stats: Arc<ModelStats>) -> Self {
        Self {
            stats,
            index: 0,
            since: Instant::now(),
            started: Instant::now(),
        }
    }

    /// A response was handed to the stream at `handed`; `sent` false: the client had left.
    pub(crate) fn sent(&mut self, sent: bool, empty: bool, handed: Instant) {
        if !sent {
            self.ended(ResponseOutcome::Cancel);
            return;
        }
        let outcome = if empty {
            ResponseOutcome::Empty
        } else {
            ResponseOutcome::Success
        };
        let compute = handed.saturating_duration_since(self.since);
        if self.index == 0 {
            self.stats
                .latency
                .record_first_response(handed.saturating_duration_since(self.started));
        }
        self.stats
            .record_response(self.index, outcome, compute, handed.elapsed());
        self.index += 1;
        self.since = Instant::now();
    }

    /// The request ended at this index without a response.
    pub(crate) fn ended(&mut self, outcome: ResponseOutcome) {
        self.stats
            .record_response(self.index, outcome, self.since.elapsed(), Duration::ZERO);
    }
}
