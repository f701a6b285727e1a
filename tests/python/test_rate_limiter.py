"""Triton's rate limiter (`--rate-limit=execution_count`, `--rate-limit-resource`,
`instance_group { rate_limiter }`): two models whose instances each need the one unit of a
resource never execute at the same time, though each has two instances and work queued; without
the flag the setting is logged as having no effect, as Triton ignores it then. The models are
Triton Python-backend models that report when each execution started and ended."""
import numpy as np
import tritonclient.http as httpclient

from conftest import Server

CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "SPAN", data_type: TYPE_FP64, dims: [ 2 ] } ]
instance_group [ { count: 2, kind: KIND_CPU,
                   rate_limiter { resources [ { name: "R", count: 1 } ] priority: 1 } } ]
"""

MODEL = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        start = time.time()
        time.sleep(0.05)
        end = time.time()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SPAN", np.array([start, end]))])
                for _ in requests]
'''


def write_repo(tmp_path):
    repo = tmp_path / "repo"
    for name in ("slow_a", "slow_b"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG)
        (repo / name / "1" / "model.py").write_text(MODEL)
    return repo


def spans(server, per_model):
    client = httpclient.InferenceServerClient(server.http, concurrency=2 * per_model,
                                              network_timeout=120)
    pending = []
    for i in range(2 * per_model):
        given = httpclient.InferInput("X", [1], "FP32")
        given.set_data_from_numpy(np.ones(1, np.float32))
        pending.append(client.async_infer(("slow_a", "slow_b")[i % 2], [given]))
    return sorted(tuple(p.get_result().as_numpy("SPAN")) for p in pending)


def test_instances_sharing_one_resource_take_turns(tmp_path):
    s = Server(str(write_repo(tmp_path)), "--rate-limit=execution_count",
               "--rate-limit-resource=R:1")
    try:
        executed = spans(s, 6)
        assert len(executed) == 12
        for (_, end), (start, _) in zip(executed, executed[1:]):
            assert start >= end, f"two executions overlapped: {executed}"
    finally:
        s.stop()


def test_without_the_flag_the_setting_is_logged_as_without_effect(tmp_path):
    s = Server(str(write_repo(tmp_path)))
    try:
        assert len(spans(s, 1)) == 2
        log = "".join(s.log)
        assert "field 'instance_group.rate_limiter' has no effect without " \
               "--rate-limit=execution_count" in log, log[-3000:]
    finally:
        s.stop()
