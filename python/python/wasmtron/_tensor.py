"""Tensors as Triton's in-process API has them (``tritonserver.Tensor``, ``DataType``,
``MemoryType``, ``MemoryBuffer``), and their conversion to and from the extension's
``(name, datatype, shape, bytes)`` tuples.

Outputs are not copied: a numeric output's buffer is the server's own memory (for ONNX models,
what ONNX Runtime wrote), lent read-only; ``numpy.from_dlpack(tensor)`` or
``torch.from_dlpack(tensor)`` read it in place. BYTES tensors hold the serialized elements
(4-byte little-endian length, then the bytes), as Triton's do; ``to_bytes_array()`` and
``to_string_array()`` turn them into object arrays."""
import dataclasses
import enum
from typing import Any, List, Sequence, Tuple

import numpy as np

from ._wasmtron import InvalidArgumentError, UnsupportedError


class DataType(enum.IntEnum):
    """Triton's tensor datatypes (``TRITONSERVER_DataType``)."""
    INVALID = 0
    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14


class MemoryType(enum.IntEnum):
    """Where a tensor's memory is (``TRITONSERVER_MemoryType``). The in-process server answers
    in host memory (``CPU``)."""
    CPU = 0
    CPU_PINNED = 1
    GPU = 2


class DLDeviceType(enum.IntEnum):
    """DLPack's device types (those a tensor here can report)."""
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3


_NUMPY = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
}
_FROM_NUMPY = {dtype: data_type for data_type, dtype in _NUMPY.items()}


def data_type_of(dtype) -> DataType:
    """The Triton datatype of a NumPy dtype (str, bytes and object: BYTES)."""
    dtype = np.dtype(dtype)
    if dtype == np.object_ or dtype.kind in ("S", "U"):
        return DataType.BYTES
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    return _FROM_NUMPY.get(dtype, DataType.INVALID)


@dataclasses.dataclass
class MemoryBuffer:
    """A tensor's memory: address, kind, device id, size in bytes, and the object keeping it
    alive (``owner``)."""
    data_ptr: int
    memory_type: MemoryType
    memory_type_id: int
    size: int
    owner: Any


def _serialize(elements) -> bytes:
    out = bytearray()
    for element in elements:
        if isinstance(element, str):
            element = element.encode()
        if not isinstance(element, (bytes, bytearray)):
            raise InvalidArgumentError(
                f"a BYTES element must be bytes or str, got {type(element).__name__}")
        out += len(element).to_bytes(4, "little") + bytes(element)
    return bytes(out)


def _deserialize(data) -> List[bytes]:
    data = memoryview(data).cast("B")
    elements, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "little")
        elements.append(bytes(data[at + 4:at + 4 + size]))
        at += 4 + size
    return elements


@dataclasses.dataclass
class Tensor:
    """A tensor in host memory, as Triton's ``tritonserver.Tensor``: ``data_type``, ``shape``
    and ``memory_buffer``. Outputs of :meth:`Model.infer` come as these; inputs may be these,
    NumPy arrays, nested lists, or any object with ``__dlpack__`` (a CPU ``torch`` tensor)."""
    data_type: DataType
    shape: Sequence[int]
    memory_buffer: MemoryBuffer

    @property
    def data_ptr(self) -> int:
        """The address of the tensor's first byte."""
        return self.memory_buffer.data_ptr

    @property
    def memory_type(self) -> MemoryType:
        """Where the tensor's memory is (always ``CPU`` here)."""
        return self.memory_buffer.memory_type

    @property
    def memory_type_id(self) -> int:
        """The device id of the tensor's memory."""
        return self.memory_buffer.memory_type_id

    @property
    def size(self) -> int:
        """The tensor's size in bytes."""
        return self.memory_buffer.size

    def _array(self) -> np.ndarray:
        """The tensor's bytes as an array of its dtype and shape (no copy)."""
        owner = self.memory_buffer.owner
        raw = owner if isinstance(owner, np.ndarray) else np.frombuffer(owner, dtype=np.uint8)
        if self.data_type == DataType.BYTES:
            return raw
        dtype = _NUMPY.get(self.data_type)
        if dtype is None:  # BF16: raw 16-bit words
            dtype = np.dtype(np.uint16)
        return raw.reshape(-1).view(dtype).reshape(tuple(self.shape))

    def __dlpack__(self, *, stream=None, **kwargs):
        """Lends the tensor's memory through DLPack (``numpy.from_dlpack``,
        ``torch.from_dlpack``) without a copy. BYTES and BF16 tensors have no DLPack form:
        use :meth:`to_bytes_array` (BF16: read ``memory_buffer``)."""
        if self.data_type in (DataType.BYTES, DataType.BF16):
            raise UnsupportedError(
                f"a {self.data_type.name} tensor has no DLPack form"
                + (": use to_bytes_array() or to_string_array()"
                   if self.data_type == DataType.BYTES else ""))
        return self._array().__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> Tuple[DLDeviceType, int]:
        """The device of the tensor's memory: the host."""
        return (DLDeviceType.kDLCPU, 0)

    def to_bytes_array(self) -> np.ndarray:
        """A BYTES tensor as an ``object`` array of ``bytes`` in the tensor's shape."""
        if self.data_type != DataType.BYTES:
            raise InvalidArgumentError(
                f"to_bytes_array() needs a BYTES tensor, not {self.data_type.name}")
        elements = _deserialize(self._array())
        array = np.empty(len(elements), dtype=np.object_)
        array[:] = elements
        return array.reshape(tuple(self.shape))

    def to_string_array(self) -> np.ndarray:
        """A BYTES tensor as an ``object`` array of ``str`` (UTF-8) in the tensor's shape."""
        out = self.to_bytes_array()
        strings = np.empty(out.size, dtype=np.object_)
        strings[:] = [b.decode("utf-8") for b in out.reshape(-1)]
        return strings.reshape(out.shape)

    @staticmethod
    def from_bytes_array(array) -> "Tensor":
        """A BYTES tensor from an array (or nested list) of ``bytes`` or ``str``."""
        array = np.asarray(array, dtype=np.object_)
        data = np.frombuffer(_serialize(array.reshape(-1)), dtype=np.uint8)
        return Tensor._from_buffer(DataType.BYTES, array.shape, data)

    @staticmethod
    def from_string_array(array) -> "Tensor":
        """A BYTES tensor from an array (or nested list) of ``str``, UTF-8 encoded."""
        return Tensor.from_bytes_array(array)

    @staticmethod
    def from_dlpack(obj) -> "Tensor":
        """A tensor over the memory of any object with ``__dlpack__`` in host memory (no
        copy)."""
        return Tensor._from_numpy(np.from_dlpack(obj))

    def to_host(self) -> "Tensor":
        """This tensor (its memory is already the host's)."""
        return self

    def to_device(self, device) -> "Tensor":
        """This tensor when ``device`` is the host (``"cpu"``, ``MemoryType.CPU``); a GPU
        device is not offered in-process."""
        if _is_host(device):
            return self
        raise UnsupportedError(f"to_device({device!r}): tensors are in host memory only")

    @staticmethod
    def _from_buffer(data_type: DataType, shape, owner) -> "Tensor":
        array = owner if isinstance(owner, np.ndarray) else np.frombuffer(owner, dtype=np.uint8)
        pointer = array.ctypes.data if array.size else 0
        return Tensor(data_type, [int(d) for d in shape],
                      MemoryBuffer(pointer, MemoryType.CPU, 0, array.nbytes, array))

    @staticmethod
    def _from_numpy(array: np.ndarray) -> "Tensor":
        data_type = data_type_of(array.dtype)
        if data_type == DataType.BYTES:
            return Tensor.from_bytes_array(array)
        if data_type == DataType.INVALID:
            raise InvalidArgumentError(f"dtype {array.dtype} has no Triton datatype")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return Tensor._from_buffer(data_type, array.shape, np.ascontiguousarray(array))


def _is_host(device) -> bool:
    if device is None or device in (MemoryType.CPU, MemoryType.CPU_PINNED):
        return True
    if isinstance(device, tuple):
        device = device[0]
    return isinstance(device, str) and device.split(":")[0].lower() in ("cpu", "cpu_pinned")


def to_wire(name: str, value) -> Tuple[str, str, List[int], bytes]:
    """An input for the extension: a :class:`Tensor`, a NumPy array, anything ``np.asarray``
    takes (nested lists of numbers, ``str`` or ``bytes``), or an object with ``__dlpack__``."""
    if isinstance(value, Tensor):
        tensor = value
    else:
        if not isinstance(value, np.ndarray) and hasattr(value, "__dlpack__"):
            try:
                value = np.from_dlpack(value)
            except (BufferError, RuntimeError, TypeError) as e:
                raise InvalidArgumentError(
                    f"input '{name}': cannot read it through DLPack in host memory ({e})"
                ) from None
        try:
            tensor = Tensor._from_numpy(np.asarray(value))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"input '{name}': {e}") from None
    data = tensor.memory_buffer.owner
    return (name, tensor.data_type.name, [int(d) for d in tensor.shape],
            data.tobytes() if isinstance(data, np.ndarray) else bytes(data))


def from_wire(datatype: str, shape: Sequence[int], data) -> Tensor:
    """An output of the extension as a :class:`Tensor` over its buffer (no copy)."""
    data_type = DataType[datatype]
    return Tensor._from_buffer(data_type, shape, np.frombuffer(data, dtype=np.uint8))


def to_numpy(datatype: str, shape: Sequence[int], data) -> np.ndarray:
    """An extension tensor as a NumPy array (BYTES: an ``object`` array of ``bytes``)."""
    tensor = from_wire(datatype, shape, data)
    if tensor.data_type == DataType.BYTES:
        return tensor.to_bytes_array()
    return tensor._array()
