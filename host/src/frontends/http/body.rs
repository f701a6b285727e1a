//! Request bodies: read up to the size limit and decompressed (`Content-Encoding: gzip|deflate`),
//! JSON that may be empty, header values as text.

use std::io::Read;

use axum::{
    body::Body,
    http::{header, HeaderMap},
};
use bytes::Bytes;
use serde_json::{json, Value};

use super::state::HttpState;
use crate::error::Error;

/// Reads a body up to the size limit, then undoes `Content-Encoding: gzip|deflate`.
pub(crate) async fn read_body(
    st: &HttpState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Error> {
    let limit = st.max_input_size;
    let raw = axum::body::to_bytes(body, limit).await.map_err(|_| {
        Error::invalid(format!(
            "request body is larger than the maximum input size of {limit} bytes (--http-max-input-size)"
        ))
    })?;
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase());
    let mut out = Vec::new();
    let read = match encoding.as_deref() {
        None | Some("") | Some("identity") => return Ok(raw),
        Some("gzip") => flate2::read::GzDecoder::new(&raw[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut out),
        Some("deflate") => flate2::read::ZlibDecoder::new(&raw[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut out),
        Some(other) => {
            return Err(Error::unsupported(format!(
                "unsupported Content-Encoding '{other}' (supported: gzip, deflate)"
            )))
        }
    };
    read.map_err(|e| {
        Error::invalid(format!(
            "cannot decompress the request body ({}): {e}",
            encoding.as_deref().unwrap_or_default()
        ))
    })?;
    if out.len() > limit {
        return Err(Error::invalid(format!(
            "decompressed request body is larger than the maximum input size of {limit} bytes (--http-max-input-size)"
        )));
    }
    Ok(out.into())
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
