"""Text generation with the `generation` backend: the SmolLM2 decoder converted from its GGUF
by `make models`, and a tiny decoder of another shape, served by the real binary.

Covers the conversion (ONNX greedy decoding against an independent NumPy forward pass of the
GGUF weights), greedy serving against ONNX Runtime called directly, concurrent requests
(in-flight batching gives each the tokens it gets alone), seeds, stop strings, a short request
overtaking a long one, cancellation freeing its place in the batch, and bad requests; then
the `smollm2` ensemble (tokenizer stage -> decoder -> detokenizer stage) over Triton's
generate, generate_stream and tritonclient's gRPC streaming.
"""
import json
import urllib.error
import urllib.request
import os
import queue
import re
import shutil
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
import tokenizers
import tritonclient.grpc as grpcclient

from conftest import ROOT, Server

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import decoder_loop  # noqa: E402
import llm_reference  # noqa: E402

SMOL = os.path.join(ROOT, "model_repository", "smollm2_decoder")
TINY = os.path.join(ROOT, "tests", "models", "tiny_decoder")
GGUF = os.path.join(ROOT, ".cache", "gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))


def without_speculation(text):
    """A decoder's config.pbtxt without its speculative_config parameter."""
    return re.sub(r'(?m)^parameters \{ key: "speculative_config".*\n', "", text)


def link_model(repo, source, name=None, config=None, served_file=False):
    """`source` in `repo` as `name`: config.pbtxt copied (or `config`), the ONNX model linked,
    other files copied (Wasm stages may not follow links out of their directory). Unless
    `served_file`, the decoder served is model.onnx (SmolLM2's FP32 export, whose greedy answers
    do not depend on how many rows run together: what the tests compare against ONNX Runtime
    called directly), not the 8-bit file the repository names."""
    dest = os.path.join(repo, name or os.path.basename(source))
    os.makedirs(os.path.join(dest, "1"))
    with open(os.path.join(source, "config.pbtxt")) as f:
        text = f.read()
    if not served_file:
        text = re.sub(r'(?m)^default_model_filename: "model_q8.onnx"\n', "", text)
    with open(os.path.join(dest, "config.pbtxt"), "w") as f:
        f.write(config(text) if config else text)
    for file in os.listdir(os.path.join(source, "1")):
        place = os.symlink if file.endswith(".onnx") else shutil.copy
        place(os.path.join(source, "1", file), os.path.join(dest, "1", file))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("generation"))
    link_model(repo, SMOL)
    link_model(repo, TINY)
    # The tiny decoder's weights in the shared-buffer layout (cache in place), FP32 and FP16,
    # 16 sequences at a time so that the buffer grows, frees rows and moves into a smaller one.
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import llm_export
    import onnx

    for name, half in (("tiny_shared", False), ("tiny_half", True)):
        os.makedirs(os.path.join(repo, name, "1"))
        onnx.save(llm_export.tiny(shared_cache=True, fp16_cache=half)[0], os.path.join(repo, name, "1", "model.onnx"))
        shutil.copy(os.path.join(TINY, "1", "generation_config.json"), os.path.join(repo, name, "1"))
        with open(os.path.join(TINY, "config.pbtxt")) as f:
            config = f.read().replace("max_batch_size: 4", "max_batch_size: 16")
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(config)
    for name in ("smollm2", "llm_preprocessing", "llm_postprocessing"):
        link_model(repo, os.path.join(ROOT, "model_repository", name))
    # What the repository serves (the 8-bit export, with n-gram speculation), and the same
    # file without speculation.
    link_model(repo, SMOL, "smol_served", served_file=True)
    link_model(repo, SMOL, "smol_served_plain", without_speculation, served_file=True)
    # Two sequences at a time in a cache of 2048 tokens, for the cancellation and cache tests.
    link_model(repo, SMOL, "smollm2_two",
               lambda t: t.replace("max_batch_size: 32", "max_batch_size: 2")
               + 'parameters { key: "kv_cache_max_tokens" value { string_value: "2048" } }\n')
    s = Server(repo)
    s.repo = repo
    yield s
    s.stop()


class Stream:
    """One gRPC stream to a decoupled model: responses collected until the last."""

    def __init__(self, server):
        self.client = grpcclient.InferenceServerClient(server.grpc)
        self.responses = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model, ids, timeout_us=None, stream=True, **params):
        """`stream`: the tokens as they come (the `stream` input; without it, one answer)."""
        inputs = []
        ids = np.asarray([ids], dtype=np.int32)
        t = grpcclient.InferInput("input_ids", list(ids.shape), "INT32")
        t.set_data_from_numpy(ids)
        inputs.append(t)
        if stream is not None:
            t = grpcclient.InferInput("stream", [1, 1], "BOOL")
            t.set_data_from_numpy(np.array([[stream]], dtype=bool))
            inputs.append(t)
        types = {"max_tokens": ("INT32", np.int32), "end_id": ("INT32", np.int32),
                 "top_k": ("INT32", np.int32), "temperature": ("FP32", np.float32),
                 "top_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64)}
        for key, value in params.items():
            if key == "stop":
                t = grpcclient.InferInput("stop", [1, len(value)], "BYTES")
                t.set_data_from_numpy(np.array([value], dtype=object))
            else:
                wire, dtype = types[key]
                t = grpcclient.InferInput(key, [1, 1], wire)
                t.set_data_from_numpy(np.array([[value]], dtype=dtype))
            inputs.append(t)
        self.client.async_stream_infer(model, inputs, timeout=timeout_us)

    def collect(self, timeout=300):
        """(tokens, finish_reason, responses) of the request, or raises its error."""
        tokens, count = [], 0
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            count += 1
            tokens += [int(t) for t in result.as_numpy("output_ids")[0]]
            finish = result.as_numpy("finish_reason")[0][0].decode()
            if finish:
                return tokens, finish, count

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def generate(server, model, ids, **params):
    s = Stream(server)
    try:
        s.send(model, ids, **params)
        return s.collect()
    finally:
        s.close()


def generate_together(server, model, prompts, counts, **params):
    """Each prompt's tokens, all requests sent at once, each on its own stream."""
    results = [None] * len(prompts)

    def one(i):
        results[i] = generate(server, model, prompts[i], max_tokens=counts[i], **params)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def onnx_greedy(path, ids, count, end_ids=()):
    """Greedy decoding with ONNX Runtime directly, one sequence (either cache layout)."""
    return decoder_loop.greedy(path, ids, count, end_ids)


def test_the_onnx_conversion_decodes_as_an_independent_forward_pass_of_the_gguf(tokenizer):
    reference = llm_reference.GgufLlama(GGUF)
    for prompt in PROMPTS:
        ids = tokenizer.encode(chat(prompt)).ids
        ours = onnx_greedy(os.path.join(SMOL, "1", "model.onnx"), ids, 10)
        theirs = reference.greedy(ids, 10)
        assert ours == theirs, f"{prompt!r}: {tokenizer.decode(ours)!r} vs {tokenizer.decode(theirs)!r}"


def test_the_4bit_export_keeps_the_ggufs_blocks(tokenizer, tmp_path):
    """`--four-bit` keeps Q4_1 matrices as MatMulNBits (scale d, float zero point -m/d): the
    same weights, so greedy decoding agrees with the FP32 export."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import llm_export

    llm_export.from_gguf(GGUF, str(tmp_path), four_bit=True, shared_cache=True)
    ids = tokenizer.encode(chat(PROMPTS[0])).ids
    four_bit = onnx_greedy(str(tmp_path / "model.onnx"), ids, 12, end_ids=(2,))
    assert four_bit == onnx_greedy(os.path.join(SMOL, "1", "model.onnx"), ids, 12, end_ids=(2,))
    assert tokenizer.decode(four_bit) == "The capital of France is Paris."


def test_the_8bit_export_keeps_the_ggufs_levels(tokenizer):
    """`--eight-bit` writes each Q4_1 block's 16 levels exactly 16 steps of d/16 apart, its
    offset within d/32, and the Q8_0 output matrix exactly; with int8 compute (ONNX Runtime's
    accuracy_level 4, as llama.cpp quantises activations) it still answers a plain question as
    the FP32 export does."""
    import gguf
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import llm_export

    reader = gguf.GGUFReader(GGUF)
    tensors = {t.name: t for t in reader.tensors}
    q4 = tensors["blk.0.ffn_up.weight"]
    w = llm_export.q4_1_as_8bit(np.asarray(q4.data), np.arange(np.asarray(q4.data).shape[0]))
    exact = gguf.quants.dequantize(q4.data, q4.tensor_type).astype(np.float64)
    blocks = w.packed.shape[1]
    ours = ((w.packed.astype(np.float64) - w.zero_points.reshape(-1, blocks, 1))
            * w.scales.reshape(-1, blocks, 1)).reshape(exact.shape)
    d = np.abs(np.asarray(q4.data).reshape(exact.shape[0], -1, 20)[..., 0:2].copy()
               .view(np.float16).astype(np.float64))
    assert np.all(np.abs(ours - exact).reshape(exact.shape[0], blocks, 32) <= d / 32 + 1e-6)
    q8 = tensors["token_embd.weight"]
    head = llm_export.q8_0_as_8bit(np.asarray(q8.data))
    exact = gguf.quants.dequantize(q8.data, q8.tensor_type).astype(np.float64)
    blocks = head.packed.shape[1]
    ours = ((head.packed.astype(np.float64) - 128) * head.scales.reshape(-1, blocks, 1)).reshape(exact.shape)
    assert np.array_equal(ours, exact)
    ids = tokenizer.encode(chat(PROMPTS[0])).ids
    eight_bit = onnx_greedy(os.path.join(SMOL, "1", "model_q8.onnx"), ids, 12, end_ids=(2,))
    assert tokenizer.decode(eight_bit) == "The capital of France is Paris."


def test_greedy_serving_gives_onnx_runtimes_tokens(server, tokenizer):
    for prompt in PROMPTS:
        ids = tokenizer.encode(chat(prompt)).ids
        expected = onnx_greedy(os.path.join(SMOL, "1", "model.onnx"), ids, 32, end_ids=(2,))
        tokens, finish, responses = generate(server, "smollm2_decoder", ids, max_tokens=32)
        assert tokens == expected, tokenizer.decode(tokens)
        assert finish == ("stop" if len(expected) < 32 else "length")
        # Streamed: a response per token (and one for the end token).
        assert responses >= len(tokens)
    tokens, _, _ = generate(server, "smollm2_decoder", tokenizer.encode(chat(PROMPTS[0])).ids)
    assert tokenizer.decode(tokens) == "The capital of France is Paris."


def test_the_served_decoder_is_the_8_bit_export_and_answers_as_onnx_runtime_on_it(server, tokenizer):
    """make run serves model_q8.onnx: one request at a time it answers ONNX Runtime's greedy
    tokens on that file; with the repository's n-gram speculation too, runs of several tokens
    are rounded by int8 kernels of another shape, so the answer is checked for sense rather
    than token for token (the FP32 export's are: test_speculation.py)."""
    q8 = os.path.join(SMOL, "1", "model_q8.onnx")
    for prompt in PROMPTS:
        ids = tokenizer.encode(chat(prompt)).ids
        expected = onnx_greedy(q8, ids, 32, end_ids=(2,))
        tokens, _, _ = generate(server, "smol_served_plain", ids, max_tokens=32)
        assert tokens == expected, tokenizer.decode(tokens)
    tokens, finish, _ = generate(server, "smol_served", tokenizer.encode(chat(PROMPTS[0])).ids)
    assert "Paris" in tokenizer.decode(tokens) and finish == "stop"
    with open(os.path.join(server.repo, "smol_served", "config.pbtxt")) as f:
        assert 'default_model_filename: "model_q8.onnx"' in f.read()


@pytest.mark.parametrize("model", ["smollm2_decoder", "tiny_decoder", "tiny_shared", "tiny_half"])
def test_concurrent_requests_get_the_tokens_they_get_alone(server, tokenizer, model):
    source = os.path.join(server.repo, model)
    if model.startswith("tiny"):
        prompts = [[5, 17, 42], [9] * 11, [100, 200, 250, 7, 7, 8], [1, 2]]
        end_ids, count = (3,), 20
    else:
        prompts = [tokenizer.encode(chat(p)).ids for p in PROMPTS + ["Say hello."]]
        end_ids, count = (2,), 24
    alone = [onnx_greedy(os.path.join(source, "1", "model.onnx"), p, count, end_ids) for p in prompts]
    assert generate_together(server, model, prompts, [count] * len(prompts)) == alone


@pytest.mark.parametrize("model", ["tiny_shared", "tiny_half"])
def test_sequences_keep_their_tokens_while_the_shared_cache_grows_and_shrinks(server, model):
    """Twelve sequences of different lengths at once in a 16-row shared buffer: rows are added
    as they arrive (the buffer grows), freed as they end, and the last few move into a smaller
    buffer; each still gets the tokens it gets alone, and the layouts agree."""
    prompts = [[(7 * i + j) % 290 + 5 for j in range(3 + i)] for i in range(12)]
    counts = [2 + 3 * (i % 4) if i < 9 else 40 for i in range(12)]
    path = os.path.join(server.repo, model, "1", "model.onnx")
    alone = [onnx_greedy(path, p, c) for p, c in zip(prompts, counts)]
    assert generate_together(server, model, prompts, counts, end_id=-1) == alone
    loaded = [line for line in server.log if "generation model loaded" in line and model in line]
    assert loaded and "shared_buffer=true" in loaded[0], loaded
    if model == "tiny_shared":
        # The same weights in the growing layout answer the same.
        assert alone[:4] == [onnx_greedy(os.path.join(TINY, "1", "model.onnx"), p, c)
                             for p, c in zip(prompts[:4], counts[:4])]


@pytest.mark.parametrize("model", ["smollm2_decoder", "tiny_decoder", "tiny_shared", "tiny_half"])
def test_prompt_log_probs_score_each_prompt_token_as_onnx_runtime_does(server, tokenizer, model):
    source = os.path.join(server.repo, model, "1", "model.onnx")
    if model.startswith("tiny"):
        prompts, end_ids = [[5, 17, 42, 9, 9, 100], [7]], (3,)
    else:
        prompts, end_ids = [tokenizer.encode(chat(PROMPTS[1])).ids], (2,)
    reference = decoder_loop.DecoderLoop(source)
    # FP16 cache: the reference's past is FP16 zeros too, but the rounding differs in places.
    tolerance = 2e-2 if model == "tiny_half" else 1e-3
    for ids in prompts:
        want, want_top = reference.prompt_log_probs(ids, top=3)
        status, body = http_json(server, f"/v2/models/{model}/generate", {
            "input_ids": ids, "max_tokens": 4, "stream": False, "return_prompt_log_probs": True,
            "top_logprobs": 3})
        assert status == 200, body
        out = json.loads(body)
        # Triton's generate answers a one-element tensor as a scalar.
        listed = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
        got = listed(out["prompt_log_probs"])
        assert len(got) == len(ids) and got[0] is None, body
        assert np.allclose(got[1:], want[1:], atol=tolerance), (got, want)
        top = out["prompt_top_log_probs"]
        assert top[:3] == [None] * 3 and len(top) == 3 * len(ids)
        assert np.allclose(top[3:], [l for row in want_top[1:] for _, l in row], atol=tolerance)
        # Scoring the prompt changes nothing about what comes after it.
        assert listed(out["output_ids"]) == onnx_greedy(source, ids, 4, end_ids)
    if model == "smollm2_decoder":
        # Special tokens spell nothing, as the detokenizer writes them.
        assert "".join(out["prompt_token_texts"]) == tokenizer.decode(prompts[0])


def test_a_seed_gives_the_same_text_and_another_seed_another(server, tokenizer):
    ids = tokenizer.encode(chat("Tell me a story about a cat.")).ids
    first = generate(server, "smollm2_decoder", ids, max_tokens=24, temperature=1.0, seed=7)[0]
    again = generate(server, "smollm2_decoder", ids, max_tokens=24, temperature=1.0, seed=7)[0]
    other = generate(server, "smollm2_decoder", ids, max_tokens=24, temperature=1.0, seed=8)[0]
    assert first == again
    assert first != other
    top1 = generate(server, "smollm2_decoder", ids, max_tokens=24, temperature=1.0, top_k=1, seed=9)[0]
    assert top1 == generate(server, "smollm2_decoder", ids, max_tokens=24)[0]


def test_a_stop_string_ends_the_answer_before_it(server, tokenizer):
    ids = tokenizer.encode(chat(PROMPTS[0])).ids
    tokens, finish, _ = generate(server, "smollm2_decoder", ids, stop=["Paris", "never seen"])
    assert finish == "stop"
    assert tokenizer.decode(tokens) == "The capital of France is"


def test_a_short_request_started_after_a_long_one_finishes_first(server, tokenizer):
    long_stream, short_stream = Stream(server), Stream(server)
    try:
        long_stream.send("smollm2_decoder", tokenizer.encode(chat("Write an essay about rivers.")).ids,
                         max_tokens=400, end_id=-1)
        # Its first token: the long request is in the running batch.
        result, error = long_stream.responses.get(timeout=300)
        assert error is None
        short_stream.send("smollm2_decoder", tokenizer.encode(chat("Hi")).ids, max_tokens=3, end_id=-1)
        tokens, finish, _ = short_stream.collect()
        assert (len(tokens), finish) == (3, "length")
        # The long one is still generating: its last response has not come yet.
        seen = 1
        while not long_stream.responses.empty():
            result, error = long_stream.responses.get_nowait()
            assert not result.as_numpy("finish_reason")[0][0]
            seen += len(result.as_numpy("output_ids")[0])
        tokens, finish, _ = long_stream.collect()
        assert (seen + len(tokens), finish) == (400, "length")
    finally:
        long_stream.close()
        short_stream.close()


def metric(server, name, model):
    pattern = re.compile(rf'^{re.escape(name)}{{model="{model}",version="1"(,[^}}]*)?}} (\S+)$', re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(server.metrics_text()))


def wait_for(predicate, what, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_cancelled_stream_frees_its_place_in_the_batch(server, tokenizer):
    ids = tokenizer.encode(chat("Write an essay about mountains.")).ids
    streams = [Stream(server) for _ in range(2)]
    for s in streams:
        s.send("smollm2_two", ids, max_tokens=900, end_id=-1)
    for s in streams:
        assert s.responses.get(timeout=300)[1] is None
    wait_for(lambda: metric(server, "vllm:num_requests_running", "smollm2_two") == 2,
             "both sequences in the batch")
    for s in streams:
        s.close(cancel=True)
    wait_for(lambda: metric(server, "vllm:num_requests_running", "smollm2_two") == 0,
             "the cancelled sequences to leave the batch")
    assert metric(server, "vllm:request_success_total", "smollm2_two") >= 2
    # Both places are free again: a third request runs at once.
    tokens, finish, _ = generate(server, "smollm2_two", ids, max_tokens=4, end_id=-1)
    assert (len(tokens), finish) == (4, "length")


def test_a_request_that_does_not_fit_the_cache_waits_within_its_timeout(server, tokenizer):
    ids = tokenizer.encode(chat("Write an essay about forests.")).ids
    wait_for(lambda: metric(server, "vllm:num_requests_running", "smollm2_two") == 0, "an idle model")
    long_stream, late, patient = Stream(server), Stream(server), Stream(server)
    try:
        # Prompt + 1500 tokens: a second sequence of any length would pass 2048 tokens.
        long_stream.send("smollm2_two", ids, max_tokens=1500, end_id=-1)
        assert long_stream.responses.get(timeout=300)[1] is None
        late.send("smollm2_two", ids, timeout_us=300_000, max_tokens=8)
        result, error = late.responses.get(timeout=300)
        assert result is None and "timed out waiting for room in the key/value cache" in str(error)
        patient.send("smollm2_two", ids, max_tokens=8, end_id=-1)
        wait_for(lambda: metric(server, "vllm:num_requests_waiting", "smollm2_two") == 1,
                 "the request to wait for room")
        assert patient.responses.empty()
        long_stream.close(cancel=True)
        tokens, finish, _ = patient.collect()
        assert (len(tokens), finish) == (8, "length")
    finally:
        for s in (long_stream, late, patient):
            try:
                s.close()
            except Exception:  # noqa: BLE001 - closed already
                pass


def test_generation_metrics_count_tokens_and_latencies(server):
    before = metric(server, "vllm:generation_tokens_total", "tiny_decoder")
    prompt_before = metric(server, "vllm:prompt_tokens_total", "tiny_decoder")
    tokens, _, _ = generate(server, "tiny_decoder", [5, 6, 7, 8], max_tokens=10, end_id=-1)
    assert metric(server, "vllm:generation_tokens_total", "tiny_decoder") - before == 10
    assert metric(server, "vllm:prompt_tokens_total", "tiny_decoder") - prompt_before == 4
    text = server.metrics_text()
    assert 'vllm:time_to_first_token_seconds_count{model="tiny_decoder",version="1"}' in text
    assert 'vllm:inter_token_latency_seconds_bucket{model="tiny_decoder",version="1",le="+Inf"}' in text
    assert 'vllm:kv_cache_usage_perc{model="tiny_decoder",version="1"}' in text


@pytest.mark.parametrize("ids,params,message", [
    ([], {}, "the prompt is empty"),
    (list(range(10, 74)), {}, "the context is 64 tokens (max_sequence_length)"),
    ([5, 6], {"max_tokens": 63}, "'max_tokens' is 63, but the prompt's 2 tokens leave room for 62"),
    ([5, 6], {"top_p": 1.5}, "'top_p' is 1.5, outside"),
    ([5, 6], {"temperature": -1.0}, "'temperature' is -1, outside"),
    ([5, 300], {}, "token 300, outside the vocabulary [0, 300)"),
])
def test_bad_requests_are_refused_by_field_and_the_model_keeps_serving(server, ids, params, message):
    with pytest.raises(RuntimeError) as e:
        generate(server, "tiny_decoder", ids, **params)
    assert message in str(e.value)
    assert "tiny_decoder" in str(e.value)
    tokens, _, _ = generate(server, "tiny_decoder", [5, 6], max_tokens=2, end_id=-1)
    assert len(tokens) == 2


# The ensemble: text in, text out.

def http_json(server, path, body):
    req = urllib.request.Request(f"http://{server.http}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(text):
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_the_ensemble_answers_a_chat_over_generate_and_generate_stream(server, tokenizer):
    messages = json.dumps([{"role": "user", "content": PROMPTS[0]}])
    status, body = http_json(server, "/v2/models/smollm2/generate",
                             {"messages": messages, "max_tokens": 32, "stream": False})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"] == "The capital of France is Paris."
    assert answer["finish_reason"] == "stop"
    # The chat template adds SmolLM's default system prompt, as Hugging Face's does.
    assert answer["prompt_tokens"] == len(tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        + chat(PROMPTS[0])).ids)
    status, body = http_json(server, "/v2/models/smollm2/generate_stream",
                             {"messages": messages, "max_tokens": 32})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 3
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
    assert [e["finish_reason"] for e in events][-1] == "stop"
    assert all(e["finish_reason"] == "" for e in events[:-1])


def test_the_ensemble_streams_over_grpc_to_tritonclient(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[chat(PROMPTS[0]).encode()]], dtype=object))
        max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        max_tokens.set_data_from_numpy(np.array([[32]], dtype=np.int32))
        stream = grpcclient.InferInput("stream", [1, 1], "BOOL")
        stream.set_data_from_numpy(np.array([[True]], dtype=bool))
        client.async_stream_infer("smollm2", [text, max_tokens, stream])
        pieces = []
        while True:
            result, error = responses.get(timeout=300)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0][0].decode())
            if result.as_numpy("finish_reason")[0][0]:
                break
        assert "".join(pieces) == "The capital of France is Paris."
        assert len(pieces) > 3
    finally:
        client.stop_stream()
        client.close()


def test_the_detokenizer_never_splits_a_character(server, tokenizer):
    """Characters of several bytes spread over several byte-level tokens come out whole."""
    text = "Caf\u00e9 \U0001F600 na\u00efve \u2019quote\u2019 \u4e2d\u6587 \U0001F680\U0001F30D"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text.split()) + 4  # some characters take several tokens
    client = grpcclient.InferenceServerClient(server.grpc)
    pieces = []
    for i in range(len(ids)):
        context = ids[max(0, i - 8):i]
        new = grpcclient.InferInput("output_ids", [1, 1], "INT32")
        new.set_data_from_numpy(np.array([[ids[i]]], dtype=np.int32))
        inputs = [new]
        if context:
            ctx = grpcclient.InferInput("context_ids", [1, len(context)], "INT32")
            ctx.set_data_from_numpy(np.array([context], dtype=np.int32))
            inputs.append(ctx)
        result = client.infer("llm_postprocessing", inputs)
        piece = result.as_numpy("text_output")[0][0].decode("utf-8")
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == text
    assert "" in pieces  # a token that ends inside a character answers nothing yet


@pytest.mark.parametrize("body,message", [
    ({"messages": json.dumps([{"role": "system", "content": "Be brief."}])}, "no message with role 'user'"),
    ({"messages": "not json"}, "'messages' must be a JSON list"),
    ({"text_input": ""}, "'text_input' is empty"),
    ({}, "send 'text_input' (a prompt), 'messages' (a chat) or 'prompt_ids' (token ids)"),
    ({"text_input": "Hi", "max_tokens": 5000}, "'max_tokens' is 5000"),
    ({"text_input": "Hi", "top_p": 0.0}, "'top_p' is 0, outside"),
])
def test_bad_ensemble_requests_are_400_naming_the_field(server, body, message):
    status, text = http_json(server, "/v2/models/smollm2/generate", body)
    assert status == 400, text
    assert message in json.loads(text)["error"]


def test_text_that_is_not_utf8_is_refused(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"caf\xe9"]], dtype=object))
    stream = queue.Queue()
    client.start_stream(callback=lambda result, error: stream.put((result, error)))
    try:
        client.async_stream_infer("smollm2", [text])
        result, error = stream.get(timeout=120)
        assert result is None and "'text_input' is not UTF-8" in str(error)
    finally:
        client.stop_stream()
        client.close()


def test_a_cache_layout_the_decoder_cannot_run_is_refused_by_name(tmp_path):
    """`past_present_share_buffer` must be true or false, and an FP16 cache cannot grow: each
    model fails its load with the reason, the others serve."""
    import tritonclient.http as httpclient
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import llm_export
    import onnx

    with open(os.path.join(TINY, "config.pbtxt")) as f:
        config = f.read()
    cases = {"tiny_decoder": (None, ""),
             "bad_flag": (None, 'parameters { key: "past_present_share_buffer" value { string_value: "maybe" } }\n'),
             "half_growing": (True, 'parameters { key: "past_present_share_buffer" value { string_value: "false" } }\n')}
    for name, (half, extra) in cases.items():
        os.makedirs(tmp_path / name / "1")
        model = llm_export.tiny()[0] if half is None else llm_export.tiny(shared_cache=True, fp16_cache=half)[0]
        onnx.save(model, str(tmp_path / name / "1" / "model.onnx"))
        shutil.copy(os.path.join(TINY, "1", "generation_config.json"), tmp_path / name / "1")
        (tmp_path / name / "config.pbtxt").write_text(config + extra)
    s = Server(str(tmp_path))
    try:
        index = {m["name"]: m for m in httpclient.InferenceServerClient(s.http).get_model_repository_index()}
        assert index["tiny_decoder"]["state"] == "READY"
        assert index["bad_flag"]["state"] == "UNAVAILABLE"
        assert "'past_present_share_buffer' is \"maybe\"" in index["bad_flag"]["reason"]
        assert index["half_growing"]["state"] == "UNAVAILABLE"
        assert "an FP16 cache is only run in place" in index["half_growing"]["reason"]
        tokens, _, _ = generate(s, "tiny_decoder", [5, 6], max_tokens=2, end_id=-1)
        assert len(tokens) == 2
    finally:
        s.stop()
