"""Shutdown with a drain delay (--drain-delay-secs), with the real binary: on SIGTERM readiness
turns false at once while requests are still served for the delay, then the server refuses new
ones and exits 0."""
import signal
import time

import numpy as np
import tritonclient.http as httpclient

from conftest import serving

import pytest


@pytest.fixture
def draining(tmp_path_factory):
    yield from serving(tmp_path_factory, "drain", ["simple"], "--drain-delay-secs", "8",
                       "--exit-timeout-secs", "10")


def simple_inputs():
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [1, 16], "INT32")
        t.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        inputs.append(t)
    return inputs


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
    assert c.infer("simple", simple_inputs()).as_numpy("OUTPUT0").tolist() == [[2] * 16]
    assert draining.proc.wait(60) == 0
