"""Wasmtron in-process: the server's core runs inside this Python process, with the API of
Triton's in-process ``tritonserver`` package, so code written for it runs with
``import wasmtron as tritonserver``::

    import numpy as np
    import wasmtron as tritonserver

    server = tritonserver.Server(model_repository="model_repository",
                                 model_control_mode=tritonserver.ModelControlMode.EXPLICIT)
    server.start(wait_until_ready=True)
    simple = server.load("simple")
    for response in simple.infer(inputs={"INPUT0": np.ones((1, 16), np.int32),
                                         "INPUT1": np.ones((1, 16), np.int32)}):
        print(np.from_dlpack(response.outputs["OUTPUT0"]))     # [[2 2 ... 2]]

Requests go through each model's scheduler exactly as remote ones do (dynamic batching with
other callers, queue policies, Wasm stages and ensembles), and get the same checks and errors:
a wrong dtype, shape or name raises ``InvalidArgumentError`` naming the tensor, an unknown model
``NotFoundError``. The GIL is released while the server works, so threads infer concurrently.
Wasmtron's own additions: ``Server.bind`` (Python functions as models, PyTriton's ``bind``),
listeners on the same server (``start(http_port=0, ...)``), and ``wasmtron.pytriton``.
"""
from ._bind import DynamicBatcher, ModelConfig, TensorSpec
from ._model import (AsyncResponseIterator, InferenceRequest, InferenceResponse, Model,
                     ModelBatchFlag, ModelTxnPropertyFlag, ResponseIterator)
from ._server import LogFormat, MetricFormat, ModelControlMode, Options, Server
from ._tensor import DataType, DLDeviceType, MemoryBuffer, MemoryType, Tensor
from ._wasmtron import (  # noqa: F401  (re-exported)
    AlreadyExistsError,
    CancelledError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
    WasmtronError,
)

# Triton's names for the base class and the catch-all.
TritonError = WasmtronError
UnknownError = InternalError

__all__ = [
    "Server", "Options", "ModelControlMode", "LogFormat", "MetricFormat",
    "Model", "ModelBatchFlag", "ModelTxnPropertyFlag",
    "InferenceRequest", "InferenceResponse", "ResponseIterator", "AsyncResponseIterator",
    "Tensor", "DataType", "MemoryType", "MemoryBuffer", "DLDeviceType",
    "TensorSpec", "ModelConfig", "DynamicBatcher",
    "WasmtronError", "TritonError", "InvalidArgumentError", "NotFoundError",
    "UnavailableError", "UnsupportedError", "AlreadyExistsError", "CancelledError",
    "InternalError", "UnknownError",
]
