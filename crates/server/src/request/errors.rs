//! The error table (ARCHITECTURE): one [`ErrorKind`] → one HTTP status and one gRPC
//! code, for every protocol, and the `Retry-After` a refusal carries. The transports
//! only put these on their wire (`rest::error`, `grpc::status`).

use std::time::Duration;

use axum::http::StatusCode;
use snooze_core::{ErrorKind, SnoozeError};

/// `Retry-After` of a 503 or 429 that carries no better estimate.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The HTTP status and the gRPC code of `e`.
pub fn wire_codes(e: &SnoozeError) -> (StatusCode, tonic::Code) {
    use tonic::Code;
    match e.kind {
        ErrorKind::ModelNotFound => (StatusCode::NOT_FOUND, Code::NotFound),
        ErrorKind::InvalidInput => (StatusCode::BAD_REQUEST, Code::InvalidArgument),
        ErrorKind::PayloadTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, Code::ResourceExhausted),
        ErrorKind::RequestTimeout => (StatusCode::REQUEST_TIMEOUT, Code::DeadlineExceeded),
        ErrorKind::Conflict => (StatusCode::CONFLICT, Code::Aborted),
        ErrorKind::QueueFull => (StatusCode::TOO_MANY_REQUESTS, Code::ResourceExhausted),
        ErrorKind::Overloaded | ErrorKind::InsufficientMemory | ErrorKind::ShuttingDown => {
            (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable)
        }
        ErrorKind::ModelFailed if e.retry_after.is_some() => {
            (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable)
        }
        ErrorKind::ModelFailed | ErrorKind::Inference | ErrorKind::Internal => {
            (StatusCode::INTERNAL_SERVER_ERROR, Code::Internal)
        }
        ErrorKind::Unauthorized => (StatusCode::UNAUTHORIZED, Code::Unauthenticated),
    }
}

/// The HTTP column of [`wire_codes`].
pub fn status_of(e: &SnoozeError) -> StatusCode {
    wire_codes(e).0
}

/// Seconds of `Retry-After` for `e`: its own estimate, else the default for refusals
/// (503, 429), else none.
pub fn retry_after_secs(e: &SnoozeError) -> Option<u64> {
    let refused = matches!(status_of(e), StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS);
    let after = e.retry_after.or(refused.then_some(DEFAULT_RETRY_AFTER))?;
    Some(after.as_secs_f64().ceil().max(1.0) as u64)
}
