//! The connection loop: accepts at most `max_connections` clients and closes the ones
//! that hold a connection without using it.
//!
//! hyper's own header timer also runs while a kept-alive connection waits for its
//! next request, so it cannot tell a slow request head from an idle connection. Each
//! connection here is watched instead: bytes that arrive while no request is being
//! served start a request head, which must be complete within `header_read_timeout`;
//! a connection with no request and no traffic for `idle_timeout` is closed. The body
//! has its own deadline where it is read (`http::body`), so a client sending one byte
//! a second is cut off at every stage.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, OnceLock,
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::Router;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{watch, Semaphore},
};
use tower::ServiceExt;

/// How connections are bounded.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `stop` resolves to a grace; then stops accepting, asks
/// every connection to close once its request is answered, and waits for them at most
/// that long (for answers already made to be written out).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = Duration>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (closing_tx, closing) = watch::channel(false);
    tokio::pin!(stop);
    let grace = loop {
        // At max_connections, stop accepting: new clients wait in the kernel's queue.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break Duration::ZERO },
            grace = &mut stop => break grace,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off, do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            grace = &mut stop => break grace,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let closing = closing.clone();
        tokio::spawn(async move {
            connection(stream, app, limits, closing).await;
            tracing::trace!(%peer, "connection closed");
            drop(permit);
        });
    };
    drop(listener);
    let _ = closing_tx.send(true);
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(grace, permits.acquire_many(all)).await.is_err() {
        tracing::warn!(grace_s = grace.as_secs_f64(), "connections still open after shutdown; closing them");
    }
}

/// Why a watched connection is closed.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Open,
    HeadTooSlow,
    Idle,
}

/// Milliseconds since the first use, on a clock shared by every connection.
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

const NONE: u64 = 0;

/// What a connection is doing, updated by its IO and its requests.
#[derive(Debug, Default)]
struct Activity {
    /// Last time bytes moved either way.
    last_io: AtomicU64,
    /// When the first bytes of a request head arrived; `NONE` while no head is pending.
    head_since: AtomicU64,
    /// Requests handed to the router and not yet answered.
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity { last_io: AtomicU64::new(now_ms()), ..Activity::default() }
    }

    fn read(&self) {
        let now = now_ms();
        self.last_io.store(now, Ordering::Relaxed);
        if self.in_flight.load(Ordering::Acquire) == 0 {
            let _ = self.head_since.compare_exchange(NONE, now, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    fn wrote(&self) {
        self.last_io.store(now_ms(), Ordering::Relaxed);
    }

    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(NONE, Ordering::Release);
    }

    fn request_done(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.last_io.store(now_ms(), Ordering::Relaxed);
    }

    fn verdict(&self, now: u64, limits: &ConnectionLimits) -> Verdict {
        let head = self.head_since.load(Ordering::Acquire);
        if head != NONE && now.saturating_sub(head) > limits.header_read_timeout.as_millis() as u64 {
            return Verdict::HeadTooSlow;
        }
        let idle = self.in_flight.load(Ordering::Acquire) == 0 && head == NONE;
        if idle
            && now.saturating_sub(self.last_io.load(Ordering::Relaxed))
                > limits.idle_timeout.as_millis() as u64
        {
            return Verdict::Idle;
        }
        Verdict::Open
    }
}

/// Decrements the in-flight count however the request ends (answered or dropped).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut closing: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched { inner: stream, activity: activity.clone() });
    let seen = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        seen.request_started();
        let guard = InFlight(seen.clone());
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(axum::body::Body::new)).await;
            drop(guard);
            resp
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Our own watch replaces hyper's header timer (see the module docs).
    builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(None);
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let tick = (limits.header_read_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut asked_to_close = *closing.borrow();
    if asked_to_close {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep(tick) => match activity.verdict(now_ms(), &limits) {
                Verdict::Open => {}
                why => {
                    tracing::debug!(?why, "closing a connection");
                    return;
                }
            },
            changed = closing.changed(), if !asked_to_close => {
                if changed.is_err() || *closing.borrow() {
                    asked_to_close = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A socket that reports its traffic to its [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        result
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        result
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_millis(100),
            idle_timeout: Duration::from_millis(1000),
            max_connections: 1,
        }
    }

    fn at(ms: u64) -> Activity {
        let a = Activity::default();
        a.last_io.store(ms, Ordering::Relaxed);
        a
    }

    #[test]
    fn a_started_head_must_finish_within_the_header_timeout() {
        let a = at(1);
        a.head_since.store(1, Ordering::Relaxed);
        assert_eq!(a.verdict(100, &limits()), Verdict::Open);
        assert_eq!(a.verdict(102, &limits()), Verdict::HeadTooSlow);
        a.request_started();
        assert_eq!(a.verdict(5000, &limits()), Verdict::Open, "a request being served is not idle");
    }

    #[test]
    fn an_unused_connection_is_closed_after_the_idle_timeout() {
        let a = at(1);
        assert_eq!(a.verdict(1000, &limits()), Verdict::Open);
        assert_eq!(a.verdict(1002, &limits()), Verdict::Idle);
    }

    #[test]
    fn bytes_during_a_request_do_not_start_a_head() {
        let a = at(1);
        a.request_started();
        a.read();
        assert_eq!(a.head_since.load(Ordering::Relaxed), NONE);
        a.request_done();
        a.read();
        assert_ne!(a.head_since.load(Ordering::Relaxed), NONE);
    }
}
