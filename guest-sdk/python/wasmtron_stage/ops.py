"""Tensor operations run natively by the host (`wasmtron:stage/ops`): arrays stay on the host
between operations, so a Python stage does image decoding, resizing, normalisation, softmax or
top-k at the speed of compiled Rust. Functions take host arrays or `Tensor`s and return host
arrays; `Tensor.from_array(name, a)` (or returning the array from `infer`) copies one out.
Semantics of each operation: docs/stages.md, "Host tensor operations"."""
from typing import List, Sequence, Union

from componentize_py_types import Err
from wit_world.imports import ops as _ops

from .errors import StageError
from .tensor import Tensor, wit_datatype

#: A host array.
Array = _ops.Array

_COLORS = {"rgb": _ops.Color.RGB, "bgr": _ops.Color.BGR, "gray": _ops.Color.GRAY}
_FILTERS = {"nearest": _ops.Filter.NEAREST, "bilinear": _ops.Filter.BILINEAR}
_BOXES = {"corners": _ops.BoxFormat.CORNERS, "center": _ops.BoxFormat.CENTER}


def _pick(table: dict, value: str, what: str):
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"unknown {what} {value!r}; one of {', '.join(table)}") from None


def _call(fn, *args):
    try:
        return fn(*args)
    except Err as e:
        error = e.value
    # Raised outside the except block: an exception raised inside it would keep the host's
    # error and this frame in a reference cycle, and with them every array the stage's frames
    # hold, until Python's cycle collector happens to run.
    raise StageError.from_wit(error)


def array(value: Union[Array, Tensor]) -> Array:
    """A host array from a `Tensor`; an array is returned as it is. A request's input is
    read by the host from the request itself, so its bytes do not cross again."""
    if isinstance(value, Tensor):
        if value._origin is not None:
            return _call(_ops.input, *value._origin)
        return _call(Array.from_tensor, value._to_wit())
    return value


def from_values(dtype: str, shape: Sequence[int], data: bytes) -> Array:
    """A host array from raw little-endian bytes."""
    return _call(Array.from_data, wit_datatype(dtype), list(shape), data)


def decode_image(source: Union[bytes, Tensor], color: str = "rgb", max_pixels: int = 0,
                 element: int = 0) -> Array:
    """PNG or JPEG -> uint8 [height, width, channels]; `color` is rgb, bgr or gray. `source`
    is the encoded bytes, or a BYTES tensor and the index of its `element` to decode (for a
    request's input, the host decodes it straight from the request)."""
    mode = _pick(_COLORS, color, "color")
    if isinstance(source, Tensor):
        if source._origin is not None:
            index, name = source._origin
            return _call(_ops.decode_input_image, index, name, element, mode, max_pixels)
        source = source.strings()[element]
    return _call(_ops.decode_image, bytes(source), mode, max_pixels)


def convert_color(image, source: str, target: str) -> Array:
    """uint8 image from one color to another (rgb, bgr, gray)."""
    return _call(_ops.convert_color, array(image), _pick(_COLORS, source, "color"), _pick(_COLORS, target, "color"))


def resize(image, height: int, width: int, filter: str = "bilinear") -> Array:
    """Resizes to exactly height x width (Pillow's resize)."""
    return _call(_ops.resize, array(image), height, width, _pick(_FILTERS, filter, "filter"))


def resize_shorter_side(image, size: int, filter: str = "bilinear") -> Array:
    """Resizes keeping the aspect ratio so the shorter side is `size` (torchvision's Resize)."""
    return _call(_ops.resize_shorter_side, array(image), size, _pick(_FILTERS, filter, "filter"))


def letterbox(image, height: int, width: int, filter: str = "bilinear", pad: float = 114.0) -> Array:
    """Fits into height x width keeping the aspect ratio, centred, padded with `pad`."""
    return _call(_ops.letterbox, array(image), height, width, _pick(_FILTERS, filter, "filter"), pad)


def crop(image, top: int, left: int, height: int, width: int) -> Array:
    """The region at (top, left) of height x width."""
    return _call(_ops.crop, array(image), top, left, height, width)


def center_crop(image, height: int, width: int) -> Array:
    """The centred region of height x width (torchvision's CenterCrop)."""
    return _call(_ops.center_crop, array(image), height, width)


def transpose(a, axes: Sequence[int]) -> Array:
    """Permutes axes: (2, 0, 1) turns HWC into CHW."""
    return _call(_ops.transpose, array(a), list(axes))


def cast(a, dtype: str) -> Array:
    """Converts elements to `dtype` ("FP32", "UINT8", ...); out-of-range values saturate."""
    return _call(_ops.cast, array(a), wit_datatype(dtype))


def normalize(a, mean: Sequence[float], std: Sequence[float], scale: float = 1.0, axis: int = -1) -> Array:
    """fp32 (x * scale - mean[c]) / std[c], c indexing `axis` (default: the last, HWC's channels)."""
    return _call(_ops.normalize, array(a), scale, list(mean), list(std), axis)


def softmax(a, axis: int = -1) -> Array:
    """fp32 softmax along `axis`."""
    return _call(_ops.softmax, array(a), axis)


def sigmoid(a) -> Array:
    """fp32 logistic sigmoid."""
    return _call(_ops.sigmoid, array(a))


def argmax(a, axis: int = -1) -> Array:
    """int64 index of the largest value along `axis` (first on ties)."""
    return _call(_ops.argmax, array(a), axis)


def top_k(a, k: int, axis: int = -1):
    """(values fp32, indices int64) of the k largest along `axis`, largest first."""
    result = _call(_ops.top_k, array(a), k, axis)
    return result.values, result.indices


def nms(boxes, scores, iou_threshold: float = 0.5, score_threshold: float = 0.0,
        max_outputs: int = 0, box_format: str = "corners") -> Array:
    """int64 indices of the boxes kept by non-maximum suppression, best first."""
    return _call(_ops.nms, array(boxes), array(scores), _pick(_BOXES, box_format, "box format"),
                 iou_threshold, score_threshold, max_outputs)


def stack(arrays: List) -> Array:
    """Joins arrays of one shape along a new first axis."""
    return _call(_ops.stack, [array(a) for a in arrays])


def reshape(a, shape: Sequence[int]) -> Array:
    """The same elements under another shape (one dimension may be -1)."""
    return _call(array(a).reshape, list(shape))
