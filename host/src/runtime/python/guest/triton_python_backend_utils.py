"""Triton's `triton_python_backend_utils` for Wasmtron's Python backend.

Written from Triton's Python-backend documentation: a `model.py` written for Triton imports
this module (as `pb_utils`) and runs unchanged inside the server's WebAssembly sandbox. The
host is reached through one door, `_host.call(frame) -> bytes`; frames are described in
host/src/runtime/python/protocol.rs. Names starting with `_` are the backend's own.
"""

import enum as _enum
import json as _json
import struct as _struct
import sys as _sys
import time as _time

import numpy as _np

try:
    import _host
except ImportError:  # outside the sandbox (documentation tools, tests of this file)
    _host = None

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2


class PreferredMemory:
    """Where a BLS call would like its outputs: here they are always in CPU memory."""

    def __init__(self, preferred_memory_type=TRITONSERVER_MEMORY_CPU, preferred_device_id=0):
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id

# Triton's type names and numpy's, both ways. BF16 has no numpy type.
_TRITON_TO_NUMPY = {
    "BOOL": _np.bool_,
    "UINT8": _np.uint8,
    "UINT16": _np.uint16,
    "UINT32": _np.uint32,
    "UINT64": _np.uint64,
    "INT8": _np.int8,
    "INT16": _np.int16,
    "INT32": _np.int32,
    "INT64": _np.int64,
    "FP16": _np.float16,
    "FP32": _np.float32,
    "FP64": _np.float64,
    "BYTES": _np.object_,
    "STRING": _np.object_,
}


def triton_string_to_numpy(triton_type_string):
    """The numpy type of a config type name (`TYPE_FP32`) or a protocol name (`FP32`)."""
    name = triton_type_string[5:] if triton_type_string.startswith("TYPE_") else triton_type_string
    return _TRITON_TO_NUMPY.get(name)


def triton_to_numpy_type(data_type):
    """The numpy type of a Triton type given by name or by its enum number."""
    if isinstance(data_type, int):
        names = [None, "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                 "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"]
        data_type = names[data_type] if 0 <= data_type < len(names) else None
    return None if data_type is None else triton_string_to_numpy(data_type)


_NUMPY_TO_TRITON = {
    _np.dtype(t): name for name, t in _TRITON_TO_NUMPY.items() if t is not _np.object_
}


def numpy_to_triton_type(data_type):
    """Triton's name of a numpy type (`np.float32` -> `FP32`); object and bytes: `BYTES`."""
    dt = data_type if isinstance(data_type, _np.dtype) else _np.dtype(data_type)
    name = _NUMPY_TO_TRITON.get(dt)
    if name is not None:
        return name
    if dt == _np.object_ or dt.type == _np.bytes_ or dt.type == _np.str_:
        return "BYTES"
    return None


def serialize_byte_tensor(input_tensor):
    """A BYTES array as Triton serializes it: each element's 4-byte length, then its bytes."""
    if input_tensor.size == 0:
        return _np.empty([0], dtype=_np.object_)
    parts = []
    for obj in _np.nditer(input_tensor, flags=["refs_ok"], order="C"):
        item = obj.item()
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray)):
            item = str(item).encode("utf-8")
        parts.append(_struct.pack("<I", len(item)))
        parts.append(bytes(item))
    return _np.frombuffer(b"".join(parts), dtype=_np.uint8)


def deserialize_bytes_tensor(encoded_tensor):
    """A serialized BYTES buffer back as a 1-D numpy object array of bytes."""
    buf = bytes(encoded_tensor)
    out = []
    offset = 0
    while offset < len(buf):
        (n,) = _struct.unpack_from("<I", buf, offset)
        offset += 4
        out.append(buf[offset:offset + n])
        offset += n
    return _np.array(out, dtype=_np.object_)


class TritonError:
    """An error a model returns in a response (`InferenceResponse(error=...)`)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7
    _NAMES = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE",
              "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"]

    def __init__(self, message, code=INTERNAL):
        self._message = str(message)
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code

    def __str__(self):
        return self._message

    def __repr__(self):
        return "TritonError(%r, %s)" % (self._message, self._code_name())

    def _code_name(self):
        c = self._code
        return self._NAMES[c] if isinstance(c, int) and 0 <= c < len(self._NAMES) else "UNKNOWN"


class TritonModelException(Exception):
    """Raised by the utilities (and by models) for an error that fails the request."""


_UNSET = object()


def _want(value, types, what):
    """Triton's bindings refuse an argument of the wrong type with a TypeError."""
    if not isinstance(value, types):
        kinds = types if isinstance(types, tuple) else (types,)
        raise TypeError("%s must be %s, not %s" % (
            what, " or ".join(t.__name__ for t in kinds), type(value).__name__))
    return value


def _parameters(parameters):
    """Request or response parameters as Triton takes them: None or a dict of str keys and
    bool, int or str values (a JSON object's text is taken too)."""
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        parameters = _json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(
            "Expect parameters to be a dict, got %s" % str(type(parameters)))
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                "Expect parameters keys to have type str, found type %s" % str(type(key)))
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                "Expect parameters values to have type bool/int/str, found type %s"
                % str(type(value)))
    return dict(parameters)


def _text(value, what):
    """A string argument: str, or bytes in UTF-8 (Triton's bindings take both)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return _want(value, str, what)


def _tensors(values, what):
    """A list of Tensors. As Triton's bindings: a list of another type or an element of
    another type is a TypeError; a None element passes the bindings and is refused after."""
    _want(values, (list, tuple), what)
    for t in values:
        if t is None:
            raise TritonModelException("%s must hold pb_utils.Tensor objects, found None"
                                       % what)
        if not isinstance(t, Tensor):
            raise TypeError(
                "%s must hold pb_utils.Tensor objects, not %s" % (what, type(t).__name__))
    return list(values)


class Tensor:
    """A named tensor: numpy in (`as_numpy`) and out (`Tensor(name, array)`)."""

    def __init__(self, name, data, dtype=None):
        if type(name) is not str:
            name = _text(name, "Tensor name")
        if data is None:
            raise TypeError("Tensor %r: the data must be a numpy array, not None" % name)
        if not isinstance(data, _np.ndarray):
            data = _np.asarray(data)
        if data.dtype.type is _np.str_ or data.dtype.type is _np.bytes_:
            data = data.astype(_np.object_)
        self._name = name
        self._array = data
        self._dtype = dtype

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def triton_dtype(self):
        return self._dtype or numpy_to_triton_type(self._array.dtype)

    def shape(self):
        return list(self._array.shape)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        array = self._array
        if not array.flags.writeable:
            # A legacy capsule cannot say "read-only" (the server's input tensors are), so
            # it gets a copy, as numpy refuses to export the array itself.
            array = array.copy()
        return array.__dlpack__()

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name, capsule):
        """A tensor from an object with `__dlpack__` or from a DLPack capsule (host memory)."""
        if not isinstance(name, str) or not name:
            raise TritonModelException("Tensor name cannot be an empty string")
        if capsule is None:
            raise TritonModelException("Tensor %r: from_dlpack was given None" % name)
        if not hasattr(capsule, "__dlpack__"):
            capsule = _Capsule(capsule)
        return Tensor(name, _np.from_dlpack(capsule))

    def __repr__(self):
        return "Tensor(%r, %s%s)" % (self._name, self.triton_dtype(), list(self._array.shape))


class _Capsule:
    """A bare DLPack capsule as numpy's `from_dlpack` takes producers: on the CPU."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


class InferenceResponse:
    """A response: output tensors, or an error; optional parameters."""

    def __init__(self, output_tensors=_UNSET, error=None, parameters=None):
        if output_tensors is _UNSET:
            output_tensors = []
        if isinstance(error, str):
            error = TritonError(error)
        self._outputs = _tensors(output_tensors, "output_tensors")
        self._error = error
        self._parameters = _parameters(parameters)

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def parameters(self):
        return _json.dumps(self._parameters)


class InferenceResponseSender:
    """Sends the responses of one request. A decoupled model sends any number, then the
    final flag; a default-mode model (Triton 24.06+) sends exactly one, with the final flag
    or before a flag-only send."""

    def __init__(self, index, batch=None):
        self._index = index
        self._batch = batch
        self._closed = False
        self._sent = 0
        self._response = None  # a default-mode model's one response, sent with the batch

    def _count(self, response, flags):
        if not _backend.decoupled:
            if response is not None and self._sent > 0:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than "
                    "one response.")
            if response is None and flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL \
                    and self._sent == 0:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send complete "
                    "final before sending a response.")
        if self._closed:
            raise TritonModelException(
                "Unable to send response. Response sender has been closed.")
        if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        self._sent += 1

    def send(self, response=None, flags=0):
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                "expected an InferenceResponse, got %s" % type(response).__name__)
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(
                "Unable to send response. Unsupported flag %r: use 0 or "
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL" % (flags,))
        self._count(response, flags)
        if response is None:
            return
        if not _backend.decoupled:
            self._response = response
            return
        w = _Writer()
        header = {"index": self._index, "flags": int(flags), "response": w.response(response)}
        _answer(_backend.call_for(self._batch, w.finish(header, b"S")))

    def is_cancelled(self):
        return _is_cancelled(self._index, self._batch)


class _Writer:
    """Builds a frame: a JSON header and the tensors' bytes one after another."""

    def __init__(self):
        self._parts = []
        self._size = 0

    def tensor(self, t):
        # The fields, not the accessors: this runs for every output of every answer.
        name = t._name
        arr = t._array
        dtype = t._dtype or _NUMPY_TO_TRITON.get(arr.dtype) or numpy_to_triton_type(arr.dtype)
        if dtype == "BYTES" or arr.dtype.kind == "O":
            data = serialize_byte_tensor(arr).tobytes()
            dtype = "BYTES"
        elif dtype is None:
            raise TritonModelException(
                "output '%s' has numpy type %s, which Triton has no type for" % (name, arr.dtype))
        else:
            # C order whatever the array's layout (a transposed view included).
            data = arr.tobytes()
        # numpy's shape is a tuple of ints: JSON writes it as a list.
        h = {"name": name, "datatype": dtype, "shape": arr.shape,
             "offset": self._size, "size": len(data)}
        self._parts.append(data)
        self._size += len(data)
        return h

    def response(self, r):
        if not isinstance(r, InferenceResponse):
            raise TritonModelException(
                "expected an InferenceResponse, got %s" % type(r).__name__)
        out = {"outputs": [self.tensor(t) for t in r.output_tensors()], "parameters": r._parameters}
        if r.has_error():
            e = r.error()
            out["error"] = {"message": e.message(), "code": e._code_name()}
        return out

    def finish(self, header, op=b""):
        """The frame, after the one-byte `op` when given (one copy of the tensors' bytes)."""
        h = _encode_header(header).encode()
        return b"".join([op, _struct.pack("<I", len(h)), h] + self._parts)


def _header_codec():
    """The JSON writer and reader of frame headers: compact, nothing in a header refers to
    itself, no NaN. json's C encoder and scanner, called directly when this build has them
    (`json.dumps` and `json.loads` add a few Python calls around them per frame, which the
    sandbox pays on every batch), else json's own functions."""
    encoder = _json.JSONEncoder(check_circular=False, separators=(",", ":"))
    encode, decode = encoder.encode, _json.loads
    try:
        from json import encoder as _enc, scanner as _scan
        if _enc.c_make_encoder is not None:
            c_encode = _enc.c_make_encoder(
                None, encoder.default, _enc.encode_basestring_ascii, None, ":", ",", False,
                False, True)

            def encode(header):
                return "".join(c_encode(header, 0))
        if _scan.c_make_scanner is not None:
            scan = _scan.c_make_scanner(_json.JSONDecoder())

            def decode(text):
                header, end = scan(text, 0)
                if end != len(text):
                    raise ValueError("frame header: extra data after the JSON object")
                return header
        probe = {"a": [1, 2.5, "x\u00e9", True, None, (3, 4)], "b": {}}
        if decode(encode(probe)) != _json.loads(encoder.encode(probe)):
            raise ValueError("json's C codec differs")
    except Exception:  # another json module: its public functions
        encode, decode = encoder.encode, _json.loads
    return encode, decode


_encode_header, _decode_header = _header_codec()


def _read_frame(data):
    (n,) = _struct.unpack_from("<I", data, 0)
    # Decoded first: json then skips guessing the encoding of bytes.
    header = _decode_header(bytes(data[4:4 + n]).decode())
    return header, memoryview(data)[4 + n:]


def _tensor_from(h, blob):
    dtype = h["datatype"]
    raw = blob[h["offset"]:h["offset"] + h["size"]]
    shape = h["shape"]
    if dtype == "BYTES":
        arr = deserialize_bytes_tensor(raw).reshape(shape)
    elif dtype == "BF16":
        raise TritonModelException("tensor '%s' is BF16, which numpy has no type for" % h["name"])
    else:
        arr = _np.frombuffer(raw, dtype=_TRITON_TO_NUMPY[dtype]).reshape(shape)
    # The host's tensor: made without the checks a model's own Tensor(...) gets.
    t = Tensor.__new__(Tensor)
    t._name = h["name"]
    t._array = arr
    t._dtype = dtype
    return t


def _answer(data):
    """A short answer: 0 then JSON, or 1 then an error."""
    if data[:1] == b"\x00":
        return _json.loads(bytes(data[1:])) if len(data) > 1 else None
    err = _json.loads(bytes(data[1:]))
    raise TritonModelException(err.get("message", "the host refused the call"))


def _call_checked(op, body=b""):
    return _answer(_host.call(op + body))


def _is_cancelled(index, batch=None):
    frame = b"C" + _json.dumps({"index": index}).encode()
    return bool(_answer(_backend.call_for(batch, frame)))


class InferenceTrace:
    """A request's trace, as `request.trace()` gives it to pass on to BLS calls
    (`InferenceRequest(..., trace=request.trace())`); calls are traced as the calling
    request's children here whatever is passed."""

    def __init__(self, context=None):
        self._context = context

    def get_context(self):
        return self._context


_NO_TRACE = InferenceTrace()


class InferenceRequest:
    """A request: one the model received, or one it builds to call another model (BLS)."""

    def __init__(self, model_name=_UNSET, inputs=(), requested_output_names=(),
                 model_version=-1, correlation_id=0, request_id="", flags=0, timeout=0,
                 preferred_memory=None, trace=None, parameters=None, **_ignored):
        model_name = _text(model_name, "model_name")
        self._model_name = model_name
        self._inputs = _tensors(inputs, "inputs")
        _want(requested_output_names, (list, tuple), "requested_output_names")
        requested_output_names = [
            _text(name, "a requested output name") for name in requested_output_names]
        _want(correlation_id, (int, _np.integer, str), "correlation_id")
        request_id = _text(request_id, "request_id")
        _want(model_version, (int, _np.integer), "model_version")
        _want(flags, (int, _np.integer), "flags")
        _want(timeout, (int, _np.integer), "timeout")
        self._outputs = list(requested_output_names)
        self._model_version = model_version
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = _parameters(parameters)
        self._trace = trace if isinstance(trace, InferenceTrace) else InferenceTrace()
        self._index = None  # the position in the batch, for received requests
        self._batch = None  # the batch, for received requests in background mode
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _received(cls, model_name, inputs, outputs, correlation_id, request_id, flags,
                  parameters, index):
        """A request of the batch the host handed over: its fields come from the host, so
        the argument checks a model's own requests get are skipped (they cost per request)."""
        self = cls.__new__(cls)
        self._model_name = model_name
        self._inputs = inputs
        self._outputs = outputs
        self._model_version = -1
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._flags = flags
        self._timeout = 0
        self._parameters = parameters
        self._trace = _NO_TRACE
        self._index = index
        self._batch = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return self

    def inputs(self):
        return self._inputs

    def request_id(self):
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self):
        return self._flags

    def set_flags(self, flags):
        self._flags = int(flags)

    def trace(self):
        return self._trace

    def model_name(self):
        return self._model_name

    def timeout(self):
        return self._timeout

    def requested_output_names(self):
        return list(self._outputs)

    def parameters(self):
        return _json.dumps(self._parameters)

    def get_response_sender(self):
        if self._index is None:
            raise TritonModelException("only a received request has a response sender")
        if self._index is None:
            raise TritonModelException(
                "Unable to get response sender: the request was not received by this model")
        return _backend.sender(self._index, self._batch)

    def is_cancelled(self):
        if self._index is None:
            return False
        return _is_cancelled(self._index, self._batch)

    def set_release_flags(self, flags):
        """`TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`: the request runs again in a later batch
        (the model's config must say `sequence_batching { iterative_sequence: true }`)."""
        self._release_flags = _want(flags, int, "flags")

    def _call_frame(self, decoupled):
        w = _Writer()
        header = {
            "model": self._model_name if isinstance(self._model_name, str)
            else bytes(self._model_name).decode(),
            "version": int(self._model_version),
            "id": self._request_id,
            "outputs": self._outputs,
            "inputs": [w.tensor(t) for t in self._inputs],
            "parameters": self._parameters,
            "timeout_us": int(self._timeout or 0),
            "correlation_id": self._correlation_id,
            "flags": int(self._flags),
            "decoupled": bool(decoupled),
        }
        return w.finish(header)

    def exec(self, decoupled=False):
        """Runs the request on its model and returns the response (or, with
        `decoupled=True`, an iterator over the responses as the model sends them)."""
        if decoupled:
            return _ResponseIterator(handle=_call_checked(b"O", self._call_frame(True)))
        return _responses(_host.call(b"I" + self._call_frame(False)), False)

    def async_exec(self, decoupled=False):
        """`exec` that can be awaited; several run at once under `asyncio.gather`. With
        `decoupled=True` the call starts now and awaiting gives its response iterator."""
        if decoupled:
            if _backend.background:
                # As Triton: awaiting gives the iterator once the first response has come.
                return _FirstResponse(_call_checked(b"O", self._call_frame(True)))
            return _Ready(self.exec(decoupled=True))
        handle = _call_checked(b"A", self._call_frame(False))
        return _Pending(handle, False)


class _Ready:
    """An awaitable whose value is already there."""

    def __init__(self, value):
        self._value = value

    def __await__(self):
        return self._value
        yield  # a generator: awaiting it returns at once


def _responses(data, decoupled):
    header, blob = _read_frame(data)
    out = []
    for r in header["responses"]:
        error = r.get("error")
        out.append(InferenceResponse(
            [_tensor_from(t, blob) for t in r.get("outputs", [])],
            None if error is None else TritonError(
                error["message"], TritonError._NAMES.index(error.get("code", "INTERNAL"))
                if error.get("code") in TritonError._NAMES else TritonError.INTERNAL),
            r.get("parameters")))
    if decoupled:
        return _ResponseIterator(responses=out)
    return out[0] if out else InferenceResponse(error=TritonError("no response"))


class _ResponseIterator:
    """The responses of a call into a decoupled model (`exec(decoupled=True)`), in order:
    each taken from the host as the called model sends it (or, after `async_exec`, all
    collected already)."""

    def __init__(self, handle=None, responses=None):
        self._handle = handle
        self._responses = iter(responses) if responses is not None else None

    def __iter__(self):
        return self

    def __next__(self):
        if self._responses is not None:
            response = next(self._responses, None)
            if response is not None:
                return response
            self._responses = None
        if self._handle is None:
            raise StopIteration
        out = _responses(_host.call(b"X" + _json.dumps(self._handle).encode()), True)
        try:
            return next(out)
        except StopIteration:
            self._handle = None
            raise

    def cancel(self):
        """Cancels the call: the called model sees `is_cancelled()`; the responses it still
        sends (often a CANCELLED error) can be read to the end."""
        if self._handle is not None:
            _call_checked(b"Z", _json.dumps(self._handle).encode())
        elif self._responses is not None:
            self._responses = iter(())


class _Pending:
    """An `async_exec` in flight: awaiting it takes its answer from the host."""

    def __init__(self, handle, decoupled):
        self._handle = handle
        self._decoupled = decoupled

    def __await__(self):
        # Let the other coroutines of a gather start their calls before this one waits.
        yield None
        handle = _json.dumps(self._handle).encode()
        if _backend.background:
            # Other batches run while the answer is on its way.
            while True:
                data = _host.call(b"Q" + handle)
                if data:
                    return _responses(data, self._decoupled)
                yield from _backend.call_event().__await__()
        return _responses(_host.call(b"W" + handle), self._decoupled)


class _FirstResponse:
    """`async_exec(decoupled=True)` in background mode: awaiting waits (letting other
    batches run) for the first response, then gives the iterator."""

    def __init__(self, handle):
        self._handle = handle

    def __await__(self):
        handle = _json.dumps(self._handle).encode()
        while True:
            data = _host.call(b"Y" + handle)
            if data:
                break
            yield from _backend.call_event().__await__()
        first = list(_responses(data, True))
        if not first:
            return _ResponseIterator(responses=[])
        return _ResponseIterator(handle=self._handle, responses=first)


class _LogLevel(_enum.Enum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    """Triton's model logger: lines go to the server's log with the model's name."""

    LogLevel = _LogLevel
    # Triton exports the levels onto the class too: `Logger.log(msg, Logger.INFO)`.
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log(message, level=_LogLevel.INFO):
        _want(level, _LogLevel, "the log level (pb_utils.Logger.INFO, WARNING, ERROR, VERBOSE)")
        _log(level.value, _text(message, "the log message"))

    @staticmethod
    def log_info(message):
        _log(0, _text(message, "the log message"))

    @staticmethod
    def log_warn(message):
        _log(1, _text(message, "the log message"))

    @staticmethod
    def log_error(message):
        _log(2, _text(message, "the log message"))

    @staticmethod
    def log_verbose(message):
        _log(3, _text(message, "the log message"))


LogLevel = _LogLevel


def _log(level, message):
    if _host is None:
        print(message, file=_sys.__stderr__)
        return
    _host.call(b"L" + bytes([level]) + str(message).encode("utf-8", "replace"))


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives and returns: the
    model's configuration, which the static method fills in before the model loads."""

    def __init__(self, model_config):
        if isinstance(model_config, str):
            model_config = _json.loads(model_config)
        self._model_config = model_config

    def as_dict(self):
        return self._model_config

    def set_max_batch_size(self, max_batch_size):
        current = int(self._model_config.get("max_batch_size") or 0)
        if current not in (0, max_batch_size):
            raise ValueError(
                "configuration specified max_batch_size %d, but in auto-complete-config "
                "function for model '%s' specified max_batch_size %d"
                % (current, self._model_config.get("name"), max_batch_size))
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self):
        if not self._model_config.get("dynamic_batching"):
            self._model_config["dynamic_batching"] = {}

    def set_model_transaction_policy(self, transaction_policy_dict):
        if not isinstance(transaction_policy_dict, dict):
            raise ValueError("model transaction policy must be a dict")
        self._model_config["model_transaction_policy"] = dict(transaction_policy_dict)

    def _add(self, kind, tensor):
        if not isinstance(tensor, dict):
            raise ValueError("model %s must be a dict" % kind)
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError("model %s '%s' has no '%s'" % (kind, tensor.get("name"), key))
        existing = self._model_config.setdefault(kind, [])
        for item in existing:
            if item.get("name") != tensor["name"]:
                continue
            for key in ("data_type", "dims"):
                have = item.get(key)
                if have not in (None, "", "TYPE_INVALID", []) and have != tensor[key]:
                    raise ValueError(
                        "model %s '%s' has %s %r in the configuration but %r in "
                        "auto_complete_config" % (kind, tensor["name"], key, have, tensor[key]))
            item.update(tensor)
            return
        existing.append(dict(tensor))

    def add_input(self, input):
        self._add("input", input)

    def add_output(self, output):
        self._add("output", output)


def _metric_call(request):
    return _call_checked(b"M", _json.dumps(request).encode())


class Metric:
    """One series of a `MetricFamily`: its labels; instances asking for the same labels
    share it."""

    def __init__(self, family, labels=None, buckets=None):
        self._family = family._name
        self._kind = family._kind
        self._labels = {str(k): str(v) for k, v in (labels or {}).items()}
        request = {"op": "metric", "family": self._family, "labels": self._labels}
        if buckets is not None:
            request["buckets"] = [float(b) for b in buckets]
        _metric_call(request)

    def _update(self, op, value=None):
        request = {"op": op, "family": self._family, "labels": self._labels}
        if value is not None:
            request["value"] = float(value)
        return _metric_call(request)

    def increment(self, value):
        self._update("increment", value)

    def set(self, value):
        self._update("set", value)

    def observe(self, value):
        self._update("observe", value)

    def value(self):
        return self._update("value")


class MetricFamily:
    """A custom metric family, reported on the server's /metrics."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"

    def __init__(self, name, description, kind):
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException("unknown metric kind %r" % (kind,))
        self._name = name
        self._kind = kind
        _metric_call({"op": "family", "name": name, "description": description, "kind": kind})

    def Metric(self, labels=None, buckets=None):
        return Metric(self, labels, buckets)


def _repository_call(request):
    return _call_checked(b"P", _json.dumps(request).encode())


def is_model_ready(model_name, model_version=""):
    """Whether `model_name` (at `model_version`, or the version the policy picks) is loaded
    and ready."""
    return bool(_repository_call(
        {"action": "ready", "model": str(model_name), "version": str(model_version)}))


def load_model(model_name, config="", files=None):
    """Loads (or reloads) a model, as the repository API does (explicit model control mode):
    `config` a configuration in JSON used instead of its config.pbtxt, `files` its files
    ({"file:1/model.onnx": bytes}), which need `config`."""
    import base64
    request = {"action": "load", "model": str(model_name)}
    if config:
        request["config"] = str(config)
    if files:
        request["files"] = {str(k): base64.b64encode(bytes(v)).decode("ascii")
                            for k, v in files.items()}
    _repository_call(request)


def unload_model(model_name, unload_dependents=False):
    """Unloads a model (explicit model control mode); with `unload_dependents`, the models it
    calls too."""
    _repository_call({"action": "unload", "model": str(model_name),
                      "unload_dependents": bool(unload_dependents)})


def get_input_tensor_by_name(inference_request, name):
    for t in inference_request.inputs():
        if t._name == name:
            return t
    return None


def get_output_tensor_by_name(inference_response, name):
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config, name):
    for i in model_config.get("input", []):
        if i.get("name") == name:
            return i
    return None


def get_output_config_by_name(model_config, name):
    for o in model_config.get("output", []):
        if o.get("name") == name:
            return o
    return None


def using_decoupled_model_transaction_policy(model_config):
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def get_model_dir():
    return _backend.args.get("model_repository")
