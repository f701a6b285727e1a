"""Writes a Triton model repository of PyTorch and TensorFlow models, as their users save them,
and each model's answer on a fixed input as `<references>/<model>.npz`. Run by
test_framework_conversion.py with the converter environment's Python:
python framework_models.py <repository> <references>.
"""

import os
import sys
import zipfile
from typing import List

import numpy as np

REPO, REFERENCES = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(7)


def model_dir(name, config):
    os.makedirs(os.path.join(REPO, name, "1"), exist_ok=True)
    with open(os.path.join(REPO, name, "config.pbtxt"), "w") as f:
        f.write(config)
    return os.path.join(REPO, name, "1")


def reference(name, inputs, outputs):
    os.makedirs(REFERENCES, exist_ok=True)
    np.savez(os.path.join(REFERENCES, name + ".npz"),
             **{"in:" + k: v for k, v in inputs.items()},
             **{"out:" + k: v for k, v in outputs.items()})


def torch_models():
    import torch
    import torchvision

    torch.manual_seed(0)

    # An image classifier as Triton's PyTorch examples serve it: traced, INPUT__0/OUTPUT__0.
    resnet = torchvision.models.resnet18(weights=None).eval()
    image = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    traced = torch.jit.trace(resnet, torch.from_numpy(image[:1]))
    d = model_dir("resnet18_ts", """platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1000 ] } ]
""")
    traced.save(os.path.join(d, "model.pt"))
    with torch.no_grad():
        logits = resnet(torch.from_numpy(image)).numpy()
    reference("resnet18_ts", {"INPUT__0": image}, {"OUTPUT__0": logits})

    # Two inputs addressed by forward()'s argument names, two outputs by <name>__<index>
    # listed out of order, a variable dimension; scripted, and named `backend: "pytorch"`.
    class Mix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 4)

        def forward(self, features, scale):
            projected = self.proj(features) * scale.to(torch.float32)
            return projected, projected.sum(dim=1)

    mix = Mix().eval()
    d = model_dir("mix_ts", """backend: "pytorch"
max_batch_size: 8
input [
  { name: "scale" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "features" data_type: TYPE_FP32 dims: [ 6 ] }
]
output [
  { name: "total__1" data_type: TYPE_FP32 dims: [ ] },
  { name: "projected__0" data_type: TYPE_FP32 dims: [ 4 ] }
]
parameters: { key: "INFERENCE_MODE" value: { string_value: "true" } }
""")
    torch.jit.script(mix).save(os.path.join(d, "model.pt"))
    features = rng.standard_normal((3, 6)).astype(np.float32)
    scale = np.array([[2], [3], [-1]], dtype=np.int64)
    with torch.no_grad():
        p, t = mix(torch.from_numpy(features), torch.from_numpy(scale))
    reference("mix_ts", {"features": features, "scale": scale},
              {"projected__0": p.numpy(), "total__1": t.numpy()})

    # One Dict(str, Tensor) argument keyed by the config's input names, as Triton's PyTorch
    # backend passes such a model its inputs.
    from typing import Dict

    class Keyed(torch.nn.Module):
        def forward(self, inputs: Dict[str, torch.Tensor]):
            return inputs["left"] * 2 - inputs["right"]

    d = model_dir("dict_ts", """platform: "pytorch_libtorch"
max_batch_size: 4
input [
  { name: "right" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "left" data_type: TYPE_FP32 dims: [ 3 ] }
]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
""")
    torch.jit.script(Keyed()).save(os.path.join(d, "model.pt"))
    left = rng.standard_normal((2, 3)).astype(np.float32)
    right = rng.standard_normal((2, 3)).astype(np.float32)
    reference("dict_ts", {"left": left, "right": right}, {"OUTPUT__0": left * 2 - right})

    # An ExportedProgram (torch.export) addressed by torch_aoti's call names.
    class Heads(torch.nn.Module):
        def forward(self, x, *, bias):
            return {"sum": x + bias, "scaled": torch.tanh(x) * 3}

    x = rng.standard_normal((2, 5)).astype(np.float32)
    bias = rng.standard_normal((2, 5)).astype(np.float32)
    program = torch.export.export(Heads(), (torch.from_numpy(x),),
                                  {"bias": torch.from_numpy(bias)})
    d = model_dir("heads_ep", """platform: "torch_aoti"
max_batch_size: 0
input [
  { name: "ARGS[0]" data_type: TYPE_FP32 dims: [ 2, 5 ] },
  { name: "KWARGS[bias]" data_type: TYPE_FP32 dims: [ 2, 5 ] }
]
output [
  { name: "RESULT[scaled]" data_type: TYPE_FP32 dims: [ 2, 5 ] },
  { name: "RESULT[sum]" data_type: TYPE_FP32 dims: [ 2, 5 ] }
]
""")
    torch.export.save(program, os.path.join(d, "model.pt2"))
    out = Heads()(torch.from_numpy(x), bias=torch.from_numpy(bias))
    reference("heads_ep", {"ARGS[0]": x, "KWARGS[bias]": bias},
              {"RESULT[sum]": out["sum"].numpy(), "RESULT[scaled]": out["scaled"].numpy()})

    # What cannot be converted: a file that is not TorchScript, an AOTInductor-compiled
    # package (native code, no graph), and an operation ONNX has no operator for.
    d = model_dir("corrupt_ts", """platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""")
    with open(os.path.join(d, "model.pt"), "wb") as f:
        f.write(b"PK\x03\x04 this is not a TorchScript archive")
    d = model_dir("compiled_aoti", """platform: "torch_aoti"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""")
    with zipfile.ZipFile(os.path.join(d, "model.pt2"), "w") as z:
        z.writestr("model/data/aotinductor/model/model.so", b"\x7fELF")
        z.writestr("model/archive_format", "pt2")

    class Singular(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svdvals(x)

    d = model_dir("svd_ts", """platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4, 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""")
    torch.jit.script(Singular()).save(os.path.join(d, "model.pt"))

    # Strings: a scripted model taking List[str], as Triton's L0_infer libtorch_*_object_*
    # models do (ONNX has no equivalent of parsing them in the graph).
    class Parse(torch.nn.Module):
        def forward(self, INPUT0: List[str]):
            return torch.tensor([int(s) for s in INPUT0])

    d = model_dir("strings_ts", """platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 4 ] } ]
""")
    torch.jit.script(Parse()).save(os.path.join(d, "model.pt"))


def tensorflow_models():
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    # A Keras model exported as a SavedModel; the config names only the platform and the
    # batch size, as Triton's TensorFlow backend fills the rest from the signature.
    inp = tf.keras.Input(shape=(6,), name="features")
    hidden = tf.keras.layers.Dense(16, activation="relu")(inp)
    out = tf.keras.layers.Dense(3, activation="softmax")(hidden)
    model = tf.keras.Model(inp, out)
    d = model_dir("keras_tf", """platform: "tensorflow_savedmodel"
max_batch_size: 8
parameters: { key: "TF_SIGNATURE_DEF" value: { string_value: "serving_default" } }
""")
    model.export(os.path.join(d, "model.savedmodel"), verbose=False)
    features = rng.standard_normal((3, 6)).astype(np.float32)
    reference("keras_tf", {"features": features}, {"output_0": model(features).numpy()})


if __name__ == "__main__":
    torch_models()
    tensorflow_models()
