"""Large and hostile request bodies: a body is checked against the size limits (the server's and
its tenant's `max_request_bytes`) before it is read, its model before it is decoded, and it is
decoded straight into typed requests that keep only what an endpoint accepts, so that one
request's peak memory stays within a small multiple of its body (docs/tenants-and-security.md, Security: at most
about 6x the body beyond the body itself, for bodies up to the 64 MiB limit). Each attack is
refused with the status and message that name what was wrong, the server's peak resident
memory (VmHWM, reset before each attack) stays within that bound, and a real request is
answered right after."""
import gzip
import json
import os
import socket
import sys
import time
import zlib

import pytest

from attack import BINARY, ROOT, Server

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from test_generation import link_model  # noqa: E402
from test_tenancy import digest  # noqa: E402

MODELS = ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing", "embed_text",
          "bert_tokenizer", "minilm", "mean_pool", "simple")
KEYS = {"small": "tenant-small-key-1", "admin": "tenant-admin-key-1"}
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("attack-requests")
    for name in MODELS:
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    config = repo / "wasmtron.toml"
    config.write_text(
        f'[[tenant]]\nname = "small"\napi_keys = [{digest(KEYS["small"])}]\ninfer = ["*"]\n'
        f'[tenant.quotas]\nmax_request_bytes = {MIB}\n\n'
        f'[[tenant]]\nname = "admin"\napi_keys = [{digest(KEYS["admin"])}]\nadmin = true\n')
    s = Server(str(repo), "--config", str(config))
    yield s
    s.stop()


def auth(tenant):
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def send(server, path, body, headers):
    """(status, parsed body) of one POST sent over a raw socket; a server that answers before
    the body is all sent (a refusal by Content-Length) is read all the same."""
    host, port = server.http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=600)
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    try:
        sock.sendall(head.encode() + body)
    except OSError:
        pass  # refused before the body was read: the answer is waiting
    data = b""
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    sock.close()
    head, _, text = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    status = int(head.split()[1])
    if b"chunked" in head.lower():
        text = dechunk(text)
    return status, json.loads(text)


def dechunk(data):
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def memory(server):
    """A function that resets the server's peak resident size and returns its growth (MiB)
    since then."""
    status = f"/proc/{server.proc.pid}/status"

    def field(name):
        with open(status) as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) / 1024
        raise AssertionError(name)
    base = field("VmRSS:")
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return lambda: field("VmHWM:") - base


def message(body):
    error = body.get("error")
    return error.get("message", "") if isinstance(error, dict) else str(error)


def still_generates(server):
    status, answer = send(server, "/v1/completions",
                          json.dumps({"model": "smollm2", "prompt": "The capital of France is",
                                      "max_tokens": 2, "temperature": 0}).encode(),
                          auth("admin"))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def token_ids(n):
    return ",".join(["7"] * n)


# (path, body, headers, status, message, growth allowed as a multiple of the body)
ATTACKS = [
    # 32 MiB of token ids for a model that does not exist: named before the body is decoded.
    ("/v1/completions", lambda: f'{{"model": "nope", "prompt": [{token_ids(16 * MIB)}]}}',
     "admin", 404, "'nope' is not found", 3),
    # The same for a real model: the list is read element by element and refused at its cap.
    ("/v1/completions",
     lambda: f'{{"model": "smollm2", "max_tokens": 2, "prompt": [{token_ids(16 * MIB)}]}}',
     "admin", 400, "holds 16777216 token ids; at most 1048576", 3),
    # A million chat messages: the list keeps 4096 and counts the rest.
    ("/v1/chat/completions",
     lambda: json.dumps({"model": "smollm2", "max_tokens": 2,
                         "messages": [{"role": "user", "content": "a"}] * MIB}),
     "admin", 400, "'messages' holds 1048576 messages; at most 4096", 3),
    # The same through the Responses API, and a million parts in one message.
    ("/v1/responses",
     lambda: json.dumps({"model": "smollm2", "max_output_tokens": 2,
                         "input": [{"role": "user", "content": "a"}] * MIB}),
     "admin", 400, "'input' holds 1048576 items; at most 4096", 3),
    ("/v1/responses",
     lambda: json.dumps({"model": "smollm2", "max_output_tokens": 2, "input": [
         {"role": "user", "content": [{"type": "input_text", "text": "a"}] * MIB}]}),
     "admin", 400, "'input[0].content' holds 1048576 parts; at most 4096", 3),
    # 16 MiB of texts to embed.
    ("/v1/embeddings", lambda: json.dumps({"model": "embed_text", "input": ["ab"] * (3 * MIB)}),
     "admin", 400, "'input' holds 3145728 texts; at most 2048", 3),
    # A generate body of 16 MiB of stop words: counted, not kept, before it is refused.
    ("/v2/models/smollm2/generate",
     lambda: '{"text_input": "hi", "stop": [' + ",".join(['"a"'] * (4 * MIB)) + "]}",
     "admin", 400, "'stop' holds 4194304 strings; at most 32", 4),
    # A nested list where a generate parameter (a scalar) belongs.
    ("/v2/models/smollm2/generate",
     lambda: '{"text_input": "hi", "not_an_input": [' + token_ids(8 * MIB) + "]}",
     "admin", 400, "must be a bool, number or string", 3),
]


@pytest.mark.parametrize("path,body,tenant,status,says,bound", ATTACKS)
def test_large_bodies_are_refused_within_a_small_multiple_of_their_size(
        server, path, body, tenant, status, says, bound):
    data = body().encode()
    grown = memory(server)
    code, answer = send(server, path, data, auth(tenant))
    assert code == status and says in message(answer), (code, message(answer)[:300])
    size = len(data) / MIB
    assert grown() <= bound * size + 64, f"+{grown():.0f} MiB for a body of {size:.0f} MiB"
    still_generates(server)


def test_a_tenants_quota_refuses_a_body_before_it_is_read(server):
    # 24 MiB against a quota of 1 MiB: refused by its declared length with 429, nothing read.
    data = f'{{"model": "smollm2", "prompt": [{token_ids(12 * MIB)}]}}'.encode()
    grown = memory(server)
    code, answer = send(server, "/v1/completions", data, auth("small"))
    assert code == 429, (code, answer)
    assert "tenant 'small'" in message(answer)
    assert "quotas.max_request_bytes = 1048576" in message(answer)
    assert grown() < 16, f"+{grown():.0f} MiB for a refused body"
    # The same over the KServe routes.
    code, answer = send(server, "/v2/models/smollm2/generate", data, auth("small"))
    assert code == 429 and "max_request_bytes" in message(answer), (code, answer)
    still_generates(server)


def test_a_tenants_quota_refuses_a_grpc_message_before_it_is_buffered(server):
    # 96 MiB in one gRPC message against a quota of 1 MiB, while the server takes messages up
    # to 2 GiB (Triton's default): refused by the message's length prefix, nothing buffered.
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc)
    big = [grpcclient.InferInput(name, [12 * MIB, 1], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in big:
        tensor.set_data_from_numpy(np.zeros((12 * MIB, 1), dtype=np.int32))
    grown = memory(server)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("simple", big, headers={"authorization": f"Bearer {KEYS['small']}"})
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    text = refused.value.message()
    assert "tenant 'small'" in text and "quotas.max_request_bytes = 1048576" in text, text
    assert grown() < 16, f"+{grown():.0f} MiB for a refused message of 96 MiB"
    still_generates(server)


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compressed_bomb_is_refused_at_the_size_limit(server, encoding, compress):
    # 256 MiB of zeros in a few hundred KiB: inflated (off the async runtime) only up to the
    # 64 MiB limit.
    bomb = compress(b" " * (256 * MIB))
    assert len(bomb) < 2 * MIB
    grown = memory(server)
    code, answer = send(server, "/v1/completions", bomb,
                        {"Content-Encoding": encoding, **auth("admin")})
    assert code == 400, (code, answer)
    assert "decompressed request body is larger than the maximum input size" in message(answer)
    assert grown() < 3 * 64 + 32, f"+{grown():.0f} MiB"
    still_generates(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses",
                                  "/v2/models/smollm2/generate", "/v2/models/simple/infer"])
def test_deeply_nested_bodies_are_refused_without_recursing(server, path):
    # 200,000 nested lists: read by a parser with a recursion limit, never by the stack.
    body = b'{"model": "smollm2", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    code, answer = send(server, path, body, auth("admin"))
    assert code == 400, (code, answer)
    still_generates(server)


def test_a_scored_prompt_gives_its_memory_back(server):
    # echo with logprobs scores every position of the prompt: [1, 2000, 49152] logits (375 MiB)
    # and the activations of a 2,000-token prefill. They are freed once scored, not kept in
    # ONNX Runtime's arena: what stays is the prompt's prefix-cache entry and a step's arena.
    def rss():
        with open(f"/proc/{server.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    still_generates(server)
    before = rss()
    prompt = [(i * 7919) % 40000 + 100 for i in range(2000)]
    code, answer = send(server, "/v1/completions",
                        json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 1,
                                    "echo": True, "logprobs": 1}).encode(), auth("admin"))
    assert code == 200, (code, message(answer))
    assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) >= 2000
    # The engine frees the run's memory once it is done with the batch (moments after the
    # answer leaves).
    deadline = time.time() + 30
    while rss() - before >= 300 and time.time() < deadline:
        time.sleep(0.5)
    assert rss() - before < 300, f"{rss() - before:.0f} MiB kept after scoring"
    still_generates(server)
