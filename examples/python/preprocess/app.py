"""The Python twin of examples/rust/preprocess, on the host's tensor operations: PNG/JPEG bytes
(`IMAGE`, BYTES [batch, 1]) -> normalised CHW pixels (`PIXELS`, FP32 [batch, 3, size, size]).
Parameters in config.pbtxt: `size` (default 224), `mean` and `std` (three comma-separated
values, default ImageNet's).

Build: wasmtron stage build examples/python/preprocess (or `make stages`).
"""
from wasmtron_stage import InvalidArgument, StageError, Tensor, ops, setup, stage

settings = {"size": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def triple(config, key):
    text = config.parameter(key)
    if text is None:
        return settings[key]
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3:
        raise InvalidArgument(f"parameter '{key}' needs three numbers, got {text!r}")
    return values


@setup
def configure(config):
    settings["size"] = config.parameter("size", 224, int)
    if settings["size"] < 1:
        raise InvalidArgument("parameter 'size' must be at least 1")
    settings["mean"] = triple(config, "mean")
    settings["std"] = triple(config, "std")


@stage
def infer(IMAGE: Tensor):
    side = settings["size"]
    planes = []
    for n in range(IMAGE.count()):
        try:
            image = ops.resize(ops.decode_image(IMAGE, element=n), side, side)
        except StageError as e:
            raise InvalidArgument(f"IMAGE[{n}]: {e.message}") from None
        pixels = ops.normalize(image, settings["mean"], settings["std"], scale=1 / 255)
        planes.append(ops.transpose(pixels, (2, 0, 1)))
    return {"PIXELS": ops.stack(planes)}
