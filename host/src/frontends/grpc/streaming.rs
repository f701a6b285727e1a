//! `ModelStreamInfer`: the requests of a stream run at once (a sequence's in the order sent),
//! the responses of each in order, 0..N per request for decoupled models, errors in-band as
//! Triton sends them.

use std::{collections::HashMap, pin::Pin, sync::Arc};

use futures::{
    channel::oneshot,
    future::{FutureExt, Shared},
    stream::BoxStream,
    Stream, StreamExt,
};
use tonic::Status;

use crate::frontends::{shared_memory::SystemSharedMemory, trace::Tracing};
use crate::{
    error::Error,
    inference::{ParamValue, Parameters, SequenceQueued},
    proto::inference::infer_parameter::ParameterChoice,
    response_order::ResponseOrder,
    scheduling::{door::Target, server::Server},
    tenancy::{Caller, Tenancy},
};

use super::codec::{decode_request, encode_response, params_to_proto};
use super::*;

pub(super) type StreamResult =
    Pin<Box<dyn Stream<Item = Result<ModelStreamInferResponse, Status>> + Send>>;

/// Requests of one stream in flight at once; the stream's further requests wait (HTTP/2 flow
/// control holds the client back) until one finishes.
pub(super) const STREAM_IN_FLIGHT: usize = 128;

type Answers = BoxStream<'static, Result<ModelStreamInferResponse, Status>>;

/// What every request on one stream needs: who sent it and the server's parts.
#[derive(Clone)]
pub(super) struct StreamContext {
    pub(super) tenancy: Option<Arc<Tenancy>>,
    /// The stream's `authorization` value, checked again for each request.
    pub(super) key: Option<String>,
    /// The caller the stream was opened by (without tenants).
    pub(super) first: Caller,
    pub(super) server: Arc<Server>,
    pub(super) shm: Arc<SystemSharedMemory>,
    pub(super) max_bytes: usize,
    pub(super) tracing: Arc<Tracing>,
    pub(super) context: TraceContext,
    /// Triton's `triton_grpc_error: true` header: the first error ends the stream with its
    /// gRPC status instead of travelling in-band.
    pub(super) grpc_errors: bool,
    /// The order the stream's responses leave in: the order they were produced.
    pub(super) responses: Arc<ResponseOrder>,
}

impl StreamContext {
    /// The answers to one request of the stream: authenticated, admitted and accounted, its
    /// errors in-band (or, with `grpc_errors`, as the status that ends the stream).
    pub(super) fn answer(&self, req: ModelInferRequest, queued: SequenceQueued) -> Answers {
        let id = req.id.clone();
        let answers = self.answers(req, queued);
        if self.grpc_errors {
            return answers;
        }
        answers
            .map(move |item| match item {
                Err(status) => Ok(stream_error(id.clone(), status)),
                ok => ok,
            })
            .boxed()
    }

    /// [`Self::answer`] with every error as a status.
    fn answers(&self, req: ModelInferRequest, queued: SequenceQueued) -> Answers {
        let refuse =
            |_id: String, e: Error| futures::stream::once(async move { Err(to_status(e)) }).boxed();
        let caller = match &self.tenancy {
            Some(tenancy) => match tenancy.authenticate(self.key.as_deref()) {
                Ok(caller) => caller,
                Err(e) => return refuse(req.id, e),
            },
            None => self.first.clone(),
        };
        // Accounted once admitted (or refused); its errors travel in-band.
        let door = self.server.door(&caller);
        let admitted = door
            .resolve(&req.model_name, &req.model_version)
            .and_then(|target| Ok((target, caller.admit(prost::Message::encoded_len(&req))?)));
        door.finish(admitted.as_ref().map(|_| ()).map_err(|e| e.code));
        match admitted {
            // The admission lives as long as this request's responses.
            Ok((target, admission)) => stream_one(
                self.server.clone(),
                self.shm.clone(),
                self.max_bytes,
                (&self.tracing, &self.context),
                target,
                (req, queued),
                Some(self.responses.clone()),
            )
            .map(move |item| {
                let _held = &admission;
                item
            })
            .boxed(),
            Err(e) => refuse(req.id, e),
        }
    }
}

/// The sequence a request belongs to on its model (`sequence_id` parameter, non-zero or a
/// non-empty string), if any.
pub(super) fn sequence_key(req: &ModelInferRequest) -> Option<(String, String)> {
    let id = match req
        .parameters
        .get("sequence_id")?
        .parameter_choice
        .as_ref()?
    {
        ParameterChoice::Int64Param(0) | ParameterChoice::Uint64Param(0) => return None,
        ParameterChoice::Int64Param(n) => n.to_string(),
        ParameterChoice::Uint64Param(n) => n.to_string(),
        ParameterChoice::StringParam(s) if !s.is_empty() => format!("'{s}'"),
        _ => return None,
    };
    Some((req.model_name.clone(), id))
}

/// Keeps each sequence's requests on a stream in the order they were sent: one starts once the
/// previous request of its sequence has its place in its sequence's queue (the direct
/// strategy's slot says so), or else has answered (on Triton a sequence's requests run one at
/// a time too, in its slot). Other requests start at once.
#[derive(Default)]
pub(super) struct SequenceOrder {
    /// Per sequence, resolved when its latest request has its place or its answers end.
    last: HashMap<(String, String), Shared<oneshot::Receiver<()>>>,
}

impl SequenceOrder {
    /// Sequences remembered before the finished ones are forgotten.
    const REMEMBERED: usize = 1024;

    /// The answers `start` gives, started now, or after the sequence's previous request has
    /// its place; `start` puts the signal it gets into its request.
    pub(super) fn start(
        &mut self,
        sequence: Option<(String, String)>,
        start: impl FnOnce(SequenceQueued) -> Answers + Send + 'static,
    ) -> Answers {
        let Some(sequence) = sequence else {
            return start(SequenceQueued::default());
        };
        if self.last.len() >= Self::REMEMBERED {
            // A finished request's sender is gone, so its receiver resolves when polled.
            self.last
                .retain(|_, done| done.clone().now_or_never().is_none());
        }
        let (placed, done) = oneshot::channel::<()>();
        let placed = SequenceQueued::new(placed);
        let previous = self.last.insert(sequence, done.shared());
        let held = placed.clone();
        let answers = async move {
            if let Some(previous) = previous {
                // Resolves when the previous request has its place, or (as cancelled) when
                // it and its answers are dropped.
                let _ = previous.await;
            }
            start(placed)
        };
        answers
            .flatten_stream()
            .map(move |item| {
                // Dropped with the answers (and the request), which lets the sequence's next
                // request start if nothing fired before.
                let _held = &held;
                item
            })
            .boxed()
    }
}

fn stream_error(id: String, status: Status) -> ModelStreamInferResponse {
    ModelStreamInferResponse {
        error_message: status.message().to_owned(),
        infer_response: Some(ModelInferResponse {
            id,
            ..Default::default()
        }),
    }
}

/// The responses of one request on a `ModelStreamInfer` stream. A default-mode model's response
/// says `triton_final_response: true`; a decoupled model's say `false`, except one it sent with
/// the final flag; when it sent the flag alone, an empty response with
/// `triton_final_response: true` marks the end if the request asked for it
/// (`triton_enable_empty_final_response`), as Triton does. With `order`, the responses leave in
/// the order produced among those of every request of the stream.
pub(super) fn stream_one(
    server: Arc<Server>,
    shm: Arc<SystemSharedMemory>,
    max_bytes: usize,
    (tracing, context): (&Tracing, &TraceContext),
    target: Target,
    (req, queued): (ModelInferRequest, SequenceQueued),
    order: Option<Arc<ResponseOrder>>,
) -> futures::stream::BoxStream<'static, Result<ModelStreamInferResponse, Status>> {
    let caller = target.caller();
    let id = req.id.clone();
    let reader = shm.reader(caller, max_bytes);
    let decoded = {
        let shared = |input: &str, params: &Parameters| reader.input(input, params);
        decode_request(req, &shared)
    };
    let inputs_held = reader.into_held();
    let decoded = decoded.and_then(|request| {
        let mut held = shm.check_outputs(caller, &request.outputs)?;
        held.extend(inputs_held);
        Ok((request, held))
    });
    let (mut request, held) = match decoded {
        Ok(r) => r,
        Err(err) => return futures::stream::once(async move { Err(to_status(err)) }).boxed(),
    };
    request.sequence_queued = queued;
    request.trace = tracing.request_span(&request.model_name, "grpc", &|k| context.get(k));
    request.trace.mark("GRPC_WAITREAD_START");
    request.trace.mark("GRPC_WAITREAD_END");
    let decoupled = crate::runtime::is_decoupled(target.config());
    let empty_final = matches!(
        request.parameters.get("triton_enable_empty_final_response"),
        Some(ParamValue::Bool(true))
    );
    let final_flag = |last: bool| {
        let mut p = Parameters::new();
        p.insert("triton_final_response".into(), ParamValue::Bool(last));
        params_to_proto(&p)
    };
    let (model, version) = (request.model_name.clone(), request.model_version);
    let final_id = id.clone();
    let requested = request.outputs.clone();
    let caller = caller.clone();
    let items = server.infer_stream_ordered(&target, request, order);
    // Whether a response already said it was the last (then no empty one follows).
    let marked_final = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let marked = marked_final.clone();
    let responses = tokio_stream_from(items).map(move |item| {
        // The request's regions stay registered until its last response is written.
        let _held = &held;
        let item = item.and_then(|resp| {
            shm.write_outputs(&caller, &requested, &resp)?;
            Ok(resp)
        });
        Ok(match item {
            Ok(resp) => {
                // A default-mode model's one response is its last; a decoupled model's is the
                // one it sent with the final flag, else the empty response below (the stream
                // cannot know a response is the last without holding it back until the next).
                let last = !decoupled || resp.last;
                if last {
                    marked.store(true, std::sync::atomic::Ordering::Release);
                }
                let mut resp = encode_response(resp, &requested);
                resp.parameters.extend(final_flag(last));
                ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(resp),
                }
            }
            Err(err) => return Err(to_status(err)),
        })
    });
    // The model's final flag sent alone: an empty response says so when the client asked
    // for one (`triton_enable_empty_final_response`), as on Triton.
    let end = futures::stream::once(futures::future::lazy(move |_| {
        let marked = marked_final.load(std::sync::atomic::Ordering::Acquire);
        (decoupled && empty_final && !marked).then(|| {
            Ok(ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(ModelInferResponse {
                    model_name: model,
                    model_version: version.map(|v| v.to_string()).unwrap_or_default(),
                    id: final_id,
                    parameters: final_flag(true),
                    ..Default::default()
                }),
            })
        })
    }))
    .filter_map(futures::future::ready);
    responses.chain(end).boxed()
}

/// A tokio receiver as a stream.
fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
