"""Write Wasmtron stages in Python.

A stage is a function from input tensors to output tensors, in PyTriton's spirit::

    from wasmtron_stage import Tensor, ops, stage

    @stage
    def infer(IMAGE: Tensor) -> dict:
        image = ops.decode_image(IMAGE.strings()[0])
        return {"PIXELS": ops.normalize(ops.resize(image, 224, 224), [0.5] * 3, [0.5] * 3, 1 / 255)}

`@stage` functions get one request's inputs as keyword arguments (`Tensor`s) and return a dict
of outputs (`Tensor`s or host arrays); add `@batch` to get every request of a dynamic batch at
once, joined along the first axis. `@setup` functions run once per instance with the `Config`.
`wasmtron stage build` bundles this package with the stage (componentize-py).
"""
import gc
import json
from typing import Callable, Dict, List, Optional, Sequence, Union

from componentize_py_types import Err, Ok
from wit_world import exports
from wit_world.imports import host as _host
from wit_world.imports import types as _wit

from . import ops
from .errors import InvalidArgument, NotFound, StageError, Unavailable, Unsupported
from .tensor import Tensor, join_rows, split_rows

__all__ = [
    "Config", "Context", "InvalidArgument", "NotFound", "StageError", "Tensor", "Unavailable",
    "Unsupported", "batch", "context", "config", "infer", "log", "ops", "respond", "setup", "stage",
]

_registered: Dict[str, Optional[Callable]] = {"infer": None, "setup": None}


class Config:
    """The model configuration, read once per instance."""

    def __init__(self, config_json: str, parameters: Sequence):
        #: The configuration as `GET /v2/models/<name>/config` returns it.
        self.json: dict = json.loads(config_json) if config_json else {}
        #: `parameters` of config.pbtxt, as strings.
        self.parameters: Dict[str, str] = dict(parameters)
        #: The model's name.
        self.name: str = self.json.get("name", "")
        #: 0 when the model does not batch.
        self.max_batch_size: int = int(self.json.get("max_batch_size", 0) or 0)

    def parameter(self, key: str, default=None, type: Callable = str):
        """A config.pbtxt parameter converted with `type`; a bad value is an InvalidArgument
        naming the parameter."""
        if key not in self.parameters:
            return default
        text = self.parameters[key].strip()
        try:
            if type is bool:
                return {"true": True, "false": False}[text.lower()]
            return type(text)
        except (KeyError, ValueError):
            raise InvalidArgument(f"parameter '{key}' must be {type.__name__}, got {text!r}") from None


class Context:
    """The request being served: its id, parameters, requested outputs and batch index."""

    def __init__(self, index: int, request: _wit.Request):
        self.index = index
        self.id: str = request.id
        self.requested_outputs: List[str] = list(request.requested_outputs)
        self.parameters: dict = {p.key: p.value.value for p in request.parameters}


_state = {"config": None, "context": None}


def stage(fn: Callable) -> Callable:
    """Marks the stage's function: `fn(**inputs) -> {output name: Tensor or host array}`."""
    _registered["infer"] = fn
    return fn


def batch(fn: Callable) -> Callable:
    """Makes a `@stage` function take the whole batch: each input joins the requests' tensors
    along the first axis, and each output is split back into the requests' rows."""
    fn._wasmtron_batch = True
    return fn


def setup(fn: Callable) -> Callable:
    """Marks a function run once per instance, before any request: `fn(config: Config)`."""
    _registered["setup"] = fn
    return fn


def config() -> Config:
    """The configuration of this model (after `setup`)."""
    return _state["config"]


def context() -> Context:
    """The request being served (for a `@batch` function: the first of the batch)."""
    return _state["context"]


class _Log:
    """Lines in the server's log, tagged with the model name."""

    def error(self, message: str) -> None:
        _host.log(_host.LogLevel.ERROR, str(message))

    def warn(self, message: str) -> None:
        _host.log(_host.LogLevel.WARN, str(message))

    def info(self, message: str) -> None:
        _host.log(_host.LogLevel.INFO, str(message))

    def debug(self, message: str) -> None:
        _host.log(_host.LogLevel.DEBUG, str(message))


log = _Log()


def _to_wit(name: str, value) -> _wit.Tensor:
    if isinstance(value, Tensor):
        return value._to_wit(name)
    if isinstance(value, ops.Array):
        return value.to_tensor(name)
    raise TypeError(f"output '{name}' must be a Tensor or a host array, got {type(value).__name__}")


def _outputs(produced, wanted: Sequence[str], index: Optional[int] = None) -> List[_wit.Tensor]:
    """The outputs to return, in the requested order. With the request's `index`, host arrays
    become outputs through `ops.set-output` and never pass through this stage's memory."""
    if produced is None:
        return []
    if not isinstance(produced, dict):
        raise TypeError(f"the stage function must return a dict of outputs, got {type(produced).__name__}")
    missing = [n for n in wanted if n not in produced]
    if missing:
        raise StageError(f"the stage function returned no output {', '.join(repr(m) for m in missing)}")
    returned = []
    for name in wanted:
        value = produced[name]
        if index is not None and isinstance(value, ops.Array):
            ops._call(ops._ops.set_output, index, name, value)
        else:
            returned.append(_to_wit(name, value))
    return returned


def infer(model: str, inputs: Dict[str, Union[Tensor, "ops.Array"]], outputs: Sequence[str] = (),
          version: Optional[int] = None) -> Dict[str, Tensor]:
    """Runs another model of this server (Triton's BLS) and returns its outputs by name."""
    try:
        result = _host.infer(model, version, [_to_wit(n, v) for n, v in inputs.items()], list(outputs))
    except Err as e:
        error = e.value
    else:
        return {t.name: Tensor._from_wit(t) for t in result}
    raise StageError.from_wit(error)  # outside the except block: see ops._call


def respond(outputs: Dict[str, Union[Tensor, "ops.Array"]]) -> None:
    """Decoupled models: sends one response to the current request now."""
    ctx = _state["context"]
    try:
        _host.respond(ctx.index, _outputs(outputs, ctx.requested_outputs))
        return
    except Err as e:
        error = e.value
    raise StageError.from_wit(error)  # outside the except block: see ops._call


def _error(e: BaseException) -> _wit.Error:
    if isinstance(e, StageError):
        return e.to_wit()
    if isinstance(e, Err) and isinstance(e.value, _wit.Error):
        return e.value
    where = ""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        where = f" (at {code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name})"
    return _wit.Error(_wit.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}{where}")


def _run_one(fn: Callable, index: int, request: _wit.Request):
    _state["context"] = Context(index, request)
    try:
        inputs = {}
        for t in request.inputs:
            tensor = Tensor._from_wit(t)
            tensor._origin = (index, t.name)
            inputs[t.name] = tensor
        return Ok(_outputs(fn(**inputs), request.requested_outputs, index))
    except Exception as e:  # every failure becomes this request's error
        return Err(_error(e))


def _run_batch(fn: Callable, requests: List[_wit.Request]):
    _state["context"] = Context(0, requests[0])
    try:
        names = [t.name for t in requests[0].inputs]
        joined, counts = {}, []
        for name in names:
            tensors = []
            for r in requests:
                t = next((t for t in r.inputs if t.name == name), None)
                if t is None:
                    raise InvalidArgument(f"input '{name}' is missing from a request of the batch")
                tensors.append(Tensor._from_wit(t))
            joined[name], counts = join_rows(name, tensors)
        produced = fn(**joined)
        if not isinstance(produced, dict):
            raise TypeError(f"the stage function must return a dict of outputs, got {type(produced).__name__}")
        pieces = {}
        for name in requests[0].requested_outputs:
            if name not in produced:
                raise StageError(f"the stage function returned no output '{name}'")
            value = produced[name]
            tensor = value if isinstance(value, Tensor) else Tensor._from_wit(_to_wit(name, value))
            pieces[name] = split_rows(tensor, counts)
        return [Ok([pieces[n][i]._to_wit(n) for n in r.requested_outputs]) for i, r in enumerate(requests)]
    except Exception as e:
        return [Err(_error(e)) for _ in requests]


class Model(exports.Model):
    """The `model` export componentize-py looks for; it runs the registered functions."""

    def init(self, config_json: str, parameters) -> None:
        _state["config"] = Config(config_json, parameters)
        if _registered["infer"] is None:
            raise Err(_wit.Error(_wit.ErrorCode.INTERNAL, "no function is marked with @stage"))
        if _registered["setup"] is not None:
            try:
                _registered["setup"](_state["config"])
            except Exception as e:
                raise Err(_error(e))

    def execute(self, requests: List[_wit.Request]):
        fn = _registered["infer"]
        if getattr(fn, "_wasmtron_batch", False) and requests:
            results = _run_batch(fn, requests)
        else:
            results = [_run_one(fn, i, r) for i, r in enumerate(requests)]
        _state["context"] = None
        if any(isinstance(r, Err) for r in results):
            # A failure's traceback may keep host arrays alive in cycles; they count against
            # the memory limit, so free them before the next request.
            gc.collect()
        return results
