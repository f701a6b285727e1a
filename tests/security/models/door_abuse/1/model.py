"""Sends the host malformed frames through `_host.call` and reports what came back: every one
must be answered (an error or nothing), none may take the server down."""
import json
import struct

import _host
import numpy as np
import triton_python_backend_utils as pb_utils


def frame(op, header, data=b""):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return op + struct.pack("<I", len(h)) + h + data


ATTACKS = {
    "empty": lambda: _host.call(b""),
    "unknown_op": lambda: _host.call(b"Q" + b"\xff" * 64),
    "short_header": lambda: _host.call(b"I" + struct.pack("<I", 1 << 30) + b"{}"),
    "bad_json": lambda: _host.call(frame(b"I", b"{not json")),
    "tensor_past_end": lambda: _host.call(frame(b"I", {
        "model": "add_sub", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4],
                                         "offset": 1 << 40, "size": 16}]})),
    "bad_datatype": lambda: _host.call(frame(b"I", {
        "model": "add_sub", "inputs": [{"name": "INPUT0", "datatype": "FP99", "shape": [4],
                                         "offset": 0, "size": 0}]})),
    "huge_shape": lambda: _host.call(frame(b"I", {
        "model": "add_sub", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                                         "shape": [1 << 62, 1 << 62], "offset": 0, "size": 16}]},
        b"\0" * 16)),
    "send_elsewhere": lambda: _host.call(frame(b"S", {"index": 1 << 40, "response": {}})),
    "wait_unknown": lambda: _host.call(b"W" + b"123456789"),
    "cancelled_unknown": lambda: _host.call(b"C" + b'{"index": 99}'),
    "stream_next_unknown": lambda: _host.call(b"X" + b"987654321"),
    "stream_cancel_junk": lambda: _host.call(b"Z" + b"\xff" * 64),
    # Decoupled calls opened and never read: the 65th is refused; the rest end with the batch.
    "stream_flood": lambda: [_host.call(frame(b"O", {"model": "add_sub", "inputs": [],
                                                     "decoupled": True}))
                             for _ in range(70)][-1],
    "metric_shadow": lambda: _host.call(b"M" + json.dumps(
        {"op": "family", "name": "nv_inference_count", "description": "x", "kind": "counter"}).encode()),
    "metric_junk": lambda: _host.call(b"M" + b"\x00\x01"),
    "metric_buckets": lambda: _host.call(b"M" + json.dumps(
        {"op": "family", "name": "abuse_hist", "description": "x", "kind": "histogram"}).encode())
        + _host.call(b"M" + json.dumps({"op": "metric", "family": "abuse_hist", "labels": {},
                                         "buckets": list(range(100000))}).encode()),
    "log_flood": lambda: [_host.call(b"L\x00" + b"x" * 4096) for _ in range(100)] and b"",
    "repository_junk": lambda: _host.call(b"P" + b"\x00\xff"),
    "repository_unknown": lambda: _host.call(b"P" + json.dumps(
        {"action": "format", "model": "add_sub"}).encode()),
    "repository_bad_version": lambda: _host.call(b"P" + json.dumps(
        {"action": "ready", "model": "add_sub", "version": "one"}).encode()),
    "repository_traversal": lambda: _host.call(b"P" + json.dumps(
        {"action": "load", "model": "planted", "config": "{}",
         "files": {"file:../../../../tmp/planted": "eA=="}}).encode()),
    "repository_bad_base64": lambda: _host.call(b"P" + json.dumps(
        {"action": "load", "model": "planted", "config": "{}",
         "files": {"file:1/model.onnx": "%%%"}}).encode()),
    "repository_self": lambda: _host.call(b"P" + json.dumps(
        {"action": "unload", "model": "door_abuse"}).encode()),
}


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            how = pb_utils.get_input_tensor_by_name(request, "HOW").as_numpy()[0].decode()
            try:
                answer = ATTACKS[how]()
                text = "answered: %r" % (bytes(answer)[:300],)
            except Exception as e:  # noqa: BLE001 - reported to the test
                text = "raised: %s" % type(e).__name__
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ANSWER", np.array([text.encode()], dtype=np.object_))]))
        return out
