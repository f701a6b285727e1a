"""Model repositories in object storage, served from real servers on loopback: S3 (moto's
server) in Triton's `s3://host:port/bucket/path` form with the standard AWS credential
variables, poll mode noticing a model added, a configuration changed and a model removed while
the server serves; and Azure Blob Storage (Azurite) as `as://account/container/path`."""
import os
import socket
import subprocess
import sys
import time

import boto3
import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import ROOT, Server, simple_inputs

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
WAIT = 120  # seconds a change may take to show on a loaded machine (polls every second)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(proc, port, what):
    """Waits until `proc` accepts connections on `port` (or fails if it exits first)."""
    deadline = time.time() + WAIT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            assert time.time() < deadline and proc.poll() is None, f"{what} did not start"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free loopback port, and a boto3 client for it."""
    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        listening(proc, port, "moto_server")
        client = boto3.client("s3", endpoint_url=endpoint, **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"})
        client.create_bucket(Bucket="models")
        yield port, client
    finally:
        proc.terminate()
        proc.wait(30)


def upload(client, model, prefix="repo"):
    """Uploads model_repository/<model> under <prefix>/<model>/."""
    source = os.path.join(ROOT, "model_repository", model)
    for dirpath, _, files in os.walk(source):
        for f in files:
            path = os.path.join(dirpath, f)
            key = f"{prefix}/{model}/" + os.path.relpath(path, source).replace(os.sep, "/")
            client.upload_file(path, "models", key)


def delete(client, model, prefix="repo"):
    listed = client.list_objects_v2(Bucket="models", Prefix=f"{prefix}/{model}/")
    for obj in listed.get("Contents", []):
        client.delete_object(Bucket="models", Key=obj["Key"])


def eventually(check):
    deadline = time.time() + WAIT
    while not check():
        assert time.time() < deadline, "the change did not show"
        time.sleep(0.5)


def env():
    return dict(os.environ, **CREDENTIALS)


def test_poll_mode_follows_the_bucket_while_serving(s3):
    port, client = s3
    upload(client, "simple")
    server = Server(None, "--model-repository", f"s3://127.0.0.1:{port}/models/repo",
                    "--model-control-mode", "poll", "--repository-poll-secs", "1", env=env())
    try:
        c = httpclient.InferenceServerClient(server.http)
        a = np.arange(16, dtype=np.int32)
        assert (c.infer("simple", simple_inputs(httpclient, [a], [a])).as_numpy("OUTPUT0")
                == 2 * a).all()

        # A model added to the bucket is loaded.
        upload(client, "identity_fp32")
        eventually(lambda: c.is_model_ready("identity_fp32"))

        # A changed configuration is reloaded (the example's max_batch_size, lowered).
        config = client.get_object(Bucket="models", Key="repo/simple/config.pbtxt")["Body"].read()
        changed = config.decode().replace("max_batch_size: 8", "max_batch_size: 2")
        assert changed != config.decode()
        client.put_object(Bucket="models", Key="repo/simple/config.pbtxt", Body=changed.encode())
        eventually(lambda: c.get_model_config("simple")["max_batch_size"] == 2)
        assert (c.infer("simple", simple_inputs(httpclient, [a], [a])).as_numpy("OUTPUT0")
                == 2 * a).all()

        # A model removed from the bucket is unloaded; the others keep serving.
        delete(client, "identity_fp32")
        eventually(lambda: not c.is_model_ready("identity_fp32"))
        assert c.is_model_ready("simple")
    finally:
        server.stop()
    # The local copy lives in the temporary directory only while the server runs.
    leftovers = [d for d in os.listdir("/tmp") if d.startswith(f"wasmtron-repository-{server.proc.pid}-")]
    assert leftovers == [], leftovers


def test_the_endpoint_may_come_from_the_environment(s3):
    port, client = s3
    upload(client, "simple", prefix="plain")
    server = Server(None, "--model-repository", "s3://models/plain",
                    env=dict(env(), AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                             AWS_ALLOW_HTTP="true"))
    try:
        assert httpclient.InferenceServerClient(server.http).is_model_ready("simple")
    finally:
        server.stop()


def test_the_python_package_serves_a_bucket_in_process(s3, monkeypatch):
    """Triton's Ray Serve example takes its repository from S3_BUCKET_URL: the in-process
    server reads `s3://` as the binary does, in explicit mode, with the AWS variables."""
    wasmtron = pytest.importorskip("wasmtron")
    port, client = s3
    upload(client, "simple", prefix="inprocess")
    upload(client, "identity_bytes", prefix="inprocess")
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    server = wasmtron.Server(model_repository=f"s3://127.0.0.1:{port}/models/inprocess",
                             model_control_mode=wasmtron.ModelControlMode.EXPLICIT)
    server.start(wait_until_ready=True)
    try:
        assert {name for name, _ in server.models()} == {"simple", "identity_bytes"}
        model = server.load("identity_bytes")
        (response,) = model.infer(inputs={"INPUT0": [["from the bucket"]]})
        assert response.outputs["OUTPUT0"].to_string_array().tolist() == [["from the bucket"]]
    finally:
        server.stop()


@pytest.mark.parametrize("location,says", [
    ("s3://127.0.0.1:{port}/no-such-bucket/repo", "no-such-bucket"),
    ("s3://127.0.0.1:{port}/", "no bucket"),
])
def test_an_unreadable_repository_stops_the_server_with_a_clear_message(s3, location, says):
    port, _ = s3
    location = location.format(port=port)
    out = subprocess.run(
        [os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "debug", "wasmtron")),
         "--model-repository", location, "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--metrics-address", "127.0.0.1"],
        capture_output=True, text=True, timeout=WAIT, env=env())
    assert out.returncode != 0
    assert location in out.stderr and says in out.stderr, out.stderr


def test_the_kubernetes_s3_overlay_serves_the_bucket(s3):
    """deploy/kubernetes/overlays/s3-repository as it renders: its arguments and environment
    (the Secret's credentials and the endpoint of this loopback server added) serve the bucket."""
    from test_deploy_manifests import render
    port, client = s3
    upload(client, "simple", prefix="repository")
    deployment = render("kubernetes/overlays/s3-repository")[("Deployment", "wasmtron")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--model-repository=s3://models/repository" in container["args"]
    args = [a for a in container["args"] if not a.split("=")[0].endswith("-port")]
    pod_env = {e["name"]: e["value"] for e in container["env"]}
    assert [s["secretRef"]["name"] for s in container["envFrom"]] == ["wasmtron-s3"]
    server = Server(None, *args, env=dict(env(), **pod_env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                                          AWS_ALLOW_HTTP="true"))
    try:
        assert httpclient.InferenceServerClient(server.http).is_model_ready("simple")
    finally:
        server.stop()


# Azurite's documented development account (a public, well-known key).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")


@pytest.fixture(scope="module")
def azurite():
    """Azurite's Blob service (in memory, no telemetry) on a free loopback port, and a
    container client for its `models` container."""
    from azure.storage.blob import BlobServiceClient
    binary = os.environ.get("AZURITE", os.path.join(
        ROOT, "tests", "tools", "azurite", "node_modules", ".bin", "azurite-blob"))
    port = free_port()
    proc = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", str(port),
                             "--inMemoryPersistence", "--disableTelemetry",
                             "--skipApiVersionCheck"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        listening(proc, port, "azurite")
        service = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")
        yield endpoint, service.create_container("models")
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_azure_repository_is_served_and_followed(azurite):
    endpoint, container = azurite

    def put(model):
        source = os.path.join(ROOT, "model_repository", model)
        for dirpath, _, files in os.walk(source):
            for f in files:
                path = os.path.join(dirpath, f)
                with open(path, "rb") as data:
                    container.upload_blob(f"repo/{model}/" + os.path.relpath(path, source),
                                          data, overwrite=True)

    put("simple")
    server = Server(None, "--model-repository", f"as://{AZURITE_ACCOUNT}/models/repo",
                    "--model-control-mode", "poll", "--repository-poll-secs", "1",
                    env=dict(os.environ, AZURE_STORAGE_USE_EMULATOR="true",
                             AZURITE_BLOB_STORAGE_URL=endpoint))
    try:
        c = httpclient.InferenceServerClient(server.http)
        a = np.arange(16, dtype=np.int32)
        assert (c.infer("simple", simple_inputs(httpclient, [a], [a])).as_numpy("OUTPUT0")
                == 2 * a).all()
        put("identity_fp32")
        eventually(lambda: c.is_model_ready("identity_fp32"))
    finally:
        server.stop()
