"""Makes a random LoRA adapter with PEFT on a Llama model and its merged weights, run with the
converter environment's Python (torch, transformers, peft: CONVERTER_PYTHON):

    lora_reference.py SPEC.json

SPEC: {"hp": llm_export's hyper-parameters, "weights": an .npz of the base model's weights in
llm_export's layout (absent: random weights of that shape, for an adapter only), "targets":
PEFT's target_modules, "r", "alpha", "seed", "rslora", "out": a folder}. Writes
`out/adapter/` (PEFT's save_pretrained: adapter_config.json, adapter_model.safetensors) and,
with weights, `out/merged.npz`: the projections after PEFT's merge_and_unload, in the same
layout (the weights a plain decoder is exported from, to check a server's adapter against).
"""
import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

# llm_export's keys per layer, and their modules in Hugging Face's Llama.
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj", "attn_norm": "input_layernorm",
           "ffn_norm": "post_attention_layernorm"}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    hp = spec["hp"]
    torch.manual_seed(spec.get("seed", 0))
    config = LlamaConfig(
        vocab_size=hp["vocab"], hidden_size=hp["hidden"], intermediate_size=hp["ffn"],
        num_hidden_layers=hp["layers"], num_attention_heads=hp["heads"],
        num_key_value_heads=hp["kv_heads"], head_dim=hp["head_dim"], rms_norm_eps=hp["eps"],
        rope_theta=hp["rope_base"], max_position_embeddings=hp.get("context", 2048),
        tie_word_embeddings="weights" in spec and "lm_head" not in np.load(spec["weights"]))
    model = LlamaForCausalLM(config).float()
    base = None
    if "weights" in spec:
        base = dict(np.load(spec["weights"]))
        state = {"model.embed_tokens.weight": base["embed"], "model.norm.weight": base["norm"]}
        if "lm_head" in base:
            state["lm_head.weight"] = base["lm_head"]
        for i in range(hp["layers"]):
            for key, module in MODULES.items():
                state[f"model.layers.{i}.{module}.weight"] = base[f"{i}.{key}"]
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
        assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (missing, unexpected)
    lora = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=spec["targets"],
                      lora_dropout=0.0, bias="none", use_rslora=spec.get("rslora", False),
                      init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    out = spec["out"]
    peft_model.save_pretrained(os.path.join(out, "adapter"))
    if base is None:
        return
    merged = peft_model.merge_and_unload()
    weights = dict(base)
    names = dict(merged.named_parameters())
    for i in range(hp["layers"]):
        for key, module in MODULES.items():
            weights[f"{i}.{key}"] = names[f"model.layers.{i}.{module}.weight"].detach().numpy()
    np.savez(os.path.join(out, "merged.npz"), **weights)


if __name__ == "__main__":
    main()
