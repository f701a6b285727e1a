"""What the sandbox's interpreter costs per operation, warm and cold: a `model.py` whose
`initialize` times the pieces of one batch's guest work (the frame's header read, a request's
objects, an answer written) in a tight loop, the same pieces once after 4 MB of memory were
touched (caches and TLB cold, as between two batches of a server whose client and network
share the cores), and a few plain Python and numpy operations; run under the release server,
then the same file under this machine's CPython (pb_utils the guest's own file) for the
native figures.

    python3 benches/python_sandbox_micro.py

Prints one JSON object per side: microseconds per operation.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
GUEST = os.path.join(ROOT, "host", "src", "runtime", "python", "guest")

MODEL = r'''
import json, marshal, struct, sys, time
import numpy as np
try:
    import triton_python_backend_utils as pb
except ImportError:
    pb = None

HEADER = {"requests": [{"inputs": [
    {"name": "INPUT0", "datatype": "FP32", "shape": [4], "offset": 0, "size": 16},
    {"name": "INPUT1", "datatype": "FP32", "shape": [4], "offset": 16, "size": 16}],
    "outputs": ["OUTPUT0", "OUTPUT1"], "id": "1"}]}
TEXT = json.dumps(HEADER).encode()
FRAME = struct.pack("<I", len(TEXT)) + TEXT + bytes(32)
MARSHALLED = marshal.dumps(HEADER)
ANSWER = {"responses": [{"outputs": [
    {"name": "OUTPUT0", "datatype": "FP32", "shape": [4], "offset": 0, "size": 16},
    {"name": "OUTPUT1", "datatype": "FP32", "shape": [4], "offset": 16, "size": 16}],
    "parameters": {}}]}
ENCODE = json.JSONEncoder(check_circular=False, separators=(",", ":")).encode


def per_call(f, n=5000):
    started = time.perf_counter_ns()
    for _ in range(n):
        f()
    return round((time.perf_counter_ns() - started) / n / 1000, 2)


def once(f, before, n=300):
    total = 0
    for _ in range(n):
        before()
        started = time.perf_counter_ns()
        f()
        total += time.perf_counter_ns() - started
    return round(total / n / 1000, 2)


def loop():
    s = 0
    for i in range(1000):
        s += i * 2
    return s


def bench():
    out = {}
    out["python loop, per iteration (x1000)"] = per_call(loop, 500)
    a = np.ones(4, np.float32)
    out["numpy a + b, 4 floats"] = per_call(lambda: a + a)
    out["json.loads of a batch header"] = per_call(lambda: json.loads(TEXT.decode()))
    out["marshal.loads of the same"] = per_call(lambda: marshal.loads(MARSHALLED))
    out["json encode of an answer header"] = per_call(lambda: ENCODE(ANSWER).encode())
    out["marshal.dumps of the same"] = per_call(lambda: marshal.dumps(ANSWER))
    if pb is not None:
        def parse():
            header, blob = pb._read_frame(FRAME)
            r = header["requests"][0]
            return pb.InferenceRequest._received(
                "m", [pb._tensor_from(t, blob) for t in r["inputs"]], r["outputs"],
                r.get("correlation_id", 0), r.get("id", ""), r.get("flags", 0),
                r.get("parameters") or {}, 0)
        big = np.ones(4 << 20, np.uint8)

        def pollute():
            big[::64] += 1

        out["batch frame read + request objects, tight loop"] = per_call(parse)
        out["the same, once"] = once(parse, lambda: None)
        out["the same, once after 4 MB touched"] = once(parse, pollute)
    return out


class TritonPythonModel:
    def initialize(self, args):
        print("MICRO " + json.dumps(bench()), flush=True)

    def execute(self, requests):
        return [pb.InferenceResponse([]) for _ in requests]


if __name__ == "__main__":
    print("MICRO " + json.dumps(bench()))
'''


def main():
    with tempfile.TemporaryDirectory() as repo:
        os.makedirs(os.path.join(repo, "micro", "1"))
        with open(os.path.join(repo, "micro", "1", "model.py"), "w") as f:
            f.write(MODEL)
        with open(os.path.join(repo, "micro", "config.pbtxt"), "w") as f:
            f.write('backend: "python"\n'
                    'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                    'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
        server = subprocess.Popen(
            [BINARY, "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address",
             "127.0.0.1", "--metrics-address", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for line in server.stderr:
                found = re.search(r"MICRO (\{.*\})", line)
                if found:
                    print("sandbox:", json.dumps(json.loads(found.group(1)), indent=1))
                    break
        finally:
            server.kill()
            server.wait()
        # Natively, pb_utils is the guest's own file, its host module a blank stand-in.
        preamble = ("import sys, types; sys.modules['_host'] = types.ModuleType('_host'); "
                    "sys.path.insert(0, %r)\n" % GUEST)
        native = subprocess.run([sys.executable, "-c", preamble + MODEL], capture_output=True,
                                text=True, check=True)
        found = re.search(r"MICRO (\{.*\})", native.stdout)
        print("native (%s):" % sys.version.split()[0],
              json.dumps(json.loads(found.group(1)), indent=1))


if __name__ == "__main__":
    main()
