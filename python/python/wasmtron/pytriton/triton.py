"""PyTriton's ``Triton``, ``TritonConfig`` and ``TritonSecurityConfig``, served by the wasmtron
server in this process.

``with Triton() as triton: triton.bind(...); triton.serve()`` listens on PyTriton's ports (HTTP
8000, gRPC 8001, metrics 8002) and serves the bound callables through wasmtron's scheduler: the
dynamic batcher joins requests, each callable of ``infer_func=[f, g]`` is one execution
instance.

Safer defaults than ``tritonserver``'s: the listeners bind the loopback address (127.0.0.1)
unless ``http_address`` / ``grpc_address`` (or ``PYTRITON_TRITON_CONFIG_<FIELD>``) say
otherwise, and, as PyTriton 0.7 does, the admin APIs (shared memory, model repository,
statistics, trace, logging) need the ``triton-access-token`` header unless a
``TritonSecurityConfig`` says otherwise. A ``TritonConfig`` security option this server does not
serve (TLS, SageMaker, Vertex AI, header forwarding) is refused naming it, never ignored.
"""
import dataclasses
import inspect
import json
import os
import secrets
import signal
import threading
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import Server
from .._bind import bound_caller as _bound_caller, config_type as _config_type
from .decorators import Request, _MODEL, _ModelSpec, convert_output
from .exceptions import (PyTritonBadParameterError, PyTritonInvalidOperationError,
                         PyTritonValidationError)
from .model_config import ModelConfig, Tensor, dynamic_batching

__all__ = ["Triton", "TritonConfig", "TritonSecurityConfig"]

#: The address the listeners bind when the config names none (``tritonserver``: 0.0.0.0).
DEFAULT_ADDRESS = "127.0.0.1"

#: The header that carries ``TritonSecurityConfig.access_token``, as PyTriton names it.
TRITON_ACCESS_HEADER = "triton-access-token"

#: The API groups ``TritonSecurityConfig.restricted_endpoints`` may name.
VALID_TRITON_ENDPOINTS = {
    "health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
    "statistics", "trace", "logging",
}

#: The groups protected by default (PyTriton 0.7's).
DEFAULT_PROTECTED_ENDPOINTS = ["shared-memory", "model-repository", "statistics", "trace", "logging"]

#: ``TritonConfig`` fields that configure something this server does not serve, and why: set,
#: they are refused (an option that silently did nothing would leave a server open that its
#: user thinks closed).
_NOT_SERVED = {
    "grpc_use_ssl": "TLS is not served by wasmtron.pytriton: terminate TLS in front of it",
    "grpc_use_ssl_mutual": "TLS is not served by wasmtron.pytriton: terminate TLS in front of it",
    "grpc_server_cert": "TLS is not served by wasmtron.pytriton: terminate TLS in front of it",
    "grpc_server_key": "TLS is not served by wasmtron.pytriton: terminate TLS in front of it",
    "grpc_root_cert": "TLS is not served by wasmtron.pytriton: terminate TLS in front of it",
    "allow_sagemaker": "the SageMaker endpoint is not served",
    "sagemaker_port": "the SageMaker endpoint is not served",
    "allow_vertex_ai": "the Vertex AI endpoint is not served",
    "vertex_ai_port": "the Vertex AI endpoint is not served",
    "http_header_forward_pattern": "request headers are not forwarded to models as parameters",
    "grpc_header_forward_pattern": "request metadata is not forwarded to models as parameters",
}


@dataclasses.dataclass
class TritonSecurityConfig:
    """Token-based restriction of API groups, as PyTriton's: the ``restricted_endpoints``
    (default: the admin APIs) need the ``triton-access-token`` header holding
    ``access_token`` (generated when not given), over HTTP and gRPC. An empty list restricts
    nothing."""
    access_token: Optional[str] = None
    restricted_endpoints: Optional[List[str]] = None

    def __post_init__(self):
        if self.restricted_endpoints is None:
            self.restricted_endpoints = list(DEFAULT_PROTECTED_ENDPOINTS)
        invalid = set(self.restricted_endpoints) - VALID_TRITON_ENDPOINTS
        if invalid:
            raise PyTritonValidationError(
                f"Invalid endpoint names: {', '.join(sorted(invalid))}. Valid endpoints are: "
                f"{', '.join(sorted(VALID_TRITON_ENDPOINTS))}")
        if self.access_token is None and self.restricted_endpoints:
            self.access_token = secrets.token_urlsafe(32)


@dataclasses.dataclass
class TritonConfig:
    """Server settings, as PyTriton's. The listeners' fields (``allow_*``, ``*_address``,
    ``*_port``), ``http_restricted_api``, ``grpc_restricted_protocol``, ``strict_readiness``
    and ``exit_timeout_secs`` are honoured; TLS, SageMaker, Vertex AI and header forwarding
    are refused when set; the other fields (threads, logging, caches) are accepted for
    compatibility and have no effect here."""
    id: Optional[str] = None
    model_repository: Optional[str] = None
    log_verbose: Optional[int] = None
    log_file: Optional[str] = None
    exit_timeout_secs: Optional[int] = None
    exit_on_error: Optional[bool] = None
    strict_readiness: Optional[bool] = None
    allow_http: Optional[bool] = None
    http_address: Optional[str] = None
    http_port: Optional[int] = None
    http_header_forward_pattern: Optional[str] = None
    http_thread_count: Optional[int] = None
    http_restricted_api: Optional[str] = None
    allow_grpc: Optional[bool] = None
    grpc_address: Optional[str] = None
    grpc_port: Optional[int] = None
    grpc_header_forward_pattern: Optional[str] = None
    grpc_infer_allocation_pool_size: Optional[int] = None
    grpc_use_ssl: Optional[bool] = None
    grpc_use_ssl_mutual: Optional[bool] = None
    grpc_server_cert: Optional[str] = None
    grpc_server_key: Optional[str] = None
    grpc_root_cert: Optional[str] = None
    grpc_infer_response_compression_level: Optional[str] = None
    grpc_keepalive_time: Optional[int] = None
    grpc_keepalive_timeout: Optional[int] = None
    grpc_keepalive_permit_without_calls: Optional[bool] = None
    grpc_http2_max_pings_without_data: Optional[int] = None
    grpc_http2_min_recv_ping_interval_without_data: Optional[int] = None
    grpc_http2_max_ping_strikes: Optional[int] = None
    grpc_restricted_protocol: Optional[str] = None
    allow_metrics: Optional[bool] = None
    allow_gpu_metrics: Optional[bool] = None
    allow_cpu_metrics: Optional[bool] = None
    metrics_interval_ms: Optional[int] = None
    metrics_port: Optional[int] = None
    metrics_address: Optional[str] = None
    allow_sagemaker: Optional[bool] = None
    sagemaker_port: Optional[int] = None
    allow_vertex_ai: Optional[bool] = None
    vertex_ai_port: Optional[int] = None
    cache_config: Optional[List[str]] = None
    cache_directory: Optional[str] = None
    buffer_manager_thread_count: Optional[int] = None
    trace_config: Optional[List[str]] = None

    def to_dict(self) -> Dict[str, object]:
        """The fields as a dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, config: Dict[str, object]) -> "TritonConfig":
        """A config from a dict of fields (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    @classmethod
    def from_env(cls) -> "TritonConfig":
        """A config from ``PYTRITON_TRITON_CONFIG_<FIELD>`` environment variables."""
        values: Dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = os.environ.get(f"PYTRITON_TRITON_CONFIG_{field.name.upper()}")
            if raw is None:
                continue
            kind = str(field.type)
            if "bool" in kind:
                values[field.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif "int" in kind:
                values[field.name] = int(raw)
            elif "List" in kind:
                values[field.name] = [part for part in raw.split(",") if part]
            else:
                values[field.name] = raw
        return cls(**values)


def _merged(config: Optional[TritonConfig]) -> TritonConfig:
    merged = {k: v for k, v in TritonConfig.from_env().to_dict().items() if v is not None}
    if config is not None:
        merged.update({k: v for k, v in config.to_dict().items() if v is not None})
    return TritonConfig.from_dict(merged)


def _named(tensors: Sequence[Tensor], prefix: str) -> List[Tensor]:
    return [t if t.name else dataclasses.replace(t, name=f"{prefix}_{i}")
            for i, t in enumerate(tensors, start=1)]


def _config_json(model_name: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                 config: ModelConfig, instances: int) -> Dict[str, object]:
    def tensors(ts, with_optional):
        out = []
        for t in ts:
            entry = {"name": t.name, "data_type": _config_type(t.name, t.dtype),
                     "dims": [int(d) for d in t.shape]}
            if with_optional and t.optional:
                entry["optional"] = True
            out.append(entry)
        return out
    out: Dict[str, object] = {
        "name": model_name, "backend": "python",
        "max_batch_size": int(config.max_batch_size) if config.batching else 0,
        "input": tensors(inputs, True), "output": tensors(outputs, False),
        "instance_group": [{"count": instances, "kind": "KIND_CPU"}]}
    if config.batching and config.batcher is not None:
        out["dynamic_batching"] = dynamic_batching(config.batcher)
    return out


def _checked(name: str, value, tensor: Tensor, strict: bool) -> np.ndarray:
    """An output as its declared dtype: cast when it can be (PyTriton's default), refused
    naming the output when ``strict``."""
    array = np.asarray(value)
    declared = np.dtype(tensor.dtype)
    if declared == np.object_ or declared.kind in ("S", "U"):
        return array
    if array.dtype != declared:
        if strict:
            raise PyTritonValidationError(
                f"Output '{name}' has dtype {array.dtype}, the model declares {declared}")
        array = array.astype(declared)
    return array


def _served(model_name: str, infer_func: Callable, spec: _ModelSpec, strict: bool) -> Callable:
    """The callable as wasmtron's bound functions are called: one execution's inputs as
    keyword arguments, its outputs as a dict."""
    outputs = {t.name: t for t in spec.outputs}

    def served(**arrays):
        token = _MODEL.set(spec)
        try:
            results = infer_func([Request(dict(arrays))])
            if inspect.isgenerator(results):
                raise PyTritonBadParameterError(
                    f"model '{model_name}': the callable yields (decoupled); wasmtron.pytriton "
                    "serves one answer per request")
            if isinstance(results, dict):
                results = [results]
            if not isinstance(results, (list, tuple)) or len(results) != 1:
                raise PyTritonValidationError(
                    f"model '{model_name}': the callable must return a list with one result "
                    f"per request (1), got {type(results).__name__}"
                    + (f" of {len(results)}" if isinstance(results, (list, tuple)) else ""))
            result = convert_output(results[0])
        finally:
            _MODEL.reset(token)
        unknown = sorted(set(result) - set(outputs))
        if strict and unknown:
            raise PyTritonValidationError(
                f"model '{model_name}': the callable returned outputs the model does not "
                f"declare: {', '.join(unknown)}")
        return {n: _checked(n, v, outputs[n], strict) for n, v in result.items() if n in outputs}
    return served


class Triton:
    """PyTriton's server: ``bind`` callables, then ``run`` (non-blocking), ``serve``
    (blocking until ``stop``, SIGINT or SIGTERM) or use it as a context manager."""

    def __init__(self, *, config: Optional[TritonConfig] = None, workspace=None,
                 triton_lifecycle_policy=None,
                 security_config: Optional[TritonSecurityConfig] = None):
        self._config = _merged(config)
        for field, why in _NOT_SERVED.items():
            value = getattr(self._config, field)
            if value not in (None, False):
                raise PyTritonBadParameterError(
                    f"TritonConfig.{field} is set, but {why}; leave it unset")
        self._security = security_config or TritonSecurityConfig()
        self._server: Optional[Server] = None
        self._pending: List[tuple] = []
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def _listeners(self) -> Dict[str, object]:
        c = self._config
        addresses = {a for a in (c.http_address, c.grpc_address, c.metrics_address) if a}
        if len(addresses) > 1:
            raise PyTritonBadParameterError(
                "TritonConfig.http_address, grpc_address and metrics_address differ "
                f"({', '.join(sorted(addresses))}); wasmtron.pytriton listens on one address")
        # As PyTriton does: the security config's restriction replaces the config's own.
        http_restricted = [c.http_restricted_api] if c.http_restricted_api else []
        grpc_restricted = [c.grpc_restricted_protocol] if c.grpc_restricted_protocol else []
        s = self._security
        if s.access_token and s.restricted_endpoints:
            value = f"{','.join(s.restricted_endpoints)}:{TRITON_ACCESS_HEADER}={s.access_token}"
            http_restricted, grpc_restricted = [value], [value]
        return {
            "http_port": None if c.allow_http is False else (8000 if c.http_port is None else c.http_port),
            "grpc_port": None if c.allow_grpc is False else (8001 if c.grpc_port is None else c.grpc_port),
            "metrics_port": None if c.allow_metrics is False else (8002 if c.metrics_port is None else c.metrics_port),
            "address": addresses.pop() if addresses else DEFAULT_ADDRESS,
            "http_restricted_api": http_restricted,
            "grpc_restricted_protocol": grpc_restricted,
        }

    def get_access_token(self) -> Optional[str]:
        """The token the restricted API groups need (``triton-access-token`` header)."""
        return self._security.access_token

    def bind(self, model_name: str, infer_func: Union[Callable, Sequence[Callable]],
             inputs: Sequence[Tensor], outputs: Sequence[Tensor], model_version: int = 1,
             config: Optional[ModelConfig] = None, strict: bool = False,
             trace_config: Optional[List[str]] = None) -> None:
        """Serves ``infer_func`` (or one instance per callable of a list) as ``model_name``.
        Unnamed tensors are ``INPUT_1``, ``INPUT_2``, ... and ``OUTPUT_1``, ... by position."""
        config = config or ModelConfig()
        if config.decoupled:
            raise PyTritonBadParameterError(
                f"model '{model_name}': decoupled models (several responses per request) are "
                "not served by wasmtron.pytriton; serve a generator as a Wasm stage or a "
                "generation model instead")
        if config.response_cache:
            raise PyTritonBadParameterError(
                f"model '{model_name}': the response cache is not supported")
        functions = list(infer_func) if isinstance(infer_func, (list, tuple)) else [infer_func]
        if not functions or not all(callable(f) for f in functions):
            raise PyTritonBadParameterError(
                f"model '{model_name}': infer_func must be a callable or a list of callables")
        inputs, outputs = _named(inputs, "INPUT"), _named(outputs, "OUTPUT")
        batcher = config.batcher if config.batching else None
        spec = _ModelSpec(model_name, bool(config.batching), tuple(inputs), tuple(outputs),
                          int(config.max_batch_size) if config.batching else 0,
                          tuple(int(n) for n in ((batcher.preferred_batch_size or ()) if batcher else ())))
        calls = [_bound_caller(_served(model_name, f, spec, strict)) for f in functions]
        pending = (_config_json(model_name, inputs, outputs, config, len(calls)), calls)
        with self._lock:
            if self._stopped.is_set():
                raise PyTritonInvalidOperationError("the server is stopped")
            if self._server is None:
                self._pending.append(pending)
                return
        self._bind_now(*pending)

    def _bind_now(self, config_json: Dict[str, object], calls: List[Callable]) -> None:
        assert self._server is not None
        self._server._core.bind(json.dumps(config_json), calls)

    def run(self) -> None:
        """Starts serving (the listeners, then the models bound so far) and returns."""
        with self._lock:
            if self._server is not None:
                return
            strict = self._config.strict_readiness
            self._server = Server(strict_readiness=True if strict is None else bool(strict))
            self._server.start(**self._listeners())
            pending, self._pending = self._pending, []
        for item in pending:
            self._bind_now(*item)

    def serve(self, monitoring_period_s: float = 5.0) -> None:
        """Runs and blocks until :meth:`stop`, SIGINT or SIGTERM; then stops."""
        self.run()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: self._stopped.set())
        try:
            while not self._stopped.wait(monitoring_period_s):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def stop(self) -> bool:
        """Stops serving: requests already accepted finish first."""
        with self._lock:
            self._stopped.set()
            server, self._server = self._server, None
        if server is None:
            return False
        timeout = self._config.exit_timeout_secs
        return server.stop(30.0 if timeout is None else float(timeout))

    def is_alive(self) -> bool:
        """Whether the server runs."""
        return self._server is not None and not self._stopped.is_set()

    def is_connected(self) -> bool:
        """Whether the server runs and is ready."""
        return self.is_alive() and self._server is not None and self._server.ready()

    def connect(self) -> None:
        """Starts serving if not yet (PyTriton connects to its child server here)."""
        self.run()

    @property
    def addresses(self) -> Dict[str, str]:
        """Where the listeners listen (``{"http": "host:port", ...}``)."""
        return {} if self._server is None else self._server.addresses

    def __enter__(self) -> "Triton":
        self.run()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
