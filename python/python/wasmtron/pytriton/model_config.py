"""PyTriton's model configuration: ``ModelConfig`` (batching on by default, ``max_batch_size``
4, a default dynamic batcher), ``Tensor`` (the name optional: ``INPUT_1``, ``OUTPUT_1``, ... by
position), ``DynamicBatcher``, ``QueuePolicy``, ``TimeoutAction`` and ``DeviceKind``."""
import dataclasses
import enum
from typing import Dict, List, Optional

import numpy as np

__all__ = ["ModelConfig", "Tensor", "DynamicBatcher", "QueuePolicy", "TimeoutAction", "DeviceKind"]


class DeviceKind(enum.Enum):
    """Where instances run (PyTriton's bound functions always run on the CPU side)."""
    KIND_AUTO = "KIND_AUTO"
    KIND_CPU = "KIND_CPU"
    KIND_GPU = "KIND_GPU"


class TimeoutAction(enum.Enum):
    """What happens to a request whose queue timeout passes."""
    REJECT = "REJECT"
    DELAY = "DELAY"


@dataclasses.dataclass
class QueuePolicy:
    """Triton's queue policy: timeout action and default timeout (microseconds), whether a
    request may set its own, and the most requests queued (0: unbounded)."""
    timeout_action: TimeoutAction = TimeoutAction.REJECT
    default_timeout_microseconds: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclasses.dataclass
class DynamicBatcher:
    """Triton's dynamic batcher."""
    max_queue_delay_microseconds: int = 0
    preferred_batch_size: Optional[list] = None
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: Optional[QueuePolicy] = None
    priority_queue_policy: Optional[Dict[int, QueuePolicy]] = None


@dataclasses.dataclass
class ModelConfig:
    """How a bound function is served. ``decoupled`` (several responses per request) and
    ``response_cache`` are refused by ``bind`` with a message saying so."""
    batching: bool = True
    max_batch_size: int = 4
    batcher: DynamicBatcher = dataclasses.field(default_factory=DynamicBatcher)
    response_cache: bool = False
    decoupled: bool = False
    model_warmup: Optional[List[object]] = None


@dataclasses.dataclass(frozen=True)
class Tensor:
    """An input or output: ``shape`` without the batch dimension (-1 for a variable one),
    ``dtype`` a NumPy type (``np.bytes_`` or ``object`` for strings), ``name`` optional."""
    shape: tuple
    dtype: object
    name: Optional[str] = None
    optional: Optional[bool] = False

    def __post_init__(self):
        if isinstance(self.dtype, np.dtype):
            object.__setattr__(self, "dtype", self.dtype.type)


def _queue_policy(policy: QueuePolicy) -> Dict[str, object]:
    return {"timeout_action": policy.timeout_action.value,
            "default_timeout_microseconds": int(policy.default_timeout_microseconds),
            "allow_timeout_override": bool(policy.allow_timeout_override),
            "max_queue_size": int(policy.max_queue_size)}


def dynamic_batching(batcher: DynamicBatcher) -> Dict[str, object]:
    """The batcher as config.pbtxt's ``dynamic_batching`` (JSON)."""
    out: Dict[str, object] = {
        "max_queue_delay_microseconds": int(batcher.max_queue_delay_microseconds),
        "preferred_batch_size": [int(n) for n in batcher.preferred_batch_size or ()],
        "preserve_ordering": bool(batcher.preserve_ordering),
        "priority_levels": int(batcher.priority_levels),
        "default_priority_level": int(batcher.default_priority_level),
    }
    if batcher.default_queue_policy is not None:
        out["default_queue_policy"] = _queue_policy(batcher.default_queue_policy)
    if batcher.priority_queue_policy:
        out["priority_queue_policy"] = {str(level): _queue_policy(p)
                                        for level, p in batcher.priority_queue_policy.items()}
    return out
