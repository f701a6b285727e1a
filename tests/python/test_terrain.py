"""Terrain from a real diffusion model: the `terrain` Wasm stage (examples/rust/terrain) runs
the consistency sampler around adaptive-terrain-diffusion's UNet (`terrain_unet`, the ONNX file
the PyPI package ships). One step must give the package's own heightmap from the same noise
(`TerrainGenerator.generate`, run in the diffusion environment); several steps must follow the
multistep consistency sampler computed here with ONNX Runtime on the same noises."""
import os
import subprocess

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, copy_models

DIFFUSION_PYTHON = os.environ.get("DIFFUSION_PYTHON",
                                  os.path.join(ROOT, ".venv-diffusion", "bin", "python"))
UNET = os.path.join(ROOT, "model_repository", "terrain_unet", "1", "model.onnx")
SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0
HEIGHT_RANGE, ASINH = 22.16864013671875, 0.1

# The package's generator for one terrain, and the noise it drew: its generator draws
# standard normals from numpy's default_rng(seed) (a fixed difficulty draws no label).
PACKAGE = """
import sys
import numpy as np
from terrain_diffusion import TerrainGenerator
difficulty, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
heights = TerrainGenerator(device="cpu").generate(1, shape=128, difficulty=difficulty, seed=seed)
noise = np.random.default_rng(seed).standard_normal((1, 1, 128, 128), dtype=np.float32)
np.savez(out, heights=heights[0], noise=noise[0])
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("terrain")
    copy_models(str(repo), ["terrain_unet", "terrain"])
    s = Server(str(repo))
    yield s
    s.stop()


def terrain(url, **inputs):
    client = httpclient.InferenceServerClient(url, network_timeout=300)
    tensors = []
    for name, value in inputs.items():
        value = np.asarray(value)
        datatype = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
                    np.dtype(np.float32): "FP32"}[value.dtype]
        t = httpclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    try:
        out = client.infer("terrain", tensors)
        return out.as_numpy("heightmap"), out.as_numpy("image")
    finally:
        client.close()


def heights_of(values):
    """The package's model space to metres (zero floor), in NumPy."""
    unit = np.clip((values + 1.0) * 0.5, 0.0, 1.0)
    normalizer = np.arcsinh(HEIGHT_RANGE / ASINH)
    heights = np.clip(ASINH * np.sinh(unit * normalizer), 0.0, HEIGHT_RANGE).astype(np.float32)
    return heights - heights.min()


@pytest.mark.parametrize("difficulty,seed", [(1, 3), (40, 5), (100, 11)])
def test_one_step_gives_the_packages_heightmap_from_the_same_noise(server, tmp_path,
                                                                    difficulty, seed):
    if not os.path.exists(DIFFUSION_PYTHON):
        pytest.skip("the diffusion environment is not built (make diffusion-models)")
    out = tmp_path / "package.npz"
    done = subprocess.run([DIFFUSION_PYTHON, "-c", PACKAGE, str(difficulty), str(seed), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = np.load(out)
    heights, image = terrain(server.http, difficulty=np.array([difficulty], np.int32),
                             noise=reference["noise"])
    assert heights.shape == (128, 128) and image.shape == (128, 128)
    difference = np.abs(heights - reference["heights"])
    print(f"difficulty {difficulty}: max |Δh| {difference.max():.2e} m of "
          f"{reference['heights'].max():.2f} m")
    assert difference.max() < 1e-4 * max(1.0, float(reference["heights"].max()))
    assert heights.min() == 0.0 and heights.max() > 0.0
    np.testing.assert_array_equal(
        image, np.round(np.clip(heights / HEIGHT_RANGE, 0, 1) * 255).astype(np.uint8))


def test_several_steps_follow_the_multistep_consistency_sampler(server):
    import onnxruntime as ort

    steps, difficulty = 3, 70
    noise = np.random.default_rng(2).standard_normal((steps, 128, 128), dtype=np.float32)
    heights, _ = terrain(server.http, difficulty=np.array([difficulty], np.int32),
                         steps=np.array([steps], np.int32), noise=noise)
    # The sampler, here: Karras-spaced levels from sigma_max; re-noise, denoise.
    session = ort.InferenceSession(UNET, providers=["CPUExecutionProvider"])
    hi, lo = SIGMA_MAX ** (1 / RHO), SIGMA_MIN ** (1 / RHO)
    sigmas = [np.float32((hi + i / steps * (lo - hi)) ** RHO) for i in range(steps)]
    label = np.array([(difficulty - 1) / 99], np.float32)
    x = None
    for i, sigma in enumerate(sigmas):
        z = noise[i][None, None]
        noisy = z * sigma if i == 0 else x + np.float32(np.sqrt(sigma ** 2 - SIGMA_MIN ** 2)) * z
        x = session.run(["denoised"], {"noisy": noisy.astype(np.float32),
                                       "sigma": np.array([sigma], np.float32),
                                       "difficulty": label})[0]
    expected = heights_of(x[0, 0])
    assert np.abs(heights - expected).max() < 1e-3 * max(1.0, float(expected.max()))
    # The steps matter: one step from the first noise plane gives another terrain.
    one, _ = terrain(server.http, difficulty=np.array([difficulty], np.int32), noise=noise[:1])
    assert np.abs(one - heights).mean() > 1e-4
    # A seed makes it repeatable.
    a, _ = terrain(server.http, difficulty=np.array([5], np.int32), seed=np.array([9]),
                   steps=np.array([2], np.int32))
    b, _ = terrain(server.http, difficulty=np.array([5], np.int32), seed=np.array([9]),
                   steps=np.array([2], np.int32))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("inputs,says", [
    ({"difficulty": np.array([0], np.int32)}, "input 'difficulty' is 0"),
    ({"difficulty": np.array([101], np.int32)}, "input 'difficulty' is 101"),
    ({"difficulty": np.array([5], np.int32), "steps": np.array([9], np.int32)},
     "input 'steps' is 9"),
    ({"difficulty": np.array([5], np.int32), "noise": np.zeros((2, 128, 128), np.float32)},
     "input 'noise' must hold 1×128×128"),
])
def test_bad_values_are_refused_naming_the_input(server, inputs, says):
    with pytest.raises(InferenceServerException) as refused:
        terrain(server.http, **inputs)
    assert refused.value.status() == "400" and says in str(refused.value), refused.value
