"""Triton's Ray Serve text-to-image example (tutorials/Triton_Inference_Server_Python_API/
examples/rayserve/tritonserver_deployment.py) on the in-process wasmtron server: the
deployment code is the example's, with `import wasmtron as tritonserver` where it imports
`tritonserver`. The `stable_diffusion` model is the Wasm stage of model_repository/ (it calls
`text_encoder`, `unet` and `vae`) instead of a Python-backend model.

    serve run deploy.ray.text_to_image:deployment      # GET /generate?prompt=...

`GET /generate?prompt=...` answers the image as a JPEG (`seed`, `steps` optional;
`format=png` for the exact pixels). With
`filename=<name>` it also saves the JPEG, as the example does, but only under the directory
`WASMTRON_IMAGE_DIR` names and only by a plain file name (a request never picks a path).
The repository: `S3_BUCKET_URL` as in the example, else `WASMTRON_MODEL_REPOSITORY` (default
`model_repository`).
"""
import io
import os
import re
from pprint import pprint
from typing import Optional

import numpy
from fastapi import FastAPI, HTTPException, Response
from PIL import Image
from ray import serve

import wasmtron as tritonserver

app = FastAPI()

S3_BUCKET_URL = os.environ.get("S3_BUCKET_URL")
MODEL_REPOSITORY = os.environ.get("WASMTRON_MODEL_REPOSITORY", "model_repository")
IMAGE_DIR = os.environ.get("WASMTRON_IMAGE_DIR")
# A saved image's name: letters, digits, '-', '_' and '.', ending in .jpg/.jpeg, no path.
IMAGE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}\.jpe?g")


def _print_heading(message):
    print("")
    print(message)
    print("-" * len(message))


def image_path(filename: str) -> str:
    """Where `filename` may be saved: a plain name under WASMTRON_IMAGE_DIR, else a 400."""
    if IMAGE_DIR is None:
        raise HTTPException(400, "saving images is off (set WASMTRON_IMAGE_DIR on the server)")
    if not IMAGE_NAME.fullmatch(filename) or ".." in filename:
        raise HTTPException(400, f"filename '{filename}' must be a plain name ending in .jpg "
                                 "(letters, digits, '-', '_', '.')")
    return os.path.join(IMAGE_DIR, filename)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=1)
@serve.ingress(app)
class TritonDeployment:
    def __init__(self):
        self._triton_server = tritonserver

        if S3_BUCKET_URL is not None:
            model_repository = S3_BUCKET_URL
        else:
            model_repository = [MODEL_REPOSITORY]

        self._triton_server = tritonserver.Server(
            model_repository=model_repository,
            model_control_mode=tritonserver.ModelControlMode.EXPLICIT,
            log_info=False,
        )
        self._triton_server.start(wait_until_ready=True)

        _print_heading("Triton Server Started")
        _print_heading("Metadata")
        pprint(self._triton_server.metadata())
        self._stable_diffusion = None

        if not self._triton_server.model("stable_diffusion").ready():
            self._triton_server.load("text_encoder")
            self._triton_server.load("vae")
            self._stable_diffusion = self._triton_server.load("stable_diffusion")
            if not self._stable_diffusion.ready():
                raise Exception("Model not ready")
        else:
            self._stable_diffusion = self._triton_server.model("stable_diffusion")
        _print_heading("Models")
        pprint(self._triton_server.models())

    def check_health(self):
        if not self._triton_server.ready():
            raise RuntimeError("wasmtron is not ready")

    @app.get("/generate")
    def generate(self, prompt: str, filename: Optional[str] = None, seed: Optional[int] = None,
                 steps: Optional[int] = None, format: str = "jpeg") -> Response:
        if format not in ("jpeg", "png"):
            raise HTTPException(400, f"format '{format}' is not one of jpeg, png")
        inputs = {"prompt": [[prompt]]}
        if seed is not None:
            inputs["seed"] = numpy.array([[seed]], dtype=numpy.int64)
        if steps is not None:
            inputs["steps"] = numpy.array([[steps]], dtype=numpy.int32)
        try:
            responses = list(self._stable_diffusion.infer(inputs=inputs))
        except tritonserver.InvalidArgumentError as error:
            raise HTTPException(400, str(error)) from None
        for response in responses:
            generated_image = (
                numpy.from_dlpack(response.outputs["generated_image"])
                .squeeze()
                .astype(numpy.uint8)
            )

            image_ = Image.fromarray(generated_image)
            if filename:
                image_.save(image_path(filename))
            encoded = io.BytesIO()
            image_.save(encoded, format=format.upper(), **({"quality": 95} if format == "jpeg"
                                                          else {}))
            return Response(encoded.getvalue(), media_type=f"image/{format}")
        raise HTTPException(500, "the model answered no image")


def deployment(_args=None):
    return TritonDeployment.bind()
