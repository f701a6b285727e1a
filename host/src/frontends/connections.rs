//! The connections of the listeners, and how the server keeps idle ones from starving it.
//! Every listener (HTTP, gRPC, metrics) accepts through [`serve`], which holds its connections
//! to three rules:
//!
//! - a connection must start its first request within the header timeout (a client that
//!   connects and sends nothing, or only part of a header, or only the HTTP/2 preface, is
//!   closed), and one with no request in flight is closed after the idle timeout;
//! - all listeners together hold at most [`ConnectionLimits::max_connections`]; at the cap a
//!   new connection takes the place of the idle one that has waited longest (never-used
//!   first); when every connection has a request in flight, of the one whose socket has been
//!   silent longest, if silent for more than the header timeout (a request whose body never
//!   comes); else the new one is closed at once. Real requests keep being served while idle
//!   and stalled connections are shed;
//! - the soft limit on open files is raised to the hard limit once ([`raise_open_files_limit`]),
//!   and the default cap stays below it, leaving descriptors for models and logs.
//!
//! A request counts as in flight from its headers until its response body ends (a stream
//! included), so a long inference or a token stream is never mistaken for idleness.

use std::{
    collections::HashMap,
    convert::Infallible,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, OnceLock, PoisonError,
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{body::Body, Router};
use bytes::Bytes;
use http::Request;
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Requests one HTTP/2 connection may have open at once (HTTP and gRPC): a client cannot
/// multiply its share of the server by opening streams instead of connections.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 200;

/// How the listeners treat connections (`--http-header-timeout`, `--http-idle-timeout`,
/// `--max-connections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Time a new connection has to send its first request's headers.
    pub header_timeout: Duration,
    /// Time a connection with no request in flight stays open.
    pub idle_timeout: Duration,
    /// Most connections open at once over all listeners; 0 derives it from the open-files
    /// limit (three quarters of it).
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            max_connections: 0,
        }
    }
}

/// Raises the soft limit on open files to the hard limit (once per process) and returns the
/// soft limit in force.
pub fn raise_open_files_limit() -> u64 {
    static LIMIT: OnceLock<u64> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit read and write the struct we own.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return 1024;
        }
        let before = limit.rlim_cur;
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            // SAFETY: as above.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
        tracing::info!(
            before,
            now = limit.rlim_cur,
            "open files limit (RLIMIT_NOFILE)"
        );
        limit.rlim_cur
    })
}

/// One open connection, as the table sees it.
struct Connection {
    id: u64,
    opened: Instant,
    /// Requests whose response has not ended.
    in_flight: AtomicUsize,
    /// Requests started so far.
    started: AtomicU64,
    /// When the last request ended, in milliseconds since `opened`.
    last_done_ms: AtomicU64,
    /// When the socket last carried a byte either way, in milliseconds since `opened`.
    last_io_ms: AtomicU64,
    /// Cancelled to close the connection at once.
    close: CancellationToken,
}

impl Connection {
    /// Since when it has had no request in flight, or `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(self.opened + Duration::from_millis(self.last_done_ms.load(Ordering::Acquire)))
    }

    /// When the socket last carried a byte either way.
    fn last_io(&self) -> Instant {
        self.opened + Duration::from_millis(self.last_io_ms.load(Ordering::Acquire))
    }

    fn touch(&self) {
        let now = self.opened.elapsed().as_millis() as u64;
        self.last_io_ms.store(now, Ordering::Release);
    }

    fn never_used(&self) -> bool {
        self.started.load(Ordering::Acquire) == 0
    }

    /// When the rules close it if nothing happens before.
    fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        let since = self.idle_since()?;
        Some(if self.never_used() {
            since + limits.header_timeout
        } else {
            since + limits.idle_timeout
        })
    }
}

/// A request in flight on a connection; ends when dropped (with the response body).
struct InFlight(Arc<Connection>);

impl InFlight {
    fn start(conn: &Arc<Connection>) -> Self {
        conn.started.fetch_add(1, Ordering::AcqRel);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(conn.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let elapsed = self.0.opened.elapsed().as_millis() as u64;
        self.0.last_done_ms.store(elapsed, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it ends or is dropped.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The open connections of every listener of one server.
pub struct ConnectionTable {
    limits: ConnectionLimits,
    max: usize,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Connection>>>,
}

impl ConnectionTable {
    /// A table under `limits`; the cap is derived from the open-files limit when not set.
    pub fn new(limits: ConnectionLimits) -> Self {
        let max = match limits.max_connections {
            0 => (raise_open_files_limit().saturating_mul(3) / 4).clamp(64, 1 << 20) as usize,
            n => n,
        };
        Self {
            limits,
            max,
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The most connections held at once.
    pub fn max_connections(&self) -> usize {
        self.max
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Connection>>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes room for a new connection: `None` when at the cap with every connection busy.
    fn admit(&self) -> Option<Arc<Connection>> {
        let mut open = self.lock();
        if open.len() >= self.max {
            let idle = open
                .values()
                .filter_map(|c| c.idle_since().map(|since| (!c.never_used(), since, c)))
                .min_by_key(|(used, since, _)| (*used, *since))
                .map(|(_, _, c)| c.clone());
            let stalled = || {
                let silent_since = Instant::now().checked_sub(self.limits.header_timeout)?;
                open.values()
                    .filter(|c| c.last_io() < silent_since)
                    .min_by_key(|c| c.last_io())
                    .cloned()
            };
            let victim = idle.or_else(stalled)?;
            open.remove(&victim.id);
            victim.close.cancel();
            tracing::debug!(
                connection = victim.id,
                "closed an idle or stalled connection to admit a new one"
            );
        }
        let conn = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            last_done_ms: AtomicU64::new(0),
            last_io_ms: AtomicU64::new(0),
            close: CancellationToken::new(),
        });
        open.insert(conn.id, conn.clone());
        Some(conn)
    }

    fn remove(&self, conn: &Connection) {
        self.lock().remove(&conn.id);
    }
}

/// A socket (plain or TLS) that notes on its connection when it last carried bytes.
struct ActivityIo<S> {
    inner: S,
    conn: Arc<Connection>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for ActivityIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.touch();
        }
        polled
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for ActivityIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Which protocols a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 and HTTP/2 (prior knowledge).
    Http,
    /// HTTP/2 only (gRPC).
    Grpc,
}

/// Serves `app` on `listener` under the table's rules until `stop` is cancelled, then lets
/// open connections finish their requests. HTTP/2 connections get keepalive pings at
/// `keepalive`'s interval, closed when one goes unanswered for its timeout.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    protocol: Protocol,
    keepalive: Option<(Duration, Duration)>,
    table: Arc<ConnectionTable>,
    stop: CancellationToken,
    tls: Option<TlsAcceptor>,
) -> std::io::Result<()> {
    let tasks = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or a connection reset before accept: wait a little
                // rather than spin, and keep listening.
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(conn) = table.admit() else {
            tracing::debug!("refused a connection: every connection is busy");
            continue;
        };
        if let Err(e) = stream.set_nodelay(true) {
            // Small messages stall on Nagle + delayed ACK without TCP_NODELAY.
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let (app, table, stop, tls) = (app.clone(), table.clone(), stop.clone(), tls.clone());
        tasks.spawn(async move {
            let peer = stream.peer_addr().ok();
            let served = Served {
                app,
                protocol,
                keepalive,
                peer,
            };
            match tls {
                None => serve_connection(stream, served, &table, &conn, stop).await,
                Some(acceptor) => {
                    // The handshake gets the time a request's headers get: a client that
                    // opens a connection and says nothing holds it no longer.
                    let limit = table.limits.header_timeout;
                    match tokio::time::timeout(limit, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, served, &table, &conn, stop).await
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
            table.remove(&conn);
        });
    }
    tasks.close();
    tasks.wait().await;
    Ok(())
}

/// What a connection serves, and to whom.
struct Served {
    app: Router,
    protocol: Protocol,
    keepalive: Option<(Duration, Duration)>,
    peer: Option<std::net::SocketAddr>,
}

async fn serve_connection<S>(
    stream: S,
    served: Served,
    table: &ConnectionTable,
    conn: &Arc<Connection>,
    stop: CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Served {
        app,
        protocol,
        keepalive,
        peer,
    } = served;
    let limits = table.limits;
    let tracked = conn.clone();
    let service = tower::service_fn(move |mut request: Request<Incoming>| {
        let in_flight = InFlight::start(&tracked);
        // Who is on the other end, for handlers that care (axum's `ConnectInfo`).
        if let Some(peer) = peer {
            request
                .extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
        }
        let deadline = match protocol {
            Protocol::Grpc => request
                .headers()
                .get("grpc-timeout")
                .and_then(|v| v.to_str().ok())
                .and_then(grpc_timeout),
            Protocol::Http => None,
        };
        let call = app.clone().oneshot(request);
        async move {
            let response = match deadline {
                // What tonic's own server does with the header: the call is dropped (its work
                // cancelled) and the client hears DEADLINE_EXCEEDED.
                Some(d) => match tokio::time::timeout(d, call).await {
                    Ok(response) => response?,
                    Err(_) => tonic::Status::deadline_exceeded(format!(
                        "the request's deadline ({d:?}, grpc-timeout) passed"
                    ))
                    .into_http(),
                },
                None => call.await?,
            };
            Ok::<_, Infallible>(response.map(|inner| {
                Body::new(TrackedBody {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION);
    if let Some((interval, timeout)) = keepalive {
        builder
            .http2()
            .keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
    }
    if protocol == Protocol::Grpc {
        builder = builder.http2_only();
    }
    let io = TokioIo::new(ActivityIo {
        inner: stream,
        conn: conn.clone(),
    });
    let connection = builder.serve_connection(io, TowerToHyperService::new(service));
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        let deadline = conn
            .deadline(&limits)
            .unwrap_or_else(|| Instant::now() + limits.idle_timeout);
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            () = conn.close.cancelled() => return,
            () = stop.cancelled(), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            () = tokio::time::sleep_until(deadline.into()), if !draining => {
                if conn.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                    if conn.never_used() {
                        // Sent no complete request in time: nothing to finish.
                        return;
                    }
                    draining = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// The deadline of a gRPC request's `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
fn grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        assert_eq!(grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        for bad in ["", "m", "10x", "-1S", "1234567890S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn at_the_cap_the_longest_idle_never_used_connection_makes_room() {
        let table = ConnectionTable::new(ConnectionLimits {
            max_connections: 3,
            ..Default::default()
        });
        let used = table.admit().unwrap();
        drop(InFlight::start(&used));
        let idle = table.admit().unwrap();
        let busy = table.admit().unwrap();
        let _request = InFlight::start(&busy);
        // Full: the never-used one goes first, then the one that served a request.
        let fourth = table.admit().unwrap();
        assert!(idle.close.is_cancelled() && !used.close.is_cancelled());
        let _request = InFlight::start(&fourth);
        table.admit().unwrap();
        assert!(used.close.is_cancelled());
        assert!(!busy.close.is_cancelled());
        assert_eq!(table.open_connections(), 3);
    }

    #[test]
    fn at_the_cap_a_request_whose_socket_went_silent_makes_room() {
        let table = ConnectionTable::new(ConnectionLimits {
            max_connections: 2,
            header_timeout: Duration::from_millis(1),
            ..Default::default()
        });
        let stalled = table.admit().unwrap();
        let _request = InFlight::start(&stalled);
        std::thread::sleep(Duration::from_millis(20));
        let talking = table.admit().unwrap();
        let _request = InFlight::start(&talking);
        talking.touch();
        table.admit().unwrap();
        assert!(stalled.close.is_cancelled() && !talking.close.is_cancelled());
    }

    #[test]
    fn at_the_cap_with_every_connection_busy_a_new_one_is_refused() {
        let table = ConnectionTable::new(ConnectionLimits {
            max_connections: 1,
            ..Default::default()
        });
        let busy = table.admit().unwrap();
        let _request = InFlight::start(&busy);
        assert!(table.admit().is_none());
        assert!(!busy.close.is_cancelled());
    }
}
