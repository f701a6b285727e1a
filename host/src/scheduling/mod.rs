//! Scheduling: queues and instance workers per model version (dynamic batching, fairness
//! between tenants), ensembles, sequences, the model lifecycle, statistics, and the
//! [`server::Server`] facade that the frontends call.

pub mod cache_key;
pub mod door;
pub mod ensemble;
pub mod ensemble_defaults;
pub mod execution_share;
pub mod latency;
pub mod model_manager;
pub mod options;
pub mod queue;
pub mod rate_limiter;
mod readiness;
pub mod redis_cache;
pub mod response_cache;
pub mod response_stream;
pub mod scheduler;
pub mod sequence;
pub mod server;
pub mod stats;
pub mod views;
