"""Text to image: the `stable_diffusion` Wasm stage's loop against the same ONNX files driven by
a plain Python loop over ONNX Runtime in this process (the limit: no server, no stage), on the
same cores, alternating runs. Both tokenize with the same tokenizer.json, run classifier-free
guidance with one batch of two per UNet call, and step Euler as diffusers does; the images are
checked equal before timing.

    .venv/bin/python benches/diffusion_bench.py [REPOSITORY] [--steps 50] [--runs 5] [--side N]

REPOSITORY holds text_encoder, unet, vae and stable_diffusion (model_repository/ by default;
`scripts/sd_export.py --size bench` writes a larger one). Prints seconds per image and per
UNet step for both, their ratio, and the stage's own time per step: the stage's execution
minus its models' (from the server's statistics).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

import wasmtron as tritonserver

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
GUIDANCE = 7.5


class PythonLoop:
    """The same pipeline as a Python program would write it over ONNX Runtime."""

    def __init__(self, repo: str, threads: int):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # as the server gives a one-instance model
        options.inter_op_num_threads = 1

        def session(name):
            return ort.InferenceSession(os.path.join(repo, name, "1", "model.onnx"), options,
                                        providers=["CPUExecutionProvider"])

        self.text_encoder, self.unet, self.vae = (session(n) for n in ("text_encoder", "unet",
                                                                       "vae"))
        self.tokenizer = Tokenizer.from_file(os.path.join(repo, "stable_diffusion", "1",
                                                          "tokenizer.json"))
        pad = self.tokenizer.token_to_id("<|endoftext|>")
        self.tokenizer.enable_padding(pad_id=pad, pad_token="<|endoftext|>", length=77)
        self.tokenizer.enable_truncation(77)
        # EulerDiscreteScheduler's schedule (linspace spacing), as diffusers computes it.
        betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float32) ** 2
        alphas_cumprod = np.cumprod(1.0 - betas, dtype=np.float32)
        self.train_sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5

    def __call__(self, latents: np.ndarray, steps: int) -> np.ndarray:
        ids = np.array([e.ids for e in self.tokenizer.encode_batch(["", PROMPT])], np.int64)
        context = self.text_encoder.run(["last_hidden_state"], {"input_ids": ids})[0]
        timesteps = np.linspace(0, 999, steps, dtype=np.float32)[::-1].copy()
        sigmas = np.interp(timesteps, np.arange(1000), self.train_sigmas)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        x = latents * sigmas.max()
        for i, t in enumerate(timesteps):
            scaled = x / np.float32((sigmas[i] ** 2 + 1) ** 0.5)
            noise = self.unet.run(["out_sample"], {
                "sample": np.concatenate([scaled, scaled]),
                "timestep": np.array([t, t], np.float32),
                "encoder_hidden_states": context})[0]
            uncond, cond = noise[:1], noise[1:]
            noise = uncond + np.float32(GUIDANCE) * (cond - uncond)
            x = x + noise * (sigmas[i + 1] - sigmas[i])
        image = self.vae.run(["sample"], {"latent_sample": x / np.float32(0.18215)})[0]
        image = np.clip(image / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)
        return (image * 255).round().astype(np.uint8)


def compute_ns(server, name):
    stats = server.model(name).statistics()["model_stats"][0]["inference_stats"]
    return int(stats["compute_infer"]["ns"]) + int(stats["compute_input"]["ns"]) + \
        int(stats["compute_output"]["ns"]), int(stats["success"]["count"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repository", nargs="?", default=os.path.join(ROOT, "model_repository"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--side", type=int, default=0,
                        help="image side (default: the stage's image_height; 256 for the "
                             "bench-size export)")
    args = parser.parse_args()

    repo = tempfile.mkdtemp(prefix="diffusion-bench-")
    for name in ("text_encoder", "unet", "vae", "stable_diffusion"):
        shutil.copytree(os.path.join(args.repository, name), os.path.join(repo, name))
    # One instance of the stage (the Python loop is one caller too).
    config = os.path.join(repo, "stable_diffusion", "config.pbtxt")
    text = open(config).read().replace("count: 2, kind: KIND_CPU", "count: 1, kind: KIND_CPU")
    open(config, "w").write(text)

    cores = os.cpu_count() or 1
    python_loop = PythonLoop(repo, cores)
    server = tritonserver.Server(model_repository=repo).start(wait_until_ready=True)
    stage = server.model("stable_diffusion")
    params = stage.config()["parameters"]
    height = args.side or int(params["image_height"]["string_value"])
    latent_side = height // 8
    latents = np.random.default_rng(0).standard_normal((1, 4, latent_side, latent_side),
                                                       dtype=np.float32)
    inputs = {"prompt": [[PROMPT]], "latents": latents,
              "steps": np.array([[args.steps]], np.int32),
              "guidance_scale": np.array([[GUIDANCE]], np.float32),
              "height": np.array([[height]], np.int32), "width": np.array([[height]], np.int32)}

    def wasm():
        (response,) = stage.infer(inputs=inputs)
        return np.from_dlpack(response.outputs["generated_image"])

    ours, theirs = wasm(), python_loop(latents, args.steps)  # warm both, and compare
    differ = int(np.abs(ours.astype(int) - theirs.astype(int)).max())
    print(f"{height}×{height} image, {args.steps} Euler steps, guidance {GUIDANCE}, "
          f"{cores} cores; images differ by at most {differ} level(s)\n")

    before = {n: compute_ns(server, n) for n in ("stable_diffusion", "text_encoder", "unet",
                                                  "vae")}
    times = {"wasm": [], "python": []}
    for _ in range(args.runs):
        for name, run in (("wasm", wasm), ("python", lambda: python_loop(latents, args.steps))):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    after = {n: compute_ns(server, n) for n in before}
    server.stop()
    shutil.rmtree(repo, ignore_errors=True)

    wasm_s, python_s = statistics.median(times["wasm"]), statistics.median(times["python"])
    stage_ns = after["stable_diffusion"][0] - before["stable_diffusion"][0]
    models_ns = sum(after[n][0] - before[n][0] for n in ("text_encoder", "unet", "vae"))
    unet_calls = after["unet"][1] - before["unet"][1]
    own_per_step_ms = (stage_ns - models_ns) / max(unet_calls, 1) / 1e6
    print("| loop | s per image (median of %d) | ms per UNet step |" % args.runs)
    print("|---|---|---|")
    print(f"| Python over ONNX Runtime, in-process (the limit) | {python_s:.3f} | "
          f"{python_s / args.steps * 1e3:.2f} |")
    print(f"| wasmtron: the stable_diffusion Wasm stage | {wasm_s:.3f} | "
          f"{wasm_s / args.steps * 1e3:.2f} |")
    print(f"\nspeed, Wasm loop / Python loop: {python_s / wasm_s:.3f}")
    print(f"the stage's own time per step (its execution minus its models'): "
          f"{own_per_step_ms:.3f} ms; UNet per call: "
          f"{(after['unet'][0] - before['unet'][0]) / max(unet_calls, 1) / 1e6:.2f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
