"""Tensors as a stage sees them: a name, a datatype (Triton's names: "FP32", "UINT8", "BYTES"),
a shape and the row-major little-endian bytes, with typed views and no NumPy."""
import struct
from array import array as _array
from typing import Iterable, List, Sequence, Tuple, Union

from wit_world.imports import types as _wit

# Triton datatype name -> (WIT enum, struct/array format character or None).
_DTYPES = {
    "BOOL": (_wit.Datatype.BOOL, "?"),
    "UINT8": (_wit.Datatype.UINT8, "B"),
    "UINT16": (_wit.Datatype.UINT16, "H"),
    "UINT32": (_wit.Datatype.UINT32, "I"),
    "UINT64": (_wit.Datatype.UINT64, "Q"),
    "INT8": (_wit.Datatype.INT8, "b"),
    "INT16": (_wit.Datatype.INT16, "h"),
    "INT32": (_wit.Datatype.INT32, "i"),
    "INT64": (_wit.Datatype.INT64, "q"),
    "FP16": (_wit.Datatype.FP16, "e"),
    "FP32": (_wit.Datatype.FP32, "f"),
    "FP64": (_wit.Datatype.FP64, "d"),
    "BF16": (_wit.Datatype.BF16, None),
    "BYTES": (_wit.Datatype.BYTES, None),
}
_BY_WIT = {wit: name for name, (wit, _) in _DTYPES.items()}


def wit_datatype(dtype: str):
    """The WIT enum value of a Triton datatype name ("FP32"); also accepts "TYPE_FP32"."""
    name = dtype.upper()
    if name.startswith("TYPE_"):
        name = name[5:]
    if name == "STRING":
        name = "BYTES"
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise ValueError(f"unknown datatype {dtype!r}; one of {', '.join(_DTYPES)}") from None


def dtype_name(datatype) -> str:
    """The Triton name of a WIT datatype."""
    return _BY_WIT[datatype]


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pack_strings(items: Iterable[Union[str, bytes]]) -> bytes:
    """BYTES tensor data: each element as a 4-byte little-endian length, then its bytes."""
    out = bytearray()
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(raw))
        out += raw
    return bytes(out)


def unpack_strings(data: bytes) -> List[bytes]:
    """The elements of BYTES tensor data."""
    items, offset, view = [], 0, memoryview(data)
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        items.append(bytes(view[offset + 4:offset + 4 + length]))
        offset += 4 + length
    return items


class Tensor:
    """A named tensor. `data` is the raw bytes; `view()`, `tolist()` and `strings()` read it."""

    __slots__ = ("name", "dtype", "shape", "data", "_origin")

    def __init__(self, name: str, dtype: str, shape: Sequence[int], data: bytes):
        self.name = name
        self.dtype = dtype_name(wit_datatype(dtype))
        self.shape = tuple(int(d) for d in shape)
        self.data = bytes(data)
        # (request index, input name) for a request's input: host operations then read it
        # from the request instead of receiving its bytes again.
        self._origin = None

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.dtype}, shape={list(self.shape)}, {len(self.data)} bytes)"

    @classmethod
    def from_values(cls, name: str, dtype: str, shape: Sequence[int], values: Iterable) -> "Tensor":
        """A tensor of `dtype` from a flat sequence of numbers (or strings for BYTES)."""
        dtype = dtype_name(wit_datatype(dtype))
        if dtype == "BYTES":
            return cls.from_strings(name, shape, values)
        fmt = _DTYPES[dtype][1]
        if fmt is None:
            raise ValueError(f"{dtype} tensors cannot be built from Python numbers")
        values = list(values)
        if len(values) != _count(shape):
            raise ValueError(f"tensor '{name}': shape {list(shape)} needs {_count(shape)} values, got {len(values)}")
        if fmt in "?e":
            data = struct.pack(f"<{len(values)}{fmt}", *values)
        else:
            data = _array(fmt, values).tobytes()
        return cls(name, dtype, shape, data)

    @classmethod
    def from_strings(cls, name: str, shape: Sequence[int], items: Iterable[Union[str, bytes]]) -> "Tensor":
        """A BYTES tensor; `str` items are UTF-8 encoded."""
        items = list(items)
        if len(items) != _count(shape):
            raise ValueError(f"tensor '{name}': shape {list(shape)} needs {_count(shape)} strings, got {len(items)}")
        return cls(name, "BYTES", shape, pack_strings(items))

    @classmethod
    def from_array(cls, name: str, array) -> "Tensor":
        """A tensor holding a copy of a host array (`wasmtron_stage.ops`)."""
        return cls._from_wit(array.to_tensor(name))

    def to_array(self):
        """A host array holding a copy of the elements, for `wasmtron_stage.ops`."""
        from . import ops

        return ops.array(self)

    def count(self) -> int:
        """Number of elements."""
        return _count(self.shape)

    def view(self) -> memoryview:
        """A typed, shaped, read-only view of the elements (e.g. `t.view()[0, 3]`)."""
        fmt = _DTYPES[self.dtype][1]
        if fmt is None or fmt == "e":
            raise TypeError(f"tensor '{self.name}': {self.dtype} has no memoryview format; use tolist()")
        if self.shape and 0 not in self.shape:
            return memoryview(self.data).cast(fmt, self.shape)
        return memoryview(self.data).cast(fmt)

    def tolist(self) -> list:
        """The elements as a flat list (numbers, or bytes for BYTES)."""
        if self.dtype == "BYTES":
            return unpack_strings(self.data)
        fmt = _DTYPES[self.dtype][1]
        if fmt is None:
            raise TypeError(f"tensor '{self.name}': {self.dtype} cannot be read as Python numbers")
        return list(struct.unpack(f"<{_count(self.shape)}{fmt}", self.data))

    def strings(self, encoding: str = "") -> list:
        """The elements of a BYTES tensor: bytes, or str when `encoding` is given ("utf-8")."""
        if self.dtype != "BYTES":
            raise TypeError(f"tensor '{self.name}' is {self.dtype}, not BYTES")
        items = unpack_strings(self.data)
        return [i.decode(encoding) for i in items] if encoding else items

    def _to_wit(self, name: str = "") -> _wit.Tensor:
        return _wit.Tensor(name or self.name, wit_datatype(self.dtype), list(self.shape), self.data)

    @classmethod
    def _from_wit(cls, t: _wit.Tensor) -> "Tensor":
        tensor = cls.__new__(cls)
        tensor.name, tensor.dtype, tensor.shape, tensor.data = t.name, dtype_name(t.datatype), tuple(t.shape), t.data
        tensor._origin = None
        return tensor


def split_rows(tensor: Tensor, counts: List[int]) -> List[Tensor]:
    """Splits a tensor along its first axis into pieces of `counts` rows."""
    if not tensor.shape:
        raise ValueError(f"output '{tensor.name}' has no batch axis to split")
    rows, rest = tensor.shape[0], tensor.shape[1:]
    if sum(counts) != rows:
        raise ValueError(f"output '{tensor.name}' has {rows} rows; the batch's requests sent {sum(counts)}")
    pieces = []
    if tensor.dtype == "BYTES":
        items, per_row, at = unpack_strings(tensor.data), _count(rest), 0
        for n in counts:
            pieces.append(Tensor.from_strings(tensor.name, (n,) + rest, items[at:at + n * per_row]))
            at += n * per_row
        return pieces
    row_bytes = len(tensor.data) // rows if rows else 0
    at = 0
    for n in counts:
        pieces.append(Tensor(tensor.name, tensor.dtype, (n,) + rest, tensor.data[at:at + n * row_bytes]))
        at += n * row_bytes
    return pieces


def join_rows(name: str, tensors: List[Tensor]) -> Tuple[Tensor, List[int]]:
    """Concatenates tensors along their first axis; returns the result and each one's rows."""
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise ValueError(f"input '{name}': requests of one batch differ beyond the first axis")
    counts = [t.shape[0] if t.shape else 1 for t in tensors]
    shape = (sum(counts),) + first.shape[1:]
    return Tensor(name, first.dtype, shape, b"".join(t.data for t in tensors)), counts
