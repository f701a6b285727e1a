"""Starts the real wasmtron binary on ephemeral loopback ports for the compatibility suite."""
import os
import shutil
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "debug", "wasmtron"))
STARTUP_SECONDS = 300


class Server:
    def __init__(self, repo, *extra, binary=None, env=None):
        """`repo` None: the repository comes in `extra`; `binary` and `env` replace the
        built binary and this process's environment."""
        self.log = []
        repository = [] if repo is None else ["--model-repository", repo]
        self.proc = subprocess.Popen(
            # Tests load repositories with models meant to fail: they keep the others serving
            # unless a test asks for Triton's default (--exit-on-error=true) itself.
            [binary or BINARY, *repository, "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
             "--metrics-address", "127.0.0.1", "--exit-on-error=false", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.addresses = {}
        found = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                if line.startswith("Started ") and " at " in line:
                    kind = line.split()[1]
                    self.addresses[kind] = line.rsplit(" at ", 1)[1].strip()
                    if len(self.addresses) == 3:
                        found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(STARTUP_SECONDS):
            self.stop()
            raise RuntimeError("wasmtron did not start:\n" + "".join(self.log))
        self.http = self.addresses["HTTPService"]
        self.grpc = self.addresses["GRPCInferenceService"]
        self.metrics = self.addresses["Metrics"]

    def metrics_text(self):
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=60) as r:
            return r.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def simple_inputs(mod, input0, input1, binary=True):
    """INPUT0 and INPUT1 of `simple` ([1, 16] INT32 arrays) for one of tritonclient's modules
    (http, grpc or their aio forms); `binary=False` sends HTTP inputs as JSON."""
    inputs = []
    for name, data in (("INPUT0", input0), ("INPUT1", input1)):
        t = mod.InferInput(name, [1, 16], "INT32")
        if "grpc" in mod.__name__:
            t.set_data_from_numpy(np.asarray(data, dtype=np.int32))
        else:
            t.set_data_from_numpy(np.asarray(data, dtype=np.int32), binary_data=binary)
        inputs.append(t)
    return inputs


def copy_models(dest, names):
    for name in names:
        shutil.copytree(os.path.join(ROOT, "model_repository", name), os.path.join(dest, name))


def model_variant(repo, name, source, replace):
    """A copy of the model folder `source` named `name` in `repo`, its config.pbtxt edited by
    `replace` (pairs of old and new text; each old text must be there)."""
    dest = os.path.join(repo, name)
    shutil.copytree(source, dest)
    path = os.path.join(dest, "config.pbtxt")
    with open(path) as f:
        text = f.read()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)


def serving(tmp_path_factory, name, models, *extra):
    """A server on a fresh repository holding `models` from model_repository/, for a
    module-scoped fixture to `yield from`; stopped when the module is done."""
    repo = tmp_path_factory.mktemp(name)
    copy_models(str(repo), models)
    s = Server(str(repo), *extra)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory, "repo",
                       ["simple", "identity_bytes", "identity_fp32", "rapid_orientation"])


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    yield from serving(tmp_path_factory, "explicit", ["simple", "identity_fp32"],
                       "--model-control-mode", "explicit", "--load-model", "identity_fp32")
