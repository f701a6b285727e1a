"""Wasmtron in-process: the server's core runs inside this Python process, and models are
called directly with NumPy arrays, with no network hop (the nouns of Triton's in-process
``tritonserver`` API)::

    import numpy as np
    import wasmtron

    with wasmtron.Server(model_repository="model_repository") as server:
        simple = server.model("simple")
        out = simple.infer(inputs={"INPUT0": np.ones((1, 16), np.int32),
                                   "INPUT1": np.ones((1, 16), np.int32)})
        print(out["OUTPUT0"])          # [[2 2 ... 2]]

Requests go through each model's scheduler exactly as remote ones do (dynamic batching with
other callers, queue policies, Wasm stages and ensembles), and get the same checks and errors:
a wrong dtype, shape or name raises ``InvalidArgumentError`` naming the tensor, an unknown model
``NotFoundError``. The GIL is released while the server works, so threads infer concurrently.
"""
import asyncio
import json
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._wasmtron import (  # noqa: F401  (re-exported)
    AlreadyExistsError,
    CancelledError,
    CoreServer,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
    WasmtronError,
)

__all__ = [
    "Server",
    "Model",
    "WasmtronError",
    "InvalidArgumentError",
    "NotFoundError",
    "UnavailableError",
    "UnsupportedError",
    "AlreadyExistsError",
    "CancelledError",
    "InternalError",
]

# NumPy dtype <-> Triton datatype (BYTES is dtype=object or np.bytes_).
_TO_TRITON = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}
_FROM_TRITON = {name: dtype for dtype, name in _TO_TRITON.items()}


def _encode(name: str, value) -> Tuple[str, str, List[int], bytes]:
    array = np.asarray(value)
    if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
        out = bytearray()
        for element in array.reshape(-1):
            if isinstance(element, str):
                element = element.encode()
            elif not isinstance(element, (bytes, bytearray)):
                raise InvalidArgumentError(
                    f"input '{name}': a BYTES element must be bytes or str, got "
                    f"{type(element).__name__}")
            out += len(element).to_bytes(4, "little") + bytes(element)
        return name, "BYTES", list(array.shape), bytes(out)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    datatype = _TO_TRITON.get(array.dtype)
    if datatype is None:
        raise InvalidArgumentError(f"input '{name}': dtype {array.dtype} has no Triton datatype")
    return name, datatype, list(array.shape), np.ascontiguousarray(array).tobytes()


def _decode(datatype: str, shape: Sequence[int], data: bytes) -> np.ndarray:
    if datatype == "BYTES":
        elements, at = [], 0
        while at < len(data):
            size = int.from_bytes(data[at:at + 4], "little")
            elements.append(data[at + 4:at + 4 + size])
            at += 4 + size
        array = np.empty(len(elements), dtype=np.object_)
        array[:] = elements
        return array.reshape(shape)
    dtype = _FROM_TRITON.get(datatype)
    if dtype is None:  # BF16: raw 16-bit words.
        return np.frombuffer(data, dtype=np.uint16).reshape(shape)
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)


class Model:
    """One model (version) of a started :class:`Server`; get it with ``server.model(name)``."""

    def __init__(self, server: "Server", name: str, version: int = -1):
        self._server = server
        self.name = name
        self.version = version

    def __repr__(self) -> str:
        return f"Model({self.name!r}, version={self.version})"

    def ready(self) -> bool:
        """Whether this model (version) is loaded and its instances are healthy."""
        version = None if self.version < 0 else self.version
        return self._server._core.model_ready(self.name, version)

    def infer(self, inputs: Mapping[str, object], parameters: Optional[Mapping[str, object]] = None,
              output_names: Optional[Iterable[str]] = None) -> Dict[str, np.ndarray]:
        """Runs one request and returns ``{output name: ndarray}``.

        ``inputs`` maps input names to arrays (anything ``np.asarray`` takes; BYTES inputs as
        ``dtype=object`` arrays of bytes or str). ``parameters`` are request parameters (bool,
        int, float or str; e.g. ``priority``, ``timeout`` in microseconds). ``output_names``
        picks outputs (default: all, in the configuration's order). Raises a
        :class:`WasmtronError` subclass carrying the server's message.
        """
        encoded = [_encode(name, value) for name, value in inputs.items()]
        answers = self._server._core.infer(self.name, self.version, encoded,
                                           list(output_names or ()), dict(parameters or {}))
        return {name: _decode(datatype, shape, data) for name, datatype, shape, data in answers}

    def infer_stream(self, inputs: Mapping[str, object],
                     parameters: Optional[Mapping[str, object]] = None,
                     output_names: Optional[Iterable[str]] = None) -> Iterator[Dict[str, np.ndarray]]:
        """Runs one request and yields its responses as they come: every response of a
        decoupled model (``model_transaction_policy { decoupled: true }``), or the one response
        of any other model. Leaving the loop early stops waiting for the rest."""
        encoded = [_encode(name, value) for name, value in inputs.items()]
        stream = self._server._core.infer_stream(self.name, self.version, encoded,
                                                 list(output_names or ()), dict(parameters or {}))
        try:
            for answers in stream:
                yield {name: _decode(datatype, shape, data) for name, datatype, shape, data in answers}
        finally:
            stream.close()

    def statistics(self) -> Dict[str, object]:
        """This model's statistics, as the statistics extension reports them (counts and
        nanoseconds of success, fail, queue, compute; per batch size; warm-up)."""
        version = "" if self.version < 0 else str(self.version)
        return json.loads(self._server._core.statistics(self.name, version))

    async def async_infer(self, inputs: Mapping[str, object],
                          parameters: Optional[Mapping[str, object]] = None,
                          output_names: Optional[Iterable[str]] = None) -> Dict[str, np.ndarray]:
        """:meth:`infer` for asyncio: runs in a worker thread, the event loop keeps running."""
        return await asyncio.to_thread(self.infer, inputs, parameters, output_names)


class Server:
    """A wasmtron server inside this process.

    ``model_repository``: a directory (or several) laid out as Triton's model repository.
    ``model_control_mode``: ``"none"`` (load everything at start), ``"poll"`` (follow changes
    to the repository) or ``"explicit"`` (load and unload on request; ``load_models`` names
    what to load at start, ``"*"`` for all). ``strict_readiness``: ready only when every model
    is. ``onnxruntime_library``: path of ``libonnxruntime.so`` when not the one the package
    was built with.
    """

    def __init__(self, model_repository: Union[str, Sequence[str]], model_control_mode: str = "none",
                 load_models: Sequence[str] = (), strict_readiness: bool = True,
                 onnxruntime_library: Optional[str] = None):
        repositories = [model_repository] if isinstance(model_repository, str) else list(model_repository)
        self._core = CoreServer([str(r) for r in repositories], model_control_mode,
                                list(load_models), strict_readiness, onnxruntime_library)

    def start(self, wait_until_ready: bool = True, http_port: Optional[int] = None,
              grpc_port: Optional[int] = None, metrics_port: Optional[int] = None,
              address: str = "127.0.0.1") -> "Server":
        """Loads the repository and starts serving; returns the server.

        With ``http_port``, ``grpc_port`` or ``metrics_port`` (0: a free port) the same server
        also listens on ``address`` for remote callers (KServe v2 over HTTP and gRPC,
        Prometheus metrics), so ``tritonclient`` and ``perf_analyzer`` reach the models this
        process calls in-process; :attr:`addresses` says where. Load errors of single models
        do not fail the start (see :meth:`models`); with ``wait_until_ready`` a server that is
        not ready afterwards raises :class:`UnavailableError` naming the models that did not
        load."""
        self._core.start(http_port, grpc_port, metrics_port, address)
        if wait_until_ready and not self._core.ready():
            failed = [f"{name}: {reason}" for (name, _), state in self.models().items()
                      if state["state"] == "UNAVAILABLE" for reason in [state["reason"]]]
            raise UnavailableError("the server is not ready: " + "; ".join(failed))
        return self

    @property
    def addresses(self) -> Dict[str, str]:
        """Where the listeners opened by :meth:`start` listen, as tritonclient takes them:
        ``{"http": "127.0.0.1:8000", "grpc": ..., "metrics": ...}`` (only those opened)."""
        return self._core.addresses()

    def stop(self, timeout: float = 30.0) -> bool:
        """Stops taking requests (readiness off), waits up to ``timeout`` seconds for those
        accepted, in-process and remote, then closes the listeners; returns whether they all
        finished."""
        return self._core.stop(timeout)

    def ready(self) -> bool:
        """Whether the server is started and ready (with strict readiness: every model)."""
        return self._core.ready()

    def models(self) -> Dict[Tuple[str, int], Dict[str, str]]:
        """The repository index: ``{(name, version): {"state": ..., "reason": ...}}``, version
        -1 for a model with no loaded version."""
        return {(name, -1 if version is None else version): {"state": state, "reason": reason}
                for name, version, state, reason in self._core.index()}

    def model(self, name: str, version: int = -1) -> Model:
        """A handle on model ``name`` (``version`` -1: the latest loaded)."""
        return Model(self, name, version)

    def load(self, name: str) -> None:
        """Loads or reloads ``name`` (explicit control mode)."""
        self._core.load(name)

    def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Unloads ``name`` (explicit control mode); requests already accepted finish."""
        self._core.unload(name, unload_dependents)

    def statistics(self) -> Dict[str, object]:
        """Every loaded model's statistics (``{"model_stats": [...]}``, as
        ``GET /v2/models/stats`` answers)."""
        return json.loads(self._core.statistics())

    def metrics(self) -> str:
        """The Prometheus metrics text, as the metrics endpoint serves it."""
        return self._core.metrics()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
