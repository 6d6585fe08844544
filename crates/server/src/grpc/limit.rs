//! A request message larger than `max_request_size` is refused from its 5-byte gRPC
//! frame header — RESOURCE_EXHAUSTED, like REST's 413, naming the setting — before
//! tonic buffers or decodes a byte of it. The size the header declared travels on to
//! the handler (a request extension), which charges it to request memory without
//! walking the decoded message again.
//!
//! Only the first message of a call is looked at: every RPC of the service is unary.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::http::{Request, Response};
use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use snooze_core::{units::format_bytes, ErrorKind, SnoozeError};
use tonic::body::Body;

/// The size of a call's request message, as its frame header declared it.
#[derive(Debug, Clone, Copy)]
pub struct MessageSize(pub u64);

#[derive(Debug, Clone, Copy)]
pub struct MessageLimitLayer {
    limit: u64,
}

impl MessageLimitLayer {
    pub fn new(limit: u64) -> MessageLimitLayer {
        MessageLimitLayer { limit }
    }
}

impl<S> tower::Layer<S> for MessageLimitLayer {
    type Service = MessageLimit<S>;
    fn layer(&self, inner: S) -> MessageLimit<S> {
        MessageLimit { inner, limit: self.limit }
    }
}

#[derive(Debug, Clone)]
pub struct MessageLimit<S> {
    inner: S,
    limit: u64,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> tower::Service<Request<Body>> for MessageLimit<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone that was made ready serves this call; a fresh clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limit = self.limit;
        Box::pin(async move {
            let (mut parts, mut body) = req.into_parts();
            let mut head = BytesMut::new();
            let mut held: Option<Frame<Bytes>> = None;
            while head.len() < 5 {
                match body.frame().await {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => head.extend_from_slice(&data),
                        // Trailers before a whole header: no message to measure.
                        Err(frame) => {
                            held = Some(frame);
                            break;
                        }
                    },
                    // The body's own error (a reset stream) is tonic's to report.
                    Some(Err(e)) => {
                        let body = Body::new(Prefixed {
                            head: Some(head.freeze()),
                            held: None,
                            error: Some(e),
                            rest: body,
                        });
                        return inner.call(Request::from_parts(parts, body)).await;
                    }
                    None => break,
                }
            }
            if head.len() >= 5 {
                let size = u64::from(u32::from_be_bytes([head[1], head[2], head[3], head[4]]));
                if size > limit {
                    let e = SnoozeError::new(
                        ErrorKind::PayloadTooLarge,
                        format!(
                            "the request message ({}) is larger than max_request_size ({})",
                            format_bytes(size),
                            format_bytes(limit)
                        ),
                    );
                    return Ok(super::status(&e).into_http());
                }
                parts.extensions.insert(MessageSize(size));
            }
            let body = Body::new(Prefixed { head: Some(head.freeze()), held, error: None, rest: body });
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}

/// The bytes already read, then the rest of the body.
struct Prefixed {
    head: Option<Bytes>,
    held: Option<Frame<Bytes>>,
    error: Option<tonic::Status>,
    rest: Body,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(head) = self.head.take().filter(|h| !h.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(frame) = self.held.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(e) = self.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.as_ref().is_none_or(Bytes::is_empty)
            && self.held.is_none()
            && self.error.is_none()
            && self.rest.is_end_stream()
    }
}
