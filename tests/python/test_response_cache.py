"""Triton's response cache in memory (`--cache-config local,size=N`, issue 42's first step): a
model with `response_cache { enable: true }` answers a request it answered before without
running; statistics and Triton's cache metrics count hits and misses; a tenant never gets
another tenant's cached answer; decoupled models are refused the cache, and a model that asks
for it on a server without one is told it has no effect."""
import os
import shutil

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server
from test_config_fields import ADD_CONFIG, WEIGHTS, write_model
from test_tenancy import digest

CACHED = ADD_CONFIG + "response_cache { enable: true }\n"
KEYS = {"alpha": "cache-alpha-key", "beta": "cache-beta-key"}


def stats(client, model):
    s = client.get_inference_statistics(model)["model_stats"][0]
    i = s["inference_stats"]
    return {"hit": i["cache_hit"]["count"], "miss": i["cache_miss"]["count"],
            "success": i["success"]["count"], "inferences": s["inference_count"]}


def ask(client, model, value, headers=None):
    x = np.full((1, 1024), value, dtype=np.float32)
    given = httpclient.InferInput("x", [1, 1024], "FP32")
    given.set_data_from_numpy(x)
    y = client.infer(model, [given], headers=headers).as_numpy("y")
    np.testing.assert_allclose(y, x + WEIGHTS, rtol=1e-6)


def test_a_repeated_request_is_answered_from_the_cache(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "cached", CACHED)
    write_model(repo, "uncached", ADD_CONFIG)
    s = Server(str(repo), "--cache-config", "local,size=1048576")
    try:
        client = httpclient.InferenceServerClient(s.http)
        for _ in range(3):
            ask(client, "cached", 1.0)
        ask(client, "cached", 2.0)
        # The first request and the other input ran; the two repeats were hits.
        assert stats(client, "cached") == {"hit": 2, "miss": 2, "success": 4, "inferences": 2}
        for _ in range(2):
            ask(client, "uncached", 1.0)
        assert stats(client, "uncached") == {"hit": 0, "miss": 0, "success": 2, "inferences": 2}
        # The same cache over gRPC, with the request id of the asker.
        g = grpcclient.InferenceServerClient(s.grpc)
        given = grpcclient.InferInput("x", [1, 1024], "FP32")
        given.set_data_from_numpy(np.full((1, 1024), 2.0, dtype=np.float32))
        answer = g.infer("cached", [given], request_id="mine")
        assert answer.get_response().id == "mine"
        assert stats(client, "cached")["hit"] == 3
        metrics = s.metrics_text()
        assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 3' in metrics, metrics
        assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 2' in metrics
        assert 'model="uncached"' not in "\n".join(
            line for line in metrics.splitlines() if line.startswith("nv_cache_"))
    finally:
        s.stop()


ENSEMBLE = """platform: "ensemble"
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1024 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1024 ] } ]
ensemble_scheduling { step [ { model_name: "plain", model_version: -1,
  input_map { key: "x" value: "X" }, output_map { key: "y" value: "Y" } } ] }
response_cache { enable: true }
"""


def test_an_ensemble_is_cached_at_the_top_level(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "plain", ADD_CONFIG)
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(ENSEMBLE)
    s = Server(str(repo), "--cache-config", "local,size=1048576")
    try:
        client = httpclient.InferenceServerClient(s.http)
        for _ in range(3):
            x = np.full((1, 1024), 5.0, dtype=np.float32)
            given = httpclient.InferInput("X", [1, 1024], "FP32")
            given.set_data_from_numpy(x)
            y = client.infer("pipeline", [given]).as_numpy("Y")
            np.testing.assert_allclose(y, x + WEIGHTS, rtol=1e-6)
        pipeline = client.get_inference_statistics("pipeline")["model_stats"][0]
        step = client.get_inference_statistics("plain")["model_stats"][0]
        assert pipeline["inference_stats"]["cache_hit"]["count"] == 2, pipeline
        # The step ran once: the repeats never reached it.
        assert step["inference_count"] == 1, step
    finally:
        s.stop()


def test_a_tenant_never_gets_another_tenants_cached_answer(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "cached", CACHED)
    config = tmp_path / "wasmtron.toml"
    config.write_text("".join(
        f'[[tenant]]\nname = "{name}"\napi_keys = [{digest(key)}]\ninfer = ["cached"]\n\n'
        for name, key in KEYS.items()) + '[[tenant]]\nname = "ops"\napi_keys = ['
        + digest("cache-ops-key") + ']\nadmin = true\n')
    s = Server(str(repo), "--config", str(config), "--cache-config", "local,size=1048576")
    try:
        client = httpclient.InferenceServerClient(s.http)
        auth = {name: {"Authorization": f"Bearer {key}"} for name, key in KEYS.items()}
        ask(client, "cached", 3.0, auth["alpha"])
        ask(client, "cached", 3.0, auth["beta"])
        ask(client, "cached", 3.0, auth["alpha"])
        ops = {"Authorization": "Bearer cache-ops-key"}
        model_stats = client.get_inference_statistics("cached", headers=ops)["model_stats"][0]
        i = model_stats["inference_stats"]
        # beta's identical request ran: only alpha's repeat was a hit.
        assert (i["cache_hit"]["count"], i["cache_miss"]["count"]) == (1, 2), model_stats
    finally:
        s.stop()


def test_decoupled_models_are_refused_the_cache_and_no_cache_means_no_effect(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "model_repository", "words"), repo / "words")
    with open(repo / "words" / "config.pbtxt", "a") as f:
        f.write("\nresponse_cache { enable: true }\n")
    write_model(repo, "cached", CACHED)
    s = Server(str(repo), "--model-control-mode=explicit", "--cache-config=local,size=65536")
    try:
        client = httpclient.InferenceServerClient(s.http)
        try:
            client.load_model("words")
            raise AssertionError("a decoupled model was given the cache")
        except InferenceServerException as e:
            assert "field 'response_cache.enable': a decoupled model's answers are not cached" \
                in str(e), e
    finally:
        s.stop()
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model=cached")
    try:
        client = httpclient.InferenceServerClient(s.http)
        ask(client, "cached", 1.0)
        ask(client, "cached", 1.0)
        assert stats(client, "cached") == {"hit": 0, "miss": 0, "success": 2, "inferences": 2}
        assert any("field 'response_cache.enable' has no effect here: the server was started "
                   "without --cache-config" in line for line in s.log), "".join(s.log)
    finally:
        s.stop()


def test_an_ensembles_answers_carry_the_requests_sequence_flags(tmp_path):
    """Triton's L0_simple_ensemble test_ensemble_sequence_flags, written here: three requests
    of one sequence sent on a gRPC stream to an ensemble come back with sequence_start and
    sequence_end as the requests set them (true on the first and on the last); a request
    without sequence parameters gets none back."""
    import queue
    import tritonclient.grpc as grpcclient
    repo = tmp_path / "repo"
    write_model(repo, "plain", ADD_CONFIG)
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(
        ENSEMBLE.replace("response_cache { enable: true }\n", ""))
    s = Server(str(repo))
    try:
        c = grpcclient.InferenceServerClient(s.grpc)
        got = queue.Queue()
        c.start_stream(lambda result, error: got.put((result, error)))
        x = grpcclient.InferInput("X", [1, 1024], "FP32")
        x.set_data_from_numpy(np.ones((1, 1024), np.float32))
        flags = [(True, False), (False, False), (False, True)]
        for i, (start, end) in enumerate(flags):
            c.async_stream_infer("pipeline", [x], request_id=str(i), sequence_id=7,
                                 sequence_start=start, sequence_end=end)
        c.async_stream_infer("pipeline", [x], request_id="plain")
        seen = {}
        for _ in range(4):
            result, error = got.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            p = response.parameters
            seen[response.id] = tuple(p[k].bool_param for k in ("sequence_start", "sequence_end")
                                      if k in p)
            if response.id != "plain":
                assert p["sequence_id"].int64_param == 7
        c.stop_stream()
        assert [seen[str(i)] for i in range(3)] == flags
        assert seen["plain"] == ()
    finally:
        s.stop()


def test_an_ensemble_runs_only_the_steps_the_requested_outputs_need(tmp_path):
    """Triton's L0_simple_ensemble test_ensemble_add_sub_one_output, written here: of two
    steps writing two outputs, a request for one output runs only the step that writes it
    (the other model's inference count stays 0); asking for both runs both."""
    import tritonclient.grpc as grpcclient
    repo = tmp_path / "repo"
    write_model(repo, "left", ADD_CONFIG)
    write_model(repo, "right", ADD_CONFIG)
    (repo / "two" / "1").mkdir(parents=True)
    (repo / "two" / "config.pbtxt").write_text("""platform: "ensemble"
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1024 ] } ]
output [ { name: "L", data_type: TYPE_FP32, dims: [ 1024 ] },
         { name: "R", data_type: TYPE_FP32, dims: [ 1024 ] } ]
ensemble_scheduling { step [
  { model_name: "left", model_version: -1, input_map { key: "x" value: "X" },
    output_map { key: "y" value: "L" } },
  { model_name: "right", model_version: -1, input_map { key: "x" value: "X" },
    output_map { key: "y" value: "R" } } ] }
""")
    s = Server(str(repo))
    try:
        c = grpcclient.InferenceServerClient(s.grpc)
        x = grpcclient.InferInput("X", [1, 1024], "FP32")
        x.set_data_from_numpy(np.ones((1, 1024), np.float32))

        def count(model):
            stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
            return int(stats.get("inference_count", 0))

        answer = c.infer("two", [x], outputs=[grpcclient.InferRequestedOutput("L")])
        assert answer.as_numpy("L") is not None and answer.as_numpy("R") is None
        assert (count("left"), count("right")) == (1, 0)
        both = c.infer("two", [x])
        assert both.as_numpy("L") is not None and both.as_numpy("R") is not None
        assert (count("left"), count("right")) == (2, 1)
    finally:
        s.stop()
