//! A tenant's `max_request_bytes` on gRPC, checked on each message's length prefix as the
//! bytes arrive, before tonic buffers the message: a tenant over its quota is refused with
//! RESOURCE_EXHAUSTED having sent at most one frame header past it, whatever the server-wide
//! `--grpc-max-message-size` (2 GiB, as Triton's) allows.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::{body::Body, extract::State, middleware::Next, response::Response};
use bytes::Buf;
use http_body::{Body as HttpBody, Frame};

use super::to_status;
use crate::{
    error::Error,
    tenancy::{Caller, Tenancy},
};

/// Wraps the request body of a caller whose tenant has a `max_request_bytes` in
/// [`MessageLimit`]; other requests (and ones whose key is wrong, refused later by the
/// service with the right status) pass as they are.
pub(super) async fn limit_messages(
    State(tenancy): State<Arc<Tenancy>>,
    request: axum::extract::Request,
    next: Next,
) -> Response {
    let key = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let limited = tenancy
        .authenticate(key)
        .ok()
        .and_then(|caller| caller.max_request_bytes().map(|max| (caller, max)));
    let Some((caller, max)) = limited else {
        return next.run(request).await;
    };
    let (parts, body) = request.into_parts();
    let body = Body::new(MessageLimit {
        inner: body,
        max,
        caller,
        header: Vec::with_capacity(5),
        remaining: 0,
    });
    next.run(axum::extract::Request::from_parts(parts, body))
        .await
}

/// A gRPC request body whose messages (5-byte prefix: compression flag, big-endian length)
/// may be at most `max` bytes each; the first larger one ends the body with a
/// RESOURCE_EXHAUSTED status, which tonic answers the call with.
struct MessageLimit {
    inner: Body,
    max: usize,
    /// The tenant's caller, whose refusal names the quota.
    caller: Caller,
    /// The prefix of the next message, while it is incomplete.
    header: Vec<u8>,
    /// Bytes of the current message still to come.
    remaining: usize,
}

impl MessageLimit {
    /// Follows the framing through `data`; the size of the first message over the limit.
    fn over_limit(&mut self, mut data: &[u8]) -> Option<usize> {
        while !data.is_empty() {
            if self.remaining > 0 {
                let step = self.remaining.min(data.len());
                self.remaining -= step;
                data = &data[step..];
                continue;
            }
            let step = (5 - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..step]);
            data = &data[step..];
            if self.header.len() == 5 {
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                self.header.clear();
                if len > self.max {
                    return Some(len);
                }
                self.remaining = len;
            }
        }
        None
    }
}

impl HttpBody for MessageLimit {
    type Data = bytes::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Some(len) = this.over_limit(data.chunk()) {
                        let refusal = this.caller.request_too_large(len).unwrap_or_else(|| {
                            Error::resource_exhausted(format!(
                                "a message of {len} bytes is over {} bytes",
                                this.max
                            ))
                        });
                        return Poll::Ready(Some(Err(Box::new(to_status(refusal)))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            other => other.map(|f| f.map(|r| r.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(max: usize) -> MessageLimit {
        MessageLimit {
            inner: Body::empty(),
            max,
            caller: Caller::Anyone,
            header: Vec::new(),
            remaining: 0,
        }
    }

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn follows_the_framing_across_chunks_and_finds_the_first_large_message() {
        let mut stream = message(10);
        stream.extend(message(3));
        stream.extend(message(11));
        let mut l = limit(10);
        // Split anywhere, even inside a prefix: the framing is followed across chunks.
        for chunk in stream[..20].chunks(3) {
            assert_eq!(l.over_limit(chunk), None);
        }
        assert_eq!(l.over_limit(&stream[20..]), Some(11));
    }
}
