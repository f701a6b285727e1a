//! Wasmtron: a Triton-compatible inference server.
//!
//! The crate is layered, and each layer only calls the ones below it:
//!
//! 1. foundation: [`error`], [`tensor`], [`inference`], [`limits`], [`proto`] — shared vocabulary;
//!    [`names`] (the one check of names from requests) and [`private_dir`] (directories the
//!    server owns);
//! 2. [`repository`] — model repositories on disk and `config.pbtxt`;
//! 3. [`runtime`] — backends that execute a model (ONNX Runtime today);
//! 4. [`scheduling`] — instance pools, queues, statistics and the model lifecycle;
//! 5. [`frontends`] — KServe v2 over HTTP and gRPC, and Prometheus metrics.
#![deny(missing_docs)]

pub mod error;
pub mod frontends;
pub mod inference;
pub mod limits;
pub mod names;
pub mod private_dir;
pub mod proto;
pub mod repository;
pub mod runtime;
pub mod scheduling;
pub mod tenancy;
pub mod tensor;
