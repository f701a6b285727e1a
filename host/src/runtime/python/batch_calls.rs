//! What the host answers a Python model during one batch ([`BatchCalls`]): the batch's
//! requests, the model's responses (kept for the backend), streamed responses of decoupled
//! models, calls into other models (BLS, with the batch's callers' rights), log lines and
//! cancellation.

use std::{
    collections::HashMap,
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use super::{
    call_stream::CalledResponse,
    interpreter::HostCalls,
    protocol::{self, CallHeader, Frame, FrameWriter, Op, RequestHeader, ResponseHeader},
    PythonModel,
};
use crate::{
    cancellation::Cancellation,
    error::{Code, Error, Result},
    inference::{InferRequest, ResponseSink},
    runtime::sandbox::guest_calls::{self, Call, CallingBatch, GuestKind},
};

/// The most calls into other models one batch may have in flight with `async_exec`.
const MAX_STARTED_CALLS: usize = 64;

/// Runs a call into another model; a decoupled model's responses are all collected, as
/// its response iterator gives them.
fn run_call(
    caller: &Arc<dyn crate::runtime::backend::ModelCaller>,
    request: InferRequest,
    decoupled: bool,
) -> Result<Vec<CalledResponse>> {
    if !decoupled {
        return caller.infer(request).map(|r| vec![r.into()]);
    }
    let mut stream = super::call_stream::CallStream::start(caller.clone(), request)?;
    // An error response ends what is collected (the iterator of `exec` gives it in order).
    let mut answers = Vec::new();
    while let Some(answer) = stream.next() {
        answers.push(answer?);
    }
    Ok(answers)
}

/// One request of the batch, as far as the host side needs it.
pub struct RequestSlot {
    /// Where a decoupled model's responses go.
    pub sink: Option<ResponseSink>,
    /// Cancelled when nobody waits for the request any more.
    pub cancel: Cancellation,
}

impl RequestSlot {
    /// Cancelled, or a streamed request whose reader has gone.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled() || self.sink.as_ref().is_some_and(ResponseSink::is_closed)
    }
}

/// The host side of one turn: `load`, `execute` or `finalize`.
pub struct BatchCalls {
    pub(super) model: Arc<PythonModel>,
    /// The batch frame, handed to the guest when it asks for the next batch.
    pub batch: Vec<u8>,
    /// The requests of the batch.
    pub slots: Vec<RequestSlot>,
    /// The outputs the batch asks for.
    pub outputs: Vec<String>,
    /// The tenants of the batch, on whose behalf calls into other models run.
    pub callers: Vec<crate::tenancy::Caller>,
    /// Cancelled once every request of the batch is.
    pub cancel: Option<Cancellation>,
    /// When calls into other models must be answered by.
    pub deadline: Option<Instant>,
    /// The [`Op::Responses`] frame the guest sent, read after the turn.
    pub responses: Option<Vec<u8>>,
    /// What `initialize`, `execute` or `finalize` raised ([`Op::Failed`]).
    pub failure: Option<String>,
    /// The configuration `auto_complete_config` returned ([`Op::Completed`]).
    pub completed: Option<Vec<u8>>,
    /// The first call into another model that the batch's callers may not make: the batch
    /// fails with it whatever the model answers.
    pub refused_call: Option<Error>,
    started: HashMap<u64, Started>,
    /// Calls into decoupled models read one response at a time.
    streams: HashMap<u64, super::call_stream::CallStream>,
    /// Background mode: the calls and streams a task waits for ([`Op::Poll`] and
    /// [`Op::StreamPoll`] found nothing yet).
    awaited: std::collections::HashSet<u64>,
    /// Background mode: told when a started call has its answer.
    pub(super) wake: Option<Arc<dyn Fn() + Send + Sync>>,
    next_handle: u64,
}

/// A call started with `async_exec`: its answer once it has come.
struct Started {
    rx: mpsc::Receiver<Result<Vec<CalledResponse>>>,
    answer: Option<Result<Vec<CalledResponse>>>,
}

impl Started {
    /// Whether the answer has come (taken from the channel and kept).
    fn arrived(&mut self) -> bool {
        if self.answer.is_none() {
            self.answer = match self.rx.try_recv() {
                Ok(answer) => Some(answer),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    Some(Err(Error::internal("the call ended without an answer")))
                }
            };
        }
        self.answer.is_some()
    }
}

impl BatchCalls {
    /// A host side for a turn with no batch (`load`, `finalize`).
    pub(super) fn idle(model: Arc<PythonModel>) -> Self {
        Self {
            model,
            batch: Vec::new(),
            slots: Vec::new(),
            outputs: Vec::new(),
            callers: Vec::new(),
            cancel: None,
            deadline: None,
            responses: None,
            failure: None,
            completed: None,
            refused_call: None,
            started: HashMap::new(),
            streams: HashMap::new(),
            awaited: Default::default(),
            wake: None,
            next_handle: 1,
        }
    }

    /// A host side for a readiness check: the guest runs the model's `is_ready()` and answers
    /// `{"ready": bool}` as its responses frame.
    pub(super) fn for_readiness_check(model: Arc<PythonModel>, deadline: Instant) -> Self {
        let mut calls = Self::idle(model);
        calls.batch = FrameWriter::default().finish(&serde_json::json!({ "probe": true }));
        calls.deadline = Some(deadline);
        calls
    }

    /// A host side for one batch: its frame is written now.
    pub(super) fn for_batch(
        model: Arc<PythonModel>,
        requests: &[&InferRequest],
        outputs: &[String],
        deadline: Option<Instant>,
    ) -> Self {
        let mut calls = Self::idle(model);
        let mut w = FrameWriter::default();
        let headers: Vec<RequestHeader> = requests
            .iter()
            .map(|r| {
                let (correlation_id, flags) = sequence_of(r);
                RequestHeader {
                    id: r.id.clone(),
                    correlation_id,
                    flags,
                    parameters: protocol::parameters_to_json(&r.parameters),
                    outputs: outputs.to_vec(),
                    inputs: r.inputs.iter().map(|t| w.tensor(t)).collect(),
                }
            })
            .collect();
        calls.batch = w.finish(&serde_json::json!({ "requests": headers }));
        calls.slots = requests
            .iter()
            .map(|r| RequestSlot {
                sink: r.responses.clone(),
                cancel: r.cancel.clone(),
            })
            .collect();
        calls.outputs = outputs.to_vec();
        let mut callers: Vec<_> = requests.iter().flat_map(|r| r.callers.clone()).collect();
        callers.dedup();
        calls.callers = callers;
        calls.cancel = Some(Cancellation::child_of_all(
            requests.iter().map(|r| r.cancel.clone()),
        ));
        calls.deadline = deadline;
        calls
    }

    fn send(&mut self, body: &[u8]) -> Result<serde_json::Value> {
        #[derive(serde::Deserialize)]
        struct SendHeader {
            index: usize,
            #[serde(default)]
            flags: u32,
            #[serde(default)]
            response: Option<ResponseHeader>,
        }
        let frame = Frame::<SendHeader>::parse(body)?;
        let index = frame.header.index;
        let Some(slot) = self.slots.get(index) else {
            return Err(Error::invalid(format!(
                "a response for request {index}, but the batch has {}",
                self.slots.len()
            )));
        };
        let Some(response) = &frame.header.response else {
            return Ok(serde_json::Value::Null);
        };
        let Some(sink) = slot.sink.clone() else {
            return Err(Error::invalid(format!(
                "model '{}': request {index} does not take streamed responses",
                self.model.name
            )));
        };
        let last = frame.header.flags & 1 != 0;
        if let Some(e) = &response.error {
            // In order with the other responses; the stream goes on.
            let error = protocol::from_triton_code(&e.code, e.message.clone());
            let streamed = crate::inference::StreamedResponse {
                error: Some(error),
                last,
                ..Default::default()
            };
            sink.send_blocking(streamed, self.deadline)?;
            return Ok(serde_json::Value::Null);
        }
        let tensors = response
            .outputs
            .iter()
            .map(|t| frame.tensor(t))
            .collect::<Result<Vec<_>>>()?;
        let streamed = crate::inference::StreamedResponse {
            outputs: self.model.outputs(&self.outputs, tensors)?,
            parameters: protocol::parameters_from_json(&response.parameters)?,
            last,
            ..Default::default()
        };
        sink.send_blocking(streamed, self.deadline)?;
        Ok(serde_json::Value::Null)
    }

    /// The request of a call into another model, and whether it is decoupled.
    fn call_request(&self, body: &[u8]) -> Result<(InferRequest, bool)> {
        let frame = Frame::<CallHeader>::parse(body)?;
        let h = &frame.header;
        let mut parameters = protocol::parameters_from_json(&h.parameters)?;
        if let Some(id) = h.correlation_id.as_u64().filter(|id| *id != 0) {
            parameters.insert("sequence_id".into(), crate::inference::ParamValue::Uint(id));
        } else if let Some(id) = h.correlation_id.as_str().filter(|id| !id.is_empty()) {
            parameters.insert(
                "sequence_id".into(),
                crate::inference::ParamValue::String(id.to_owned()),
            );
        }
        if h.flags & 1 != 0 {
            parameters.insert(
                "sequence_start".into(),
                crate::inference::ParamValue::Bool(true),
            );
        }
        if h.flags & 2 != 0 {
            parameters.insert(
                "sequence_end".into(),
                crate::inference::ParamValue::Bool(true),
            );
        }
        let batch = CallingBatch {
            model: &self.model.name,
            kind: GuestKind::PythonModel,
            single_instance: self.model.single_instance,
            deadline: self.deadline,
            callers: &self.callers,
            cancel: self.cancel.as_ref(),
        };
        let request = batch.request(Call {
            model: h.model.clone(),
            version: (h.version > 0).then_some(h.version),
            id: h.id.clone(),
            parameters,
            inputs: h
                .inputs
                .iter()
                .map(|t| frame.tensor(t))
                .collect::<Result<_>>()?,
            outputs: h.outputs.clone(),
            deadline: (h.timeout_us > 0)
                .then(|| Instant::now() + Duration::from_micros(h.timeout_us)),
        })?;
        Ok((request, h.decoupled))
    }

    fn caller(&self) -> Result<Arc<dyn crate::runtime::backend::ModelCaller>> {
        guest_calls::caller_of(self.model.caller.as_ref())
    }

    /// The answer to a call: its responses as a frame, or an error response.
    fn call_answer(&mut self, result: Result<Vec<CalledResponse>>) -> Vec<u8> {
        let mut w = FrameWriter::default();
        let responses: Vec<ResponseHeader> = match result {
            Ok(answers) => answers
                .iter()
                .map(|r| ResponseHeader {
                    outputs: r.outputs.iter().map(|t| w.tensor(t)).collect(),
                    error: None,
                    parameters: protocol::parameters_to_json(&r.parameters),
                    reschedule: false,
                })
                .collect(),
            Err(e) => {
                if e.code == Code::PermissionDenied && self.refused_call.is_none() {
                    self.refused_call = Some(e.clone());
                }
                vec![ResponseHeader {
                    error: Some(protocol::ErrorHeader {
                        code: protocol::triton_code(&e).to_owned(),
                        message: e.message,
                    }),
                    ..Default::default()
                }]
            }
        };
        w.finish(&serde_json::json!({ "responses": responses }))
    }

    fn infer(&mut self, body: &[u8]) -> Vec<u8> {
        let result = self
            .call_request(body)
            .and_then(|(request, decoupled)| run_call(&self.caller()?, request, decoupled));
        self.call_answer(result)
    }

    fn start(&mut self, body: &[u8]) -> Result<serde_json::Value> {
        if self.started.len() >= MAX_STARTED_CALLS {
            return Err(Error::unavailable(format!(
                "model '{}' has {MAX_STARTED_CALLS} calls in flight already: await some first",
                self.model.name
            )));
        }
        let (request, decoupled) = self.call_request(body)?;
        let caller = self.caller()?;
        let (tx, rx) = mpsc::channel();
        let wake = self.wake.clone();
        std::thread::Builder::new()
            .name("python-call".into())
            .spawn(move || {
                let _ = tx.send(run_call(&caller, request, decoupled));
                if let Some(wake) = wake {
                    wake();
                }
            })
            .map_err(|e| Error::internal(format!("cannot start a call: {e}")))?;
        let handle = self.next_handle;
        self.next_handle += 1;
        self.started.insert(handle, Started { rx, answer: None });
        Ok(serde_json::Value::from(handle))
    }

    fn wait(&mut self, body: &[u8]) -> Vec<u8> {
        let handle = serde_json::from_slice::<u64>(body).ok();
        let Some(started) = handle.and_then(|h| self.started.remove(&h)) else {
            return self.call_answer(Err(Error::invalid("no such call in flight")));
        };
        let result = match started.answer {
            Some(answer) => answer,
            None => started
                .rx
                .recv()
                .unwrap_or_else(|_| Err(Error::internal("the call ended without an answer"))),
        };
        self.call_answer(result)
    }

    /// [`Op::Poll`]: the call's answer if it has come; else nothing, and the call is awaited.
    fn poll_call(&mut self, body: &[u8]) -> Vec<u8> {
        let handle = serde_json::from_slice::<u64>(body).unwrap_or_default();
        if self
            .started
            .get_mut(&handle)
            .is_some_and(|started| !started.arrived())
        {
            self.awaited.insert(handle);
            return Vec::new();
        }
        self.awaited.remove(&handle);
        self.wait(body)
    }

    /// [`Op::StreamPoll`]: the stream's next response if it has come (or its end); else
    /// nothing, and the stream is awaited.
    fn stream_poll(&mut self, body: &[u8]) -> Vec<u8> {
        let handle = serde_json::from_slice::<u64>(body).unwrap_or_default();
        let next = match self.streams.get_mut(&handle) {
            Some(stream) => match stream.try_next() {
                Some(next) => next,
                None => {
                    self.awaited.insert(handle);
                    return Vec::new();
                }
            },
            None => None,
        };
        self.awaited.remove(&handle);
        match next {
            Some(answer) => self.call_answer(answer.map(|a| vec![a])),
            None => {
                self.streams.remove(&handle);
                self.call_answer(Ok(Vec::new()))
            }
        }
    }

    /// Background mode: whether a call or stream the model awaits has something for it, and
    /// whether one of them is a stream (streams are looked at again a tick later: nothing
    /// tells when their responses come).
    pub(super) fn awaited_ready(&mut self) -> (bool, bool) {
        let mut streams = false;
        for handle in &self.awaited {
            if let Some(started) = self.started.get_mut(handle) {
                if started.arrived() {
                    return (true, streams);
                }
            } else if let Some(stream) = self.streams.get_mut(handle) {
                streams = true;
                if stream.has_next() {
                    return (true, streams);
                }
            } else {
                return (true, streams);
            }
        }
        (false, streams)
    }

    /// The answer to a batch's frame (a call, a send) after the batch has ended (past its
    /// deadline, or its instance closing): `error`, in the shape the guest reads for the op.
    pub(super) fn refuse(&mut self, frame: &[u8], error: &Error) -> Vec<u8> {
        match frame.first().copied().and_then(Op::of) {
            Some(Op::Infer | Op::Wait | Op::StreamNext | Op::Poll | Op::StreamPoll) => {
                self.call_answer(Err(error.clone()))
            }
            _ => protocol::error_answer(error),
        }
    }

    /// `exec(decoupled=True)`: the call starts; the model reads its responses with
    /// [`Self::stream_next`].
    fn stream_open(&mut self, body: &[u8]) -> Result<serde_json::Value> {
        if self.streams.len() >= MAX_STARTED_CALLS {
            return Err(Error::unavailable(format!(
                "model '{}' reads {MAX_STARTED_CALLS} decoupled calls already",
                self.model.name
            )));
        }
        let (request, _) = self.call_request(body)?;
        let stream = super::call_stream::CallStream::start(self.caller()?, request)?;
        let handle = self.next_handle;
        self.next_handle += 1;
        self.streams.insert(handle, stream);
        Ok(serde_json::Value::from(handle))
    }

    /// The next response of a stream (none once it has ended).
    fn stream_next(&mut self, body: &[u8]) -> Vec<u8> {
        let handle = serde_json::from_slice::<u64>(body).unwrap_or_default();
        let next = match self.streams.get_mut(&handle) {
            Some(stream) => stream.next(),
            None => None,
        };
        match next {
            Some(answer) => self.call_answer(answer.map(|a| vec![a])),
            None => {
                self.streams.remove(&handle);
                self.call_answer(Ok(Vec::new()))
            }
        }
    }

    /// The stream's iterator was cancelled: so is its call.
    fn stream_cancel(&mut self, body: &[u8]) -> Result<serde_json::Value> {
        let handle = serde_json::from_slice::<u64>(body)
            .map_err(|e| Error::invalid(format!("bad stream handle: {e}")))?;
        if let Some(stream) = self.streams.get(&handle) {
            stream.cancel();
        }
        Ok(serde_json::Value::Null)
    }

    fn log(&self, body: &[u8]) {
        let (level, message) = body.split_first().unwrap_or((&0, &[]));
        let message = String::from_utf8_lossy(message);
        let model = self.model.name.as_str();
        match level {
            2 => tracing::error!(model, "{message}"),
            1 => tracing::warn!(model, "{message}"),
            3 => tracing::debug!(model, "{message}"),
            _ => tracing::info!(model, "{message}"),
        }
    }

    fn cancelled(&self, body: &[u8]) -> Result<serde_json::Value> {
        #[derive(serde::Deserialize)]
        struct Index {
            index: usize,
        }
        let index = serde_json::from_slice::<Index>(body)
            .map_err(|e| Error::invalid(format!("bad cancellation query: {e}")))?
            .index;
        let slot = self
            .slots
            .get(index)
            .ok_or_else(|| Error::invalid(format!("request {index} is not in the batch")))?;
        Ok(serde_json::Value::from(slot.is_cancelled()))
    }
}

/// A request of the model loading API (`pb_utils.is_model_ready`, `load_model`,
/// `unload_model`).
#[derive(serde::Deserialize)]
#[serde(tag = "action", rename_all = "lowercase", deny_unknown_fields)]
enum RepositoryRequest {
    Ready {
        model: String,
        #[serde(default)]
        version: String,
    },
    Load {
        model: String,
        #[serde(default)]
        config: Option<String>,
        /// Base64 contents by `file:` key.
        #[serde(default)]
        files: std::collections::BTreeMap<String, String>,
    },
    Unload {
        model: String,
        #[serde(default)]
        unload_dependents: bool,
    },
}

impl BatchCalls {
    /// The model loading API, for the batch's tenants (in `initialize`, for whoever loaded
    /// the model).
    fn repository(&self, body: &[u8]) -> Result<serde_json::Value> {
        use base64::Engine;
        let request = serde_json::from_slice::<RepositoryRequest>(body)
            .map_err(|e| Error::invalid(format!("bad model loading request: {e}")))?;
        let caller = self.caller()?;
        let by = self.model.name.as_str();
        match request {
            RepositoryRequest::Ready { model, version } => {
                let version = crate::names::parse_version(&model, &version)?;
                Ok(serde_json::Value::from(caller.is_ready(&model, version)))
            }
            RepositoryRequest::Load {
                model,
                config,
                files,
            } => {
                self.model.repository_calls.check(by, "load_model")?;
                let files = files
                    .into_iter()
                    .map(|(key, data)| {
                        base64::engine::general_purpose::STANDARD
                            .decode(data)
                            .map(|content| (key.clone(), content))
                            .map_err(|e| {
                                Error::invalid(format!(
                                    "load_model: file '{key}' is not base64: {e}"
                                ))
                            })
                    })
                    .collect::<Result<_>>()?;
                let load = crate::runtime::backend::ModelLoad {
                    model,
                    config_json: config.filter(|c| !c.is_empty()),
                    files,
                };
                caller.load(by, &self.callers, load)?;
                Ok(serde_json::Value::Null)
            }
            RepositoryRequest::Unload {
                model,
                unload_dependents,
            } => {
                self.model.repository_calls.check(by, "unload_model")?;
                caller.unload(by, &self.callers, &model, unload_dependents)?;
                Ok(serde_json::Value::Null)
            }
        }
    }
}

impl HostCalls for BatchCalls {
    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        let Some((&op, body)) = frame.split_first() else {
            return protocol::error_answer(&Error::invalid("an empty frame"));
        };
        match Op::of(op) {
            Some(Op::Next) => Vec::new(),
            Some(Op::Responses) => {
                self.responses = Some(body.to_vec());
                Vec::new()
            }
            Some(Op::Send) => protocol::answer(self.send(body)),
            Some(Op::Infer) => self.infer(body),
            Some(Op::Start) => protocol::answer(self.start(body)),
            Some(Op::Wait) => self.wait(body),
            Some(Op::StreamOpen) => protocol::answer(self.stream_open(body)),
            Some(Op::StreamNext) => self.stream_next(body),
            Some(Op::StreamCancel) => protocol::answer(self.stream_cancel(body)),
            Some(Op::Poll) => self.poll_call(body),
            Some(Op::StreamPoll) => self.stream_poll(body),
            // Handled by a background serving loop's host side; nothing to do in a batch's.
            Some(Op::Events | Op::Select) => Vec::new(),
            Some(Op::Log) => {
                self.log(body);
                Vec::new()
            }
            Some(Op::Cancelled) => protocol::answer(self.cancelled(body)),
            Some(Op::Metric) => protocol::answer(
                serde_json::from_slice::<super::metrics::Request>(body)
                    .map_err(|e| Error::invalid(format!("bad metric request: {e}")))
                    .and_then(|r| super::metrics::handle(r, self.model.metrics_owner)),
            ),
            Some(Op::Repository) => protocol::answer(self.repository(body)),
            Some(Op::Completed) => {
                self.completed = Some(body.to_vec());
                Vec::new()
            }
            Some(Op::Failed) => {
                self.failure = Some(String::from_utf8_lossy(body).into_owned());
                Vec::new()
            }
            None => protocol::error_answer(&Error::invalid(format!("unknown op {op}"))),
        }
    }
}

/// A request's sequence as Triton's Python backend gives it: correlation id and flags.
fn sequence_of(r: &InferRequest) -> (serde_json::Value, u32) {
    use crate::inference::ParamValue;
    let id = match r.parameters.get("sequence_id") {
        Some(ParamValue::Int(i)) => serde_json::Value::from(*i),
        Some(ParamValue::Uint(u)) => serde_json::Value::from(*u),
        Some(ParamValue::String(s)) => serde_json::Value::from(s.clone()),
        _ => serde_json::Value::from(0),
    };
    let flag = |key: &str| matches!(r.parameters.get(key), Some(ParamValue::Bool(true)));
    let flags = u32::from(flag("sequence_start")) | (u32::from(flag("sequence_end")) << 1);
    (id, flags)
}
