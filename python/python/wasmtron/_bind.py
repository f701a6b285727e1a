"""Python functions served as models (PyTriton's ``bind``): the tensor and batching
declarations, the configuration the server gets, and the call the server makes."""
import dataclasses
import json
import traceback
from typing import Callable, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._tensor import DataType, data_type_of, to_numpy, to_wire
from ._wasmtron import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """An input or output of a bound function (PyTriton's ``model_config.Tensor``): ``name``,
    a NumPy ``dtype`` (``np.bytes_`` or ``object`` for BYTES) and ``shape`` without the batch
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


def config_type(name: str, dtype) -> str:
    """The ``config.pbtxt`` type of a declared tensor's dtype."""
    data_type = data_type_of(dtype)
    if data_type == DataType.INVALID:
        raise InvalidArgumentError(f"tensor '{name}': dtype {np.dtype(dtype)} has no Triton "
                                   "datatype")
    return "TYPE_STRING" if data_type == DataType.BYTES else "TYPE_" + data_type.name


def bound_config(model_name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 config: ModelConfig, instances: int) -> str:
    """The model configuration (JSON) of a bound function."""
    def tensors(ts):
        return [{"name": t.name, "data_type": config_type(t.name, t.dtype),
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
        arrays = {name: to_numpy(datatype, shape, data) for name, datatype, shape, data in inputs}
        result = function(**arrays)
        if not isinstance(result, Mapping):
            raise TypeError(f"a bound function must return a dict of arrays, not "
                            f"{type(result).__name__}")
        return [to_wire(name, result[name]) for name in output_names if name in result]
    except Exception as e:  # noqa: BLE001 - every failure answers the request, not the server
        status = _STATUS.get(type(e).__name__, "INTERNAL")
        return (status, "".join(traceback.format_exception(e)).rstrip())


def bound_caller(function: Callable) -> Callable:
    """What the server calls for one instance of a bound function."""
    def call(inputs, output_names):
        return _call_bound(function, inputs, output_names)
    return call
