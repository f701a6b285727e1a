"""Models and requests as Triton's in-process API has them: ``Model``, ``InferenceRequest``,
``InferenceResponse``, ``ResponseIterator`` and ``AsyncResponseIterator``.

``Model.infer`` returns an iterator of responses for every model: the one response of a model
that answers once (``final`` set), or each response of a decoupled model as it is sent,
followed by an empty final response, as Triton's iterator yields them."""
import asyncio
import dataclasses
import enum
import json
import queue
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Union

from ._tensor import MemoryType, Tensor, from_wire, to_wire, _is_host
from ._wasmtron import InvalidArgumentError, UnsupportedError, WasmtronError

if TYPE_CHECKING:
    from ._server import Server


class ModelBatchFlag(enum.IntFlag):
    """How a model batches (``TRITONSERVER_ModelBatchFlag``)."""
    UNKNOWN = 1
    FIRST_DIM = 2


class ModelTxnPropertyFlag(enum.IntFlag):
    """How a model answers (``TRITONSERVER_ModelTxnPropertyFlag``)."""
    ONE_TO_ONE = 1
    DECOUPLED = 2


# Triton's request flags (``TRITONSERVER_RequestFlag``).
SEQUENCE_START = 1
SEQUENCE_END = 2


@dataclasses.dataclass
class InferenceRequest:
    """One inference request (Triton's ``InferenceRequest``): ``inputs`` maps input names to
    :class:`Tensor`, NumPy arrays, nested lists (``[["a prompt"]]`` is a 1×1 BYTES tensor) or
    DLPack objects; ``parameters`` are request parameters (bool, int, float or str);
    ``priority`` and ``timeout`` (microseconds) as the scheduler's; ``correlation_id`` and
    ``flags`` (1: sequence start, 2: sequence end) for sequence models; ``response_queue``
    (a ``queue.SimpleQueue`` or ``asyncio.Queue``) also receives every response.
    ``output_names`` (wasmtron) picks outputs; all by default."""
    model: "Model"
    request_id: Optional[str] = None
    flags: int = 0
    correlation_id: Optional[Union[int, str]] = None
    priority: int = 0
    timeout: int = 0
    inputs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    parameters: Dict[str, Union[str, int, bool, float]] = dataclasses.field(default_factory=dict)
    output_memory_type: Any = None
    response_queue: Any = None
    output_names: Optional[Iterable[str]] = None

    def _parameters(self) -> Dict[str, Union[str, int, bool, float]]:
        out = dict(self.parameters)
        if self.priority:
            out["priority"] = int(self.priority)
        if self.timeout:
            out["timeout"] = int(self.timeout)
        if self.correlation_id is not None:
            out["sequence_id"] = self.correlation_id
        if self.flags & SEQUENCE_START:
            out["sequence_start"] = True
        if self.flags & SEQUENCE_END:
            out["sequence_end"] = True
        return out

    def _start(self):
        """Sends the request; returns the extension's response stream."""
        if not _is_host(self.output_memory_type):
            raise UnsupportedError(
                f"output_memory_type {self.output_memory_type!r}: the in-process server "
                "answers in host memory only (MemoryType.CPU)")
        if not isinstance(self.inputs, dict):
            raise InvalidArgumentError("inputs must be a dict of input name to tensor")
        encoded = [to_wire(name, value) for name, value in self.inputs.items()]
        model = self.model
        return model._server._running().infer_stream(
            model.name, model.version, encoded, list(self.output_names or ()),
            self._parameters(), self.request_id)


@dataclasses.dataclass
class InferenceResponse:
    """One response (Triton's ``InferenceResponse``): ``outputs`` maps output names to
    :class:`Tensor`; ``error`` is set (and ``outputs`` empty) when the request failed and the
    iterator was asked not to raise; ``final`` marks the last response of the request."""
    model: "Model"
    request_id: Optional[str] = None
    parameters: Dict[str, Union[str, int, bool, float]] = dataclasses.field(default_factory=dict)
    outputs: Dict[str, Tensor] = dataclasses.field(default_factory=dict)
    error: Optional[WasmtronError] = None
    classification_label: Optional[str] = None
    final: bool = False


class ResponseIterator:
    """The responses of one request, in order; iterating waits (without the GIL) for the
    next. ``cancel()`` stops waiting for the rest."""

    def __init__(self, model: "Model", request: InferenceRequest, raise_on_error: bool = True):
        self._model = model
        self._request = request
        self._raise_on_error = raise_on_error
        self._complete = False
        self._lock = threading.Lock()
        try:
            self._stream = request._start()
        except WasmtronError as error:
            if raise_on_error:
                raise
            self._stream, self._error = None, error
        self._pending = queue.SimpleQueue() if request.response_queue is not None else None
        try:  # an asyncio.Queue is fed on its own loop
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        if self._pending is not None:
            threading.Thread(target=self._forward, daemon=True,
                             name="wasmtron-responses").start()

    def _fetch(self) -> InferenceResponse:
        """The next response from the server (the empty final one after a decoupled model's
        last)."""
        if self._stream is None:
            return self._response(error=self._error)
        try:
            item = next(self._stream, None)
        except WasmtronError as error:
            return self._response(error=error)
        if item is None:
            return self._response()
        model_name, version, request_id, parameters, outputs = item
        model = Model(self._model._server, model_name, version)
        return InferenceResponse(
            model, request_id or self._request.request_id, parameters,
            {name: from_wire(datatype, shape, data) for name, datatype, shape, data in outputs},
            final=not self._stream.decoupled)

    def _response(self, error: Optional[WasmtronError] = None) -> InferenceResponse:
        return InferenceResponse(self._model, self._request.request_id, error=error, final=True)

    def _forward(self) -> None:
        """Feeds the request's response_queue (and this iterator) from a thread."""
        while True:
            response = self._fetch()
            self._pending.put(response)
            user = self._request.response_queue
            if isinstance(user, asyncio.Queue) and self._loop is not None:
                self._loop.call_soon_threadsafe(user.put_nowait, response)
            else:
                user.put_nowait(response)
            if response.final:
                return

    def __iter__(self) -> "ResponseIterator":
        return self

    def __next__(self) -> InferenceResponse:
        with self._lock:
            if self._complete:
                raise StopIteration
            response = self._pending.get() if self._pending is not None else self._fetch()
            self._complete = response.final
        if response.error is not None and self._raise_on_error:
            raise response.error
        return response

    def cancel(self) -> None:
        """Stops waiting for the request's remaining responses."""
        self._complete = True
        if self._stream is not None:
            self._stream.close()


class AsyncResponseIterator:
    """:class:`ResponseIterator` for asyncio (``async for response in
    model.async_infer(...)``): each response is waited for in a worker thread, so the event
    loop keeps running."""

    def __init__(self, model: "Model", request: InferenceRequest, raise_on_error: bool = True):
        self._iterator = ResponseIterator(model, request, raise_on_error)

    def __aiter__(self) -> "AsyncResponseIterator":
        return self

    async def __anext__(self) -> InferenceResponse:
        # StopIteration cannot cross into a future: the thread answers None at the end.
        response = await asyncio.to_thread(next, self._iterator, None)
        if response is None:
            raise StopAsyncIteration
        return response

    def cancel(self) -> None:
        """Stops waiting for the request's remaining responses."""
        self._iterator.cancel()


class Model:
    """One model (version) of a started server (Triton's ``Model``); get it with
    ``server.model(name)``, ``server.load(name)`` or ``server.models()``. ``state`` and
    ``reason`` are those of the repository index when the model came from there."""

    def __init__(self, server: "Server", name: str, version: int = -1,
                 state: Optional[str] = None, reason: Optional[str] = None):
        self._server = server
        self.name = name
        self.version = version
        self.state = state
        self.reason = reason

    def __repr__(self) -> str:
        return repr({"name": self.name, "version": self.version, "state": self.state})

    def _version(self) -> Optional[int]:
        return None if self.version < 0 else self.version

    def create_request(self, **kwargs) -> InferenceRequest:
        """A request for this model (the :class:`InferenceRequest` fields as keywords)."""
        kwargs.pop("model", None)
        return InferenceRequest(model=self, **kwargs)

    def _request(self, inference_request, kwargs) -> InferenceRequest:
        if inference_request is None:
            return self.create_request(**kwargs)
        if not isinstance(inference_request, InferenceRequest):
            raise InvalidArgumentError(
                f"model '{self.name}': infer() takes an InferenceRequest or keywords "
                f"(inputs={{...}}), not {type(inference_request).__name__}")
        return inference_request

    def infer(self, inference_request: Optional[InferenceRequest] = None,
              raise_on_error: bool = True, **kwargs) -> ResponseIterator:
        """Sends a request (``inference_request``, or one made from the keywords: ``inputs``,
        ``parameters``, ``request_id``, ...) and returns its responses as they come. Requests
        go through the model's scheduler as remote ones do (batched with other callers).
        With ``raise_on_error`` a failed request raises the server's error (a
        :class:`WasmtronError` subclass naming what was wrong) from the iterator; without, it
        is the final response's ``error``."""
        return ResponseIterator(self, self._request(inference_request, kwargs), raise_on_error)

    def async_infer(self, inference_request: Optional[InferenceRequest] = None,
                    raise_on_error: bool = True, **kwargs) -> AsyncResponseIterator:
        """:meth:`infer` for asyncio: ``async for response in model.async_infer(...)``."""
        return AsyncResponseIterator(self, self._request(inference_request, kwargs),
                                     raise_on_error)

    def ready(self) -> bool:
        """Whether this model (version) is loaded and its instances are healthy."""
        return self._server._running().model_ready(self.name, self._version())

    def metadata(self) -> Dict[str, Any]:
        """Name, versions, platform, inputs and outputs (``GET /v2/models/<name>``)."""
        version = "" if self.version < 0 else str(self.version)
        return json.loads(self._server._running().model_metadata(self.name, version))

    def config(self, config_version: int = 1) -> Dict[str, Any]:
        """This model's configuration, completed as the server serves it (the JSON of
        ``GET /v2/models/<name>/config``)."""
        if config_version != 1:
            raise InvalidArgumentError(f"config_version {config_version}: only 1 is offered")
        return json.loads(self._server._running().model_config(self.name, self._version()))

    def batch_properties(self) -> ModelBatchFlag:
        """Whether the model batches along the first dimension."""
        batching = int(self.config().get("max_batch_size", 0)) > 0
        return ModelBatchFlag.FIRST_DIM if batching else ModelBatchFlag.UNKNOWN

    def transaction_properties(self) -> ModelTxnPropertyFlag:
        """Whether the model answers once per request or is decoupled (0..N responses)."""
        policy = self.config().get("model_transaction_policy") or {}
        return (ModelTxnPropertyFlag.DECOUPLED if policy.get("decoupled")
                else ModelTxnPropertyFlag.ONE_TO_ONE)

    def statistics(self) -> Dict[str, Any]:
        """This model's statistics, as the statistics extension reports them."""
        version = "" if self.version < 0 else str(self.version)
        return json.loads(self._server._running().statistics(self.name, version))


__all__ = ["Model", "InferenceRequest", "InferenceResponse", "ResponseIterator",
           "AsyncResponseIterator", "ModelBatchFlag", "ModelTxnPropertyFlag", "MemoryType"]
