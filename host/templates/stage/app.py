"""{name}: OUTPUT0 = softmax(INPUT0 / temperature) over the last axis.

Built by `wasmtron stage build` with componentize-py; the SDK (wasmtron_stage) is bundled.
The guide: docs/stages.md, "Writing a stage in Python".
"""
from wasmtron_stage import InvalidArgument, Tensor, ops, setup, stage

settings = {"temperature": 1.0}


@setup
def configure(config):
    settings["temperature"] = config.parameter("temperature", 1.0, float)
    if settings["temperature"] <= 0:
        raise InvalidArgument("parameter 'temperature' must be greater than 0")


@stage
def infer(INPUT0: Tensor):
    scaled = ops.normalize(INPUT0, [0.0], [settings["temperature"]])
    return {"OUTPUT0": ops.softmax(scaled, axis=-1)}
