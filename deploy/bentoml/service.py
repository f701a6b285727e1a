"""Wasmtron in a BentoML service, in-process: the replacement for `bentoml.triton.Runner`.

Where a Triton user wrote

    triton_runner = bentoml.triton.Runner("triton_runner", "./model_repository")
    ...
    result = await triton_runner.embed_text.async_run(texts)

the service owns a `wasmtron.Server` (the `wasmtron` Python package) and calls the model
directly, in the worker's process, with NumPy arrays: no Triton process, no runner hop.

    WASMTRON_MODEL_REPOSITORY=model_repository bentoml serve deploy/bentoml/service.py:Embeddings

`POST /embed {"texts": ["..."]}` answers a [len(texts), 384] array of sentence embeddings from the
`embed_text` ensemble (Wasm WordPiece tokenizer -> MiniLM encoder -> Wasm mean pooling), and
`POST /infer {"model": ..., "inputs": {name: nested list}}` runs any model the repository holds
(inputs converted with the model's declared datatypes). `/readyz` follows the server's
readiness; BentoML's shutdown drains it.
"""
from __future__ import annotations

import os
import typing as t

import bentoml
import numpy as np

import wasmtron

REPOSITORY = os.environ.get("WASMTRON_MODEL_REPOSITORY", "model_repository")
# "*" (every model of the repository), or names separated by commas.
MODELS = os.environ.get("WASMTRON_LOAD_MODELS", "embed_text")

# The NumPy dtype of each Triton datatype, for /infer's JSON inputs.
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
          "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
          "BYTES": np.object_}


@bentoml.service(traffic={"timeout": 60}, workers=1)
class Embeddings:
    def __init__(self) -> None:
        self.server = wasmtron.Server(model_repository=REPOSITORY, model_control_mode="explicit",
                                      startup_models=[m.strip() for m in MODELS.split(",")]
                                      ).start(wait_until_ready=True)

    @bentoml.api
    async def embed(self, texts: t.List[str]) -> np.ndarray:
        """Sentence embeddings, one row of 384 floats per text (L2-normalised)."""
        if not texts:
            return np.zeros((0, 384), np.float32)
        batch = np.array([[text.encode()] for text in texts], dtype=object)
        async for response in self.server.model("embed_text").async_infer(inputs={"TEXT": batch}):
            return np.from_dlpack(response.outputs["EMBEDDING"])

    @bentoml.api
    async def infer(self, model: str, inputs: t.Dict[str, t.Any],
                    outputs: t.Optional[t.List[str]] = None) -> t.Dict[str, t.Any]:
        """Any loaded model: inputs as nested lists, converted to the datatypes its
        configuration declares; outputs as nested lists (BYTES as str)."""
        config = self._inputs(model)
        arrays = {}
        for name, value in inputs.items():
            dtype = DTYPES.get(config.get(name, ""))
            if dtype is np.object_:
                value = np.array(value, dtype=object)
                arrays[name] = np.vectorize(lambda v: v.encode() if isinstance(v, str) else v,
                                            otypes=[object])(value)
            else:
                arrays[name] = np.asarray(value, dtype=dtype)
        result = {}
        try:
            async for response in self.server.model(model).async_infer(inputs=arrays,
                                                                       output_names=outputs):
                result.update({name: tensor.to_string_array().tolist()
                               if tensor.data_type == wasmtron.DataType.BYTES
                               else np.from_dlpack(tensor).tolist()
                               for name, tensor in response.outputs.items()})
        except wasmtron.InvalidArgumentError as e:
            raise bentoml.exceptions.InvalidArgument(str(e)) from e
        except wasmtron.NotFoundError as e:
            raise bentoml.exceptions.NotFound(str(e)) from e
        return result

    def _inputs(self, model: str) -> t.Dict[str, str]:
        """Input name -> Triton datatype ("INT32", "BYTES", ...) of a loaded model."""
        try:
            config = self.server.model(model).config()
        except wasmtron.WasmtronError as e:
            raise bentoml.exceptions.NotFound(str(e)) from e
        names = {"TYPE_STRING": "BYTES"}
        return {i["name"]: names.get(i["data_type"], i["data_type"].removeprefix("TYPE_"))
                for i in config["input"]}

    def __is_ready__(self) -> bool:
        return self.server.ready()

    @bentoml.on_shutdown
    def stop(self) -> None:
        self.server.stop()
