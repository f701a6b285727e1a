"""Lifecycle with the real binary: shutdown with a drain delay (on SIGTERM readiness turns
false at once while requests are still served for the delay, then new ones are refused and
the server exits 0), and reloads / version switches under traffic that lose nothing."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import BINARY, serving, simple_inputs

ONES = np.ones((1, 16), dtype=np.int32)


@pytest.fixture
def draining(tmp_path_factory):
    yield from serving(tmp_path_factory, "drain", ["simple"], "--drain-delay-secs", "8",
                       "--exit-timeout-secs", "10")


def test_sigterm_keeps_serving_through_the_drain_delay_then_exits_0(draining):
    c = httpclient.InferenceServerClient(draining.http, network_timeout=60)
    assert c.is_server_ready()
    draining.proc.send_signal(signal.SIGTERM)
    # Readiness turns false at once (the probe is polled: the signal is asynchronous)...
    deadline = time.monotonic() + 4
    while c.is_server_ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not c.is_server_ready()
    # ... while inference is still served during the delay.
    assert c.infer("simple", simple_inputs(httpclient, ONES, ONES)).as_numpy("OUTPUT0").tolist() == [[2] * 16]
    assert draining.proc.wait(60) == 0


def test_a_signal_as_soon_as_a_listener_is_up_drains_instead_of_killing(tmp_path):
    """SIGTERM the moment the first listener reports itself: the handler is in place by then,
    so the server drains and exits 0 (it used to be registered after every listener started,
    and a signal in between ended the process at once, while probes already said ready)."""
    from conftest import copy_models
    copy_models(str(tmp_path), ["simple"])
    proc = subprocess.Popen(
        [BINARY, "--model-repository", str(tmp_path), "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--metrics-address", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("Started "):
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{rest}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_reloads_and_version_switches_under_traffic_lose_nothing():
    """benches/soak.py, briefly: four clients over HTTP and gRPC while a model is reloaded or
    switches versions every second, then SIGTERM with the clients still sending."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, DURATION="8", RELOAD_EVERY="1", WASMTRON_BIN=BINARY)
    proc = subprocess.run([sys.executable, os.path.join(root, "benches", "soak.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed although accepted: 0" in proc.stdout, proc.stdout
    reloads = int(proc.stdout.split("reloads and version switches: ")[1].split()[0])
    assert reloads >= 3, proc.stdout
    assert "exit status after SIGTERM: 0" in proc.stdout, proc.stdout


def test_reloads_of_a_model_py_an_onnx_model_and_a_stage_under_traffic_lose_nothing():
    """benches/reloads.py, briefly: each kind of model reloaded back to back while clients send
    to it without pause; every request is answered (the reload swaps versions under traffic)."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, RELOADS="5", CLIENTS="2", BASELINE="1", WASMTRON_BIN=BINARY)
    proc = subprocess.run([sys.executable, os.path.join(root, "benches", "reloads.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| add_sub")
            or line.startswith("| simple")]
    assert len(rows) == 3, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[1]) > 0 and cells[2] == "0", row
