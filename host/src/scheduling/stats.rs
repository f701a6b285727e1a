//! Per-model-version counters: the single source for the statistics extension and for the
//! Prometheus `nv_*` metrics, so the two can never disagree.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering::Relaxed},
        Mutex,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
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
    failures: [AtomicU64; 4],
    batches: Mutex<BTreeMap<u64, BatchStat>>,
}

impl ModelStats {
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
        self.execution_count.fetch_add(1, Relaxed);
        self.inference_count.fetch_add(batch_size, Relaxed);
        if let Ok(mut batches) = self.batches.lock() {
            let entry = batches.entry(batch_size).or_default();
            entry.count += 1;
            entry.compute_input_ns += input.as_nanos() as u64;
            entry.compute_infer_ns += infer.as_nanos() as u64;
            entry.compute_output_ns += output.as_nanos() as u64;
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
