//! `inference.GRPCInferenceService` over tonic, wire-compatible with Triton's clients, plus the
//! standard `grpc.health.v1` service. RPCs for features this server does not offer answer
//! UNIMPLEMENTED. The service's methods are in `service`; the wire conversion in `codec`;
//! `ModelInfer` in `unary` and `ModelStreamInfer` in `streaming`.

use std::sync::Arc;

use tonic::{Request, Status};

use super::{
    restricted::{ApiGroup, Restrictions},
    shared_memory::{Kind as MemoryKind, SystemSharedMemory},
    trace::Tracing,
};
use crate::{
    error::{Code, Error},
    proto::inference::*,
    scheduling::server::Server,
    tenancy::{Caller, ModelAction, Tenancy},
};

pub use crate::proto::inference::grpc_inference_service_server::GrpcInferenceServiceServer;

mod codec;
mod message_limit;
mod service;
mod streaming;
mod unary;

pub use codec::{decode_request, encode_response};

/// The gRPC service implementation.
pub struct GrpcService {
    server: Arc<Server>,
    tenancy: Option<Arc<Tenancy>>,
    restrictions: Restrictions,
    shared_memory: Arc<SystemSharedMemory>,
    tracing: Arc<Tracing>,
    /// Largest request message: also the most one request may read from shared memory.
    max_message_size: usize,
}

impl GrpcService {
    /// A service over the server core, open to everyone.
    pub fn new(server: Arc<Server>) -> Self {
        Self {
            server,
            tenancy: None,
            restrictions: Restrictions::default(),
            shared_memory: Arc::new(SystemSharedMemory::new()),
            tracing: Arc::new(Tracing::default()),
            max_message_size: MAX_MESSAGE_SIZE,
        }
    }

    /// The largest request message (`--grpc-max-message-size`); a request's inputs in shared
    /// memory are held to it as well.
    pub fn with_max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Which requests are traced, shared with the HTTP frontend.
    pub fn with_tracing(mut self, tracing: Arc<Tracing>) -> Self {
        self.tracing = tracing;
        self
    }

    /// The system shared-memory regions, shared with the HTTP frontend.
    pub fn with_shared_memory(mut self, shared_memory: Arc<SystemSharedMemory>) -> Self {
        self.shared_memory = shared_memory;
        self
    }

    /// Protocol groups that need a shared-secret header (`--grpc-restricted-protocol`).
    pub fn with_restrictions(mut self, restrictions: Restrictions) -> Self {
        self.restrictions = restrictions;
        self
    }

    /// The service for the tenants of `tenancy`: every call but the health checks needs an
    /// API key in the `authorization` metadata (`Bearer <key>`).
    pub fn with_tenancy(mut self, tenancy: Option<Arc<Tenancy>>) -> Self {
        self.tenancy = tenancy;
        self
    }

    /// Refuses a request to a restricted `group` without the group's header.
    fn restrict<T>(&self, request: &Request<T>, group: ApiGroup) -> Result<(), Status> {
        let metadata = request.metadata();
        self.restrictions
            .check(group, |name| {
                metadata.get(name).and_then(|v| v.to_str().ok())
            })
            .map_err(to_status)
    }

    /// The caller's shared-memory regions of `kind` (the one named, unless `name` is empty).
    fn regions<T>(
        &self,
        r: Request<T>,
        kind: MemoryKind,
        name: impl FnOnce(T) -> String,
    ) -> Result<Vec<crate::frontends::shared_memory::RegionStatus>, Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let name = name(r.into_inner());
        self.shared_memory
            .status(&caller, kind, (!name.is_empty()).then_some(name.as_str()))
            .map_err(to_status)
    }

    /// Unregisters the caller's region `name` of `kind` (all of them when empty).
    fn unregister_regions<T>(
        &self,
        r: Request<T>,
        kind: MemoryKind,
        name: impl FnOnce(T) -> String,
    ) -> Result<(), Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let name = name(r.into_inner());
        self.shared_memory
            .unregister(&caller, kind, (!name.is_empty()).then_some(name.as_str()))
            .map_err(to_status)
    }

    /// Who sent `request` to an API of `group`, after the group's restriction header.
    fn caller<T>(&self, request: &Request<T>, group: ApiGroup) -> Result<Caller, Status> {
        self.restrict(request, group)?;
        let Some(tenancy) = &self.tenancy else {
            return Ok(Caller::Anyone);
        };
        let key = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        tenancy.authenticate(key).map_err(to_status)
    }
}

/// [`Caller::require`] as a gRPC status.
fn require(caller: &Caller, action: ModelAction, model: &str) -> Result<(), Status> {
    caller.require(action, model).map_err(to_status)
}

/// The largest gRPC message by default: 2 GiB, as in Triton (a tenant's `max_request_bytes`
/// bounds its own, checked as the bytes arrive).
pub const MAX_MESSAGE_SIZE: usize = i32::MAX as usize;

/// The gRPC routes with each tenant's `max_request_bytes` checked on every message's length
/// before it is read (nothing to check without tenants).
pub(crate) fn with_message_limits(
    router: axum::Router,
    tenancy: Option<Arc<Tenancy>>,
) -> axum::Router {
    match tenancy {
        Some(tenancy) => router.layer(axum::middleware::from_fn_with_state(
            tenancy,
            message_limit::limit_messages,
        )),
        None => router,
    }
}

/// Maps an error to a gRPC status.
pub fn to_status(err: Error) -> Status {
    let code = match err.code {
        Code::InvalidArg => tonic::Code::InvalidArgument,
        Code::NotFound => tonic::Code::NotFound,
        Code::Unavailable => tonic::Code::Unavailable,
        Code::Unsupported => tonic::Code::Unimplemented,
        Code::AlreadyExists => tonic::Code::AlreadyExists,
        Code::Cancelled => tonic::Code::Cancelled,
        Code::Internal => tonic::Code::Internal,
        Code::Unknown => tonic::Code::Unknown,
        Code::Unauthenticated => tonic::Code::Unauthenticated,
        Code::PermissionDenied => tonic::Code::PermissionDenied,
        Code::ResourceExhausted => tonic::Code::ResourceExhausted,
    };
    Status::new(code, err.message)
}

/// The W3C trace context a call's metadata carries (`traceparent`, `tracestate`).
#[derive(Clone, Default)]
struct TraceContext(Vec<(&'static str, String)>);

impl TraceContext {
    fn of(metadata: &tonic::metadata::MetadataMap) -> Self {
        Self(
            ["traceparent", "tracestate"]
                .into_iter()
                .filter_map(|k| Some((k, metadata.get(k)?.to_str().ok()?.to_owned())))
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    }
}
