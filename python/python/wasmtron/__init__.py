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
import dataclasses
import json
import tempfile
import traceback
import weakref
from typing import (Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

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
    "Tensor",
    "ModelConfig",
    "DynamicBatcher",
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


@dataclasses.dataclass(frozen=True)
class Tensor:
    """An input or output of a bound function (PyTriton's ``Tensor``): ``name``, a NumPy
    ``dtype`` (``np.bytes_`` or ``object`` for BYTES) and ``shape`` without the batch
    dimension, ``-1`` for a variable one."""
    name: str
    dtype: object
    shape: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DynamicBatcher:
    """Triton's ``dynamic_batching``: how long a request may wait for others, and the batch
    sizes to prefer."""
    max_queue_delay_microseconds: int = 0
    preferred_batch_size: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The configuration of a bound function (PyTriton's ``ModelConfig``): ``max_batch_size``
    (0: no batching; then shapes are whole tensors) and ``batcher`` (None: each request runs
    alone)."""
    max_batch_size: int = 0
    batcher: Optional[DynamicBatcher] = None


def _config_type(name: str, dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.object_ or dtype.kind in ("S", "U"):
        return "TYPE_STRING"
    triton = _TO_TRITON.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if triton is None:
        raise InvalidArgumentError(f"tensor '{name}': dtype {dtype} has no Triton datatype")
    return "TYPE_" + triton


def _bound_config(model_name: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                  config: ModelConfig, instances: int) -> str:
    def tensors(ts):
        return [{"name": t.name, "data_type": _config_type(t.name, t.dtype),
                 "dims": [int(d) for d in t.shape]} for t in ts]
    out = {"name": model_name, "backend": "python", "max_batch_size": int(config.max_batch_size),
           "input": tensors(inputs), "output": tensors(outputs),
           "instance_group": [{"count": instances, "kind": "KIND_CPU"}]}
    if config.batcher is not None:
        out["dynamic_batching"] = {
            "max_queue_delay_microseconds": int(config.batcher.max_queue_delay_microseconds),
            "preferred_batch_size": [int(n) for n in config.batcher.preferred_batch_size]}
    return json.dumps(out)


_STATUS = {"InvalidArgumentError": "INVALID_ARGUMENT", "NotFoundError": "NOT_FOUND",
           "UnavailableError": "UNAVAILABLE", "UnsupportedError": "UNSUPPORTED"}


def _call_bound(function: Callable, inputs, output_names):
    """Runs a bound function on one execution's inputs (the server calls this, GIL held):
    tuples in, tuples out; an exception comes back as (status, message with traceback)."""
    try:
        arrays = {name: _decode(datatype, shape, data) for name, datatype, shape, data in inputs}
        result = function(**arrays)
        if not isinstance(result, Mapping):
            raise TypeError(f"a bound function must return a dict of arrays, not "
                            f"{type(result).__name__}")
        return [_encode(name, result[name]) for name in output_names if name in result]
    except Exception as e:  # noqa: BLE001 - every failure answers the request, not the server
        status = _STATUS.get(type(e).__name__, "INTERNAL")
        return (status, "".join(traceback.format_exception(e)).rstrip())


def _bound_caller(function: Callable) -> Callable:
    def call(inputs, output_names):
        return _call_bound(function, inputs, output_names)
    return call


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

    def config(self) -> Dict[str, object]:
        """This model's configuration, completed as the server serves it (the JSON of
        ``GET /v2/models/<name>/config``: ``input``, ``output``, ``max_batch_size``, ...)."""
        version = None if self.version < 0 else self.version
        return json.loads(self._server._core.model_config(self.name, version))

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

    ``model_repository``: a directory (or several) laid out as Triton's model repository, or an
    object store as the binary's ``--model-repository`` takes it (``s3://[host:port/]bucket/
    path`` with the ``AWS_*`` variables, ``gs://``, ``as://``), copied locally at start.
    ``model_control_mode``: ``"none"`` (load everything at start), ``"poll"`` (follow changes
    to the repository) or ``"explicit"`` (load and unload on request; ``load_models`` names
    what to load at start, ``"*"`` for all). ``strict_readiness``: ready only when every model
    is. ``onnxruntime_library``: path of ``libonnxruntime.so`` when not the one the package
    was built with. ``config``: the server config file (TOML; tenants, their hashed API keys,
    models and quotas), as the binary's ``--config``: remote callers on the listeners need a
    tenant's key; in-process calls are this program's own and are not checked.
    """

    def __init__(self, model_repository: Union[str, Sequence[str], None] = None,
                 model_control_mode: str = "none", load_models: Sequence[str] = (),
                 strict_readiness: bool = True, onnxruntime_library: Optional[str] = None,
                 config: Optional[str] = None):
        if model_repository is None:  # only bound functions: an empty repository
            self._empty = tempfile.TemporaryDirectory(prefix="wasmtron-")
            model_repository = self._empty.name
        repositories = [model_repository] if isinstance(model_repository, str) else list(model_repository)
        self._core = CoreServer([str(r) for r in repositories], model_control_mode,
                                list(load_models), strict_readiness, onnxruntime_library,
                                None if config is None else str(config))
        # Garbage-collected or at interpreter exit: drain and stop while Python still runs
        # (bound functions need the interpreter to finish what was accepted).
        self._finalizer = weakref.finalize(self, self._core.stop)

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

    def bind(self, model_name: str, infer_func: Union[Callable, Sequence[Callable]],
             inputs: Sequence[Tensor], outputs: Sequence[Tensor],
             config: ModelConfig = ModelConfig()) -> Model:
        """Serves a Python function as model ``model_name`` (PyTriton's ``bind``), to
        in-process and remote callers alike, through the same scheduler as every model: with
        ``config.batcher`` requests are batched by the dynamic batcher and the function gets
        the batch (arrays with the batch dimension first, like PyTriton's ``@batch``).

        ``infer_func(**inputs) -> {output name: array}``; a list of functions gives one
        execution instance each (they run side by side where they release the GIL, as NumPy
        does). An exception fails only the requests of that execution, with its traceback in
        the message (raise :class:`InvalidArgumentError` for a 400). The function runs in the
        server's process with the server's rights: this is for trusted code; code from
        tenants belongs in Wasm stages. Call after :meth:`start`; returns the model."""
        functions = list(infer_func) if isinstance(infer_func, (list, tuple)) else [infer_func]
        if not functions or not all(callable(f) for f in functions):
            raise InvalidArgumentError(f"bind '{model_name}': infer_func must be a callable "
                                       "or a list of callables")
        calls = [_bound_caller(f) for f in functions]
        self._core.bind(_bound_config(model_name, inputs, outputs, config, len(calls)), calls)
        return self.model(model_name)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
