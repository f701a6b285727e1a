//! The network listeners of a running [`Server`]: KServe v2 over HTTP and gRPC (with gRPC
//! health checking) and Prometheus metrics, each on its own address, opened and closed
//! together. The binary opens them from its command line; the Python package opens them from
//! `Server.start(http_port=...)`, so one process serves in-process and remote callers.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;

use super::{
    connections::{self, ConnectionLimits, ConnectionTable, Protocol},
    grpc::{GrpcInferenceServiceServer, GrpcService},
    http::{self, HttpState},
    metrics,
    restricted::Restrictions,
    shared_memory::SystemSharedMemory,
    trace::Tracing,
};
use crate::{
    error::{Error, Result},
    scheduling::server::Server,
    tenancy::Tenancy,
};

/// Where one listener binds: an IP address and a port (0 picks a free one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// An IPv4 or IPv6 address (`0.0.0.0` for every interface).
    pub address: String,
    /// The port; 0 picks a free one.
    pub port: u16,
}

impl Endpoint {
    /// `address:port`.
    pub fn new(address: impl Into<String>, port: u16) -> Self {
        Self {
            address: address.into(),
            port,
        }
    }
}

/// Which listeners to open and how they treat requests.
#[derive(Clone)]
pub struct ListenerOptions {
    /// HTTP/REST, if served.
    pub http: Option<Endpoint>,
    /// gRPC, if served.
    pub grpc: Option<Endpoint>,
    /// Prometheus metrics, if served.
    pub metrics: Option<Endpoint>,
    /// Largest HTTP request body in bytes (before and after decompression).
    pub http_max_input_size: usize,
    /// Largest gRPC request message in bytes.
    pub grpc_max_message_size: usize,
    /// Gzip gRPC inference responses for clients that accept it.
    pub grpc_compress_responses: bool,
    /// Tenants and their keys; `None` serves everyone.
    pub tenancy: Option<Arc<Tenancy>>,
    /// HTTP API groups that need a header (`--http-restricted-api`).
    pub http_restrictions: Restrictions,
    /// gRPC protocol groups that need a header (`--grpc-restricted-protocol`).
    pub grpc_restrictions: Restrictions,
    /// Request tracing settings, changed at run time through the trace API.
    pub tracing: Arc<Tracing>,
    /// Timeouts and the cap on open connections, over all listeners.
    pub connections: ConnectionLimits,
    /// Whether clients may register shared memory (`--allow-client-shm`; Triton's default,
    /// since 2026, is off).
    pub allow_client_shm: bool,
    /// The gRPC listener's keepalive pings on idle connections: (interval, time to wait for
    /// the acknowledgement) (`--grpc-keepalive-time`, `--grpc-keepalive-timeout`).
    pub grpc_keepalive: Option<(std::time::Duration, std::time::Duration)>,
    /// TLS on the gRPC listener (`--grpc-use-ssl`), if asked for.
    pub grpc_tls: Option<super::tls::TlsFiles>,
    /// TLS on the HTTP and metrics listeners (`--http-ssl-cert`), if asked for.
    pub http_tls: Option<super::tls::TlsFiles>,
    /// Whether the metrics include the host's CPU and memory (`--allow-cpu-metrics`).
    pub cpu_metrics: bool,
    /// Report the GPUs' metrics (`--allow-gpu-metrics`; only `cuda` builds have them).
    pub gpu_metrics: bool,
}

impl Default for ListenerOptions {
    /// Every listener on 127.0.0.1 at a free port, the binary's default limits.
    fn default() -> Self {
        Self {
            http: Some(Endpoint::new("127.0.0.1", 0)),
            grpc: Some(Endpoint::new("127.0.0.1", 0)),
            metrics: Some(Endpoint::new("127.0.0.1", 0)),
            http_max_input_size: 64 * 1024 * 1024,
            grpc_max_message_size: super::grpc::MAX_MESSAGE_SIZE,
            grpc_compress_responses: false,
            tenancy: None,
            http_restrictions: Restrictions::default(),
            grpc_restrictions: Restrictions::default(),
            tracing: Arc::new(Tracing::default()),
            connections: ConnectionLimits::default(),
            allow_client_shm: false,
            grpc_keepalive: None,
            grpc_tls: None,
            http_tls: None,
            cpu_metrics: true,
            gpu_metrics: true,
        }
    }
}

/// The addresses the listeners got (the real port where 0 was asked for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoundAddresses {
    /// HTTP's, if served.
    pub http: Option<SocketAddr>,
    /// gRPC's, if served.
    pub grpc: Option<SocketAddr>,
    /// Metrics', if served.
    pub metrics: Option<SocketAddr>,
}

/// Open listeners; [`Listeners::close`] stops them.
pub struct Listeners {
    addresses: BoundAddresses,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<std::io::Result<()>>>,
    health: tonic_health::server::HealthReporter,
}

/// Binds every listener first, so that a port in use fails before anything serves.
async fn bind(endpoint: &Endpoint, what: &str) -> Result<TcpListener> {
    let address = &endpoint.address;
    let addr: SocketAddr = format!("{address}:{}", endpoint.port)
        .parse()
        .or_else(|_| format!("[{address}]:{}", endpoint.port).parse())
        .map_err(|_| Error::invalid(format!("{what} address '{address}' is not an IP address")))?;
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::unavailable(format!("cannot listen on {addr} for {what}: {e}")))
}

fn local_addr(listener: &TcpListener, what: &str) -> Result<SocketAddr> {
    listener
        .local_addr()
        .map_err(|e| Error::internal(format!("the {what} listener has no address: {e}")))
}

impl Listeners {
    /// Binds and starts the listeners `options` names for `server`, on the current tokio
    /// runtime. Each prints Triton's "Started ... at ADDRESS" line to stderr.
    pub async fn open(server: Arc<Server>, options: ListenerOptions) -> Result<Self> {
        let grpc = match &options.grpc {
            Some(e) => Some(bind(e, "grpc").await?),
            None => None,
        };
        let http = match &options.http {
            Some(e) => Some(bind(e, "http").await?),
            None => None,
        };
        let metrics = match &options.metrics {
            Some(e) => Some(bind(e, "metrics").await?),
            None => None,
        };
        let stop = CancellationToken::new();
        let table = Arc::new(ConnectionTable::new(options.connections));
        tracing::info!(
            max_connections = table.max_connections(),
            header_timeout = ?options.connections.header_timeout,
            idle_timeout = ?options.connections.idle_timeout,
            "connection limits"
        );
        let shared_memory = Arc::new(SystemSharedMemory::allowing(options.allow_client_shm));
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        // Read before any listener accepts: a bad certificate or key stops the start.
        let grpc_tls = match &options.grpc_tls {
            Some(files) => Some(super::tls::acceptor(files, &[b"h2"]).map_err(Error::invalid)?),
            None => None,
        };
        let http_tls = match &options.http_tls {
            Some(files) => {
                Some(super::tls::acceptor(files, &[b"h2", b"http/1.1"]).map_err(Error::invalid)?)
            }
            None => None,
        };
        // Every listener accepts under the same connection table and stops together.
        let spawn = |listener, app, protocol| {
            let (keepalive, tls) = match protocol {
                Protocol::Grpc => (options.grpc_keepalive, grpc_tls.clone()),
                Protocol::Http => (None, http_tls.clone()),
            };
            tokio::spawn(connections::serve(
                listener,
                app,
                protocol,
                keepalive,
                table.clone(),
                stop.clone(),
                tls,
            ))
        };
        let mut addresses = BoundAddresses::default();
        let mut tasks = Vec::new();
        if let Some(listener) = grpc {
            let addr = local_addr(&listener, "grpc")?;
            addresses.grpc = Some(addr);
            eprintln!("Started GRPCInferenceService at {addr}");
            let service = GrpcService::new(server.clone())
                .with_tenancy(options.tenancy.clone())
                .with_restrictions(options.grpc_restrictions.clone())
                .with_shared_memory(shared_memory.clone())
                .with_tracing(options.tracing.clone())
                .with_max_message_size(options.grpc_max_message_size);
            let service = GrpcInferenceServiceServer::new(service)
                .max_decoding_message_size(options.grpc_max_message_size)
                .max_encoding_message_size(usize::MAX)
                .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
            let service = if options.grpc_compress_responses {
                service.send_compressed(tonic::codec::CompressionEncoding::Gzip)
            } else {
                service
            };
            let app = tonic::service::Routes::new(service)
                .add_service(health_service)
                .prepare()
                .into_axum_router();
            let app = super::grpc::with_message_limits(app, options.tenancy.clone());
            tasks.push(spawn(listener, app, Protocol::Grpc));
        }
        if let Some(listener) = http {
            let addr = local_addr(&listener, "http")?;
            addresses.http = Some(addr);
            eprintln!("Started HTTPService at {addr}");
            let app = http::router(HttpState {
                server: server.clone(),
                max_input_size: options.http_max_input_size,
                tenancy: options.tenancy.clone(),
                restrictions: Arc::new(options.http_restrictions.clone()),
                shared_memory: shared_memory.clone(),
                tracing: options.tracing.clone(),
            });
            tasks.push(spawn(listener, app, Protocol::Http));
        }
        if let Some(listener) = metrics {
            let addr = local_addr(&listener, "metrics")?;
            addresses.metrics = Some(addr);
            eprintln!("Started Metrics Service at {addr}");
            let app = metrics::router(
                server.clone(),
                options.tenancy.clone(),
                options.cpu_metrics,
                options.gpu_metrics,
            );
            tasks.push(spawn(listener, app, Protocol::Http));
        }
        Ok(Self {
            addresses,
            stop,
            tasks,
            health,
        })
    }

    /// Where the listeners listen.
    pub fn addresses(&self) -> BoundAddresses {
        self.addresses
    }

    /// Tells gRPC health checks the server is not serving any more (the start of a drain;
    /// HTTP readiness follows the server's own state).
    pub async fn set_not_serving(&self) {
        self.health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    }

    /// Stops accepting connections, lets open ones finish, and waits up to `timeout` for the
    /// listeners to end; returns whether they did.
    pub async fn close(self, timeout: Duration) -> bool {
        self.stop.cancel();
        let ended = tokio::time::timeout(timeout, futures::future::join_all(self.tasks)).await;
        match ended {
            Ok(results) => {
                for result in results {
                    match result {
                        Ok(Err(e)) => tracing::warn!("a listener ended with an error: {e}"),
                        Err(e) => tracing::warn!("a listener task failed: {e}"),
                        Ok(Ok(())) => {}
                    }
                }
                true
            }
            Err(_) => false,
        }
    }
}
