//! What every HTTP handler shares: the server core and the settings of the listener.

use std::sync::Arc;

use crate::{
    frontends::{restricted::Restrictions, shared_memory::SystemSharedMemory, trace::Tracing},
    scheduling::server::Server,
    tenancy::Tenancy,
};

/// State shared by the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    /// The server core.
    pub server: Arc<Server>,
    /// Largest request body accepted, before and after decompression.
    pub max_input_size: usize,
    /// Tenants and their keys; `None` serves everyone (single-tenant).
    pub tenancy: Option<Arc<Tenancy>>,
    /// API groups that need a shared-secret header (`--http-restricted-api`).
    pub restrictions: Arc<Restrictions>,
    /// Registered system shared-memory regions (shared with the gRPC frontend).
    pub shared_memory: Arc<SystemSharedMemory>,
    /// Which requests are traced (shared with the gRPC frontend).
    pub tracing: Arc<Tracing>,
}
