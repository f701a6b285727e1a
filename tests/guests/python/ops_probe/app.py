"""Test stage: runs a chain of host tensor operations named by the request, so that tests can
compare each operation with Pillow/NumPy and feed it hostile arguments.

DATA (BYTES [n]): the operands, raw. Request parameters: `inputs`, a JSON list with one entry
per element of DATA, {"dtype": "FP32", "shape": [2, 3]} for an array or null for raw bytes;
`steps`, a JSON list of [operation, {keyword arguments}] applied in turn (the first gets every
operand, later ones the previous result); `hold` (int) keeps the result of every step alive
until the request ends. OUT (BYTES [k]) holds each result's raw bytes, META (BYTES [1]) their
datatypes and shapes as JSON.
"""
import json

from wasmtron_stage import InvalidArgument, Tensor, context, ops, stage


def operand(spec, raw):
    if spec is None:
        return raw
    return ops.from_values(spec["dtype"], spec["shape"], raw)


@stage
def infer(DATA: Tensor):
    params = context().parameters
    specs = json.loads(params.get("inputs", "[]"))
    raws = DATA.strings()
    if len(specs) != len(raws):
        raise InvalidArgument(f"{len(raws)} operands but {len(specs)} input specs")
    values = [operand(s, r) for s, r in zip(specs, raws)]
    held = []
    for name, kwargs in json.loads(params.get("steps", "[]")):
        if name == "repeat_forever":
            while True:
                held.append(ops.softmax(values[0]))
                held.pop()
        if name == "stack":
            result = ops.stack(values, **kwargs)
        else:
            result = getattr(ops, name)(*values, **kwargs)
        values = list(result) if isinstance(result, tuple) else [result]
        if params.get("hold"):
            held.extend(values)
    tensors = [Tensor.from_array("v", v) for v in values]
    meta = [{"dtype": t.dtype, "shape": list(t.shape)} for t in tensors]
    return {
        "OUT": Tensor.from_strings("OUT", [len(tensors)], [t.data for t in tensors]),
        "META": Tensor.from_strings("META", [1], [json.dumps(meta)]),
    }
