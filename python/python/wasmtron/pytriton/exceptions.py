"""PyTriton's exception names."""
from .. import WasmtronError


class PyTritonError(WasmtronError):
    """Base of the errors raised here."""

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


class PyTritonValidationError(PyTritonError):
    """An inference callable's result does not match the model's outputs."""


class PyTritonBadParameterError(PyTritonError):
    """A bad argument to a decorator or to ``bind``."""


class PyTritonRuntimeError(PyTritonError):
    """An inference callable or decorator failed at run time."""


class PyTritonUnrecoverableError(PyTritonError):
    """An error the inference callable cannot recover from."""


class PyTritonInvalidOperationError(PyTritonError):
    """An operation in the wrong state (binding after stop, ...)."""


class PyTritonClientError(PyTritonError):
    """Base of the client's errors."""


class PyTritonClientValueError(PyTritonClientError):
    """Bad arguments to a client call."""


class PyTritonClientTimeoutError(PyTritonClientError):
    """The server or the model was not ready, or the answer not back, in time."""


class PyTritonClientModelUnavailableError(PyTritonClientError):
    """The model is not served."""


class PyTritonClientInferenceServerError(PyTritonClientError):
    """The server or the inference callable answered with an error."""


class PyTritonClientModelDoesntSupportBatchingError(PyTritonClientError):
    """``infer_batch`` on a model without batching."""


class PyTritonClientClosedError(PyTritonClientError):
    """The client was closed."""


class PyTritonClientInvalidUrlError(PyTritonClientError):
    """The URL names no scheme the client speaks."""
