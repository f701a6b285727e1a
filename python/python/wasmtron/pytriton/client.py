"""PyTriton's clients over ``tritonclient`` (install ``tritonclient[http,grpc]``): they talk to
any KServe v2 server, wasmtron's or Triton's.

``ModelClient(url, model_name)``: ``url`` as ``host[:port]`` (HTTP, port 8000 by default),
``http://host:port`` or ``grpc://host:port`` (port 8001 by default). ``infer_sample`` adds and
removes the batch dimension for batching models; ``infer_batch`` sends a batch. Inputs given
positionally follow the model's input order; every output comes back, by name.
"""
import asyncio
import concurrent.futures
import queue
import threading
import time
import urllib.parse
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import numpy as np

from .exceptions import (PyTritonClientClosedError, PyTritonClientInferenceServerError,
                         PyTritonClientInvalidUrlError, PyTritonClientModelDoesntSupportBatchingError,
                         PyTritonClientModelUnavailableError, PyTritonClientTimeoutError,
                         PyTritonClientValueError)

__all__ = ["ModelClient", "AsyncioModelClient", "FuturesModelClient", "DecoupledModelClient"]

_DEFAULT_INIT_TIMEOUT_S = 300.0
_DEFAULT_INFERENCE_TIMEOUT_S = 60.0


def _parse_url(url: str) -> Tuple[str, str]:
    """(scheme, host:port)."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "grpc"):
        raise PyTritonClientInvalidUrlError(
            f"url '{url}': the scheme must be http or grpc, not '{parts.scheme}'")
    port = parts.port or (8001 if parts.scheme == "grpc" else 8000)
    return parts.scheme, f"{parts.hostname or 'localhost'}:{port}"


class TensorSpec(NamedTuple):
    """An input or output as the model's configuration declares it (PyTriton's ``TensorSpec``)."""
    name: str
    shape: Tuple[int, ...]
    dtype: object
    optional: bool = False


def _spec_of(entry: Dict[str, object]) -> TensorSpec:
    from tritonclient.utils import triton_to_np_dtype
    datatype = str(entry.get("data_type", "")).removeprefix("TYPE_")
    datatype = "BYTES" if datatype == "STRING" else datatype
    dtype = triton_to_np_dtype(datatype)
    return TensorSpec(str(entry["name"]), tuple(int(d) for d in entry.get("dims", [])),
                      np.bytes_ if dtype == np.object_ else dtype, bool(entry.get("optional", False)))


class _Spec:
    """What the client reads of the model's configuration (PyTriton's ``TritonModelConfig``:
    ``model_name``, ``max_batch_size``, ``batching``, ``decoupled``, ``inputs``, ``outputs``)."""

    def __init__(self, config: Dict[str, object]):
        self.model_name = config.get("name", "")
        self.max_batch_size = int(config.get("max_batch_size", 0) or 0)
        self.batching = self.max_batch_size > 0
        self.inputs = [_spec_of(i) for i in config.get("input", [])]
        self.outputs = [_spec_of(o) for o in config.get("output", [])]
        policy = config.get("model_transaction_policy") or {}
        self.decoupled = bool(policy.get("decoupled", False))


class ModelClient:
    """A synchronous client for one model."""

    def __init__(self, url: str, model_name: str, model_version: Optional[str] = None, *,
                 lazy_init: bool = True, init_timeout_s: Optional[float] = None,
                 inference_timeout_s: Optional[float] = None, model_config=None,
                 ensure_model_is_ready: bool = True, access_token: Optional[str] = None):
        try:
            import tritonclient.grpc as grpcclient
            import tritonclient.http as httpclient
            from tritonclient.utils import InferenceServerException
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("wasmtron.pytriton.client needs tritonclient: "
                              "pip install 'tritonclient[http,grpc]'") from e
        self._exception = InferenceServerException
        self._scheme, self._address = _parse_url(url)
        self._lib = grpcclient if self._scheme == "grpc" else httpclient
        self._model_name = model_name
        self._model_version = "" if model_version is None else str(model_version)
        self._init_timeout_s = _DEFAULT_INIT_TIMEOUT_S if init_timeout_s is None else init_timeout_s
        self._inference_timeout_s = (_DEFAULT_INFERENCE_TIMEOUT_S if inference_timeout_s is None
                                     else inference_timeout_s)
        self._headers = {"authorization": f"Bearer {access_token}"} if access_token else None
        self._ensure_ready = ensure_model_is_ready
        if self._scheme == "grpc":
            self._client = grpcclient.InferenceServerClient(self._address)
        else:
            self._client = httpclient.InferenceServerClient(
                self._address, connection_timeout=self._inference_timeout_s,
                network_timeout=self._inference_timeout_s)
        self._spec: Optional[_Spec] = None
        self._next_id = 0
        if not lazy_init:
            self._init()

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Closes the connection; later calls raise ``PyTritonClientClosedError``."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _live(self):
        if self._client is None:
            raise PyTritonClientClosedError("ModelClient is closed")
        return self._client

    def wait_for_model(self, timeout_s: float) -> None:
        """Waits until the server and the model are ready."""
        deadline = time.time() + timeout_s
        while True:
            try:
                client = self._live()
                if client.is_server_ready(headers=self._headers) and client.is_model_ready(
                        self._model_name, self._model_version, headers=self._headers):
                    return
            except self._exception:
                pass
            except (ConnectionError, OSError):
                pass
            if time.time() >= deadline:
                raise PyTritonClientTimeoutError(
                    f"model '{self._model_name}' was not ready within {timeout_s} s")
            time.sleep(0.1)

    def _init(self) -> _Spec:
        if self._spec is None:
            if self._ensure_ready:
                self.wait_for_model(self._init_timeout_s)
            try:
                config = self._live().get_model_config(self._model_name, self._model_version,
                                                       headers=self._headers,
                                                       **({"as_json": True} if self._scheme == "grpc" else {}))
            except self._exception as e:
                raise PyTritonClientModelUnavailableError(e.message()) from e
            self._spec = _Spec(config.get("config", config))
        return self._spec

    @property
    def model_config(self) -> _Spec:
        """The model's configuration as the client reads it (``inputs``, ``outputs``,
        ``max_batch_size``, ``batching``, ``decoupled``)."""
        return self._init()

    @property
    def is_batching_supported(self) -> bool:
        """Whether the model batches (``max_batch_size`` > 0)."""
        return self._init().batching

    # --- inference -------------------------------------------------------------------------

    def _named(self, inputs, named_inputs) -> Dict[str, np.ndarray]:
        if inputs and named_inputs:
            raise PyTritonClientValueError("Use either positional or named inputs, not both")
        if inputs:
            names = [t.name for t in self._init().inputs]
            if len(inputs) > len(names):
                raise PyTritonClientValueError(
                    f"model '{self._model_name}' takes {len(names)} inputs, got {len(inputs)}")
            return dict(zip(names, inputs))
        return dict(named_inputs)

    def _request(self, arrays: Dict[str, np.ndarray]):
        from tritonclient.utils import np_to_triton_dtype
        wrapped = []
        for name, value in arrays.items():
            value = np.asarray(value)
            if value.dtype.type == np.str_:
                raise PyTritonClientValueError(
                    f"Unicode inputs are not supported. Encode numpy array for {name!r} input "
                    "(ex. with np.char.encode(array, 'utf-8')).")
            t = self._lib.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            t.set_data_from_numpy(value)
            wrapped.append(t)
        outputs = [self._lib.InferRequestedOutput(t.name) for t in self._init().outputs]
        return wrapped, outputs

    def _infer(self, arrays: Dict[str, np.ndarray], parameters, headers) -> Dict[str, np.ndarray]:
        spec = self._init()
        if spec.decoupled:
            raise PyTritonClientInferenceServerError(
                "Model config is decoupled. Use DecoupledModelClient instead.")
        inputs, outputs = self._request(arrays)
        self._next_id += 1
        extra = {"client_timeout": self._inference_timeout_s} if self._scheme == "grpc" else {}
        try:
            result = self._live().infer(
                self._model_name, inputs, model_version=self._model_version, outputs=outputs,
                request_id=str(self._next_id), parameters=parameters,
                headers={**(self._headers or {}), **(headers or {})} or None, **extra)
        except self._exception as e:
            message = e.message() or str(e)
            if "Deadline Exceeded" in message or "timed out" in message:
                raise PyTritonClientTimeoutError(message) from e
            raise PyTritonClientInferenceServerError(
                f"Error occurred during inference request. Message: {message}") from e
        return {t.name: result.as_numpy(t.name) for t in spec.outputs
                if result.as_numpy(t.name) is not None}

    def infer_sample(self, *inputs, parameters=None, headers=None, **named_inputs) -> Dict[str, np.ndarray]:
        """One sample (no batch dimension); returns its outputs by name."""
        arrays = self._named(inputs, named_inputs)
        batching = self.is_batching_supported
        if batching:
            arrays = {n: np.asarray(v)[np.newaxis, ...] for n, v in arrays.items()}
        result = self._infer(arrays, parameters, headers)
        return {n: v[0] for n, v in result.items()} if batching else result

    def infer_batch(self, *inputs, parameters=None, headers=None, **named_inputs) -> Dict[str, np.ndarray]:
        """A batch (the first dimension); returns its outputs by name."""
        arrays = self._named(inputs, named_inputs)
        if not self.is_batching_supported:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"Model {self._model_name} doesn't support batching - use infer_sample method instead")
        return self._infer(arrays, parameters, headers)


class DecoupledModelClient(ModelClient):
    """A client for decoupled models over the gRPC stream: ``infer_sample`` and
    ``infer_batch`` yield each response's outputs as they come."""

    def __init__(self, url: str, model_name: str, model_version: Optional[str] = None, **kwargs):
        if not url.startswith("grpc://"):
            raise PyTritonClientInvalidUrlError("DecoupledModelClient needs a grpc:// url")
        super().__init__(url, model_name, model_version, **kwargs)

    def _infer(self, arrays, parameters, headers) -> Iterator[Dict[str, np.ndarray]]:
        spec = self._init()
        inputs, outputs = self._request(arrays)
        answers: "queue.Queue" = queue.Queue()
        client = self._live()
        client.start_stream(callback=lambda result, error: answers.put((result, error)),
                            headers={**(self._headers or {}), **(headers or {})} or None)
        try:
            client.async_stream_infer(self._model_name, inputs, model_version=self._model_version,
                                      outputs=outputs, parameters=parameters,
                                      enable_empty_final_response=True)
            while True:
                result, error = answers.get(timeout=self._inference_timeout_s)
                if error is not None:
                    raise PyTritonClientInferenceServerError(str(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                if response.outputs:
                    yield {t.name: result.as_numpy(t.name) for t in spec.outputs
                           if result.as_numpy(t.name) is not None}
                if final is not None and final.bool_param:
                    return
        except queue.Empty:
            raise PyTritonClientTimeoutError("no response within the inference timeout") from None
        finally:
            client.stop_stream()

    def infer_sample(self, *inputs, parameters=None, headers=None, **named_inputs):
        arrays = self._named(inputs, named_inputs)
        batching = self.is_batching_supported
        if batching:
            arrays = {n: np.asarray(v)[np.newaxis, ...] for n, v in arrays.items()}
        for result in self._infer(arrays, parameters, headers):
            yield {n: v[0] for n, v in result.items()} if batching else result


class FuturesModelClient:
    """:class:`ModelClient` calls run by a thread pool, each returning a
    ``concurrent.futures.Future``."""

    def __init__(self, url: str, model_name: str, model_version: Optional[str] = None, *,
                 max_workers: int = 128, **kwargs):
        self._args = (url, model_name, model_version)
        self._kwargs = kwargs
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
        self._local = threading.local()
        self._clients = []
        self._clients_lock = threading.Lock()

    def _client(self) -> ModelClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = ModelClient(*self._args, **self._kwargs)
            with self._clients_lock:
                self._clients.append(client)
        return client

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
        for client in self._clients:
            client.close()

    def wait_for_model(self, timeout_s: float) -> concurrent.futures.Future:
        return self._pool.submit(lambda: self._client().wait_for_model(timeout_s))

    def model_config(self) -> concurrent.futures.Future:
        return self._pool.submit(lambda: self._client().model_config)

    def infer_sample(self, *inputs, parameters=None, headers=None, **named_inputs) -> concurrent.futures.Future:
        return self._pool.submit(lambda: self._client().infer_sample(
            *inputs, parameters=parameters, headers=headers, **named_inputs))

    def infer_batch(self, *inputs, parameters=None, headers=None, **named_inputs) -> concurrent.futures.Future:
        return self._pool.submit(lambda: self._client().infer_batch(
            *inputs, parameters=parameters, headers=headers, **named_inputs))


class AsyncioModelClient:
    """:class:`ModelClient` for asyncio: the same calls as coroutines. Each call runs in a
    worker thread with a connection of that thread's own (tritonclient's connections are not
    shared between threads); the event loop keeps running."""

    def __init__(self, url: str, model_name: str, model_version: Optional[str] = None, **kwargs):
        self._pool = FuturesModelClient(url, model_name, model_version, **kwargs)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.close)

    async def wait_for_model(self, timeout_s: float) -> None:
        await asyncio.wrap_future(self._pool.wait_for_model(timeout_s))

    async def model_config(self):
        return await asyncio.wrap_future(self._pool.model_config())

    async def infer_sample(self, *inputs, parameters=None, headers=None, **named_inputs):
        return await asyncio.wrap_future(self._pool.infer_sample(
            *inputs, parameters=parameters, headers=headers, **named_inputs))

    async def infer_batch(self, *inputs, parameters=None, headers=None, **named_inputs):
        return await asyncio.wrap_future(self._pool.infer_batch(
            *inputs, parameters=parameters, headers=headers, **named_inputs))
