"""What the attack suite shares: a server of the real binary (from tests/python/conftest.py),
raw HTTP requests whose paths go out exactly as written (percent-encoding included, as an
attacker would send them), victims planted on disk whose fate each test checks, and the check
that the server still answers a real request correctly after an attack."""
import http.client
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from conftest import BINARY, ROOT, Server, copy_models, simple_inputs  # noqa: E402,F401

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

RANGE = np.arange(16, dtype=np.int32).reshape(1, 16)


def ulimit_binary(tmp_path, nofile):
    """The binary started under `ulimit -n nofile` (soft and hard), as a script to pass as
    Server's `binary`."""
    script = tmp_path / "wasmtron-ulimit"
    script.write_text(f'#!/bin/sh\nulimit -n {nofile} || exit 1\nexec "{BINARY}" "$@"\n')
    script.chmod(0o755)
    return str(script)


def raw(address, method, path, body=None, headers=None, timeout=60):
    """(status, parsed JSON or text) of one request, the path sent byte for byte."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text) if text else None
    except ValueError:
        return resp.status, text


def error_text(body):
    return body.get("error", "") if isinstance(body, dict) else str(body)


def plant_victim(tmp_path, name="victim"):
    """A directory with a file in it, outside anything the server owns; returns its path and a
    function that asserts both are still there, unchanged."""
    victim = tmp_path / name
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")

    def untouched():
        assert victim.is_dir(), f"{victim} was removed"
        assert (victim / "keep.txt").read_text() == "precious", f"{victim}/keep.txt changed"
        assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"], list(victim.iterdir())

    return victim, untouched


def still_serves(server, model="simple"):
    """A real request over HTTP and gRPC after the attack, with the right answer."""
    h = httpclient.InferenceServerClient(server.http, network_timeout=120)
    r = h.infer(model, simple_inputs(httpclient, RANGE, RANGE))
    assert (r.as_numpy("OUTPUT0") == RANGE + RANGE).all()
    g = grpcclient.InferenceServerClient(server.grpc)
    r = g.infer(model, simple_inputs(grpcclient, RANGE, RANGE))
    assert (r.as_numpy("OUTPUT1") == RANGE - RANGE).all()
    g.close()


def index_names(server):
    status, body = raw(server.http, "POST", "/v2/repository/index", {})
    assert status == 200, body
    return sorted({e["name"] for e in body})
