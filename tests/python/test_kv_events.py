"""vLLM's KV-cache events (`--kv-events-config`, `--block-size`): an independent pyzmq +
msgpack subscriber, framed as vLLM's ZmqEventPublisher frames (topic, 8-byte sequence number,
msgpack KVEventBatch), rebuilds the server's block index from BlockStored / BlockRemoved /
AllBlocksCleared alone, and after every request of a bounded mixed workload (shared system
prefixes, repeats, evictions from a small prefix cache) it equals the blocks the server says
it holds (`GET /v2/models/<model>/kv_cache`). Each block's hash is checked against vLLM's
`sha256_cbor_64bit` chaining recomputed here, and the metrics the Gateway API Inference
Extension's endpoint picker reads are there under vLLM's names."""
import hashlib
import json
import random
import re
import socket
import struct
import subprocess
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import zmq

from conftest import BINARY, Server
from test_generation import TINY, link_model

TOPIC = "kv@wasmtron-test"
BLOCK = 16
MODEL = "tiny_events"


def cbor(value):
    """CBOR for ints, None, lists and str, as cbor2 writes them."""
    def head(major, n):
        if n < 24:
            return bytes([major << 5 | n])
        for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
        raise ValueError(n)
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value) if value >= 0 else head(1, -1 - value)
    if isinstance(value, str):
        data = value.encode()
        return head(3, len(data)) + data
    return head(4, len(value)) + b"".join(cbor(v) for v in value)


def block_hash(parent, tokens, extra=None):
    """vLLM's sha256_cbor_64bit of (parent, tokens, extra keys)."""
    digest = hashlib.sha256(cbor([parent, list(tokens), extra])).digest()
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def subscriber():
    """A SUB socket the server's publisher connects to, and the address of the server's
    replay socket (a subscriber that joined late asks it for what it missed)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, sub, port, f"tcp://127.0.0.1:{free_port()}"
    sub.close(linger=0)
    ctx.term()


@pytest.fixture(scope="module")
def server(tmp_path_factory, subscriber):
    _, _, port, replay = subscriber
    repo = str(tmp_path_factory.mktemp("kv_events"))
    # A prefix cache of 160 tokens: three or so prompts, so that the workload evicts.
    link_model(repo, TINY, MODEL, lambda t: t + (
        'parameters { key: "prefix_cache_max_tokens" value { string_value: "160" } }\n'))
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": replay,
              "topic": TOPIC}
    s = Server(repo, "--kv-events-config", json.dumps(config), "--block-size", str(BLOCK))
    yield s
    s.stop()


def generate(server, ids, max_tokens=4):
    client = grpcclient.InferenceServerClient(server.grpc)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    inputs = []
    for name, value in [("input_ids", [ids]), ("max_tokens", [[max_tokens]])]:
        t = grpcclient.InferInput(name, list(np.shape(value)), "INT32")
        t.set_data_from_numpy(np.array(value, dtype=np.int32))
        inputs.append(t)
    client.async_stream_infer(MODEL, inputs)
    client.stop_stream()
    client.close()
    for _, error in answers:
        assert error is None, error
    return answers


def server_blocks(server):
    with urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/kv_cache") as r:
        said = json.load(r)
    assert said["block_size"] == BLOCK
    return sorted(said["blocks"])


class Index:
    """A router's view of the server, from the events alone."""

    def __init__(self, ctx, replay):
        self.blocks = {}  # hash -> tokens of the block
        self.seq = -1
        self.stored = self.removed = self.replayed = self.live = 0
        self.ctx, self.replay = ctx, replay

    def receive(self, frames):
        """A published batch; a gap before it (a subscriber that joined late, as this one
        does: the server's first batches go out before the subscription reaches it) is asked
        of the replay socket first, as vLLM's own subscriber example does."""
        topic, seq, payload = frames
        assert topic.decode() == TOPIC
        seq = struct.unpack(">q", seq)[0]
        self.live += 1
        if seq <= self.seq:
            return
        if seq > self.seq + 1:
            self.ask_replay(self.seq + 1, seq)
        self.apply(seq, payload)

    def ask_replay(self, start, until):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert dealer.poll(30_000), "no answer from the replay socket"
            _, seq, payload = dealer.recv_multipart()
            seq = struct.unpack(">q", seq)[0]
            if seq == -1:
                break
            if seq > self.seq and (until is None or seq < until):
                self.apply(seq, payload)
                self.replayed += 1
        dealer.close(linger=0)
        assert until is None or self.seq == until - 1, (self.seq, until)

    def apply(self, seq, payload):
        assert seq == self.seq + 1, (self.seq, seq)
        self.seq = seq
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch["ts"], float) and batch["data_parallel_rank"] == 0
        for event in batch["events"]:
            kind = event["type"]
            if kind == "BlockStored":
                hashes, tokens = event["block_hashes"], event["token_ids"]
                assert event["block_size"] == BLOCK and len(tokens) == BLOCK * len(hashes)
                assert event["medium"] == "CPU" and event["lora_id"] is None
                parent = event["parent_block_hash"]
                assert parent is None or parent in self.blocks, "a parent the router never saw"
                for i, h in enumerate(hashes):
                    block = tokens[i * BLOCK:(i + 1) * BLOCK]
                    assert h == block_hash(parent, block), "not vLLM's chained block hash"
                    assert h not in self.blocks, "stored twice"
                    self.blocks[h] = block
                    parent = h
                    self.stored += 1
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
                    self.removed += 1
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:
                raise AssertionError(f"unknown event {kind}")

    def catch_up(self, sub, expected, seconds=30):
        """Applies events until the index equals `expected` (the server's blocks)."""
        deadline = time.time() + seconds
        while sorted(self.blocks) != expected:
            left = deadline - time.time()
            assert left > 0, (sorted(self.blocks), expected)
            if sub.poll(int(min(left, 1) * 1000)):
                self.receive(sub.recv_multipart())
            else:
                # Nothing more is coming and the index is behind: what it missed is asked.
                self.ask_replay(self.seq + 1, None)


def test_a_subscriber_rebuilds_the_servers_blocks_from_its_events(server, subscriber):
    ctx, sub, _, replay = subscriber
    rng = random.Random(7)
    systems = [[rng.randrange(10, 300) for _ in range(32)] for _ in range(3)]
    index = Index(ctx, replay)
    for turn in range(36):
        system = systems[rng.randrange(len(systems))]
        tail = [rng.randrange(10, 300) for _ in range(rng.randrange(2, 22))]
        if turn % 5 == 4:
            tail = tail[:3]  # a repeat-like short turn: mostly shared blocks
        generate(server, system + tail)
        index.catch_up(sub, server_blocks(server))
    # The workload stored blocks, shared them (a prefix stored once) and evicted some.
    assert index.stored > 0 and index.removed > 0, (index.stored, index.removed)
    # Most batches came as published, not replayed.
    assert index.live > index.replayed, (index.live, index.replayed)
    assert len(index.blocks) <= 160 // BLOCK


def test_the_endpoint_pickers_metrics_are_served_under_vllm_names(server):
    text = server.metrics_text()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert f"# TYPE {name} gauge" in text, name
    info = re.search(rf'^vllm:cache_config_info{{model="{MODEL}",version="1",'
                     r'block_size="(\d+)",num_gpu_blocks="(\d+)",'
                     r'enable_prefix_caching="True"} 1$', text, re.M)
    assert info and int(info.group(1)) == BLOCK and int(info.group(2)) > 0, text[-2000:]


def test_a_model_without_events_says_so(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{server.http}/v2/models/nonexistent/kv_cache")
    assert e.value.code == 404


def test_vllm_s_config_errors_are_named(tmp_path):
    """A field vLLM's KVEventsConfig does not have, or a publisher other than ZeroMQ, stops
    the server at start naming it."""
    for bad, said in [('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "endpont"),
                      ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kafka")]:
        done = subprocess.run([BINARY, "--model-repository", str(tmp_path), "--http-port", "0",
                               "--grpc-port", "0", "--metrics-port", "0",
                               "--kv-events-config", bad],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and said in done.stderr, done.stderr


def test_malformed_replay_requests_are_ignored_and_replay_still_answers(server, subscriber):
    """The replay socket is reachable by any client that can reach the port: requests of the
    wrong shape (no start, a start of the wrong size, many frames, a flood of them) get no
    answer and break nothing; a well-formed request is still answered up to the end marker,
    and the server keeps serving."""
    ctx, _, _, replay = subscriber
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    for bad in ([b""], [b"", b"\x01\x02"], [b"", b"x" * 100_000], [b"", b"a", b"b", b"c"]):
        for _ in range(50):
            dealer.send_multipart(bad)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        assert dealer.poll(30_000), "the replay socket stopped answering"
        frames = dealer.recv_multipart()
        assert len(frames) == 3, frames[:2]
        seq = struct.unpack(">q", frames[1])[0]
        if seq == -1:
            break
        seqs.append(seq)
    dealer.close(linger=0)
    assert seqs == sorted(seqs)
    generate(server, list(range(10, 50)))
    assert server_blocks(server) is not None
