"""The server as Triton's in-process API has it: ``Server``, ``Options``,
``ModelControlMode``."""
import dataclasses
import enum
import json
import tempfile
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from ._bind import ModelConfig, TensorSpec, bound_caller, bound_config
from ._model import Model
from ._wasmtron import CoreServer, InvalidArgumentError, UnavailableError, init_logging


class ModelControlMode(enum.IntEnum):
    """How models are loaded (``TRITONSERVER_ModelControlMode``): all at start (``NONE``),
    following the repository (``POLL``), or on request (``EXPLICIT``)."""
    NONE = 0
    POLL = 1
    EXPLICIT = 2


class LogFormat(enum.IntEnum):
    """The log's line format (``TRITONSERVER_LogFormat``)."""
    DEFAULT = 0
    ISO8601 = 1


class MetricFormat(enum.IntEnum):
    """The metrics' format (``TRITONSERVER_MetricFormat``)."""
    PROMETHEUS = 0


@dataclasses.dataclass
class Options:
    """Server options, with the names and defaults of Triton's ``tritonserver.Options``.

    ``model_repository``: a directory or several, laid out as Triton's model repository, or
    an object store as the binary's ``--model-repository`` takes it (``s3://[host:port/]
    bucket/path`` with the ``AWS_*`` variables, ``gs://``, ``as://``), copied locally at
    start. ``model_control_mode``: a :class:`ModelControlMode` (or its name);
    ``startup_models``: what ``EXPLICIT`` loads at start (``"*"``: all). ``log_error`` /
    ``log_warn`` / ``log_info`` / ``log_verbose`` send the server's log to stderr (or
    ``log_file``); without them it logs nothing. ``exit_timeout``: seconds :meth:`Server.stop`
    waits for accepted requests. ``model_load_thread_count``: models loaded at once at start.

    Accepted for compatibility, with no effect here: ``server_id``, ``strict_model_config``
    (configurations are always completed from the model), ``exit_on_error``,
    ``metrics``, ``gpu_metrics``, ``cpu_metrics``,
    ``metrics_interval``, ``log_format``. Wasmtron's own: ``onnxruntime_library`` (the
    ``libonnxruntime.so`` to load when not the one the package was built with) and
    ``config`` (the server config file: tenants, their hashed API keys, models, quotas; it
    guards the listeners :meth:`Server.start` opens, not in-process calls)."""
    model_repository: Union[str, List[str]] = dataclasses.field(default_factory=list)
    server_id: str = "triton"
    model_control_mode: Union[ModelControlMode, str] = ModelControlMode.NONE
    startup_models: List[str] = dataclasses.field(default_factory=list)
    strict_model_config: bool = False
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout: int = 30
    model_load_thread_count: int = 4
    log_file: Optional[str] = None
    log_info: bool = False
    log_warn: bool = False
    log_error: bool = False
    log_format: LogFormat = LogFormat.DEFAULT
    log_verbose: int = 0
    metrics: bool = True
    gpu_metrics: bool = True
    cpu_metrics: bool = True
    metrics_interval: int = 2000
    onnxruntime_library: Optional[str] = None
    config: Optional[str] = None

    def _control_mode(self) -> str:
        mode = self.model_control_mode
        if isinstance(mode, str):
            try:
                mode = ModelControlMode[mode.upper()]
            except KeyError:
                raise InvalidArgumentError(
                    f"model_control_mode '{self.model_control_mode}' is not one of NONE, "
                    "POLL, EXPLICIT") from None
        return ModelControlMode(mode).name.lower()

    def _log_level(self) -> Optional[str]:
        if self.log_verbose:
            return "debug"
        for level, on in (("info", self.log_info), ("warn", self.log_warn),
                          ("error", self.log_error)):
            if on:
                return level
        return None


class ModelDictionary(dict):
    """``{(name, version): Model}`` of the repository index; ``[name]`` gives the model's
    latest version."""

    def __init__(self, server: "Server", models: Sequence[Model]):
        super().__init__(((m.name, m.version), m) for m in models)
        self._server = server

    def __getitem__(self, key):
        if isinstance(key, tuple):
            try:
                return dict.__getitem__(self, key)
            except KeyError:
                raise KeyError(f"Unknown Model: {key}") from None
        if any(name == key for name, _ in self.keys()):
            return Model(self._server, key)
        raise KeyError(f"Unknown Model: {key}")


class Server:
    """A wasmtron server inside this process, with the API of Triton's ``tritonserver.Server``
    (``Server(options)`` or ``Server(model_repository=..., **options)``; see :class:`Options`).

    Requests go through each model's scheduler exactly as remote ones do (dynamic batching
    with other callers, queue policies, Wasm stages and ensembles), with the same checks and
    errors. The GIL is released while the server works, so threads infer concurrently."""

    def __init__(self, options: Union[Options, str, Sequence[str], None] = None, **kwargs):
        if isinstance(options, (str, list, tuple)):  # Server("model_repository")
            kwargs.setdefault("model_repository", options)
            options = None
        self.options: Options = options if options is not None else Options(**kwargs)
        self._core: Optional[CoreServer] = None
        self._empty = None
        self._finalizer = None

    def _make_core(self) -> CoreServer:
        options = self.options
        level = options._log_level()
        if level is not None:
            init_logging(level, options.log_file)
        repositories = options.model_repository
        repositories = [repositories] if isinstance(repositories, str) else list(repositories)
        if not repositories:  # only bound functions: an empty repository
            self._empty = tempfile.TemporaryDirectory(prefix="wasmtron-")
            repositories = [self._empty.name]
        return CoreServer([str(r) for r in repositories], options._control_mode(),
                          list(options.startup_models), bool(options.strict_readiness),
                          options.onnxruntime_library,
                          None if options.config is None else str(options.config),
                          int(options.model_load_thread_count))

    def start(self, wait_until_ready: bool = False, polling_interval: float = 0.1,
              timeout: Optional[float] = None, http_port: Optional[int] = None,
              grpc_port: Optional[int] = None, metrics_port: Optional[int] = None,
              address: str = "127.0.0.1", http_restricted_api: Sequence[str] = (),
              grpc_restricted_protocol: Sequence[str] = ()) -> "Server":
        """Loads the repository (as the control mode says) and starts serving; returns the
        server. Load errors of single models do not fail the start (see :meth:`models`);
        with ``wait_until_ready`` a server that is not ready raises :class:`UnavailableError`
        naming the models that did not load (models load before ``start`` returns, so there
        is nothing to poll for; ``polling_interval`` and ``timeout`` are accepted).

        With ``http_port``, ``grpc_port`` or ``metrics_port`` (0: a free port) the same server
        also listens on ``address`` for remote callers (KServe v2 over HTTP and gRPC,
        Prometheus metrics); :attr:`addresses` says where. ``http_restricted_api`` and
        ``grpc_restricted_protocol`` take the values of Triton's flags of those names
        (``<api>,<api>,...:<header>=<value>``): those API groups then need the header."""
        if self._core is not None:
            raise InvalidArgumentError("Server already started")
        core = self._make_core()
        core.start(http_port, grpc_port, metrics_port, address, list(http_restricted_api),
                   list(grpc_restricted_protocol))
        self._core = core
        # Garbage-collected or at interpreter exit: drain and stop while Python still runs
        # (bound functions need the interpreter to finish what was accepted).
        self._finalizer = weakref.finalize(self, core.stop)
        if wait_until_ready and not core.ready():
            failed = [f"{m.name}: {m.reason}" for m in self.models().values()
                      if m.state == "UNAVAILABLE"]
            raise UnavailableError("the server is not ready: " + "; ".join(failed))
        return self

    def _running(self) -> CoreServer:
        if self._core is None:
            raise InvalidArgumentError("Server not started")
        return self._core

    @property
    def addresses(self) -> Dict[str, str]:
        """Where the listeners opened by :meth:`start` listen, as tritonclient takes them:
        ``{"http": "127.0.0.1:8000", "grpc": ..., "metrics": ...}`` (only those opened)."""
        return {} if self._core is None else self._core.addresses()

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Stops taking requests (readiness off), waits up to ``timeout`` seconds
        (``exit_timeout`` by default) for those accepted, in-process and remote, then closes
        the listeners and unloads; returns whether they all finished. The server may be
        started again."""
        core, self._core = self._core, None
        if core is None:
            return True
        if self._finalizer is not None:
            self._finalizer.detach()
        wait = self.options.exit_timeout if timeout is None else timeout
        return core.stop(float(wait))

    def live(self) -> bool:
        """Whether the server is started."""
        return self._core is not None and self._core.live()

    def ready(self) -> bool:
        """Whether the server is started and ready (with strict readiness: every model)."""
        return self._core is not None and self._core.ready()

    def metadata(self) -> Dict[str, Any]:
        """The server's name, version and protocol extensions."""
        return json.loads(self._running().metadata())

    def model(self, model_name: str, model_version: int = -1) -> Model:
        """A handle on model ``model_name`` (``model_version`` -1: the latest loaded); it is
        checked when used."""
        self._running()
        return Model(self, model_name, model_version)

    def models(self, exclude_not_ready: bool = False) -> ModelDictionary:
        """The repository index: ``{(name, version): Model}`` with each model's ``state``
        (``READY``, ``UNAVAILABLE``, ...) and ``reason``; version -1 for a model with no
        loaded version."""
        rows = self._running().index()
        models = [Model(self, name, -1 if version is None else version, state, reason)
                  for name, version, state, reason in rows
                  if not exclude_not_ready or state == "READY"]
        return ModelDictionary(self, models)

    def load(self, model_name: str,
             parameters: Optional[Mapping[str, Union[str, int, bool, bytes]]] = None) -> Model:
        """Loads or reloads ``model_name`` (explicit control mode) and returns it, ready.
        ``parameters``: ``"config"`` (a configuration in JSON, used instead of
        ``config.pbtxt``) and ``"file:<path>"`` (a model file's bytes, e.g.
        ``"file:1/model.onnx"``), as the repository extension's load parameters."""
        config, files = None, []
        for key, value in (parameters or {}).items():
            if key == "config":
                config = value.decode() if isinstance(value, bytes) else str(value)
            elif key.startswith("file:"):
                if not isinstance(value, (bytes, bytearray)):
                    raise InvalidArgumentError(f"load parameter '{key}' must be bytes")
                files.append((key[len("file:"):], bytes(value)))
            else:
                raise InvalidArgumentError(
                    f"load parameter '{key}' is not one of config, file:<path>")
        self._running().load(model_name, config, files)
        return self.model(model_name)

    def unload(self, model: Union[str, Model], unload_dependents: bool = False,
               wait_until_unloaded: bool = False, polling_interval: float = 0.1,
               timeout: Optional[float] = None) -> None:
        """Unloads a model (explicit control mode); requests already accepted finish first.
        ``unload_dependents``: also the ensembles using it. Returns once unloaded
        (``wait_until_unloaded`` and its polling arguments are accepted for Triton's
        signature)."""
        name = model.name if isinstance(model, Model) else model
        self._running().unload(name, unload_dependents)
        deadline = None if timeout is None else time.monotonic() + timeout
        while wait_until_unloaded and self._running().model_ready(name, None):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(polling_interval)

    def metrics(self, metric_format: MetricFormat = MetricFormat.PROMETHEUS) -> str:
        """The Prometheus metrics text, as the metrics endpoint serves it."""
        return self._running().metrics()

    def statistics(self) -> Dict[str, Any]:
        """Every loaded model's statistics (``{"model_stats": [...]}``, as
        ``GET /v2/models/stats`` answers)."""
        return json.loads(self._running().statistics())

    def bind(self, model_name: str, infer_func: Union[Callable, Sequence[Callable]],
             inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
             config: ModelConfig = ModelConfig()) -> Model:
        """Serves a Python function as model ``model_name`` (PyTriton's ``bind``), to
        in-process and remote callers alike, through the same scheduler as every model: with
        ``config.batcher`` requests are batched by the dynamic batcher and the function gets
        the batch (arrays with the batch dimension first, like PyTriton's ``@batch``).

        ``infer_func(**inputs) -> {output name: array}``; a list of functions gives one
        execution instance each. An exception fails only the requests of that execution,
        with its traceback in the message (raise :class:`InvalidArgumentError` for a 400).
        The function runs in the server's process with the server's rights: this is for
        trusted code; code from tenants belongs in Wasm stages. Call after :meth:`start`;
        returns the model."""
        functions = list(infer_func) if isinstance(infer_func, (list, tuple)) else [infer_func]
        if not functions or not all(callable(f) for f in functions):
            raise InvalidArgumentError(f"bind '{model_name}': infer_func must be a callable "
                                       "or a list of callables")
        calls = [bound_caller(f) for f in functions]
        self._running().bind(bound_config(model_name, inputs, outputs, config, len(calls)),
                             calls)
        return self.model(model_name)

    def __enter__(self) -> "Server":
        return self.start(wait_until_ready=True)

    def __exit__(self, *exc) -> None:
        self.stop()
