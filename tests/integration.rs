//! The server's integration tests, in one test binary (one link of the server's code, not one
//! per file): each module starts the real binary (or the library's server) on loopback ports
//! of its own, as the files did when each was a binary.

mod common;

mod batching;
mod ensembles;
mod fuzz_regressions;
mod grpc_api;
mod hardening;
mod http_api;
mod in_flight;
mod model_lifecycle;
mod onnx_backend;
// Not `tracing`: that would shadow the tracing crate in every module here.
#[path = "tracing.rs"]
mod otel_tracing;
mod padding_and_warmup;
mod streaming;
mod wasm_stages;
