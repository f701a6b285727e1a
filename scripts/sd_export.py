"""A small Stable Diffusion with random weights (no weights can be fetched here), in the shape of
SD 1.x: a CLIP text model over CLIP's real BPE vocabulary (open-clip-torch ships it, MIT), a
UNet2DConditionModel with cross-attention, an AutoencoderKL whose decoder upsamples 8×. Fixed
seed, CPU torch. Writes:

- model_repository/text_encoder/1/model.onnx  (input_ids INT64 [B, 77] -> last_hidden_state)
- model_repository/unet/1/model.onnx          (sample, timestep, encoder_hidden_states -> out_sample)
- model_repository/vae/1/model.onnx           (latent_sample -> sample; the decoder only)
- model_repository/stable_diffusion/1/tokenizer.json  (CLIP's tokenizer in Hugging Face's
  format, built from the BPE vocabulary)
- <cache>/pipeline: the same weights as diffusers saves them, for scripts/sd_reference.py

Run with the diffusion environment (`make diffusion-models`):
    .venv-diffusion/bin/python scripts/sd_export.py model_repository .cache/diffusion
`--size bench` builds a larger one (wider UNet and VAE, 256×256 images) for
benches/diffusion_bench.py, where the models' cost should dwarf the loop's.
"""
import gzip
import importlib.util
import json
import os
import sys

import torch

SEED = 1234
MAX_LENGTH = 77      # CLIP's context, as SD pads prompts
# Per size: the text model's width (SD 1.x: 768), the UNet's and the VAE's channels, the
# UNet's levels, and the image side the exports are traced at.
SIZES = {
    "test": dict(hidden=64, unet=(32, 64), vae=(32, 32, 32, 32), groups=16, side=64),
    "bench": dict(hidden=256, unet=(128, 256, 256), vae=(64, 128, 128, 128), groups=32,
                  side=256),
}


def vocabulary_file() -> str:
    """open_clip's bpe_simple_vocab_16e6.txt.gz, found without importing open_clip (which
    would need torchvision)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("open-clip-torch is not installed (make diffusion-models installs it)")
    path = os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing from open-clip-torch")
    return path


def clip_tokenizer(vocab_gz: str, scratch: str):
    """CLIP's tokenizer over the real vocabulary, as OpenAI's simple_tokenizer builds it: the
    256 byte symbols, the same with '</w>', the first 48,894 merges, then the two specials."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    lines = gzip.open(vocab_gz, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(line.split()) for line in lines[1:49152 - 256 - 2 + 1]]
    byte_symbols = list(bytes_to_unicode().values())
    vocab = byte_symbols + [s + "</w>" for s in byte_symbols]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(scratch, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    slow = CLIPTokenizer(os.path.join(scratch, "vocab.json"), os.path.join(scratch, "merges.txt"),
                         model_max_length=MAX_LENGTH, pad_token="<|endoftext|>")
    fast = CLIPTokenizerFast.from_pretrained(scratch, model_max_length=MAX_LENGTH,
                                             pad_token="<|endoftext|>", from_slow=True)
    return slow, fast


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table, which CLIP's BPE uses."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, [chr(c) for c in chars]))


def build(tokenizer, size):
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(SEED)
    hidden, levels = size["hidden"], len(size["unet"])
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=MAX_LENGTH,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        hidden_act="quick_gelu", projection_dim=hidden)).eval()
    unet = UNet2DConditionModel(
        sample_size=size["side"] // 8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=size["unet"],
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (levels - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (levels - 1) + ("UpBlock2D",),
        cross_attention_dim=hidden, attention_head_dim=8,
        norm_num_groups=size["groups"]).eval()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
        block_out_channels=size["vae"], norm_num_groups=size["groups"],
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, sample_size=size["side"]).eval()
    # Random weights give latents of unit scale; SD's scaling factor stays as in SD 1.x.
    vae.register_to_config(scaling_factor=0.18215)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", num_train_timesteps=1000)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   unet=unet, scheduler=scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)


class TextEncoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, return_dict=False)[0]


class Unet(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.model(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class VaeDecoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, latent_sample):
        return self.model.decode(latent_sample, return_dict=False)[0]


def export(module, args, path, inputs, outputs, dynamic):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.onnx.export(module, args, path, input_names=inputs, output_names=outputs,
                      dynamic_axes=dynamic, opset_version=17, dynamo=False)
    print("wrote", path, os.path.getsize(path) // 1024, "KiB")


def main(repository: str, cache: str, size_name: str = "test") -> None:
    size = SIZES[size_name]
    hidden, latent = size["hidden"], size["side"] // 8
    vocab_gz = vocabulary_file()
    slow, fast = clip_tokenizer(vocab_gz, os.path.join(cache, "tokenizer-src"))
    pipe = build(fast, size)
    probe = ["a photograph of an astronaut riding a horse", "", "Hello,   WORLD! it's 4:30"]
    assert slow(probe).input_ids == fast(probe).input_ids, "the fast tokenizer differs"

    stage_dir = os.path.join(repository, "stable_diffusion", "1")
    os.makedirs(stage_dir, exist_ok=True)
    fast.backend_tokenizer.save(os.path.join(stage_dir, "tokenizer.json"))

    with torch.no_grad():
        ids = torch.tensor(fast(["a cat"] * 2, padding="max_length", max_length=MAX_LENGTH)
                           .input_ids, dtype=torch.int64)
        export(TextEncoder(pipe.text_encoder), (ids,),
               os.path.join(repository, "text_encoder", "1", "model.onnx"),
               ["input_ids"], ["last_hidden_state"],
               {"input_ids": {0: "batch"}, "last_hidden_state": {0: "batch"}})
        sample = torch.randn(2, 4, latent, latent)
        timestep = torch.tensor([999.0, 999.0])
        context = torch.randn(2, MAX_LENGTH, hidden)
        export(Unet(pipe.unet), (sample, timestep, context),
               os.path.join(repository, "unet", "1", "model.onnx"),
               ["sample", "timestep", "encoder_hidden_states"], ["out_sample"],
               {"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "batch"},
                "encoder_hidden_states": {0: "batch"},
                "out_sample": {0: "batch", 2: "height", 3: "width"}})
        export(VaeDecoder(pipe.vae), (torch.randn(1, 4, latent, latent),),
               os.path.join(repository, "vae", "1", "model.onnx"),
               ["latent_sample"], ["sample"],
               {"latent_sample": {0: "batch", 2: "height", 3: "width"},
                "sample": {0: "batch", 2: "height", 3: "width"}})
    pipe.save_pretrained(os.path.join(cache, "pipeline"))
    print("saved the diffusers pipeline to", os.path.join(cache, "pipeline"))


if __name__ == "__main__":
    size = "test"
    if "--size" in sys.argv:
        at = sys.argv.index("--size")
        size = sys.argv[at + 1]
        del sys.argv[at:at + 2]
    main(sys.argv[1], sys.argv[2], size)
