//! A request message larger than `max_request_size` is refused from its 5-byte gRPC
//! frame header — RESOURCE_EXHAUSTED, like REST's 413, naming the setting — before
//! tonic buffers or decodes a byte of it. The size the header declared travels on to
//! the handler (a request extension), which charges it to request memory without
//! walking the decoded message again.
//!
//! The message must also arrive within `body_read_timeout` (DEADLINE_EXCEEDED, like
//! REST's 408), so a client that sends a few bytes and stalls does not hold the call;
//! once it has arrived, the call takes as long as its work does.
//!
//! Only the first message of a call is looked at: every RPC of the service is unary.
//!
//! A [`Gate`] (the API key and admin token rules) is asked first, from the call's path
//! and metadata alone: a call without the right key is refused before a byte of its
//! message is read, as REST refuses one before reading its body.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
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

/// Whether a call may go on, from its path (`/package.Service/Method`) and its
/// `authorization` metadata.
pub type Gate = std::sync::Arc<dyn Fn(&str, Option<&str>) -> Result<(), SnoozeError> + Send + Sync>;

#[derive(Clone)]
pub struct MessageLimitLayer {
    limit: u64,
    read_timeout: Duration,
    gate: Option<Gate>,
}

impl MessageLimitLayer {
    /// Messages of at most `limit` bytes, received within `read_timeout`.
    pub fn new(limit: u64, read_timeout: Duration) -> MessageLimitLayer {
        MessageLimitLayer { limit, read_timeout, gate: None }
    }

    /// Calls `gate` refuses are answered before their message is read.
    pub fn with_gate(mut self, gate: Gate) -> MessageLimitLayer {
        self.gate = Some(gate);
        self
    }
}

impl<S> tower::Layer<S> for MessageLimitLayer {
    type Service = MessageLimit<S>;
    fn layer(&self, inner: S) -> MessageLimit<S> {
        MessageLimit { inner, limit: self.limit, read_timeout: self.read_timeout, gate: self.gate.clone() }
    }
}

#[derive(Clone)]
pub struct MessageLimit<S> {
    inner: S,
    limit: u64,
    read_timeout: Duration,
    gate: Option<Gate>,
}

/// The refusal of a message that did not arrive in time.
fn too_slow(read_timeout: Duration) -> tonic::Status {
    let e = SnoozeError::new(
        ErrorKind::RequestTimeout,
        format!(
            "the request message was not received within body_read_timeout ({:.0}s)",
            read_timeout.as_secs_f64()
        ),
    );
    super::status(&e)
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
        let (limit, read_timeout) = (self.limit, self.read_timeout);
        let refused = self.gate.as_ref().and_then(|gate| {
            let authorization = req.headers().get("authorization").and_then(|v| v.to_str().ok());
            gate(req.uri().path(), authorization).err()
        });
        Box::pin(async move {
            if let Some(e) = refused {
                return Ok(super::status(&e).into_http());
            }
            let deadline = Box::pin(tokio::time::sleep(read_timeout));
            let (mut parts, mut body) = req.into_parts();
            let mut head = BytesMut::new();
            let mut held: Option<Frame<Bytes>> = None;
            while head.len() < 5 {
                let frame = match tokio::time::timeout_at(deadline.deadline(), body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) => return Ok(too_slow(read_timeout).into_http()),
                };
                match frame {
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
                            deadline: None,
                            read_timeout,
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
            let body = Body::new(Prefixed {
                head: Some(head.freeze()),
                held,
                error: None,
                rest: body,
                deadline: Some(deadline),
                read_timeout,
            });
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}

/// The bytes already read, then the rest of the body, which must end by `deadline`.
struct Prefixed {
    head: Option<Bytes>,
    held: Option<Frame<Bytes>>,
    error: Option<tonic::Status>,
    rest: Body,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    read_timeout: Duration,
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
        if let Some(deadline) = self.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                self.deadline = None;
                let e = too_slow(self.read_timeout);
                return Poll::Ready(Some(Err(e)));
            }
        }
        let frame = Pin::new(&mut self.rest).poll_frame(cx);
        if matches!(frame, Poll::Ready(None)) {
            self.deadline = None; // all of it arrived: the work that follows is not timed
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.head.as_ref().is_none_or(Bytes::is_empty)
            && self.held.is_none()
            && self.error.is_none()
            && self.rest.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use futures_util::StreamExt;
    use tower::{Layer, Service, ServiceExt};

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    /// A body that sends `sent` and then nothing more, never ending (`ends`: it ends).
    fn body(sent: &'static [u8], ends: bool) -> Body {
        let first =
            futures_util::stream::once(
                async move { Ok::<_, Infallible>(Frame::data(Bytes::from_static(sent))) },
            );
        let rest = futures_util::stream::pending().take(usize::from(!ends));
        Body::new(http_body_util::StreamBody::new(first.chain(rest)))
    }

    /// Calls the layer over a handler that reads the whole message and answers the
    /// gRPC status its read ended with (0: it arrived).
    async fn call(body: Body) -> (Option<String>, Option<String>) {
        let inner = tower::service_fn(|req: Request<Body>| async move {
            let code = match req.into_body().collect().await {
                Ok(_) => tonic::Code::Ok,
                Err(status) => status.code(),
            };
            let mut r = Response::new(Body::empty());
            r.headers_mut().insert("x-read", (code as i32).into());
            Ok::<_, Infallible>(r)
        });
        let mut service = MessageLimitLayer::new(1 << 20, TIMEOUT).layer(inner);
        let answer = service.ready().await.expect("ready").call(Request::new(body));
        let r = tokio::time::timeout(TIMEOUT * 2, answer).await.expect("the call hung").expect("response");
        let header = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
        (header("x-read"), header("grpc-status"))
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_must_arrive_within_the_read_timeout_and_its_work_is_not_timed() {
        let deadline = tonic::Code::DeadlineExceeded as i32;
        // Its header, 3 of its 8 bytes, then nothing: the handler's read fails at the timeout.
        let (read, _) = call(body(&[0, 0, 0, 0, 8, 1, 2, 3], false)).await;
        assert_eq!(read, Some(deadline.to_string()));
        // Not even the header: the layer answers itself.
        let (read, status) = call(body(&[0, 0], false)).await;
        assert_eq!((read, status), (None, Some(deadline.to_string())));
        // All of it: read whole, whenever the work ends.
        let (read, _) = call(body(&[0, 0, 0, 0, 3, 1, 2, 3], true)).await;
        assert_eq!(read, Some("0".to_string()));
    }
}
