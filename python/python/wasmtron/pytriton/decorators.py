"""PyTriton's decorators for inference callables.

An inference callable takes a list of requests (each a mapping of input name to array, with
``parameters``) and returns a list of output mappings, one per request. ``@batch`` turns that
into ``fn(**inputs)`` over the whole batch; ``@sample`` into ``fn(**inputs)`` over one request
of a model without batching. A callable may return a list or tuple of arrays instead of a
mapping: they are the model's outputs in the order ``bind`` declared them.

Under wasmtron the dynamic batcher has already joined the requests of one execution, so the
list a callable gets holds one request whose arrays carry the whole batch; decorators work the
same either way.
"""
import contextvars
import dataclasses
import functools
import inspect
import itertools
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .exceptions import PyTritonBadParameterError, PyTritonRuntimeError, PyTritonValidationError

__all__ = ["batch", "sample", "group_by_values", "group_by_keys", "first_value", "fill_optionals",
           "pad_batch", "triton_context", "ConstantPadder"]


@dataclasses.dataclass(frozen=True)
class _ModelSpec:
    """What decorators need to know of the model a callable is bound to."""
    name: str
    batching: bool
    inputs: Sequence[object]   # model_config.Tensor with names filled in
    outputs: Sequence[object]
    max_batch_size: int = 0
    preferred_batch_sizes: Sequence[int] = ()


_MODEL: contextvars.ContextVar = contextvars.ContextVar("wasmtron_pytriton_model")


def _spec() -> _ModelSpec:
    try:
        return _MODEL.get()
    except LookupError:
        raise PyTritonRuntimeError("this decorator works inside a function bound with "
                                   "Triton.bind, while it serves a request") from None


class Request(Mapping):
    """One inference request: its inputs by name (arrays with the batch dimension first when
    the model batches) and its ``parameters``."""

    def __init__(self, data: Dict[str, np.ndarray], parameters: Optional[Dict[str, object]] = None):
        self.data = data
        self.parameters = parameters or {}
        self.requested_output_names = None
        self.span = None

    def __getitem__(self, name: str) -> np.ndarray:
        return self.data[name]

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self.data[name] = value

    def __delitem__(self, name: str) -> None:
        del self.data[name]

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def convert_output(outputs) -> Dict[str, np.ndarray]:
    """A callable's result as a mapping: a list or tuple names the model's outputs in order."""
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, (list, tuple)):
        names = [t.name for t in _spec().outputs]
        if len(outputs) != len(names):
            raise PyTritonValidationError(
                f"model '{_spec().name}': the callable returned {len(outputs)} outputs, the "
                f"model declares {len(names)} ({', '.join(names)})")
        return dict(zip(names, outputs))
    raise PyTritonValidationError(f"model '{_spec().name}': unsupported output type "
                                  f"{type(outputs).__name__}; return a dict, list or tuple of arrays")


def _batch_size(request: Mapping) -> int:
    for value in request.values():
        return int(np.shape(value)[0]) if np.ndim(value) else 1
    return 0


def sample(wrapped: Callable) -> Callable:
    """For models without batching: the first request's inputs as keyword arguments."""
    @functools.wraps(wrapped)
    def wrapper(requests, *args, **kwargs):
        kwargs.update(requests[0])
        return [convert_output(wrapped(*args, **kwargs))]
    return wrapper


def batch(wrapped: Callable) -> Callable:
    """The requests' inputs joined along the batch dimension as keyword arguments; the result
    split back per request (each output must have the total batch size first)."""
    @functools.wraps(wrapped)
    def wrapper(requests, *args, **kwargs):
        names = list(requests[0].keys())
        for other in requests[1:]:
            if list(other.keys()) != names:
                raise PyTritonValidationError("Cannot batch requests with different set of inputs keys")
        inputs = {name: np.concatenate([r[name] for r in requests]) for name in names}
        outputs = wrapped(*args, **{**kwargs, **inputs})

        def split(result):
            result = convert_output(result)
            sizes = [_batch_size(r) for r in requests]
            total = sum(sizes)
            wrong = {n: np.shape(v) for n, v in result.items() if np.shape(v)[:1] != (total,)}
            if wrong:
                raise ValueError(f"Received output tensors with different batch sizes: "
                                 f"{', '.join(f'{n}: {s}' for n, s in wrong.items())}. "
                                 f"Expected batch size: {total}.")
            out, at = [], 0
            for size in sizes:
                out.append({n: np.asarray(v)[at:at + size] for n, v in result.items()})
                at += size
            return out

        if inspect.isgenerator(outputs):
            return (split(r) for r in outputs)
        return split(outputs)
    return wrapper


def group_by_keys(wrapped: Callable) -> Callable:
    """Calls the callable once per group of requests with the same input names, answers in the
    requests' order."""
    @functools.wraps(wrapped)
    def wrapper(requests, *args, **kwargs):
        answers: List[object] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: tuple(sorted(requests[i].keys())))
        for _, group in itertools.groupby(order, key=lambda i: tuple(sorted(requests[i].keys()))):
            indices = list(group)
            for i, answer in zip(indices, wrapped([requests[i] for i in indices], *args, **kwargs)):
                answers[i] = answer
        return answers
    return wrapper


def _value_key(value) -> bytes:
    value = np.asarray(value)
    if value.dtype == np.object_ or value.dtype.type == np.bytes_:
        return b"\0".join(bytes(v) if isinstance(v, (bytes, bytearray)) else str(v).encode()
                          for v in value.reshape(-1))
    return value.tobytes()


def group_by_values(*keys: str, pad_fn: Optional[Callable] = None) -> Callable:
    """Inside ``@batch``: splits the batch into sub-batches whose ``keys`` inputs hold equal
    values, calls the callable per sub-batch and puts the answers back in order."""
    def decorator(wrapped: Callable) -> Callable:
        @functools.wraps(wrapped)
        def wrapper(*args, **inputs):
            size = _batch_size(inputs)
            def key(i):
                return tuple(_value_key(inputs[k][i]) for k in keys if k in inputs)
            order = sorted(range(size), key=key)
            parts = []
            for _, group in itertools.groupby(order, key=key):
                idx = list(group)
                parts.append((idx, convert_output(
                    wrapped(*args, **{n: np.asarray(v)[idx] for n, v in inputs.items()}))))
            if pad_fn is not None:
                padded = pad_fn([p for _, p in parts])
                parts = [(idx, p) for (idx, _), p in zip(parts, padded)]
            first = parts[0][1]
            result = {n: np.zeros((size,) + np.shape(v)[1:], dtype=np.asarray(v).dtype)
                      for n, v in first.items()}
            for idx, part in parts:
                for n, v in part.items():
                    result[n][idx] = v
            return result
        return wrapper
    return decorator


class ConstantPadder:
    """For ``group_by_values(pad_fn=...)``: pads every sub-batch's outputs to the widest shape
    with ``pad_value``."""

    def __init__(self, pad_value=0):
        self.pad_value = pad_value

    def __call__(self, results: List[Dict[str, np.ndarray]]) -> List[Dict[str, np.ndarray]]:
        widest: Dict[str, tuple] = {}
        for r in results:
            for n, v in r.items():
                shape = np.shape(v)[1:]
                old = widest.get(n, shape)
                widest[n] = tuple(max(a, b) for a, b in zip(old, shape)) if len(old) == len(shape) else shape
        out = []
        for r in results:
            padded = {}
            for n, v in r.items():
                v = np.asarray(v)
                pads = [(0, 0)] + [(0, w - s) for s, w in zip(v.shape[1:], widest[n])]
                padded[n] = np.pad(v, pads, constant_values=self.pad_value) if v.dtype != object else v
            out.append(padded)
        return out


def first_value(*keys: str, squeeze_single_values: bool = True, strict: bool = True) -> Callable:
    """Replaces each of ``keys`` by its first value (a scalar when it holds one element);
    with ``strict`` all values must be equal. Inside ``@batch`` or over requests."""
    def take(values, name):
        values = np.asarray(values)
        if strict and len(np.unique(values if values.dtype != object else values.reshape(-1),
                                    axis=None if values.dtype == object else 0)) > 1:
            raise PyTritonRuntimeError(
                f"The values on the {name!r} input are not equal. To proceed, either disable "
                f"strict mode in @first_value wrapper or ensure that the values always are "
                f"consistent. The current values of {name!r} are {values!r}.")
        first = values[0]
        if squeeze_single_values and not np.isscalar(first) and np.size(first) == 1:
            first = np.asarray(first).reshape(-1)[0]
        return first

    def decorator(wrapped: Callable) -> Callable:
        @functools.wraps(wrapped)
        def wrapper(*args, **kwargs):
            if not _spec().batching:
                raise PyTritonRuntimeError(
                    "The @first_value decorator can only be used with models that support batching.")
            if args and isinstance(args[0], list) and not kwargs:
                requests = args[0]
                for r in requests:
                    for k in keys:
                        if k in r:
                            r[k] = take(r[k], k)
                return wrapped(requests, *args[1:])
            for k in keys:
                if k in kwargs:
                    kwargs[k] = take(kwargs[k], k)
            return wrapped(*args, **kwargs)
        return wrapper
    return decorator


def fill_optionals(**defaults: np.ndarray) -> Callable:
    """Fills inputs a request left out with defaults (arrays without the batch dimension,
    repeated to the request's batch size)."""
    for name, value in defaults.items():
        if not isinstance(value, np.ndarray):
            raise PyTritonBadParameterError(
                f"Could not use {name}={value} defaults as they are not NumPy arrays")

    def decorator(wrapped: Callable) -> Callable:
        @functools.wraps(wrapped)
        def wrapper(requests, *args, **kwargs):
            declared = {t.name for t in _spec().inputs}
            unknown = sorted(set(defaults) - declared)
            if unknown:
                raise PyTritonBadParameterError(f"Could not found {', '.join(unknown)} inputs")
            for r in requests:
                size = _batch_size(r)
                for name, value in defaults.items():
                    if name not in r:
                        r[name] = np.repeat(value[np.newaxis], size, axis=0) if _spec().batching else value
            return wrapped(requests, *args, **kwargs)
        return wrapper
    return decorator


def pad_batch(wrapped: Callable) -> Callable:
    """Inside ``@batch``: repeats the last row of every input up to the nearest preferred batch
    size (or ``max_batch_size``) at or above the batch's."""
    @functools.wraps(wrapped)
    def wrapper(*args, **inputs):
        spec = _spec()
        size = _batch_size(inputs)
        sizes = sorted(spec.preferred_batch_sizes) + [spec.max_batch_size]
        target = next((n for n in sizes if n >= size), size)
        padded = {}
        for name, value in inputs.items():
            value = np.asarray(value)
            repeats = np.ones(value.shape[0], dtype=np.int64)
            repeats[-1] += target - size
            padded[name] = np.repeat(value, repeats, axis=0)
        return wrapped(*args, **padded)
    return wrapper


def triton_context(wrapped: Callable) -> Callable:
    """Passes ``triton_context`` (with ``model_configs``) to the callable."""
    @functools.wraps(wrapped)
    def wrapper(*args, **kwargs):
        spec = _spec()
        context = type("TritonContext", (), {"model_configs": {wrapped: spec}})()
        return wrapped(*args, triton_context=context, **kwargs)
    return wrapper
