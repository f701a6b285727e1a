//! Response bodies: compressed as the client accepts (`Accept-Encoding`), sent in the parts they
//! were encoded in with an exact length, and large ones encoded off the async runtime under
//! each tenant's own permits.

use std::{collections::HashMap, sync::Arc};

use axum::http::{header, HeaderMap};
use bytes::Bytes;

/// The content encoding of our responses the client accepts (`Accept-Encoding`), if any.
pub(crate) fn accepted_encoding(headers: &HeaderMap) -> Option<&'static str> {
    let accept = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())?
        .to_ascii_lowercase();
    if accept.contains("gzip") {
        Some("gzip")
    } else if accept.contains("deflate") {
        Some("deflate")
    } else {
        None
    }
}

/// `parts` compressed as `encoding` ("gzip" or "deflate"); `None` if that fails.
pub(crate) fn compress(encoding: &str, parts: &[Bytes]) -> Option<Bytes> {
    use std::io::Write;
    let level = flate2::Compression::fast();
    let len: usize = parts.iter().map(Bytes::len).sum();
    let out = Vec::with_capacity(len / 4 + 64);
    let out = if encoding == "gzip" {
        let mut enc = flate2::write::GzEncoder::new(out, level);
        parts.iter().try_for_each(|p| enc.write_all(p)).ok()?;
        enc.finish().ok()?
    } else {
        let mut enc = flate2::write::ZlibEncoder::new(out, level);
        parts.iter().try_for_each(|p| enc.write_all(p)).ok()?;
        enc.finish().ok()?
    };
    Some(out.into())
}

/// Responses whose tensors hold more bytes than this are encoded and compressed off the
/// async runtime: compressing (or writing as JSON) hundreds of kilobytes holds a runtime
/// thread for a millisecond or more, and every connection that thread serves, whoever's it
/// is, waits that long.
pub(crate) const LARGE_RESPONSE_BYTES: usize = 64 << 10;

/// Large responses a tenant may have encoded at once: half the cores (at least one) with
/// tenants, every core without. Each tenant has its own permits, so a tenant whose flood of
/// large answers waits here never makes another tenant's answer wait behind it.
pub(crate) fn encoders(tenant: Option<&str>) -> Arc<tokio::sync::Semaphore> {
    static ENCODERS: std::sync::OnceLock<
        std::sync::Mutex<HashMap<Option<String>, Arc<tokio::sync::Semaphore>>>,
    > = std::sync::OnceLock::new();
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let permits = if tenant.is_some() {
        (cores / 2).max(1)
    } else {
        cores
    };
    let mut all = ENCODERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.entry(tenant.map(str::to_owned))
        .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(permits)))
        .clone()
}

/// A body sent as it was encoded, in parts, with its exact length (so that it goes out with
/// `Content-Length`, not chunked).
pub(crate) struct PartsBody {
    parts: std::collections::VecDeque<Bytes>,
    remaining: u64,
}

impl PartsBody {
    pub(crate) fn new(parts: Vec<Bytes>) -> Self {
        let remaining = parts.iter().map(|p| p.len() as u64).sum();
        Self {
            parts: parts.into(),
            remaining,
        }
    }
}

impl http_body::Body for PartsBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let next = self.parts.pop_front();
        if let Some(part) = &next {
            self.remaining -= part.len() as u64;
        }
        std::task::Poll::Ready(next.map(|part| Ok(http_body::Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.remaining)
    }
}
