"""JSON schemas for the custom resources in deploy/, strict (no unknown fields), written from
the fields their CRDs define: the Prometheus Operator's monitoring.coreos.com/v1 ServiceMonitor
and KServe's serving.kserve.io ClusterServingRuntime (v1alpha1) and InferenceService (v1beta1).
Only the fields in use, and their neighbours, are listed: a field the CRD has but this file
lacks fails the test and is added here, a misspelt one is caught. The Kubernetes objects inside
them (containers, pod fields) are validated by test_deploy_manifests.py against Kubernetes'
own schemas, so they stay open here."""

STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
STR_MAP = {"type": "object", "additionalProperties": STR}


def strict(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": STR, "namespace": STR, "labels": STR_MAP,
                           "annotations": STR_MAP}}


def resource(api_version, kind, spec):
    return strict({"apiVersion": {"const": api_version}, "kind": {"const": kind},
                   "metadata": METADATA, "spec": spec}, ["apiVersion", "kind", "metadata", "spec"])


LABEL_SELECTOR = strict({"matchLabels": STR_MAP, "matchExpressions": {"type": "array"}})

SERVICE_MONITOR = resource("monitoring.coreos.com/v1", "ServiceMonitor", strict({
    "selector": LABEL_SELECTOR,
    "namespaceSelector": strict({"any": BOOL, "matchNames": {"type": "array", "items": STR}}),
    "jobLabel": STR,
    "targetLabels": {"type": "array", "items": STR},
    "podTargetLabels": {"type": "array", "items": STR},
    "endpoints": {"type": "array", "minItems": 1, "items": strict({
        "port": STR, "targetPort": {"type": ["string", "integer"]}, "path": STR,
        "scheme": {"enum": ["http", "https"]}, "interval": STR, "scrapeTimeout": STR,
        "honorLabels": BOOL, "honorTimestamps": BOOL, "params": OBJ,
        "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
        "tlsConfig": OBJ, "bearerTokenSecret": OBJ, "authorization": OBJ,
    })},
}, ["selector", "endpoints"]))

MODEL_FORMAT = strict({"name": STR, "version": STR, "autoSelect": BOOL, "priority": INT},
                      ["name"])
PROTOCOLS = {"type": "array", "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]}}

CLUSTER_SERVING_RUNTIME = resource("serving.kserve.io/v1alpha1", "ClusterServingRuntime", strict({
    "supportedModelFormats": {"type": "array", "items": MODEL_FORMAT},
    "protocolVersions": PROTOCOLS,
    "multiModel": BOOL,
    "disabled": BOOL,
    "annotations": STR_MAP,
    "labels": STR_MAP,
    "containers": {"type": "array", "minItems": 1, "items": OBJ},
    "volumes": {"type": "array"},
    "nodeSelector": STR_MAP,
    "affinity": OBJ,
    "tolerations": {"type": "array"},
    "imagePullSecrets": {"type": "array"},
    "hostIPC": BOOL,
    "grpcEndpoint": STR,
    "grpcDataEndpoint": STR,
    "httpDataEndpoint": STR,
    "replicas": INT,
    "storageHelper": strict({"disabled": BOOL}),
    "builtInAdapter": OBJ,
    "workerSpec": OBJ,
}, ["containers"]))

# InferenceService predictor: ComponentExtensionSpec fields, the pod fields (validated as a
# Pod by the test) and `model`, whose own fields are ModelSpec's plus a container's.
COMPONENT_FIELDS = {
    "minReplicas": INT, "maxReplicas": INT, "scaleTarget": INT,
    "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
    "scaleMetricType": {"enum": ["Utilization", "AverageValue"]},
    "containerConcurrency": INT, "timeout": INT, "canaryTrafficPercent": INT,
    "logger": OBJ, "batcher": OBJ, "labels": STR_MAP, "annotations": STR_MAP,
    "deploymentStrategy": OBJ, "autoScaling": OBJ,
}
MODEL_FIELDS = {
    "modelFormat": strict({"name": STR, "version": STR}, ["name"]),
    "runtime": STR, "protocolVersion": {"enum": ["v1", "v2", "grpc-v2"]},
    "storageUri": {"type": "string", "pattern": r"^(s3|gs|https?|pvc|hf|oci)://"},
    "storage": OBJ,
}
CONTAINER_FIELDS = {name: {} for name in (
    "name", "image", "args", "command", "env", "envFrom", "ports", "resources", "volumeMounts",
    "securityContext", "livenessProbe", "readinessProbe", "startupProbe", "imagePullPolicy",
    "workingDir", "lifecycle")}
POD_FIELDS = {name: {} for name in (
    "serviceAccountName", "nodeSelector", "affinity", "tolerations", "volumes",
    "imagePullSecrets", "securityContext", "priorityClassName", "schedulerName",
    "terminationGracePeriodSeconds", "initContainers", "containers")}

INFERENCE_SERVICE = resource("serving.kserve.io/v1beta1", "InferenceService", strict({
    "predictor": strict({
        **COMPONENT_FIELDS, **POD_FIELDS,
        "model": strict({**MODEL_FIELDS, **CONTAINER_FIELDS}, ["modelFormat"]),
    }, ["model"]),
    "transformer": OBJ,
    "explainer": OBJ,
}, ["predictor"]))

CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): CLUSTER_SERVING_RUNTIME,
    ("serving.kserve.io/v1beta1", "InferenceService"): INFERENCE_SERVICE,
}
