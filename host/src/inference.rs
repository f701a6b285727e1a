//! Protocol-neutral inference requests and responses: what a frontend decodes into and what the
//! scheduler hands back.

use std::collections::BTreeMap;

use crate::tensor::Tensor;

/// A request or response parameter value.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    /// Boolean.
    Bool(bool),
    /// Signed integer.
    Int(i64),
    /// Unsigned integer (gRPC `uint64_param`).
    Uint(u64),
    /// Floating point.
    Double(f64),
    /// String.
    String(String),
}

impl ParamValue {
    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            ParamValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
    /// The value as an integer, if it is one (or an unsigned one that fits).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            ParamValue::Int(i) => Some(*i),
            ParamValue::Uint(u) => i64::try_from(*u).ok(),
            _ => None,
        }
    }
    /// The value as a non-negative integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            ParamValue::Uint(u) => Some(*u),
            other => other.as_i64().and_then(|i| u64::try_from(i).ok()),
        }
    }
}

/// Named parameters, ordered for stable output.
pub type Parameters = BTreeMap<String, ParamValue>;

/// An output the client asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    /// Output tensor name.
    pub name: String,
    /// Per-output parameters (e.g. `binary_data`).
    pub parameters: Parameters,
}

/// One inference request, already decoded from the wire.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferRequest {
    /// Target model.
    pub model_name: String,
    /// Requested version; `None` lets the version policy choose (the highest loaded).
    pub model_version: Option<i64>,
    /// Client-chosen id, echoed in the response.
    pub id: String,
    /// Request-level parameters.
    pub parameters: Parameters,
    /// Input tensors.
    pub inputs: Vec<Tensor>,
    /// Requested outputs; empty means all.
    pub outputs: Vec<RequestedOutput>,
    /// When the request stops being worth running: a request still queued at its deadline is
    /// answered with an error instead of executed. Set for calls from a stage (the caller's
    /// own deadline), so that work nobody waits for any more is dropped.
    pub deadline: Option<std::time::Instant>,
    /// For decoupled models: where responses go as the model produces them.
    pub responses: Option<ResponseSink>,
    /// For an ensemble step: where the step's model adds the time the request spent queued
    /// and computing, so that the ensemble reports the sum over its steps as Triton does.
    pub step_durations: Option<StepDurations>,
    /// The tenants this request runs for: the client's, carried into ensemble steps and into
    /// the calls a stage makes (several when a stage's batch mixes tenants). A stage may call
    /// only models that every one of them may infer with. Empty without tenants.
    pub callers: Vec<crate::tenancy::Caller>,
    /// Sent by a stage while it runs (BLS), or an ensemble step of such a call: it runs under
    /// the calling execution's part of the server's executions, which the caller holds while
    /// it waits, instead of waiting for one of its own.
    pub from_stage: bool,
    /// The request's trace span: its steps and executions are traced as its children.
    /// Disabled (the default) when the request is not traced.
    pub trace: Trace,
    /// Cancelled when nobody waits for the answer any more (the server sets it when the
    /// caller's wait is dropped); the work checks it and stops.
    pub cancel: crate::cancellation::Cancellation,
    /// The parameters the model sets on its (final) response, as Triton's Python backend's
    /// `InferenceResponse(parameters=...)`: filled by the backend while it runs the request.
    pub reply_parameters: ReplyParameters,
    /// Set by a backend whose model released the request to run again in a later batch
    /// (Triton's request rescheduling): the scheduler queues it again instead of answering.
    pub reschedule: Reschedule,
    /// Told when a request of a sequence has its place in its sequence's queue.
    pub sequence_queued: SequenceQueued,
}

/// Fired once a request of a sequence has taken its place in the queue of its sequence's
/// slot: from then on the sequence's next request may follow, and keeps its order. A gRPC
/// stream waits for it before it sends a sequence's next request on (a strategy that does not
/// fire it lets the next one go once this request is dropped, that is answered).
#[derive(Debug, Clone, Default)]
pub struct SequenceQueued(
    Option<std::sync::Arc<std::sync::Mutex<Option<futures::channel::oneshot::Sender<()>>>>>,
);

impl SequenceQueued {
    /// Fires `sender` (or drops it, with the last clone of this).
    pub fn new(sender: futures::channel::oneshot::Sender<()>) -> Self {
        Self(Some(std::sync::Arc::new(std::sync::Mutex::new(Some(
            sender,
        )))))
    }

    /// Says the request has its place (once; later calls do nothing).
    pub fn fire(&self) {
        let Some(cell) = &self.0 else { return };
        let sender = cell
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(sender) = sender {
            let _ = sender.send(());
        }
    }
}

impl PartialEq for SequenceQueued {
    /// Part of the transport, not of the request.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Whether a model released a request for rescheduling (a Python model's
/// `set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`).
#[derive(Debug, Clone, Default)]
pub struct Reschedule(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Reschedule {
    /// The request runs again in a later batch.
    pub fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether it was set; cleared for the next execution.
    pub fn take(&self) -> bool {
        self.0.swap(false, std::sync::atomic::Ordering::Relaxed)
    }
}

impl PartialEq for Reschedule {
    /// Part of the execution, not of the request.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Where a backend leaves the parameters of a request's response for the scheduler, which
/// puts them on the response it builds (the instance sees the request only by reference).
#[derive(Debug, Clone, Default)]
pub struct ReplyParameters(std::sync::Arc<std::sync::Mutex<Parameters>>);

impl ReplyParameters {
    /// Sets the response's parameters.
    pub fn set(&self, parameters: Parameters) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = parameters;
    }

    /// Takes what was set (empty when nothing was).
    pub fn take(&self) -> Parameters {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl PartialEq for ReplyParameters {
    /// Part of the answer, not of the request: requests equal whatever was set.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// One response on a decoupled request's stream: its outputs and parameters, or an error
/// (Triton's decoupled models may answer a request with an error among other responses).
#[derive(Debug, Clone, Default)]
pub struct StreamedResponse {
    /// An error response: delivered in order, the stream going on.
    pub error: Option<crate::error::Error>,
    /// The response's output tensors.
    pub outputs: Vec<Tensor>,
    /// The response's parameters (Triton's response parameters).
    pub parameters: Parameters,
    /// Sent with the final flag (Triton's `TRITONSERVER_RESPONSE_COMPLETE_FINAL`): the
    /// model's last response for the request.
    pub last: bool,
    /// Its place in its stream's order, taken when the sink was given it (streams whose
    /// responses leave in the order produced: see [`crate::response_order`]).
    pub stamp: Option<std::sync::Arc<crate::response_order::Stamp>>,
}

impl From<Vec<Tensor>> for StreamedResponse {
    fn from(outputs: Vec<Tensor>) -> Self {
        Self {
            outputs,
            ..Default::default()
        }
    }
}

impl InferRequest {
    /// What a frontend decoded for `model` (version `None`: the policy chooses): the wire's
    /// part of a request, the one way every frontend (HTTP, gRPC, OpenAI, Python) builds one.
    /// The frontend then adds its trace span; the door records whom it runs for
    /// (`Server::infer_on` with the caller's `Target`), and the server fills the rest (deadline, response sink, step durations) as it runs it.
    pub fn new(model: impl Into<String>, version: Option<i64>) -> Self {
        Self {
            model_name: model.into(),
            model_version: version,
            ..Default::default()
        }
    }

    /// The client's request id, echoed in the response.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Request-level parameters.
    pub fn with_parameters(mut self, parameters: Parameters) -> Self {
        self.parameters = parameters;
        self
    }

    /// Input tensors.
    pub fn with_inputs(mut self, inputs: Vec<Tensor>) -> Self {
        self.inputs = inputs;
        self
    }

    /// Requested outputs (empty: all of them).
    pub fn with_outputs(mut self, outputs: Vec<RequestedOutput>) -> Self {
        self.outputs = outputs;
        self
    }
}

/// The request parameter that names an adapter to run a request with (a LoRA adapter of a
/// generation model: `smollm2:<adapter>` as an OpenAI model name becomes this parameter).
pub const ADAPTER_PARAMETER: &str = "lora";

/// Target of the spans that make up request traces (exported with `--trace-config`, kept out
/// of the log).
pub const TRACE_TARGET: &str = "wasmtron::trace";

/// What a traced request records (Triton's `trace_level`): its activities' timestamps, its
/// tensors, both, or nothing (`OFF`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceLevel {
    /// `TIMESTAMPS`: `REQUEST_START`, `QUEUE_START`, `COMPUTE_START`, ….
    pub timestamps: bool,
    /// `TENSORS`: the inputs as queued and as given to the model, and the outputs.
    pub tensors: bool,
}

impl TraceLevel {
    /// `TIMESTAMPS` alone.
    pub const TIMESTAMPS: TraceLevel = TraceLevel {
        timestamps: true,
        tensors: false,
    };

    /// Whether anything is traced.
    pub fn is_on(self) -> bool {
        self.timestamps || self.tensors
    }
}

/// A request's trace span and what it records; requests compare equal whatever their spans.
#[derive(Clone)]
pub struct Trace(pub tracing::Span, pub TraceLevel);

impl Default for Trace {
    fn default() -> Self {
        Trace(tracing::Span::none(), TraceLevel::default())
    }
}

impl Trace {
    /// Whether the request is traced.
    pub fn is_traced(&self) -> bool {
        !self.0.is_none()
    }

    /// A trace for a call this request makes (an ensemble step, a stage's call), recording
    /// what this one records; `span` is made with [`trace_span!`](crate::trace_span).
    pub fn child(&self, span: tracing::Span) -> Trace {
        Trace(span, self.1)
    }

    /// Records one of Triton's trace activities (`QUEUE_START`, `HTTP_SEND_END`, …) now.
    pub fn mark(&self, activity: &'static str) {
        // Untraced requests (nearly all) do not even read the clock.
        if self.is_traced() && self.1.timestamps {
            self.mark_at(activity, std::time::Instant::now());
        }
    }

    /// Records `activity` as having happened at `at`.
    pub fn mark_at(&self, activity: &'static str, at: std::time::Instant) {
        if self.is_traced() && self.1.timestamps {
            tracing::info!(target: TRACE_TARGET, parent: &self.0, activity, ns = trace_ns(at));
        }
    }

    /// `REQUEST_START` at `at`, naming the version that serves the request and its id.
    pub fn start(&self, version: i64, request_id: &str, at: std::time::Instant) {
        if !self.is_traced() {
            return;
        }
        if self.1.timestamps {
            tracing::info!(
                target: TRACE_TARGET,
                parent: &self.0,
                activity = "REQUEST_START",
                ns = trace_ns(at),
                version,
                request_id
            );
        } else {
            tracing::info!(target: TRACE_TARGET, parent: &self.0, version, request_id);
        }
    }

    /// Records `tensors` under one of Triton's tensor activities (`TENSOR_QUEUE_INPUT`,
    /// `TENSOR_BACKEND_INPUT`, `TENSOR_BACKEND_OUTPUT`) when the level asks for tensors.
    pub fn tensors<'a>(
        &self,
        activity: &'static str,
        tensors: impl IntoIterator<Item = &'a crate::tensor::Tensor>,
    ) {
        if !(self.is_traced() && self.1.tensors) {
            return;
        }
        for t in tensors {
            let tensor = crate::tensor::trace_json(t);
            tracing::info!(target: TRACE_TARGET, parent: &self.0, tensor_activity = activity, tensor);
        }
    }
}

/// Nanoseconds on the traces' clock: monotonic, counted from the wall-clock time the process
/// first asked (so values read like Triton's timestamps and never go back).
pub fn trace_ns(at: std::time::Instant) -> u64 {
    static ORIGIN: std::sync::OnceLock<(std::time::Instant, u64)> = std::sync::OnceLock::new();
    let (origin, wall) = ORIGIN.get_or_init(|| {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(0));
        (std::time::Instant::now(), wall)
    });
    let since = at.saturating_duration_since(*origin).as_nanos();
    wall.saturating_add(u64::try_from(since).unwrap_or(u64::MAX))
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_traced() {
            "Trace(on)"
        } else {
            "Trace(off)"
        })
    }
}

impl PartialEq for Trace {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A span named `$name` (with fields) under `$parent` (a [`tracing::Span`]) when that one is
/// traced, else a disabled span: untraced requests create no spans, and no span becomes a
/// root of its own.
#[macro_export]
macro_rules! trace_span {
    (parent: $parent:expr, $name:literal $(, $($field:tt)*)?) => {{
        let parent: &::tracing::Span = $parent;
        if parent.is_none() {
            ::tracing::Span::none()
        } else {
            ::tracing::info_span!(target: "wasmtron::trace", parent: parent, $name $(, $($field)*)?)
        }
    }};
}

/// Queue and compute time that an ensemble's steps spent on one request, summed over the
/// steps (shared by the steps, which may run concurrently).
#[derive(Clone, Default)]
pub struct StepDurations(std::sync::Arc<[std::sync::atomic::AtomicU64; 4]>);

impl StepDurations {
    /// Adds one step's queue, compute-input, compute-infer and compute-output time.
    pub fn add(&self, durations: [std::time::Duration; 4]) {
        for (total, d) in self.0.iter().zip(durations) {
            let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            total.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The sums so far, in the order of [`StepDurations::add`].
    pub fn totals(&self) -> [std::time::Duration; 4] {
        let get = |i: usize| {
            std::time::Duration::from_nanos(self.0[i].load(std::sync::atomic::Ordering::Relaxed))
        };
        [get(0), get(1), get(2), get(3)]
    }
}

impl std::fmt::Debug for StepDurations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StepDurations")
            .field(&self.totals())
            .finish()
    }
}

impl PartialEq for StepDurations {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The sending end of a decoupled request's response stream (outputs of one response each).
/// Bounded: a model that produces faster than its client reads waits, but only up to the
/// stream's stall deadline: a reader that takes nothing for that long (a client that stopped
/// reading, an HTTP/2 window left at zero) has its request cancelled, so that it cannot hold
/// an instance, a batch row or memory for longer.
#[derive(Clone)]
pub struct ResponseSink {
    tx: tokio::sync::mpsc::Sender<StreamedResponse>,
    stall: std::time::Duration,
    /// The order of the stream the responses go to, when it keeps one.
    order: Option<std::sync::Arc<crate::response_order::ResponseOrder>>,
    /// The final response's place in `order`, taken where the answer is produced; only for
    /// a model that answers once (a decoupled model's final answer may come before responses
    /// it still sends, so it is stamped when it leaves, after them).
    final_stamp: Option<FinalStamp>,
}

/// Where the scheduler leaves the final response's [`crate::response_order::Stamp`] when it
/// answers a request of an ordered stream, so that the answer takes its place in the stream
/// when it was produced, not when the task that forwards it happens to run.
pub type FinalStamp =
    std::sync::Arc<std::sync::Mutex<Option<std::sync::Arc<crate::response_order::Stamp>>>>;

impl ResponseSink {
    /// A sink and its receiving end, holding up to `capacity` unread responses; a send waits
    /// at most `stall` for room.
    pub fn channel(
        capacity: usize,
        stall: std::time::Duration,
    ) -> (Self, tokio::sync::mpsc::Receiver<StreamedResponse>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        let order = None;
        (
            Self {
                tx,
                stall,
                order,
                final_stamp: None,
            },
            rx,
        )
    }

    /// For a request answered once (not decoupled): its answer takes its place in the
    /// stream's order where it is produced ([`Self::stamp_final`]), left in the returned cell.
    pub fn stamping_final(mut self) -> (Self, FinalStamp) {
        let cell = FinalStamp::default();
        self.final_stamp = Some(cell.clone());
        (self, cell)
    }

    /// Takes the final response's place in the stream's order now (once; without an order or
    /// [`Self::stamping_final`], nothing): called where a request is answered.
    pub fn stamp_final(&self) {
        let (Some(order), Some(cell)) = (&self.order, &self.final_stamp) else {
            return;
        };
        let mut cell = cell
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cell.is_none() {
            *cell = Some(std::sync::Arc::new(order.stamp()));
        }
    }

    /// Stamps every response sent from now on with its place in `order`.
    pub fn ordered(
        mut self,
        order: Option<std::sync::Arc<crate::response_order::ResponseOrder>>,
    ) -> Self {
        self.order = order;
        self
    }

    /// `outputs`, stamped when its stream keeps an order: produced now.
    fn stamped(&self, outputs: impl Into<StreamedResponse>) -> StreamedResponse {
        let mut outputs = outputs.into();
        if let Some(order) = &self.order {
            outputs.stamp = Some(std::sync::Arc::new(order.stamp()));
        }
        outputs
    }

    /// How long a send waits for the reader before the request is cancelled.
    pub fn stall(&self) -> std::time::Duration {
        self.stall
    }

    fn stalled(&self) -> crate::error::Error {
        crate::error::Error::new(
            crate::error::Code::Cancelled,
            format!(
                "the client read none of its responses for {} ms (--response-stall-timeout-secs): \
                 the request was cancelled",
                self.stall.as_millis()
            ),
        )
    }

    /// Sends one response from a model worker thread (never the async runtime), waiting while
    /// the stream is full, but not past `deadline` nor past the stall deadline.
    pub fn send_blocking(
        &self,
        outputs: impl Into<StreamedResponse>,
        deadline: Option<std::time::Instant>,
    ) -> crate::error::Result<()> {
        let mut outputs = self.stamped(outputs);
        use tokio::sync::mpsc::error::TrySendError;
        let stalled_at = std::time::Instant::now() + self.stall;
        loop {
            match self.tx.try_send(outputs) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed(_)) => {
                    return Err(crate::error::Error::new(
                        crate::error::Code::Cancelled,
                        "the client has gone away",
                    ))
                }
                Err(TrySendError::Full(back)) => {
                    let now = std::time::Instant::now();
                    if deadline.is_some_and(|d| now >= d) {
                        return Err(crate::error::Error::unavailable(
                            "the client does not read its responses",
                        ));
                    }
                    if now >= stalled_at {
                        return Err(self.stalled());
                    }
                    outputs = back;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    /// Whether the receiving end has gone (the client left).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Sends one response from async code, waiting while the stream is full, but not past
    /// the stall deadline.
    pub async fn send(&self, outputs: impl Into<StreamedResponse>) -> crate::error::Result<()> {
        match tokio::time::timeout(self.stall, self.tx.send(self.stamped(outputs))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(crate::error::Error::new(
                crate::error::Code::Cancelled,
                "the client has gone away",
            )),
            Err(_) => Err(self.stalled()),
        }
    }
}

impl std::fmt::Debug for ResponseSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseSink")
    }
}

impl PartialEq for ResponseSink {
    fn eq(&self, other: &Self) -> bool {
        self.tx.same_channel(&other.tx)
    }
}

/// The result of a successful inference.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferResponse {
    /// Model that served the request.
    pub model_name: String,
    /// Version that served the request.
    pub model_version: i64,
    /// The request's id.
    pub id: String,
    /// Response-level parameters.
    pub parameters: Parameters,
    /// Output tensors, in the order requested (or the model's order when all were requested).
    pub outputs: Vec<Tensor>,
    /// A decoupled model sent it with the final flag (Triton's
    /// `TRITONSERVER_RESPONSE_COMPLETE_FINAL`): its last response for the request, which
    /// Triton's gRPC stream marks `triton_final_response: true`.
    pub last: bool,
}
