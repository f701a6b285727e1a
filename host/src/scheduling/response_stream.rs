//! A request whose responses are streamed ([`Server::infer_stream`]): every response a
//! decoupled model sends as it sends it, then its final one, each counted per index as
//! Triton's response statistics; a reader that stops taking them cancels the request.

use std::{future::Future, sync::Arc, time::Instant};

use super::{
    door::Target,
    model_manager::ModelVersion,
    server::Server,
    stats::{ResponseClock, ResponseOutcome},
};
use crate::{
    error::Result,
    inference::{InferRequest, InferResponse, StreamedResponse},
    response_order::{ResponseOrder, Stamp},
};

impl Server {
    /// Runs one request with its responses streamed: every response a decoupled model sends,
    /// then its final one (if it has outputs), then the end of the stream; an error ends the
    /// stream too. Models that are not decoupled give exactly one item.
    pub fn infer_stream(
        self: &Arc<Self>,
        request: InferRequest,
    ) -> tokio::sync::mpsc::Receiver<Result<InferResponse>> {
        match self.lookup_for(&request.callers, &request.model_name, request.model_version) {
            Ok(model) => self.infer_stream_with(model, request, None),
            Err(e) => {
                let (out, items) = tokio::sync::mpsc::channel(1);
                let _ = out.try_send(Err(e));
                items
            }
        }
    }

    /// [`Server::infer_stream`] on a resolved target, for its caller.
    pub fn infer_stream_on(
        self: &Arc<Self>,
        target: &Target,
        request: InferRequest,
    ) -> tokio::sync::mpsc::Receiver<Result<InferResponse>> {
        self.infer_stream_ordered(target, request, None)
    }

    /// [`Server::infer_stream_on`] for one of several requests whose responses share a stream
    /// that keeps `order`: each response is handed over only once every response produced
    /// before it, for any request of that stream, has been taken from its receiver
    /// ([`crate::response_order`]).
    pub fn infer_stream_ordered(
        self: &Arc<Self>,
        target: &Target,
        mut request: InferRequest,
        order: Option<Arc<ResponseOrder>>,
    ) -> tokio::sync::mpsc::Receiver<Result<InferResponse>> {
        target.stamp(&mut request);
        self.infer_stream_with(target.model.clone(), request, order)
    }

    fn infer_stream_with(
        self: &Arc<Self>,
        model: Arc<ModelVersion>,
        mut request: InferRequest,
        order: Option<Arc<ResponseOrder>>,
    ) -> tokio::sync::mpsc::Receiver<Result<InferResponse>> {
        // In order, one response at a time is handed over (and the next one once it is taken).
        let (out, items) = tokio::sync::mpsc::channel(if order.is_some() { 1 } else { 16 });
        let stall = self.options.response_stall_timeout;
        let (sink, mut produced) = crate::inference::ResponseSink::channel(16, stall);
        let decoupled = crate::runtime::is_decoupled(&model.config);
        let (sink, final_stamp) = match sink.ordered(order.clone()) {
            sink if decoupled => (sink, None),
            sink => {
                let (sink, cell) = sink.stamping_final();
                (sink, Some(cell))
            }
        };
        request.responses = Some(sink);
        let server = self.clone();
        let (name, id) = (request.model_name.clone(), request.id.clone());
        // Polled once here, before the task starts, so the request reaches its model's queue
        // now: requests a stream reads one after another are queued (and batched) in the
        // order they were sent, as on Triton, not in the order tasks happen to be polled.
        let mut running = Box::pin({
            let (server, model) = (server.clone(), model.clone());
            async move { server.infer_with(model, request).await }
        });
        let early = running
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        let final_response = async move {
            match early {
                std::task::Poll::Ready(result) => result,
                std::task::Poll::Pending => running.await,
            }
        };
        tokio::spawn(async move {
            let version = model.version;
            // A decoupled model's responses are counted per index, as Triton's response_stats.
            let mut responses = decoupled.then(|| ResponseClock::new(model.stats.clone()));
            let wrap = |streamed: StreamedResponse, name: &str, id: &str| InferResponse {
                model_name: name.to_owned(),
                model_version: version,
                id: id.to_owned(),
                parameters: streamed.parameters,
                outputs: streamed.outputs,
                last: streamed.last,
            };
            tokio::pin!(final_response);
            // A reader that takes nothing for `stall` is treated as gone: returning drops the
            // request's future, which cancels it. In a stream that keeps an order, an item
            // waits for its turn and holds it until the reader has taken it.
            let to_reader = &out;
            let deliver = |item, stamp: Option<Arc<Stamp>>| {
                tokio::time::timeout(stall, async move {
                    if let Some(stamp) = &stamp {
                        stamp.turn().await;
                    }
                    to_reader.send(item).await.map_err(|_| ())?;
                    if stamp.is_some() {
                        // The one slot is free again once the reader has the item.
                        drop(to_reader.reserve().await.map_err(|_| ())?);
                    }
                    Ok::<(), ()>(())
                })
            };
            // The final response (or error) keeps the place the scheduler took when it
            // answered; what the server itself produces is stamped when it is at hand.
            let stamp_now = || {
                let taken = final_stamp.as_ref().and_then(|cell| {
                    cell.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .take()
                });
                taken.or_else(|| order.as_ref().map(|o| Arc::new(o.stamp())))
            };
            let send = async |mut outputs: StreamedResponse, clock: &mut Option<ResponseClock>| {
                let empty = outputs.outputs.is_empty();
                let handed = Instant::now();
                let stamp = outputs.stamp.take();
                // An error response travels in order with the others; the stream goes on.
                let item = match outputs.error.take() {
                    Some(e) => Err(e),
                    None => Ok(wrap(outputs, &name, &id)),
                };
                let sent = matches!(deliver(item, stamp).await, Ok(Ok(())));
                if let Some(clock) = clock {
                    clock.sent(sent, empty, handed);
                }
                sent
            };
            let result = loop {
                tokio::select! {
                    Some(outputs) = produced.recv() => {
                        if !send(outputs, &mut responses).await {
                            return; // the client left or stopped reading
                        }
                    }
                    result = &mut final_response => break result,
                    // The client left before anything was sent (a long answer that is not
                    // streamed): dropping the request cancels it.
                    () = out.closed() => {
                        if let Some(clock) = &mut responses {
                            clock.ended(ResponseOutcome::Cancel);
                        }
                        return;
                    }
                }
            };
            // Everything sent during execution is queued ahead of the final response. The
            // stream ends once every sender is gone: a model that answers in the background
            // (a decoupled `async def execute`) holds it open until it has sent everything.
            loop {
                tokio::select! {
                    next = produced.recv() => match next {
                        Some(outputs) => {
                            if !send(outputs, &mut responses).await {
                                return;
                            }
                        }
                        None => break,
                    },
                    () = out.closed() => {
                        if let Some(clock) = &mut responses {
                            clock.ended(ResponseOutcome::Cancel);
                        }
                        return;
                    }
                }
            }
            match result {
                Ok(last) if last.outputs.is_empty() => {}
                Ok(last) => {
                    let handed = Instant::now();
                    let sent = matches!(deliver(Ok(last), stamp_now()).await, Ok(Ok(())));
                    if let Some(clock) = &mut responses {
                        clock.sent(sent, false, handed);
                    }
                }
                Err(e) => {
                    if let Some(clock) = &mut responses {
                        clock.ended(if e.code == crate::error::Code::Cancelled {
                            ResponseOutcome::Cancel
                        } else {
                            ResponseOutcome::Fail
                        });
                    }
                    let _ = deliver(Err(e), stamp_now()).await;
                }
            }
        });
        items
    }
}
