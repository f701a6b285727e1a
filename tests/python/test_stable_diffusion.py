"""Text to image: the `stable_diffusion` Wasm stage (examples/rust/stable_diffusion) driving the
text_encoder, unet and vae ONNX models on the real binary, called with tritonclient as Triton's
example calls its Python-backend model (`prompt` as [[text]]). The reference is diffusers' own
StableDiffusionPipeline on the same random weights (scripts/sd_reference.py, run in the
diffusion environment) with the same initial latents and scheduler (Euler, DDIM, LMS): the
images must be equal to within one level of 255 per channel (in practice they are identical:
the stage computes the scheduler in f32 in diffusers' order, the models are the same graphs;
LMS's coefficients are integrated exactly here and numerically by diffusers, a difference far
below a level)."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, copy_models

PIPELINE = ["text_encoder", "unet", "vae", "stable_diffusion"]
DIFFUSION_PYTHON = os.environ.get("DIFFUSION_PYTHON",
                                  os.path.join(ROOT, ".venv-diffusion", "bin", "python"))
REFERENCE = os.path.join(ROOT, ".cache", "diffusion", "pipeline")


STREAM_OUTPUTS = """output [
  { name: "generated_image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ] },
  { name: "step", data_type: TYPE_INT32, dims: [ 1 ] }
]
input [ { name: "stream_every", data_type: TYPE_INT32, dims: [ 1 ], optional: true } ]"""
STREAM_POLICY = "model_transaction_policy { decoupled: true }\n"


def set_parameters(config_path, **values):
    """Rewrites `parameters` values of a config.pbtxt (string values)."""
    text = open(config_path, encoding="utf-8").read()
    for key, value in values.items():
        marker = f'{{ key: "{key}", value: {{ string_value: "'
        start = text.index(marker) + len(marker)
        end = text.index('"', start)
        text = text[:start] + value + text[end:]
    open(config_path, "w", encoding="utf-8").write(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("diffusion")
    copy_models(str(repo), PIPELINE)
    # The same stage with the DDIM and LMS samplers, as a deployment would configure it.
    for kind in ("ddim", "lms"):
        other = repo / f"stable_diffusion_{kind}"
        shutil.copytree(repo / "stable_diffusion", other)
        set_parameters(other / "config.pbtxt", scheduler=kind)
    # The decoupled configuration docs/examples.md's "Text to image" shows: previews while sampling.
    stream = repo / "stable_diffusion_stream"
    shutil.copytree(repo / "stable_diffusion", stream)
    text = (stream / "config.pbtxt").read_text()
    text = text.replace(
        'output [ { name: "generated_image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ] } ]',
        STREAM_OUTPUTS)
    (stream / "config.pbtxt").write_text(text + STREAM_POLICY)
    s = Server(str(repo))
    yield s
    s.stop()


def generate(url, model="stable_diffusion", **inputs):
    """One image from the stage over gRPC: inputs by name (the prompt as [[text]])."""
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, value in inputs.items():
        array = np.asarray(value)
        datatype = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
                    np.dtype(np.float32): "FP32"}.get(array.dtype, "BYTES")
        if datatype == "BYTES":
            array = np.array(value, dtype=object)
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    try:
        return client.infer(model, tensors).as_numpy("generated_image")
    finally:
        client.close()


def reference(tmp_path, latents, prompt, negative, steps, guidance, scheduler, settings):
    if not os.path.exists(DIFFUSION_PYTHON) or not os.path.isdir(REFERENCE):
        pytest.skip("the diffusion environment is not built (make diffusion-models)")
    np.save(tmp_path / "latents.npy", latents)
    out = tmp_path / "reference.npz"
    args = [DIFFUSION_PYTHON, os.path.join(ROOT, "scripts", "sd_reference.py"), REFERENCE,
            str(out), "--prompt", prompt, "--latents", str(tmp_path / "latents.npy"),
            "--steps", str(steps), "--guidance", str(guidance), "--scheduler", scheduler,
            "--scheduler-config", json.dumps(settings)]
    if negative is not None:
        args += ["--negative", negative]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out)["image"]


@pytest.mark.parametrize("model,scheduler,settings,steps,guidance,negative", [
    # The stage's defaults: SD 1.x's Euler configuration, 50 steps, guidance 7.5.
    ("stable_diffusion", "euler", {"timestep_spacing": "linspace"}, 50, 7.5, None),
    # DDIM as SD 1.x configures it, a negative prompt, another scale.
    ("stable_diffusion_ddim", "ddim",
     {"timestep_spacing": "leading", "steps_offset": 1, "clip_sample": False,
      "set_alpha_to_one": False}, 30, 5.0, "blurry, low quality"),
    # LMS (order 4), which Triton's Stable Diffusion example uses.
    ("stable_diffusion_lms", "lms", {"timestep_spacing": "linspace"}, 25, 7.5, None),
])
def test_the_image_equals_diffusers_on_the_same_weights(server, tmp_path, model, scheduler,
                                                        settings, steps, guidance, negative):
    latents = np.random.default_rng(17).standard_normal((1, 4, 8, 8)).astype(np.float32)
    prompt = "a lighthouse on a cliff at dusk, oil painting"
    inputs = {"prompt": [[prompt]], "latents": latents,
              "steps": np.array([[steps]], np.int32),
              "guidance_scale": np.array([[guidance]], np.float32)}
    if negative is not None:
        inputs["negative_prompt"] = [[negative]]
    image = generate(server.grpc, model, **inputs)
    assert image.dtype == np.uint8 and image.shape == (1, 64, 64, 3)
    expected = reference(tmp_path, latents, prompt, negative, steps, guidance, scheduler,
                         settings)
    difference = np.abs(image[0].astype(np.int16) - expected.astype(np.int16))
    print(f"{scheduler}: max difference {difference.max()}, "
          f"{(difference > 0).mean():.2%} of values differ")
    assert difference.max() <= 1, difference.max()
    assert image.std() > 5  # an image, not a flat field


def test_seeds_make_images_repeatable(server):
    prompt = [["a red fox in the snow"]]
    few = np.array([[8]], np.int32)
    first = generate(server.grpc, prompt=prompt, seed=np.array([[42]]), steps=few)
    again = generate(server.grpc, prompt=prompt, seed=np.array([[42]]), steps=few)
    other = generate(server.grpc, prompt=prompt, seed=np.array([[43]]), steps=few)
    np.testing.assert_array_equal(first, again)
    assert np.abs(first.astype(int) - other.astype(int)).mean() > 1
    # Without a seed every request draws new noise.
    a = generate(server.grpc, prompt=prompt, steps=few)
    b = generate(server.grpc, prompt=prompt, steps=few)
    assert (a != b).any()
    # A prompt changes the image; the size follows height and width (multiples of 8).
    fox = generate(server.grpc, prompt=[["a blue whale"]], seed=np.array([[42]]), steps=few)
    assert (fox != first).any()
    wide = generate(server.grpc, prompt=prompt, seed=np.array([[1]]), steps=few,
                    height=np.array([[32]], np.int32), width=np.array([[96]], np.int32))
    assert wide.shape == (1, 32, 96, 3)


@pytest.mark.parametrize("inputs,says", [
    ({"steps": np.array([[0]], np.int32)}, "input 'steps' is 0"),
    ({"steps": np.array([[100000]], np.int32)}, "input 'steps' is 100000"),
    ({"guidance_scale": np.array([[-1.0]], np.float32)}, "input 'guidance_scale' is -1"),
    ({"height": np.array([[65]], np.int32)}, "input 'height' is 65"),
    ({"width": np.array([[4096]], np.int32)}, "input 'width' is 4096"),
    ({"latents": np.zeros((1, 4, 4, 4), np.float32)}, "input 'latents' must hold 4×8×8"),
    ({"latents": np.full((1, 4, 8, 8), np.nan, np.float32)}, "input 'latents' must hold"),
])
def test_bad_values_are_refused_naming_the_input(server, inputs, says):
    client = httpclient.InferenceServerClient(server.http)
    tensors = []
    for name, value in {"prompt": np.array([[b"a cat"]], dtype=object), **inputs}.items():
        datatype = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}.get(
            value.dtype, "BYTES")
        t = httpclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("stable_diffusion", tensors)
    assert refused.value.status() == "400", refused.value
    assert says in str(refused.value), refused.value
    # The server keeps serving.
    assert client.is_model_ready("stable_diffusion")
    client.close()


def test_a_missing_prompt_is_named(server):
    client = httpclient.InferenceServerClient(server.http)
    steps = httpclient.InferInput("steps", [1, 1], "INT32")
    steps.set_data_from_numpy(np.array([[4]], np.int32))
    with pytest.raises(InferenceServerException, match="prompt") as refused:
        client.infer("stable_diffusion", [steps])
    assert refused.value.status() == "400"
    client.close()


def test_a_decoupled_configuration_streams_previews_then_the_image(server):
    """Previews every `stream_every` steps (the image of the clean latents predicted at that
    step, with `step`), then the final image, equal to the one-response model's."""
    import queue

    steps, every = 10, 3
    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensors = []
    for name, value, datatype in [
            ("prompt", np.array([["a red fox in the snow"]], dtype=object), "BYTES"),
            ("seed", np.array([[42]], np.int64), "INT64"),
            ("steps", np.array([[steps]], np.int32), "INT32"),
            ("stream_every", np.array([[every]], np.int32), "INT32")]:
        t = grpcclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    client.async_stream_infer("stable_diffusion_stream", tensors,
                              enable_empty_final_response=True)
    images, steps_seen = [], []
    while True:
        result, error = answers.get(timeout=300)
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        images.append(result.as_numpy("generated_image"))
        steps_seen.append(int(result.as_numpy("step")[0, 0]))
    client.stop_stream()
    client.close()
    assert steps_seen == [3, 6, 9, 10], steps_seen
    final = generate(server.grpc, prompt=[["a red fox in the snow"]], seed=np.array([[42]]),
                     steps=np.array([[steps]], np.int32))
    np.testing.assert_array_equal(images[-1], final)
    assert all(image.shape == (1, 64, 64, 3) for image in images)
    # The model that answers once does not take the input (its configuration declares none).
    with pytest.raises(InferenceServerException, match="unexpected inference input 'stream_every'"):
        generate(server.grpc, prompt=[["x"]], stream_every=np.array([[2]], np.int32))
