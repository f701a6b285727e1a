//! Wasmtron: a Triton-compatible inference server.
//!
//! The crate is layered, and each layer only calls the ones below it:
//!
//! 1. foundation: [`error`], [`tensor`], [`inference`], [`cancellation`], [`limits`], [`proto`] —
//!    shared vocabulary;
//!    [`names`] (the one check of names from requests), [`private_dir`] (directories the
//!    server owns) and [`tenancy`] (tenants, keys, permissions, quotas);
//! 2. [`repository`] — model repositories on disk and in object storage, `config.pbtxt`;
//! 3. [`runtime`] — backends that execute a model: ONNX Runtime, WebAssembly stages, Triton
//!    Python-backend models, text generation;
//! 4. [`scheduling`] — queues, instance workers, ensembles, sequences, statistics and the
//!    model lifecycle, behind the `Server` facade;
//! 5. [`frontends`] — KServe v2 over HTTP and gRPC, OpenAI's API, Prometheus metrics, shared
//!    memory and the listeners.
//!
//! `host/README.md` says where each concept lives and how a request walks through the layers.
#![deny(missing_docs)]

pub mod cancellation;
pub mod classification;
pub mod content_hash;
pub mod error;
pub mod frontends;
pub mod inference;
pub mod limits;
pub mod names;
pub mod private_dir;
pub mod proto;
pub mod repository;
pub mod response_order;
pub mod runtime;
pub mod scheduling;
pub mod tenancy;
pub mod tensor;
