"""The reference image: diffusers' own StableDiffusionPipeline on the weights scripts/sd_export.py
saved, with the given initial latents and scheduler, in float32 on the CPU. Writes the image
as diffusers hands it to Pillow (uint8 H×W×3, `(x * 255).round()`), and the float image.

    .venv-diffusion/bin/python scripts/sd_reference.py .cache/diffusion/pipeline out.npz \
        --prompt "a cat" --latents latents.npy --steps 20 --guidance 7.5 [--negative "..."]
"""
import argparse

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline")
    parser.add_argument("out")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative", default=None)
    parser.add_argument("--latents", required=True, help=".npy of [1, 4, H/8, W/8] float32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--scheduler", default="euler", choices=["euler", "lms", "ddim"])
    parser.add_argument("--scheduler-config", default="{}",
                        help="JSON of the scheduler's settings beyond SD 1.x's betas "
                             "(timestep_spacing, steps_offset, clip_sample, set_alpha_to_one)")
    args = parser.parse_args()

    import json

    from diffusers import (DDIMScheduler, EulerDiscreteScheduler, LMSDiscreteScheduler,
                           StableDiffusionPipeline)

    torch.set_num_threads(1)  # deterministic reductions, and the machine's other core free
    pipe = StableDiffusionPipeline.from_pretrained(args.pipeline, safety_checker=None,
                                                   requires_safety_checker=False)
    kind = {"euler": EulerDiscreteScheduler, "lms": LMSDiscreteScheduler,
            "ddim": DDIMScheduler}[args.scheduler]
    # Stated in full (not inherited from the saved configuration): SD 1.x's betas, then the
    # settings given.
    pipe.scheduler = kind(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          num_train_timesteps=1000, **json.loads(args.scheduler_config))
    latents = torch.from_numpy(np.load(args.latents).astype(np.float32))
    height, width = latents.shape[2] * pipe.vae_scale_factor, latents.shape[3] * pipe.vae_scale_factor
    with torch.no_grad():
        image = pipe(args.prompt, negative_prompt=args.negative, height=height, width=width,
                     num_inference_steps=args.steps, guidance_scale=args.guidance,
                     latents=latents, output_type="np").images[0]
    np.savez(args.out, image=(image * 255).round().astype(np.uint8), float_image=image)


if __name__ == "__main__":
    main()
