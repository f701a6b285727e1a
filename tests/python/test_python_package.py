"""The `wasmtron` Python package (python/, built and installed by `make python-package`): the
server in-process, called with NumPy arrays, with no network hop. Outputs are checked against
what the models compute; errors against the messages the HTTP API gives."""
import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import wasmtron
from conftest import copy_models


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("inprocess")
    copy_models(str(root), ["simple", "identity_bytes", "add_sub", "words"])
    return str(root)


@pytest.fixture(scope="module")
def server(repo):
    with wasmtron.Server(model_repository=repo) as s:
        yield s


def pair(k):
    a = np.arange(16, dtype=np.int32).reshape(1, 16) + 100 * k
    b = np.full((1, 16), k, dtype=np.int32)
    return a, b


def test_infer_returns_numpy_outputs(server):
    assert server.ready()
    assert server.model("simple").ready()
    a, b = pair(3)
    out = server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
    assert set(out) == {"OUTPUT0", "OUTPUT1"}
    assert out["OUTPUT0"].dtype == np.int32 and out["OUTPUT0"].shape == (1, 16)
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    only = server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b},
                                        output_names=["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]
    index = server.models()
    assert index[("simple", 1)]["state"] == "READY"


def test_bytes_round_trip_as_object_arrays(server):
    words = np.array([[b"alpha", "b\u00e9ta".encode(), b""]], dtype=np.object_)
    out = server.model("identity_bytes").infer(inputs={"INPUT0": words})
    assert out["OUTPUT0"].dtype == np.object_
    assert out["OUTPUT0"].tolist() == words.tolist()
    as_str = server.model("identity_bytes").infer(inputs={"INPUT0": np.array([["x", "yz"]])})
    assert as_str["OUTPUT0"].tolist() == [[b"x", b"yz"]]


def test_a_wasm_stage_runs_in_process(server):
    # add_sub does not batch: its inputs are [4].
    x = np.array([1.5, 2.0, -3.0, 4.25], dtype=np.float32)
    y = np.array([0.5, 1.0, 1.0, 0.25], dtype=np.float32)
    out = server.model("add_sub").infer(inputs={"INPUT0": x, "INPUT1": y})
    np.testing.assert_array_equal(out["OUTPUT0"], x + y)
    np.testing.assert_array_equal(out["OUTPUT1"], x - y)


def test_threads_and_asyncio_infer_concurrently(server):
    simple = server.model("simple")

    def one(k):
        a, b = pair(k)
        return k, simple.infer(inputs={"INPUT0": a, "INPUT1": b})["OUTPUT0"]

    with ThreadPoolExecutor(8) as pool:
        for k, got in pool.map(one, range(32)):
            a, b = pair(k)
            np.testing.assert_array_equal(got, a + b)

    async def many():
        calls = [simple.async_infer(inputs=dict(zip(("INPUT0", "INPUT1"), pair(k))))
                 for k in range(8)]
        return await asyncio.gather(*calls)

    for k, out in enumerate(asyncio.run(many())):
        a, b = pair(k)
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)


def test_mistakes_raise_the_servers_errors_and_it_keeps_serving(server):
    a, b = pair(1)
    with pytest.raises(wasmtron.InvalidArgumentError, match=r"Expected \[4\], got \[1,4\]"):
        server.model("add_sub").infer(inputs={"INPUT0": np.zeros((1, 4), np.float32),
                                              "INPUT1": np.zeros((1, 4), np.float32)})
    with pytest.raises(wasmtron.NotFoundError, match="'ghost'"):
        server.model("ghost").infer(inputs={"INPUT0": a})
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT0") as wrong:
        server.model("simple").infer(inputs={"INPUT0": a.astype(np.float32), "INPUT1": b})
    assert isinstance(wrong.value, wasmtron.WasmtronError)
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT1"):
        server.model("simple").infer(inputs={"INPUT0": a})
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT0"):
        server.model("simple").infer(inputs={"INPUT0": np.zeros((1, 15), np.int32), "INPUT1": b})
    with pytest.raises(wasmtron.NotFoundError, match="version 7"):
        server.model("simple", version=7).infer(inputs={"INPUT0": a, "INPUT1": b})
    with pytest.raises(wasmtron.InvalidArgumentError, match="parameter 'p'"):
        server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}, parameters={"p": [1]})
    with pytest.raises(wasmtron.UnsupportedError, match="explicit"):
        server.load("simple")
    out = server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    assert 'nv_inference_request_success{model="simple",version="1"}' in server.metrics()


def test_explicit_control_and_lifecycle(repo):
    s = wasmtron.Server(model_repository=repo, model_control_mode="explicit",
                        load_models=["simple"])
    with pytest.raises(wasmtron.UnavailableError, match="start"):
        s.model("simple").infer(inputs={})
    s.start()
    a, b = pair(2)
    assert s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})["OUTPUT0"].sum() > 0
    assert not s.model("identity_bytes").ready()
    s.load("identity_bytes")
    assert s.model("identity_bytes").ready()
    s.unload("simple")
    with pytest.raises(wasmtron.NotFoundError, match="simple"):
        s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
    # A second server in the same process serves the same repository side by side.
    with wasmtron.Server(model_repository=repo) as other:
        out = other.model("identity_bytes").infer(inputs={"INPUT0": np.array([[b"two"]], dtype=object)})
        assert out["OUTPUT0"].tolist() == [[b"two"]]
    assert s.stop() is True
    with pytest.raises(wasmtron.UnavailableError):
        s.model("identity_bytes").infer(inputs={"INPUT0": np.array([[b"x"]], dtype=object)})
    with pytest.raises(wasmtron.InvalidArgumentError, match="model_control_mode 'sometimes'"):
        wasmtron.Server(model_repository=repo, model_control_mode="sometimes")
    with pytest.raises(wasmtron.InvalidArgumentError, match="not a directory"):
        wasmtron.Server(model_repository=repo + "/nope").start()


def test_a_dropped_server_drains_and_stops(repo):
    s = wasmtron.Server(model_repository=repo).start()
    simple = s.model("simple")
    a, b = pair(5)
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(simple.infer, {"INPUT0": a, "INPUT1": b}) for _ in range(16)]
        results = [f.result() for f in answers]
    assert all((r["OUTPUT0"] == a + b).all() for r in results)
    del s, simple
    gc.collect()  # drops the core: drains, unloads, stops its runtime, without hanging


def test_a_decoupled_model_streams_its_responses(server):
    words = server.model("words")
    text = np.array(["the quick brown fox"], dtype=object)
    got = [(r["WORD"].tolist(), r["POSITION"].tolist()) for r in words.infer_stream(inputs={"TEXT": text})]
    assert got == [([b"the"], [0]), ([b"quick"], [1]), ([b"brown"], [2]), ([b"fox"], [3])]
    # Leaving early is fine; a plain model streams its one response.
    first = next(iter(words.infer_stream(inputs={"TEXT": text})))
    assert first["WORD"].tolist() == [b"the"]
    a, b = pair(4)
    (only,) = list(server.model("simple").infer_stream(inputs={"INPUT0": a, "INPUT1": b}))
    np.testing.assert_array_equal(only["OUTPUT0"], a + b)
    with pytest.raises(wasmtron.InvalidArgumentError, match="decoupled.*infer_stream"):
        words.infer(inputs={"TEXT": text})
    with pytest.raises(wasmtron.NotFoundError, match="'ghost'"):
        list(server.model("ghost").infer_stream(inputs={"TEXT": text}))


def test_statistics_count_what_ran(repo):
    with wasmtron.Server(model_repository=repo) as s:
        a, b = pair(1)
        for _ in range(3):
            s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
        stats = s.model("simple").statistics()["model_stats"][0]
        assert (stats["name"], stats["version"], stats["inference_count"]) == ("simple", "1", 3)
        assert stats["inference_stats"]["success"]["count"] == 3
        every = {m["name"] for m in s.statistics()["model_stats"]}
        assert {"simple", "identity_bytes", "add_sub", "words"} <= every


def test_the_same_server_answers_remote_callers_on_its_listeners(repo):
    import socket
    import urllib.request

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    s = wasmtron.Server(model_repository=repo).start(http_port=0, grpc_port=0, metrics_port=0)
    urls = s.addresses
    assert set(urls) == {"http", "grpc", "metrics"}
    a, b = pair(6)
    # A remote call over each protocol, then one in-process: the statistics count all three.
    http = httpclient.InferenceServerClient(urls["http"])
    assert http.is_server_ready() and http.is_model_ready("simple")
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    np.testing.assert_array_equal(http.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
    grpc = grpcclient.InferenceServerClient(urls["grpc"])
    ginputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
               grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    ginputs[0].set_data_from_numpy(a)
    ginputs[1].set_data_from_numpy(b)
    np.testing.assert_array_equal(grpc.infer("simple", ginputs).as_numpy("OUTPUT1"), a - b)
    s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
    assert s.model("simple").statistics()["model_stats"][0]["inference_count"] == 3
    metrics = urllib.request.urlopen(f"http://{urls['metrics']}/metrics", timeout=30).read().decode()
    assert 'nv_inference_request_success{model="simple",version="1"} 3' in metrics
    grpc.close()
    http.close()
    # A port in use fails the start, naming the listener; the first server is untouched.
    with pytest.raises(wasmtron.UnavailableError, match="cannot listen on .* for http"):
        wasmtron.Server(model_repository=repo).start(http_port=int(urls["http"].rsplit(":", 1)[1]))
    assert s.stop() is True
    assert s.addresses == {}
    host, port = urls["http"].rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_outputs_lend_the_servers_memory_and_outlive_the_server(repo):
    s = wasmtron.Server(model_repository=repo).start()
    a, b = pair(7)
    out = s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})["OUTPUT0"]
    owner = out
    while isinstance(owner, (np.ndarray, memoryview)):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    # No copy into a Python bytes object: the array reads the server's own output memory.
    assert type(owner).__name__ == "TensorBuffer" and len(owner) == a.nbytes
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1
    assert memoryview(owner).readonly
    s.stop()
    del s
    gc.collect()
    np.testing.assert_array_equal(out, a + b)  # still valid: the array owns its memory
    words = wasmtron.Server(model_repository=repo).start()
    text = words.model("identity_bytes").infer(inputs={"INPUT0": np.array([[b"kept"]], dtype=object)})
    words.stop()
    assert text["OUTPUT0"].tolist() == [[b"kept"]]


def test_a_server_config_file_guards_the_listeners_not_in_process_calls(repo, tmp_path):
    import subprocess

    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from conftest import BINARY

    key = "py-tenant-key-123"
    hashed = subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True,
                            check=True).stdout.strip()
    config = tmp_path / "wasmtron.toml"
    config.write_text(f'[[tenant]]\nname = "team"\napi_keys = [{hashed}]\ninfer = ["simple"]\n')
    with pytest.raises(wasmtron.InvalidArgumentError, match="nope.toml"):
        wasmtron.Server(model_repository=repo, config=str(tmp_path / "nope.toml"))
    s = wasmtron.Server(model_repository=repo, config=str(config)).start(http_port=0)
    try:
        a, b = pair(8)
        np.testing.assert_array_equal(
            s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})["OUTPUT0"], a + b)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                  httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        client = httpclient.InferenceServerClient(s.addresses["http"])
        with pytest.raises(InferenceServerException) as refused:
            client.infer("simple", inputs)
        assert refused.value.status() == "401"
        out = client.infer("simple", inputs, headers={"authorization": f"Bearer {key}"})
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
        words = httpclient.InferInput("INPUT0", [1, 1], "BYTES")
        words.set_data_from_numpy(np.array([[b"x"]], dtype=object))
        with pytest.raises(InferenceServerException) as other_model:
            client.infer("identity_bytes", [words], headers={"authorization": f"Bearer {key}"})
        assert other_model.value.status() in ("403", "404")
        client.close()
    finally:
        s.stop()


def test_the_readmes_python_snippets_run(monkeypatch):
    """The README's snippets, as a user copies them (fixed ports swapped for free ones)."""
    import os
    import re

    from conftest import ROOT

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## From Python, in-process"):text.index("## GPU builds")]
    snippets = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(snippets) >= 2, "the README's Python section lost its snippets"
    monkeypatch.chdir(ROOT)
    for code in snippets:
        code = re.sub(r"(http|grpc|metrics)_port=\d+", r"\1_port=0", code)
        scope = {}
        exec(compile(code, "README.md", "exec"), scope)
        server = scope.get("server")
        if isinstance(server, wasmtron.Server):
            server.stop()
