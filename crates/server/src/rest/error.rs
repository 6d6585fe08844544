//! Errors on the HTTP wire: the status from the shared table (`request::errors`), and
//! every error body JSON — ours, axum's own rejections (bad path encoding, wrong
//! method, unknown route) and panics alike. KServe and admin paths answer
//! `{"error": "...", "code": "..."}`, `/v1/*` answers OpenAI's error object.

use std::any::Any;

use axum::{
    body::Body,
    extract::Request,
    http::{header, HeaderValue, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    Json,
};
use serde_json::{json, Value};
use snooze_core::{ErrorKind, SnoozeError};

use crate::request::errors::{retry_after_secs, status_of};

/// The one error type of every KServe and admin handler.
pub struct AppError(pub SnoozeError);

impl From<SnoozeError> for AppError {
    fn from(e: SnoozeError) -> Self {
        AppError(e)
    }
}

/// The response for `e` with `body`: its status, `Retry-After` on every 503 and on any
/// error that has one, and `Connection: close` where the rest of the request was not
/// read (too large, too slow).
pub fn error_response(e: &SnoozeError, body: Value) -> Response {
    let status = status_of(e);
    if status.is_server_error() {
        // The core logs the refusals it makes (with the model and its reason), and the
        // server's own load shedding is counted in snooze_refusals_total: a second WARN
        // line per refused request only doubled what a client retrying on Retry-After
        // writes to the log.
        if matches!(e.kind, ErrorKind::InsufficientMemory | ErrorKind::QueueFull | ErrorKind::Overloaded) {
            tracing::debug!(status = status.as_u16(), code = e.kind.code(), error = %e.message, "request refused");
        } else {
            tracing::warn!(status = status.as_u16(), code = e.kind.code(), error = %e.message, "request failed");
        }
    }
    let mut resp = (status, Json(body)).into_response();
    let headers = resp.headers_mut();
    if let Some(secs) = retry_after_secs(e) {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if matches!(e.kind, ErrorKind::PayloadTooLarge | ErrorKind::RequestTimeout) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    if e.kind == ErrorKind::Unauthorized {
        // RFC 9110: a 401 names the scheme it wants.
        headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

/// The KServe / admin error body.
pub fn kserve_body(e: &SnoozeError) -> Value {
    json!({ "error": e.message, "code": e.kind.code() })
}

/// OpenAI's error object.
pub fn openai_body(e: &SnoozeError, param: Option<&str>) -> Value {
    let kind = match e.kind {
        ErrorKind::InvalidInput
        | ErrorKind::PayloadTooLarge
        | ErrorKind::ModelNotFound
        | ErrorKind::RequestTimeout
        | ErrorKind::Conflict => "invalid_request_error",
        ErrorKind::Unauthorized => "authentication_error",
        ErrorKind::Overloaded
        | ErrorKind::InsufficientMemory
        | ErrorKind::ShuttingDown
        | ErrorKind::QueueFull => "service_unavailable",
        _ => "server_error",
    };
    json!({"error": {"message": e.message, "type": kind, "param": param, "code": e.kind.code()}})
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        error_response(&self.0, kserve_body(&self.0))
    }
}

/// The code of an error that axum or a layer produced on its own.
fn code_of_status(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "invalid_input",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::REQUEST_TIMEOUT => "request_timeout",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded",
        StatusCode::TOO_MANY_REQUESTS => "queue_full",
        s if s.is_client_error() => "invalid_request",
        _ => "internal_error",
    }
}

/// Middleware: an error response that is not JSON yet (axum's rejections, 405, ...)
/// is rewritten into the error shape of its path, keeping its status and headers.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let openai = req.uri().path().starts_with("/v1/");
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // Rejection texts are short sentences; anything longer is cut.
    let text = match axum::body::to_bytes(body, 4096).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).trim().to_string(),
        _ => String::new(),
    };
    let message = match (status, text.is_empty()) {
        (StatusCode::METHOD_NOT_ALLOWED, _) => {
            let allow = parts.headers.get(header::ALLOW).and_then(|v| v.to_str().ok()).unwrap_or("");
            format!("method not allowed on this endpoint (allowed: {allow})")
        }
        (_, false) => text,
        (s, true) => s.canonical_reason().unwrap_or("error").to_lowercase(),
    };
    let code = code_of_status(status);
    let body = if openai {
        let kind = if status.is_client_error() { "invalid_request_error" } else { "server_error" };
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
    } else {
        json!({"error": message, "code": code})
    };
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(bytes))
}

/// A handler that panicked answers 500 (as JSON, through [`json_errors`]) instead of
/// dropping the connection; the process and every other request go on.
pub fn panic_response(payload: Box<dyn Any + Send + 'static>) -> Response {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    tracing::error!(panic = %what, "a request handler panicked");
    let e = SnoozeError::new(ErrorKind::Internal, format!("internal error: the handler panicked ({what})"));
    error_response(&e, kserve_body(&e))
}
