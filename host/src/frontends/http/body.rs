//! Request bodies: checked against the size limit before they are read (by their
//! `Content-Length`) and while they are read, then decompressed (`Content-Encoding:
//! gzip|deflate`) within the same limit; JSON that may be empty, header values as text.
//!
//! An inference request's limit is the smaller of `--http-max-input-size` and its tenant's
//! `max_request_bytes`, so a tenant's oversized body is refused (429) before it is read.
//! Inflating a large body, and decoding a large JSON body ([`off_runtime`]), run on blocking
//! threads: a runtime thread serves every connection, and a 64 MiB inflate would hold it.

use std::io::Read;

use axum::{
    body::Body,
    http::{header, HeaderMap},
};
use bytes::Bytes;
use serde_json::{json, Value};

use super::state::HttpState;
use crate::{error::Error, tenancy::Caller};

/// Bodies larger than this are inflated and decoded on a blocking thread.
pub(crate) const LARGE_BODY_BYTES: usize = 256 << 10;

/// Reads a body up to the server's size limit (`--http-max-input-size`), then undoes
/// `Content-Encoding: gzip|deflate`. For the admin APIs; inference requests are read with
/// [`read_request_body`].
pub(crate) async fn read_body(
    st: &HttpState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Error> {
    read_within(st, &Caller::Anyone, headers, body).await
}

/// Reads an inference request's body within the server's limit and the caller's
/// `max_request_bytes`, refusing a larger declared length before reading anything.
pub(crate) async fn read_request_body(
    st: &HttpState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Error> {
    read_within(st, caller, headers, body).await
}

/// The refusal of a body over the limit: the tenant's quota (429) when that is the smaller,
/// else the server's (400). `size` is the body's length when it is known.
fn too_large(st: &HttpState, caller: &Caller, size: Option<usize>, inflated: bool) -> Error {
    let limit = st.max_input_size;
    if let Some(e) = caller
        .max_request_bytes()
        .filter(|max| *max < limit)
        .and_then(|max| caller.request_too_large(size.unwrap_or(max + 1)))
    {
        return e;
    }
    let what = if inflated {
        "decompressed request body"
    } else {
        "request body"
    };
    Error::invalid(format!(
        "{what} is larger than the maximum input size of {limit} bytes (--http-max-input-size)"
    ))
}

async fn read_within(
    st: &HttpState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Error> {
    let limit = caller
        .max_request_bytes()
        .map_or(st.max_input_size, |max| max.min(st.max_input_size));
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    if let Some(size) = declared.filter(|size| *size > limit) {
        return Err(too_large(st, caller, Some(size), false));
    }
    let raw = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| too_large(st, caller, None, false))?;
    let raw_size = raw.len();
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase());
    let gzip = match encoding.as_deref() {
        None | Some("") | Some("identity") => return Ok(raw),
        Some("gzip") => true,
        Some("deflate") => false,
        Some(other) => {
            return Err(Error::unsupported(format!(
                "unsupported Content-Encoding '{other}' (supported: gzip, deflate)"
            )))
        }
    };
    let inflate = move || -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        if gzip {
            flate2::read::GzDecoder::new(&raw[..])
                .take(limit as u64 + 1)
                .read_to_end(&mut out)?;
        } else {
            flate2::read::ZlibDecoder::new(&raw[..])
                .take(limit as u64 + 1)
                .read_to_end(&mut out)?;
        }
        Ok(out)
    };
    let out = off_runtime(raw_size, inflate).await?.map_err(|e| {
        Error::invalid(format!(
            "cannot decompress the request body ({}): {e}",
            encoding.as_deref().unwrap_or_default()
        ))
    })?;
    if out.len() > limit {
        return Err(too_large(st, caller, None, true));
    }
    Ok(out.into())
}

/// Runs `work` (decoding a body of `size` bytes) here when the body is small, else on a
/// blocking thread, so that large bodies never hold a runtime thread.
pub(crate) async fn off_runtime<T: Send + 'static>(
    size: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    if size < LARGE_BODY_BYTES {
        return Ok(work());
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::internal(format!("decoding the request failed: {e}")))
}

/// A request header as text, if present and printable.
pub(crate) fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name)?.to_str().ok().map(str::to_owned)
}

pub(crate) fn optional_json(body: &Bytes) -> Result<Value, Error> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(body)
        .map_err(|e| Error::invalid(format!("failed to parse the request JSON buffer: {e}")))
}
