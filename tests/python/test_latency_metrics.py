"""Triton's latency metrics, chosen with `--metrics-config` as on Triton: the first-response
histogram (`histogram_latencies=true`, its buckets per model from `model_metrics`), summaries
with quantiles (`summary_latencies=true`, `summary_quantiles`), and the duration counters that
`counter_latencies=false` turns off. Read from /metrics after requests sent with tritonclient."""
import re
import shutil
import subprocess

import numpy as np
import tritonclient.http as httpclient

from conftest import BINARY, Server, copy_models

BUCKETS = 'model_metrics { metric_control [ { metric_identifier { family: ' \
          '"nv_inference_first_response_histogram_ms" } histogram_options { buckets: ' \
          '[ 1, 60000 ] } } ] }\n'


def repo_with_two_models(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["identity_fp32"])
    shutil.copytree(repo / "identity_fp32", repo / "identity_buckets")
    with open(repo / "identity_buckets" / "config.pbtxt", "a") as f:
        f.write(BUCKETS)
    return repo


def send(server, model, n):
    client = httpclient.InferenceServerClient(server.http, network_timeout=120)
    x = np.ones((2, 3), np.float32)
    for _ in range(n):
        given = httpclient.InferInput("INPUT0", [2, 3], "FP32")
        given.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer(model, [given]).as_numpy("OUTPUT0"), x)


def value(text, sample):
    """The value of the one sample line that starts with `sample`."""
    found = [line for line in text.splitlines() if line.startswith(sample + " ")]
    assert len(found) == 1, (sample, text)
    return float(found[0].rsplit(" ", 1)[1])


def test_histograms_and_summaries_as_triton_reports_them(tmp_path):
    repo = repo_with_two_models(tmp_path)
    s = Server(str(repo), "--metrics-config=histogram_latencies=true",
               "--metrics-config", "summary_latencies=true",
               "--metrics-config=summary_quantiles=0.5:0.05,0.99:0.001")
    try:
        send(s, "identity_fp32", 5)
        send(s, "identity_buckets", 3)
        text = s.metrics_text()
        h = "nv_inference_first_response_histogram_ms"
        assert f"# TYPE {h} histogram" in text, text
        assert f"# HELP {h} Duration from request to first response in milliseconds" in text
        # Triton's default buckets, and the model's own from model_metrics.
        a = '{model="identity_fp32",version="1"'
        b = '{model="identity_buckets",version="1"'
        assert value(text, f'{h}_count{a}}}') == 5
        assert value(text, f'{h}_bucket{a},le="5000"}}') == 5
        assert value(text, f'{h}_bucket{a},le="+Inf"}}') == 5
        assert value(text, f'{h}_count{b}}}') == 3
        assert value(text, f'{h}_bucket{b},le="60000"}}') == 3
        assert f'{h}_bucket{b},le="100"}}' not in text
        assert f'{h}_bucket{a},le="60000"}}' not in text
        for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
            summary = f"nv_inference_{name}_summary_us"
            assert f"# TYPE {summary} summary" in text, text
            assert value(text, f"{summary}_count{a}}}") == 5
            for q in ("0.5", "0.99"):
                assert value(text, f'{summary}{a},quantile="{q}"}}') >= 0
            assert f'{summary}{a},quantile="0.9"}}' not in text
        # The median request took no longer than the slowest, and the sum holds them all.
        req = "nv_inference_request_summary_us"
        assert value(text, f'{req}{a},quantile="0.5"}}') <= value(text, f'{req}{a},quantile="0.99"}}')
        assert value(text, f"{req}_sum{a}}}") >= value(text, f'{req}{a},quantile="0.99"}}')
        # Counters stay on by default.
        assert value(text, f"nv_inference_request_duration_us{a}}}") > 0
    finally:
        s.stop()


def test_counter_latencies_false_drops_the_duration_counters_and_nothing_else(tmp_path):
    repo = repo_with_two_models(tmp_path)
    s = Server(str(repo), "--metrics-config=counter_latencies=false")
    try:
        send(s, "identity_fp32", 2)
        text = s.metrics_text()
        assert 'nv_inference_count{model="identity_fp32",version="1"} 2' in text, text
        for gone in ("nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                     "nv_inference_compute_infer_duration_us",
                     "nv_inference_first_response_histogram_ms", "_summary_us"):
            assert gone not in text, gone
    finally:
        s.stop()


def test_an_unknown_metrics_setting_stops_the_start_naming_it(tmp_path):
    repo = repo_with_two_models(tmp_path)
    done = subprocess.run([BINARY, "--model-repository", str(repo), "--http-port", "0",
                           "--grpc-port", "0", "--metrics-port", "0",
                           "--metrics-config=latency_histograms=true"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--metrics-config=latency_histograms=true: unknown setting 'latency_histograms'" \
        in done.stderr, done.stderr


def test_bad_model_metrics_buckets_are_refused_by_field(tmp_path):
    repo = repo_with_two_models(tmp_path)
    cfg = repo / "identity_buckets" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("[ 1, 60000 ]", "[ 60000, 1 ]"))
    s = Server(str(repo))
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("identity_fp32")
        assert not client.is_model_ready("identity_buckets")
        log = "".join(s.log)
        assert re.search(r"model_metrics\.metric_control\[0\]\.histogram_options\.buckets': "
                         r"bucket bounds must be finite and ascending", log), log[-3000:]
    finally:
        s.stop()
