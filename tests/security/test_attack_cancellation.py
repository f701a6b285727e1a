"""Work nobody waits for stops, and one client cannot hold what others need: a client that
closes its connection ends its sequences (streamed or not, `/v1` and `/v2`) and its Wasm
stage's execution, the model calls that stage made included; a client that never reads its
stream (an HTTP/2 window left at zero) is cancelled at the stall deadline; one request of many
sequences, or one tenant, holds no more than its share of the decoder's rows while another
waits (the newest over-share sequence is preempted and resumed later), and a tenant's
concurrency quota counts every sequence. Each test checks the server's own metrics (vLLM's
names) or its CPU time, and that a real request is answered right after."""
import http.client
import json
import os
import socket
import sys
import threading
import time

import h2.connection
import h2.config
import h2.settings
import pytest

from attack import ROOT, Server

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from test_generation import TINY, link_model  # noqa: E402
from test_tenancy import digest, probe_copy  # noqa: E402

LLM = ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing")
KEYS = {"two": "tenant-two-key-1", "big": "tenant-big-key-1", "other": "tenant-other-key-1"}
# Generous: the engine notices a cancellation within one decode step.
CANCEL_WAIT = 60


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """smollm2 with tenants, and a stall deadline too long to play a part: what frees rows here
    is the share, not the deadline."""
    repo = tmp_path_factory.mktemp("attack-cancel")
    for name in LLM:
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    config = repo / "wasmtron.toml"
    config.write_text(
        f'[[tenant]]\nname = "two"\napi_keys = [{digest(KEYS["two"])}]\ninfer = ["*"]\n'
        '[tenant.quotas]\nmax_concurrent_requests = 2\n\n'
        f'[[tenant]]\nname = "big"\napi_keys = [{digest(KEYS["big"])}]\ninfer = ["*"]\n\n'
        f'[[tenant]]\nname = "other"\napi_keys = [{digest(KEYS["other"])}]\ninfer = ["*"]\n')
    s = Server(str(repo), "--config", str(config), "--response-stall-timeout-secs", "600")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """The tiny decoder and spinning stages, with a short stall deadline."""
    repo = tmp_path_factory.mktemp("attack-cancel-light")
    link_model(str(repo), TINY, "tiny")
    slow = ', { key: "execution_timeout_ms", value: { string_value: "120000" } }'
    probe_copy(repo, "spin", "loop", slow)
    probe_copy(repo, "caller", "call", slow + ', { key: "target", value: { string_value: "spin" } }')
    probe_copy(repo, "echo", "echo")
    s = Server(str(repo), "--response-stall-timeout-secs", "2")
    yield s
    s.stop()


def auth(tenant):
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def metric(server, name, model, *labels):
    """A metric of `model` (whose line also holds each of `labels`), 0 when absent."""
    for line in server.metrics_text().splitlines():
        if (line.startswith(name + "{") and f'model="{model}"' in line
                and all(label in line for label in labels)):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def aborted(server, model):
    return metric(server, "vllm:request_success_total", model, 'finished_reason="abort"')


def running(server, model):
    return metric(server, "vllm:num_requests_running", model)


def wait_for(condition, seconds=CANCEL_WAIT):
    end = time.time() + seconds
    while time.time() < end:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def open_request(server, path, body, headers=None):
    """Sends a POST and returns the socket without reading the answer: closing it is the
    client going away."""
    host, port = server.http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=600)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n")
    sock.sendall(head.encode() + data)
    return sock


def post(server, path, body, headers=None, timeout=600):
    sock = open_request(server, path, body, headers)
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(1 << 16)
    sock.close()
    return int(head.split()[1]), json.loads(rest)


def still_generates(server, headers=None):
    status, answer = post(server, "/v1/completions",
                          {"model": "smollm2", "prompt": "The capital of France is",
                           "max_tokens": 2, "temperature": 0}, headers)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1000,
                         "ignore_eos": True}),
    ("/v1/completions", {"model": "smollm2", "prompt": ["Once upon a time", "Far away"], "n": 4,
                         "max_tokens": 1000, "ignore_eos": True}),
    ("/v2/models/smollm2/generate", {"text_input": "Once upon a time", "max_tokens": 1000}),
    ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 1000, "stream": True,
                              "messages": [{"role": "user", "content": "Tell me a story"}]}),
])
def test_a_client_that_leaves_ends_its_sequences(llm, path, body):
    before = aborted(llm, "smollm2_decoder")
    sequences = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    sock = open_request(llm, path, body, auth("big"))
    assert wait_for(lambda: running(llm, "smollm2_decoder") >= sequences), llm.metrics_text()
    sock.close()
    # Every sequence ends as aborted, long before its 1,000 tokens.
    assert wait_for(lambda: running(llm, "smollm2_decoder") == 0), llm.metrics_text()
    assert aborted(llm, "smollm2_decoder") - before == sequences
    still_generates(llm, auth("other"))


def test_a_tenants_concurrency_quota_counts_each_sequence(llm):
    status, answer = post(llm, "/v1/completions",
                          {"model": "smollm2", "prompt": ["a", "b"], "n": 16, "max_tokens": 4},
                          auth("two"))
    assert status == 429, answer
    message = answer["error"]["message"]
    assert "runs 32 sequences" in message and "quotas.max_concurrent_requests" in message
    # Within its quota the tenant is served.
    status, answer = post(llm, "/v1/completions",
                          {"model": "smollm2", "prompt": "a", "n": 2, "max_tokens": 2}, auth("two"))
    assert status == 200 and len(answer["choices"]) == 2, answer


def test_one_tenants_many_sequences_leave_another_tenant_its_share(llm):
    # Tenant big takes every row (2 prompts x 16 choices x 1,200 tokens); tenant other's short
    # request is answered while big's is still running: one of big's sequences was preempted.
    preempted = metric(llm, "vllm:num_preemptions_total", "smollm2_decoder")
    big = open_request(llm, "/v1/completions",
                       {"model": "smollm2", "prompt": ["Tell a tale", "Sing a song"], "n": 16,
                        "max_tokens": 1200, "ignore_eos": True}, auth("big"))
    assert wait_for(lambda: running(llm, "smollm2_decoder") == 32), llm.metrics_text()
    still_generates(llm, auth("other"))
    assert metric(llm, "vllm:num_preemptions_total", "smollm2_decoder") > preempted
    # big's request is still running (it is nowhere near its 1,200 tokens); leaving ends it.
    assert running(llm, "smollm2_decoder") >= 16
    big.close()
    assert wait_for(lambda: running(llm, "smollm2_decoder") == 0), llm.metrics_text()


def stalled_streams(server, path, body, count, headers=None):
    """An HTTP/2 client with a flow-control window of zero: it sends `count` requests and
    never reads a byte of their answers. Returns a function that closes it."""
    host, port = server.http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    data = json.dumps(body).encode()
    for _ in range(count):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                (":authority", server.http), ("content-type", "application/json"),
                                ("content-length", str(len(data)))]
                          + [(k.lower(), v) for k, v in (headers or {}).items()])
        conn.send_data(sid, data, end_stream=True)
    sock.sendall(conn.data_to_send())
    done = threading.Event()

    def pump():
        # Answers pings and settings so the connection stays up; grants no window.
        sock.settimeout(0.5)
        while not done.is_set():
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not chunk:
                return
            conn.receive_data(chunk)
            out = conn.data_to_send()
            if out:
                sock.sendall(out)

    threading.Thread(target=pump, daemon=True).start()

    def close():
        done.set()
        sock.close()
    return close


def test_a_client_that_never_reads_does_not_pin_the_decoder(llm):
    # Two streamed requests of 16 choices each hold all 32 rows and read nothing; another
    # client's request is still answered (the stall deadline, 600 s here, plays no part).
    preempted = metric(llm, "vllm:num_preemptions_total", "smollm2_decoder")
    close = stalled_streams(llm, "/v1/completions",
                            {"model": "smollm2", "prompt": "Tell me a long story", "n": 16,
                             "max_tokens": 1000, "stream": True, "ignore_eos": True}, 2,
                            auth("big"))
    try:
        assert wait_for(lambda: running(llm, "smollm2_decoder") == 32), llm.metrics_text()
        still_generates(llm, auth("other"))
        assert metric(llm, "vllm:num_preemptions_total", "smollm2_decoder") > preempted
    finally:
        close()
    assert wait_for(lambda: running(llm, "smollm2_decoder") == 0), llm.metrics_text()


def test_a_stream_nobody_reads_is_cancelled_at_the_stall_deadline(light):
    # As many streams nobody reads as the tiny decoder has instances (two per row and one
    # request's most sequences: 2 x 4 + 64): each instance waits on a full stream, and only the
    # stall deadline (2 s here) frees it, so that the next request is served at all.
    instances = 2 * 4 + 64
    close = stalled_streams(light, "/v2/models/tiny/generate_stream",
                            {"input_ids": [5, 6, 7], "max_tokens": 60, "end_id": -1}, instances)
    try:
        assert wait_for(lambda: metric(light, "vllm:generation_tokens_total", "tiny")
                        >= instances * 60)
        status, answer = post(light, "/v2/models/tiny/generate",
                              {"input_ids": [5, 6, 7], "max_tokens": 4, "end_id": -1}, timeout=120)
        assert status == 200 and answer["output_ids"], answer
    finally:
        close()


def cpu_seconds(server):
    with open(f"/proc/{server.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy(server, seconds=3.0):
    """CPU seconds the server spends over the next `seconds`."""
    start = cpu_seconds(server)
    time.sleep(seconds)
    return cpu_seconds(server) - start


@pytest.mark.parametrize("model", ["spin", "caller"])
def test_a_stage_whose_client_left_stops_with_the_calls_it_made(light, model):
    # `spin` loops until its 120 s deadline; `caller` waits in a call to `spin`. Once the
    # client leaves, the stage is interrupted within an epoch tick (and the call it made with
    # it), so the server goes quiet instead of burning a core for two minutes.
    sock = open_request(light, f"/v2/models/{model}/infer",
                        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1],
                                     "data": [1.0]}]})
    assert busy(light, 2.0) > 1.0  # spinning
    sock.close()
    time.sleep(1.0)
    assert busy(light) < 0.5
    # An interrupted stage did not crash: the model stays ready, and others are served.
    for _ in range(6):
        sock = open_request(light, "/v2/models/spin/infer",
                            {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1],
                                         "data": [1.0]}]})
        time.sleep(0.3)
        sock.close()
    time.sleep(1.0)
    host, port = light.http.rsplit(":", 1)
    ready = http.client.HTTPConnection(host, int(port), timeout=60)
    ready.request("GET", "/v2/models/spin/ready")
    assert ready.getresponse().status == 200
    status, answer = post(light, "/v2/models/echo/infer",
                          {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2],
                                       "data": [1.0, 2.0]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [1.0, 2.0], answer


def test_a_preempted_sequence_answers_as_if_it_had_never_left(llm):
    # Greedy choices of one prompt are all the same text; preempting one of them (tenant
    # other claims its share meanwhile) and prefilling it again must not change a token.
    preempted = metric(llm, "vllm:num_preemptions_total", "smollm2_decoder")
    answers = {}

    def big():
        answers["big"] = post(llm, "/v1/completions",
                              {"model": "smollm2", "prompt": ["The sea is", "My garden has"],
                               "n": 16, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
                              auth("big"))

    thread = threading.Thread(target=big)
    thread.start()
    assert wait_for(lambda: running(llm, "smollm2_decoder") == 32), llm.metrics_text()
    still_generates(llm, auth("other"))
    thread.join(600)
    assert metric(llm, "vllm:num_preemptions_total", "smollm2_decoder") > preempted
    status, answer = answers["big"]
    assert status == 200, answer
    texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    assert len(set(texts[:16])) == 1 and len(set(texts[16:])) == 1, texts
    assert answer["usage"]["completion_tokens"] == 32 * 40
