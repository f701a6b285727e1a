"""Wasmtron inside Ray Serve replicas, in-process: each replica owns a `wasmtron.Server` (the
`wasmtron` Python package) and calls its models directly with NumPy arrays, as Triton's Ray
Serve example holds a `tritonserver.Server`. No subprocess, no HTTP between the replica and
the models; requests from the replica's callers batch together in wasmtron's schedulers.

    from ray import serve
    from wasmtron_inprocess import WasmtronModels, TextApp

    # Any model of the repository, from other deployments or a handle:
    models = serve.run(WasmtronModels.bind("/models"), name="models")
    out = models.infer.remote("simple", {"INPUT0": a, "INPUT1": b}).result()

    # Business logic that calls several models through the server, behind Serve's HTTP proxy:
    serve.run(TextApp.bind("/models"), name="text", route_prefix="/")
    # POST /embed {"texts": [...]}  ->  {"embeddings": [[...384 floats...], ...]}
    # GET  /identity?string=hello   ->  "hello"

Both check health with the server's readiness and stop it (draining) when Serve stops the
replica. Install: `pip install -r deploy/ray/requirements.txt` and the wheel `make
python-package` builds.
"""
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel
from ray import serve

import wasmtron


def _server(model_repository, **options) -> "wasmtron.Server":
    """A started server; a replica whose models did not load fails its start (and Serve says
    why) rather than answering errors."""
    return wasmtron.Server(model_repository=model_repository, **options).start(
        wait_until_ready=True)


async def _outputs(responses) -> Dict[str, "wasmtron.Tensor"]:
    """The outputs of a request's responses (the last one's, for a name sent twice)."""
    out = {}
    async for response in responses:
        out.update(response.outputs)
    return out


def _array(tensor: "wasmtron.Tensor") -> np.ndarray:
    """A tensor as NumPy has it (BYTES: an object array of bytes)."""
    if tensor.data_type == wasmtron.DataType.BYTES:
        return tensor.to_bytes_array()
    return np.from_dlpack(tensor)


class _OwnsServer:
    """Health and shutdown of a replica that owns `self.server`: unhealthy while the server
    is not ready; stopping the replica drains the server."""

    def check_health(self):
        if not self.server.ready():
            raise RuntimeError("wasmtron is not ready: " + repr(self.server.models()))

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


@serve.deployment(ray_actor_options={"num_cpus": 1}, health_check_period_s=5)
class WasmtronModels(_OwnsServer):
    """The repository's models, in-process in each replica; call `infer` from a handle.

    `options` go to `wasmtron.Server` (`model_control_mode`, `startup_models`, ...)."""

    def __init__(self, model_repository: str, **options):
        self.server = _server(model_repository, **options)

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray],
                    parameters: Optional[Mapping[str, object]] = None,
                    output_names: Optional[Sequence[str]] = None,
                    version: int = -1) -> Dict[str, np.ndarray]:
        """One request to `model`: `{input: ndarray}` in, `{output: ndarray}` out. Errors
        are wasmtron's exceptions, raised at the caller by Serve."""
        responses = self.server.model(model, version).async_infer(
            inputs=dict(inputs), parameters=dict(parameters or {}), output_names=output_names)
        return {name: _array(t) for name, t in (await _outputs(responses)).items()}

    def ready(self, model: str) -> bool:
        return self.server.model(model).ready()


class EmbedRequest(BaseModel):
    texts: List[str]


api = FastAPI(title="wasmtron in Ray Serve")


@serve.deployment(ray_actor_options={"num_cpus": 1}, health_check_period_s=5)
@serve.ingress(api)
class TextApp(_OwnsServer):
    """The shape of Triton's Ray Serve example: an HTTP ingress whose handlers run business
    logic in Python and call several models through the in-process server. `/embed` runs
    the WordPiece tokenizer (a Wasm stage), the MiniLM encoder (ONNX) and mean pooling (a
    Wasm stage) one after another, as the `embed_text` ensemble does in one call."""

    MODELS = ["bert_tokenizer", "minilm", "mean_pool", "identity_bytes"]

    def __init__(self, model_repository: str):
        self.server = _server(model_repository, model_control_mode="explicit",
                              startup_models=self.MODELS)

    @api.get("/identity")
    async def identity(self, string: str) -> str:
        async for response in self.server.model("identity_bytes").async_infer(
                inputs={"INPUT0": [[string]]}):
            return response.outputs["OUTPUT0"].to_string_array()[0][0]

    @api.post("/embed")
    async def embed(self, body: EmbedRequest) -> Dict[str, List[List[float]]]:
        if not body.texts:
            return {"embeddings": []}
        texts = [[t] for t in body.texts]
        # One model's output tensors are the next one's inputs, with no copy between.
        tokens = await _outputs(self.server.model("bert_tokenizer").async_infer(
            inputs={"TEXT": texts}))
        hidden = await _outputs(self.server.model("minilm").async_infer(
            inputs=tokens, output_names=["last_hidden_state"]))
        pooled = await _outputs(self.server.model("mean_pool").async_infer(
            inputs={"last_hidden_state": hidden["last_hidden_state"],
                    "attention_mask": tokens["attention_mask"]}))
        return {"embeddings": np.from_dlpack(pooled["EMBEDDING"]).tolist()}


__all__ = ["WasmtronModels", "TextApp"]
