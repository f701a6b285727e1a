"""A PyTriton server as its quick start writes one: unnamed tensors, @batch, outputs returned
as a list, two instances, strict checks, `with Triton() as triton: bind; serve()`. Ports come
from PYTRITON_TRITON_CONFIG_* environment variables, as PyTriton reads them."""
import numpy as np

from pytriton.decorators import batch, first_value, group_by_values
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton


@batch
def linear(**inputs):
    (data,) = inputs.values()
    return [data * np.float32(-2.0) + np.float32(1.0)]


@batch
@first_value("scale")
def scaled(data, scale):
    return {"scaled": data * np.float32(scale)}


@batch
@group_by_values("mode")
def texts(text, mode):
    upper = mode[0][0] == b"upper"
    return {"out": np.array([[t.upper() if upper else t.lower() for t in row] for row in text], dtype=object)}


with Triton() as triton:
    triton.bind(
        model_name="Linear",
        infer_func=[linear, linear],
        inputs=[Tensor(dtype=np.float32, shape=(-1,))],
        outputs=[Tensor(dtype=np.float32, shape=(-1,))],
        config=ModelConfig(max_batch_size=8),
        strict=True,
    )
    triton.bind(
        model_name="Scaled",
        infer_func=scaled,
        inputs=[Tensor(name="data", dtype=np.float32, shape=(-1,)),
                Tensor(name="scale", dtype=np.float32, shape=(1,))],
        outputs=[Tensor(name="scaled", dtype=np.float32, shape=(-1,))],
        config=ModelConfig(max_batch_size=16, batcher=DynamicBatcher(max_queue_delay_microseconds=1000)),
    )
    triton.bind(
        model_name="Texts",
        infer_func=texts,
        inputs=[Tensor(name="text", dtype=np.bytes_, shape=(-1,)),
                Tensor(name="mode", dtype=np.bytes_, shape=(1,))],
        outputs=[Tensor(name="out", dtype=np.bytes_, shape=(-1,))],
        config=ModelConfig(max_batch_size=8),
    )
    triton.serve()
