"""`tritonserver`'s command line starts `wasmtron` unchanged: Triton's flags and spellings
(`--flag=value`, repeated flags, booleans as true/false/1/0/on/off, per-backend
`--backend-config`) are honoured, refused at start naming the flag and why, or logged as having
no effect here; `--exit-on-error` (on by default, as in Triton) stops a server whose model fails
to load, naming it."""
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from conftest import BINARY, ROOT, Server, copy_models

# A launch line as production deployments write it (options from Triton's docs and the
# tritonserver examples that users copy).
PRODUCTION = [
    "--strict-model-config=false", "--log-verbose=0", "--log-info=1", "--log-warning=true",
    "--log-error=on", "--model-control-mode=explicit", "--load-model=*",
    "--model-load-thread-count=4", "--http-thread-count=3", "--allow-gpu-metrics=false",
    "--allow-cpu-metrics=true", "--metrics-interval-ms=2000",
    "--pinned-memory-pool-byte-size=268435456", "--cuda-memory-pool-byte-size=0:67108864",
    "--backend-directory=/opt/tritonserver/backends",
    "--backend-config=python,shm-default-byte-size=10485760",
    "--backend-config=onnxruntime,default-max-batch-size=8", "--id=prod-replica-1",
    "--grpc-keepalive-time=10000", "--grpc-keepalive-timeout=5000",
    "--grpc-keepalive-permit-without-calls=1", "--rate-limit=off", "--exit-timeout-secs=30",
    "--strict-readiness=1",
]
TRITON_LINE = re.compile(r'^[IWEV]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] ".*"')
ISO_LINE = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [IWEV] \d+ [\w.]+:\d+\] ".*"')


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    copy_models(str(path), ["simple", "identity_fp32"])
    return path


def test_a_production_command_line_starts_and_each_flag_does_what_it_says(repo, tmp_path):
    log = tmp_path / "server.log"
    # A model whose configuration names only its backend: auto-complete gives it the
    # --backend-config batch size and, as Triton's ONNX Runtime backend does, the dynamic batcher.
    auto = repo / "identity_auto"
    (auto / "1").mkdir(parents=True)
    onnx = os.path.join(ROOT, "model_repository", "identity_fp32", "1", "model.onnx")
    shutil.copy(onnx, auto / "1" / "model.onnx")
    (auto / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    # One that gives only its batch size gets the dynamic batcher too (Triton adds it whenever
    # the model batches, max_batch_size > 1 and no scheduler is named).
    sized = repo / "identity_sized"
    (sized / "1").mkdir(parents=True)
    shutil.copy(onnx, sized / "1" / "model.onnx")
    (sized / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 4\n')
    s = Server(str(repo), *PRODUCTION, "--log-format=default", f"--log-file={log}")
    try:
        with urllib.request.urlopen(f"http://{s.http}/v2", timeout=60) as r:
            metadata = r.read().decode()
        assert '"name":"prod-replica-1"' in metadata, metadata
        with urllib.request.urlopen(f"http://{s.http}/v2/models/simple/ready", timeout=60) as r:
            assert r.status == 200
        url = f"http://{s.http}/v2/models/identity_auto/config"
        with urllib.request.urlopen(url, timeout=60) as r:
            config = json.loads(r.read())
        assert config["max_batch_size"] == 8, config
        assert "dynamic_batching" in config, config
        assert config["input"][0]["dims"] == [-1], config
        url = f"http://{s.http}/v2/models/identity_sized/config"
        with urllib.request.urlopen(url, timeout=60) as r:
            config = json.loads(r.read())
        assert config["max_batch_size"] == 4 and "dynamic_batching" in config, config
        text = log.read_text()
        lines = [line for line in text.splitlines() if line]
        assert lines and all(TRITON_LINE.match(line) for line in lines), lines[:5]
        assert any("async runtime's threads" in line and "threads=3" in line for line in lines)
        # --allow-cpu-metrics=true: the host's CPU and memory among the metrics, as Triton's.
        metrics = s.metrics_text()
        for name in ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"):
            assert f"\n{name} " in metrics, name
        for flag in ("--pinned-memory-pool-byte-size=268435456", "--backend-directory",
                     "--backend-config=python,shm-default-byte-size=10485760"):
            assert any(flag in line and "no effect" in line for line in lines), flag
        # Nothing of the log went to the standard error but what the harness reads.
        assert not any("no effect" in line for line in s.log)
    finally:
        s.stop()


def test_log_levels_and_the_iso8601_format(repo, tmp_path):
    log = tmp_path / "iso.log"
    s = Server(str(repo), "--log-format=ISO8601", f"--log-file={log}",
               "--pinned-memory-pool-byte-size=1")
    s.stop()
    lines = [line for line in log.read_text().splitlines() if line]
    assert lines and all(ISO_LINE.match(line) for line in lines), lines[:5]
    assert any("--pinned-memory-pool-byte-size=1 has no effect" in line for line in lines)
    # Info lines off: the same start logs none of them.
    quiet = tmp_path / "quiet.log"
    s = Server(str(repo), "--log-format=ISO8601", f"--log-file={quiet}", "--log-info=off",
               "--pinned-memory-pool-byte-size=1")
    s.stop()
    assert not any(line.split()[1] == "I" for line in quiet.read_text().splitlines() if line)


@pytest.mark.parametrize("flag,says", [
    ("--grpc-use-ssl=true", "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
    ("--cache-config=redis,host=127.0.0.1", "the redis cache needs host and port"),
    ("--rate-limit-resource=R:1", "--rate-limit-resource needs --rate-limit=execution_count"),
    ("--allow-sagemaker=1", "--allow-sagemaker=1 is refused"),
    ("--backend-config=onnxruntime,no-such-setting=1", "unknown setting 'no-such-setting'"),
    ("--allow-http=maybe", "'maybe' is not a boolean"),
])
def test_flags_for_what_is_not_served_stop_the_start_naming_the_flag(repo, flag, says):
    out = subprocess.run([BINARY, "--model-repository", str(repo), "--http-port", "0",
                          "--grpc-port", "0", "--metrics-port", "0", flag],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert says in out.stderr, out.stderr


def test_a_model_that_fails_at_start_stops_the_server_naming_it(repo):
    broken = repo / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 0\n')
    command = [BINARY, "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address",
               "127.0.0.1", "--metrics-address", "127.0.0.1"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "failed to load a model" in out.stderr and "'broken'" in out.stderr, out.stderr[-2000:]
    assert "Started HTTPService" not in out.stderr
    # --exit-on-error=false serves the models that loaded, not ready under strict readiness.
    s = Server(str(repo), "--exit-on-error=false")
    try:
        with urllib.request.urlopen(f"http://{s.http}/v2/models/simple/ready", timeout=60) as r:
            assert r.status == 200
    finally:
        s.stop()


def test_the_logging_extension_turns_levels_off_at_run_time(repo):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    s = Server(str(repo), "--model-control-mode=explicit", "--log-info=true")
    try:
        h = httpclient.InferenceServerClient(s.http)
        settings = h.get_log_settings()
        assert settings["log_info"] is True and settings["log_verbose_level"] == 0, settings
        h.load_model("simple")
        assert any("loading model" in line and "simple" in line for line in s.log)
        # Info lines off, as Triton's client asks: the next load writes none.
        assert h.update_log_settings({"log_info": False})["log_info"] is False
        h.load_model("identity_fp32")
        assert not any("loading model" in line and "identity_fp32" in line for line in s.log)
        g = grpcclient.InferenceServerClient(s.grpc)
        assert g.get_log_settings(as_json=True)["settings"]["log_info"]["bool_param"] is False
        # The file cannot change at run time: refused in Triton's words (Triton's L0_logging
        # logging_endpoint_test), and nothing is changed.
        with pytest.raises(Exception, match="log file location can not be updated through "
                                            "network protocol"):
            h.update_log_settings({"log_warning": False, "log_file": "/tmp/elsewhere.log"})
        assert h.get_log_settings()["log_warning"] is True
        # The format can (L0_logging's dynamic format case): the next lines are Triton's.
        assert h.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        h.unload_model("identity_fp32")
        g.update_log_settings({"log_info": True})
        h.load_model("identity_fp32")
        iso = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z I \d+ [\w.]+:\d+\] ")
        wait_until(lambda: any(iso.match(line) and "identity_fp32" in line for line in s.log))
        with pytest.raises(Exception, match="invalid argument for --log_format, got: json"):
            h.update_log_settings({"log_format": "json"})
        assert h.update_log_settings({"log_format": "default"})["log_format"] == "default"
        g.update_log_settings({"log_info": False})
        # Verbose lines turned on at run time, though the server started without them.
        assert not any("version ready to schedule" in line for line in s.log)
        g.update_log_settings({"log_verbose_level": 1})
        h.load_model("simple")
        # Triton's default lines now (the format was set back to "default" above): verbose
        # lines are "V<mmdd> <time> <pid> <file>:<line>] ...".
        verbose = re.compile(r"^V\d{4} \d{2}:\d{2}:\d{2}\.\d{6} \d+ ")
        wait_until(lambda: any(verbose.match(line) and "version ready to schedule" in line
                               and "simple" in line for line in s.log))
    finally:
        s.stop()


def wait_until(seen, timeout=30):
    """Waits for `seen()` (the log is read from the server's stderr as it comes)."""
    deadline = time.monotonic() + timeout
    while not seen() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen()


@pytest.mark.parametrize("threads", [1, 3])
def test_model_load_threads_load_that_many_models_at_once(repo, threads):
    copy_models(str(repo), ["identity_bytes"])
    s = Server(str(repo), f"--model-load-thread-count={threads}")
    try:
        with urllib.request.urlopen(f"http://{s.http}/v2/health/ready", timeout=60) as r:
            assert r.status == 200
        events = [("start" if "loading model" in line else "end", line) for line in s.log
                  if "loading model" in line or "model loaded" in line]
        assert len(events) == 6, s.log
        kinds = [kind for kind, _ in events]
        # One thread: each load ends before the next starts; three: the three start together.
        want = ["start", "end"] * 3 if threads == 1 else ["start"] * 3 + ["end"] * 3
        assert kinds == want, events
    finally:
        s.stop()


def test_the_manual_lists_every_triton_flag_and_what_it_does(repo):
    # The flags the server takes for compatibility are in docs/command-line.md, each with its
    # treatment, so that a user can look up what a launch line does before running it.
    with open(os.path.join(ROOT, "docs", "command-line.md")) as f:
        readme = f.read()
    out = subprocess.run([BINARY, "--help"], capture_output=True, text=True, timeout=60)
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", out.stdout, re.M)) - {"--help", "--version"}
    missing = sorted(f for f in flags if f"`{f}" not in readme)
    assert not missing, missing


def test_compile_fills_the_cache_so_the_first_start_compiles_nothing(tmp_path):
    """`wasmtron compile` compiles each stage of a repository ahead of time (a bad component is
    named and fails the command, the others still compiled); a server on that cache loads the
    stage from it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["add_sub", "identity_fp32"])
    shutil.copytree(repo / "add_sub", repo / "broken")
    (repo / "broken" / "1" / "model.wasm").write_bytes(b"not a component")
    cache = tmp_path / "cache"
    command = [BINARY, "compile", "--model-repository", str(repo), "--wasm-cache-dir", str(cache)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode != 0, first.stdout + first.stderr
    assert re.search(r"^add_sub \(version 1\): compiled in ", first.stdout, re.M), first.stdout
    assert re.search(r"^broken \(version 1\): .*not a valid WebAssembly component", first.stdout,
                     re.M), first.stdout
    assert "identity_fp32" not in first.stdout  # an ONNX model: nothing to compile
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert "add_sub (version 1): already in the cache" in again.stdout, again.stdout

    shutil.rmtree(repo / "broken")
    server = Server(str(repo), "--wasm-cache-dir", str(cache))
    try:
        logged = "".join(server.log)
        assert re.search(r"stage component loaded from cache.*model=add_sub", logged), logged
    finally:
        server.stop()
