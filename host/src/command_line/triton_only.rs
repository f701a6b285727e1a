//! Triton's flags that [`Cli`](super::Cli) does not hold, and what each does here: accepted
//! with no effect (and why), or accepted only with values that mean what this server does.

use super::*;

/// What the server does with a Triton flag it has no setting of its own for.
#[derive(Debug, Clone, Copy)]
pub enum Treatment {
    /// Accepted, with one log line saying it has no effect here, and why.
    NoEffect(&'static str),
    /// Accepted when its value is one of these (Triton's default, or what it means here);
    /// refused at start otherwise, naming the flag and why.
    Only(&'static [&'static str], &'static str),
}

const NO_SAGEMAKER: &str = "the SageMaker endpoint is not served";
const NO_VERTEX: &str = "the Vertex AI endpoint is not served";
const NO_GPU_POOLS: &str =
    "no memory pools of its own: ONNX Runtime's execution providers allocate what they need";

/// Triton's flags that [`Cli`] does not hold, and what each does here.
pub const TRITON_ONLY: &[(&str, Treatment)] = &[
    (
        "model-load-retry-count",
        Treatment::Only(&["0"], "a failed load is not retried"),
    ),
    (
        "reuse-http-port",
        Treatment::Only(&["false"], "a port is never shared with another server"),
    ),
    (
        "reuse-grpc-port",
        Treatment::Only(&["false"], "a port is never shared with another server"),
    ),
    (
        "http-header-forward-pattern",
        Treatment::Only(
            &[],
            "request headers are not forwarded to models as parameters",
        ),
    ),
    (
        "grpc-header-forward-pattern",
        Treatment::Only(
            &[],
            "request metadata is not forwarded to models as parameters",
        ),
    ),
    (
        "grpc-infer-allocation-pool-size",
        Treatment::NoEffect("gRPC requests are not drawn from a pool of preallocated objects"),
    ),
    (
        "grpc-keepalive-permit-without-calls",
        Treatment::NoEffect("keepalive pings go to every idle connection, calls in flight or not"),
    ),
    (
        "grpc-http2-max-pings-without-data",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-http2-min-recv-ping-interval-without-data",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-http2-max-ping-strikes",
        Treatment::NoEffect("the pings a client sends are not counted"),
    ),
    (
        "grpc-max-connection-age",
        Treatment::NoEffect("connections end when idle (--http-idle-timeout-secs), not by age"),
    ),
    (
        "grpc-max-connection-age-grace",
        Treatment::NoEffect("connections end when idle (--http-idle-timeout-secs), not by age"),
    ),
    ("allow-sagemaker", Treatment::Only(&["false"], NO_SAGEMAKER)),
    ("sagemaker-port", Treatment::NoEffect(NO_SAGEMAKER)),
    (
        "sagemaker-safe-port-range",
        Treatment::NoEffect(NO_SAGEMAKER),
    ),
    ("sagemaker-thread-count", Treatment::NoEffect(NO_SAGEMAKER)),
    ("allow-vertex-ai", Treatment::Only(&["false"], NO_VERTEX)),
    ("vertex-ai-port", Treatment::NoEffect(NO_VERTEX)),
    ("vertex-ai-thread-count", Treatment::NoEffect(NO_VERTEX)),
    ("vertex-ai-default-model", Treatment::NoEffect(NO_VERTEX)),
    (
        "metrics-interval-ms",
        Treatment::NoEffect("metrics are read when they are scraped"),
    ),
    (
        "cache-directory",
        Treatment::NoEffect("caches are built into the server"),
    ),
    (
        "pinned-memory-pool-byte-size",
        Treatment::NoEffect(NO_GPU_POOLS),
    ),
    (
        "cuda-memory-pool-byte-size",
        Treatment::NoEffect(NO_GPU_POOLS),
    ),
    (
        "cuda-virtual-address-size",
        Treatment::NoEffect("implicit state is not kept in growable CUDA memory"),
    ),
    (
        "min-supported-compute-capability",
        Treatment::NoEffect("GPUs are chosen by instance_group and the execution providers"),
    ),
    (
        "buffer-manager-thread-count",
        Treatment::NoEffect("tensors are copied on the request's own thread"),
    ),
    (
        "host-policy",
        Treatment::NoEffect("instances are not pinned to NUMA nodes or cores"),
    ),
    (
        "model-load-gpu-limit",
        Treatment::NoEffect("GPU memory is not checked before a load"),
    ),
    (
        "backend-directory",
        Treatment::NoEffect("backends are built into the server"),
    ),
    (
        "repoagent-directory",
        Treatment::NoEffect("repository agents are built into the server"),
    ),
];

/// A value as the table compares it: lower case, booleans as `true` / `false`.
pub(super) fn normalized(value: &str) -> String {
    match triton_bool(value) {
        Ok(b) => b.to_string(),
        Err(_) => value.to_ascii_lowercase(),
    }
}
