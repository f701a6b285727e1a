"""deploy/: the Kubernetes and KServe manifests, without a cluster. Every kustomization is
rendered (kubectl's kustomize where kubectl is installed, cross-checked against a small renderer
for the subset these files use, so the test also runs where kubectl is not) and every document
is validated strictly: core kinds against Kubernetes 1.32's schemas (kubernetes-validate), the
custom resources against the fields their CRDs define (k8s_schemas.py), with the pods and
containers inside them validated as core objects. Then the real binary is started with the
manifests' arguments, and what the manifests rely on is checked against it: the probes answer,
the named ports are the ports it serves, the autoscaling rule's metrics exist, the grace period
covers the drain."""
import copy
import os
import re
import socket
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

import jsonpatch
import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

import k8s_schemas
from conftest import ROOT, Server, copy_models, simple_inputs

DEPLOY = os.path.join(ROOT, "deploy")
KUSTOMIZATIONS = ["kubernetes/base", "kubernetes/overlays/volume-repository",
                  "kubernetes/overlays/s3-repository"]
PLAIN = ["kserve/clusterservingruntime.yaml", "kserve/inferenceservice.yaml",
         "kserve/llm-servingruntime.yaml"]
K8S_VERSION = "1.32.0"


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render_subset(directory):
    """What `kubectl kustomize` makes of the features deploy/ uses: resources (files and
    directories), `labels` without selectors, and RFC 6902 patches with a kind/name target."""
    spec = load_all(os.path.join(directory, "kustomization.yaml"))[0]
    allowed = {"apiVersion", "kind", "resources", "labels", "patches"}
    assert set(spec) <= allowed, f"{directory}: the test renderer lacks {set(spec) - allowed}"
    docs = []
    for res in spec.get("resources", []):
        path = os.path.normpath(os.path.join(directory, res))
        docs += render_subset(path) if os.path.isdir(path) else load_all(path)
    for label in spec.get("labels", []):
        assert not label.get("includeSelectors") and not label.get("includeTemplates"), label
        for d in docs:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for patch in spec.get("patches", []):
        target = patch["target"]
        ops = load_all(os.path.join(directory, patch["path"]))[0]
        hits = [d for d in docs if d["kind"] == target["kind"]
                and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, (directory, target)
        hits[0].update(jsonpatch.apply_patch(hits[0], ops))
    return docs


def by_key(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def render(name):
    directory = os.path.join(DEPLOY, name)
    docs = render_subset(directory)
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert by_key(yaml.safe_load_all(out.stdout)) == by_key(docs), name
    return by_key(docs)


def every_document():
    docs = {}
    for name in KUSTOMIZATIONS:
        for key, d in render(name).items():
            docs[(name,) + key] = d
    for name in PLAIN:
        for d in load_all(os.path.join(DEPLOY, name)):
            docs[(name, d["kind"], d["metadata"]["name"])] = d
    return docs


def pod_with(spec):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}


def validate(doc):
    """Raises when `doc` has a field its kind does not define, a wrong type, or misses a
    required one."""
    schema = k8s_schemas.CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    jsonschema.validate(doc, schema)
    # The Kubernetes objects inside the custom resources are checked as what they are.
    spec = doc["spec"]
    if doc["kind"] == "ClusterServingRuntime":
        kubernetes_validate.validate(pod_with({"containers": spec["containers"]}),
                                     K8S_VERSION, strict=True)
    elif doc["kind"] == "InferenceService":
        model = {k: v for k, v in spec["predictor"]["model"].items()
                 if k not in k8s_schemas.MODEL_FIELDS}
        pod = {k: v for k, v in spec["predictor"].items()
               if k != "model" and k not in k8s_schemas.COMPONENT_FIELDS}
        kubernetes_validate.validate(
            pod_with({**pod, "containers": [{"name": "kserve-container", **model}]}),
            K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def documents():
    return every_document()


def test_every_manifest_is_valid(documents):
    kinds = sorted({key[1] for key in documents})
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap",
            "ClusterServingRuntime", "InferenceService"} <= set(kinds), kinds
    for key, doc in documents.items():
        try:
            validate(doc)
        except Exception as e:  # the document's name makes the failure readable
            raise AssertionError(f"{key}: {e}") from e


@pytest.mark.parametrize("kind,path,typo", [
    ("HorizontalPodAutoscaler", ["spec", "metrics", 0, "pods", "target"], "averageValu"),
    ("Deployment", ["spec", "template", "spec", "containers", 0, "readinessProbe"], "periodSecond"),
    ("ServiceMonitor", ["spec", "endpoints", 0], "intervall"),
    ("ClusterServingRuntime", ["spec"], "protocolVersion"),
    ("ClusterServingRuntime", ["spec", "containers", 0], "arg"),
    ("InferenceService", ["spec", "predictor", "model"], "storageURI"),
])
def test_validation_rejects_a_misspelt_field(documents, kind, path, typo):
    doc = copy.deepcopy(next(d for key, d in documents.items() if key[1] == kind))
    node = doc
    for step in path:
        node = node[step]
    node[typo] = node.get(typo, 1)
    with pytest.raises(Exception):
        validate(doc)


def split_args(args, repo):
    """The manifest's arguments for a local run: the repository replaced by `repo`, the
    ports and addresses left to conftest.Server (ephemeral, loopback); returns the arguments and
    the ports the manifest asked for."""
    local, ports = [], {}
    for arg in args:
        flag, _, value = arg.partition("=")
        assert value, f"{arg}: the manifests write --flag=value"
        if flag == "--model-repository":
            local.append(f"--model-repository={repo}")
        elif flag in ("--http-port", "--grpc-port", "--metrics-port"):
            ports[flag[2:-5]] = int(value)
        else:
            assert not flag.endswith("-address"), arg
            local.append(arg)
    return local, ports


def flag(args, name):
    return next(int(a.split("=", 1)[1]) for a in args if a.startswith(f"--{name}="))


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_deployment_runs_as_its_manifest_says(documents, tmp_path):
    docs = by_key(d for key, d in documents.items() if key[0] == "kubernetes/base")
    deployment = docs[("Deployment", "wasmtron")]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args, ports = split_args(container["args"], tmp_path)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == ports, (named, ports)

    # Services reach the named ports of these pods; the ServiceMonitor finds the metrics one.
    pod_labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = docs[("ServiceMonitor", "wasmtron")]
    for (kind, name), svc in docs.items():
        if kind == "Service":
            assert svc["spec"]["selector"].items() <= pod_labels.items(), name
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(named), name
    scraped = [s for (kind, _), s in docs.items() if kind == "Service"
               and monitor["spec"]["selector"]["matchLabels"].items()
               <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in scraped] == ["wasmtron-metrics"], scraped
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in scraped[0]["spec"]["ports"]}

    # Kubernetes sends SIGKILL after the grace period: it must cover the drain delay (serving
    # with readiness off) and the exit timeout (in-flight requests finishing), with a margin.
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= flag(container["args"], "drain-delay-secs") + flag(
        container["args"], "exit-timeout-secs") + 5, grace

    copy_models(str(tmp_path), ["simple"])
    server = Server(None, *args)
    try:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            action = container[probe]["httpGet"]
            assert action["port"] == "http", probe  # probes are HTTP GETs on the http port
            assert get(f"http://{server.http}{action['path']}") == 200, probe

        # The autoscaling rule reads counters the server exports, per pod, under their names.
        client = httpclient.InferenceServerClient(server.http)
        a = np.arange(16, dtype=np.int32)
        client.infer("simple", simple_inputs(httpclient, [a], [a]))
        rule = yaml.safe_load(docs[("ConfigMap", "wasmtron-prometheus-adapter")]["data"][
            "config.yaml"])["rules"][0]
        hpa = docs[("HorizontalPodAutoscaler", "wasmtron")]
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"]
        metrics = server.metrics_text()
        used = set(re.findall(r"\b(nv_\w+)\{<<\.LabelMatchers>>\}", rule["metricsQuery"]))
        used.add(re.match(r"(\w+)", rule["seriesQuery"]).group(1))
        assert used == {"nv_inference_queue_duration_us", "nv_inference_request_success"}, used
        for name in used:
            assert f"# TYPE {name} counter" in metrics, name
            assert re.search(rf'^{name}{{model="simple",version="1"}} \d', metrics, re.M), name

        # SIGTERM as Kubernetes sends it: out of rotation at once, then a clean exit.
        # (Triton's not-ready answer is 400; probes count any status from 400 up as failed.)
        server.proc.send_signal(signal.SIGTERM)
        for _ in range(300):
            status = get(f"http://{server.http}/v2/health/ready")
            if status != 200:
                break
            time.sleep(0.1)
        assert status == 400, status
        assert server.proc.wait(grace + 60) == 0
    finally:
        server.stop()


def test_the_kserve_runtime_serves_v2_and_grpc_v2_from_mnt_models(documents, tmp_path):
    runtime = documents[("kserve/clusterservingruntime.yaml", "ClusterServingRuntime",
                         "kserve-wasmtron")]
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    container = runtime["spec"]["containers"][0]
    assert container["name"] == "kserve-container"  # the name KServe merges the model into
    assert "--model-repository=/mnt/models" in container["args"]
    args, ports = split_args(container["args"], tmp_path)
    # KServe routes HTTP to 8080 and gRPC to 9000 and scrapes the annotated metrics port.
    assert ports == {"http": 8080, "grpc": 9000,
                     "metrics": int(runtime["spec"]["annotations"]["prometheus.kserve.io/port"])}
    isvc = documents[("kserve/inferenceservice.yaml", "InferenceService", "wasmtron-pipelines")]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"][
        "supportedModelFormats"]}

    copy_models(str(tmp_path), ["simple"])
    env = dict(os.environ, **{e["name"]: e["value"].replace("/tmp", str(tmp_path))
                              for e in container.get("env", [])})
    server = Server(None, *args, env=env)
    try:
        a = np.arange(16, dtype=np.int32)
        http = httpclient.InferenceServerClient(server.http)
        assert http.is_server_ready()
        assert (http.infer("simple", simple_inputs(httpclient, [a], [a])).as_numpy(
            "OUTPUT0") == 2 * a).all()
        grpc = grpcclient.InferenceServerClient(server.grpc)
        assert grpc.is_server_ready()
        assert (grpc.infer("simple", simple_inputs(grpcclient, [a], [a])).as_numpy(
            "OUTPUT0") == 2 * a).all()
        assert "nv_inference_request_success" in server.metrics_text()
    finally:
        server.stop()


def test_the_kserve_llm_runtime_publishes_kv_events_and_the_pickers_metrics(documents, tmp_path):
    """deploy/kserve/llm-servingruntime.yaml run with its own arguments (the pod's name put in
    as Kubernetes expands `$(POD_NAME)`, the event sockets moved to loopback): a generation
    request's prefix-cache blocks reach a ZeroMQ subscriber under the `kv@<pod>` topic, and
    the metrics the endpoint picker reads are served with the manifest's block size."""
    import json as json_

    import msgpack
    import zmq

    from test_generation import TINY, link_model

    runtime = documents[("kserve/llm-servingruntime.yaml", "ClusterServingRuntime",
                         "kserve-wasmtron-llm")]
    container = runtime["spec"]["containers"][0]
    assert container["name"] == "kserve-container"
    assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] ==
               "metadata.name" for e in container["env"])
    args, ports = split_args(container["args"], tmp_path)
    assert ports == {"http": 8080, "grpc": 9000, "metrics": 8002}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    local = []
    for arg in args:
        if arg.startswith("--kv-events-config="):
            config = json_.loads(arg.split("=", 1)[1].replace("$(POD_NAME)", "check-pod"))
            assert config["endpoint"] == "tcp://*:5557" and config["replay_endpoint"] == "tcp://*:5558"
            config["endpoint"] = f"tcp://127.0.0.1:{port}"
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                config["replay_endpoint"] = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            arg = "--kv-events-config=" + json_.dumps(config)
        local.append(arg)
    assert "--block-size=16" in local
    link_model(str(tmp_path), TINY, "llm")
    env = dict(os.environ, **{e["name"]: e["value"].replace("/tmp", str(tmp_path))
                              for e in container["env"] if "value" in e})
    server = Server(None, *local, env=env)
    try:
        ids = [[7 + i % 200 for i in range(40)]]
        for _ in range(30):  # the first batches may go before the subscription arrives
            client = grpcclient.InferenceServerClient(server.grpc)
            client.start_stream(callback=lambda result, error: None)
            inputs = []
            for name, value in [("input_ids", ids), ("max_tokens", [[2]])]:
                t = grpcclient.InferInput(name, list(np.shape(value)), "INT32")
                t.set_data_from_numpy(np.array(value, dtype=np.int32))
                inputs.append(t)
            client.async_stream_infer("llm", inputs)
            client.stop_stream()
            client.close()
            if sub.poll(1000):
                break
            ids = [[i + 1 for i in ids[0]]]
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@check-pod" and len(seq) == 8
        event = msgpack.unpackb(payload)["events"][0]
        assert event["type"] == "BlockStored" and event["block_size"] == 16, event
        text = server.metrics_text()
        assert re.search(r'^vllm:cache_config_info\{model="llm",version="1",block_size="16",',
                         text, re.M), text[-2000:]
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                     "vllm:kv_cache_usage_perc"):
            assert f"# TYPE {name} gauge" in text
    finally:
        server.stop()
        sub.close(linger=0)
        ctx.term()
