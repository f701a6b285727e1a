//! Frontends: KServe v2 and OpenAI's API over HTTP ([`http`]), KServe v2 over gRPC ([`grpc`]),
//! Prometheus [`metrics`], shared memory, and the [`listeners`] that serve them.
//! They translate the wire into [`crate::inference`] types and back: every request enters
//! the core through its door ([`crate::scheduling::door`]), and what they report about the
//! server (metadata, statistics, metrics) is built in the core
//! ([`crate::scheduling::views`]).

pub mod connections;
pub mod grpc;
pub mod http;
pub mod kv_events;
pub mod listeners;
pub mod logging;
pub mod metrics;
pub mod restricted;
pub mod shared_memory;
pub mod tls;
pub mod trace;
pub mod trace_file;
pub mod trace_settings;
