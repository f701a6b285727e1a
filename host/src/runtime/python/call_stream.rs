//! A call into a decoupled model that `model.py` reads one response at a time
//! (`InferenceRequest(...).exec(decoupled=True)`): each response reaches the model as the called
//! model sends it, and the iterator's `cancel()` cancels the call, as on Triton. The stream
//! ends after the response sent with the final flag, or with an empty response when the final
//! flag came alone, as Triton's iterator does.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
    inference::{InferRequest, InferResponse, ResponseSink, StreamedResponse},
};

/// One response of a called model: outputs and parameters.
#[derive(Default)]
pub struct CalledResponse {
    pub(super) outputs: Vec<crate::tensor::Tensor>,
    pub(super) parameters: crate::inference::Parameters,
}

impl From<crate::inference::StreamedResponse> for CalledResponse {
    fn from(r: crate::inference::StreamedResponse) -> Self {
        Self {
            outputs: r.outputs,
            parameters: r.parameters,
        }
    }
}

impl From<InferResponse> for CalledResponse {
    fn from(r: InferResponse) -> Self {
        Self {
            outputs: r.outputs,
            parameters: r.parameters,
        }
    }
}

/// How many responses of the called model wait unread before it waits for the reader.
const CAPACITY: usize = 64;

/// Where the iterator is: reading the stream (then the call's own last response), or done.
enum Stage {
    Reading,
    Ended,
}

/// One call in flight, read by the model.
pub(super) struct CallStream {
    rx: tokio::sync::mpsc::Receiver<StreamedResponse>,
    cancel: Cancellation,
    call: Option<std::thread::JoinHandle<Result<InferResponse>>>,
    stage: Stage,
    /// The last response read came with the final flag: no empty one follows it.
    final_read: bool,
    /// A response taken by [`Self::has_next`], given by the next [`Self::next`].
    buffered: Option<StreamedResponse>,
}

impl CallStream {
    /// Starts `request` on its own thread, its responses kept for [`Self::next`].
    pub(super) fn start(
        caller: Arc<dyn crate::runtime::backend::ModelCaller>,
        mut request: InferRequest,
    ) -> Result<Self> {
        let stall = request.deadline.map_or(Duration::from_secs(60), |d| {
            d.saturating_duration_since(Instant::now())
        });
        let (sink, rx) = ResponseSink::channel(CAPACITY, stall);
        request.responses = Some(sink);
        // The iterator's `cancel()` reaches the called model only: the wait ends early only
        // when the calling batch's own requests are cancelled.
        let watch = request.cancel.clone();
        request.cancel = watch.child();
        let cancel = request.cancel.clone();
        let call = std::thread::Builder::new()
            .name("python-call".into())
            .spawn(move || caller.infer_watching(request, watch))
            .map_err(|e| Error::internal(format!("cannot start a call: {e}")))?;
        Ok(Self {
            rx,
            cancel,
            call: Some(call),
            stage: Stage::Reading,
            final_read: false,
            buffered: None,
        })
    }

    /// The next response, waiting for it; an error ends the stream; `None` once it ended.
    pub(super) fn next(&mut self) -> Option<Result<CalledResponse>> {
        match self.stage {
            Stage::Ended => None,
            Stage::Reading => {
                if let Some(streamed) = self.buffered.take().or_else(|| self.rx.blocking_recv()) {
                    self.final_read = streamed.last;
                    return Some(match streamed.error {
                        Some(e) => Err(e),
                        None => Ok(CalledResponse::from(streamed)),
                    });
                }
                // The called model has answered: its final response, if it has outputs.
                let last = match self.call.take().map(std::thread::JoinHandle::join) {
                    Some(Ok(result)) => result,
                    Some(Err(_)) => Err(Error::internal("a call into another model panicked")),
                    None => Err(Error::internal("the call ended without an answer")),
                };
                match last {
                    // A final response with outputs (a model that is not decoupled).
                    Ok(last) if !last.outputs.is_empty() => {
                        self.stage = Stage::Ended;
                        Some(Ok(CalledResponse::from(last)))
                    }
                    // The model's last response had the final flag: the stream ends with it.
                    Ok(_) if self.final_read => {
                        self.stage = Stage::Ended;
                        None
                    }
                    // It sent the final flag alone: Triton's iterator gives an empty response.
                    Ok(_) => {
                        self.stage = Stage::Ended;
                        Some(Ok(CalledResponse::default()))
                    }
                    Err(e) => {
                        self.stage = Stage::Ended;
                        Some(Err(e))
                    }
                }
            }
        }
    }

    /// Whether [`Self::next`] would answer without waiting.
    pub(super) fn has_next(&mut self) -> bool {
        use tokio::sync::mpsc::error::TryRecvError;
        if matches!(self.stage, Stage::Ended) || self.buffered.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(streamed) => {
                self.buffered = Some(streamed);
                true
            }
            Err(TryRecvError::Empty) => false,
            // The stream is closed: the call's own answer follows once its thread is done.
            Err(TryRecvError::Disconnected) => self
                .call
                .as_ref()
                .is_none_or(std::thread::JoinHandle::is_finished),
        }
    }

    /// [`Self::next`] if it would answer without waiting, else `None`.
    pub(super) fn try_next(&mut self) -> Option<Option<Result<CalledResponse>>> {
        self.has_next().then(|| self.next())
    }

    /// Cancels the call: the called model sees its request cancelled.
    pub(super) fn cancel(&self) {
        self.cancel.cancel();
    }
}
