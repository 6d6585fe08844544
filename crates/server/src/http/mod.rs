//! HTTP: KServe v2 REST (`kserve`), the admin API (`admin`) and the OpenAI-compatible
//! embeddings API (`openai`), over one shared [`AppState`].

pub mod admin;
pub mod codec;
pub mod kserve;
pub mod memory;
pub mod openai;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::SystemTime,
};

use axum::{
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json, Router,
};
use snooze_core::{ErrorKind, ModelManager, SnoozeError};

use crate::{config::ServerSettings, ServerMemory};

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub manager: ModelManager,
    pub settings: ServerSettings,
    pub memory: ServerMemory,
    pub shutting_down: AtomicBool,
    pub started: SystemTime,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(manager: ModelManager, settings: ServerSettings, memory: ServerMemory) -> AppState {
        AppState(Arc::new(Inner {
            manager,
            settings,
            memory,
            shutting_down: AtomicBool::new(false),
            started: SystemTime::now(),
        }))
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Refuses new work once shutdown began.
    pub fn admit(&self) -> Result<(), SnoozeError> {
        if self.is_shutting_down() {
            return Err(SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
                .retry_after(self.settings.retry_after));
        }
        Ok(())
    }
}

/// The whole HTTP API.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(kserve::routes())
        .merge(openai::routes())
        .merge(admin::routes())
        .merge(memory::routes())
        .fallback(|| async { AppError(SnoozeError::new(ErrorKind::ModelNotFound, "no such endpoint")) })
        .with_state(state)
}

pub(crate) fn ok_json(value: serde_json::Value) -> Response {
    Json(value).into_response()
}

/// The one error type of every KServe and admin handler: `{"error", "code"}`.
pub struct AppError(pub SnoozeError);

impl From<SnoozeError> for AppError {
    fn from(e: SnoozeError) -> Self {
        AppError(e)
    }
}

/// The ARCHITECTURE table, HTTP column.
pub fn status_of(e: &SnoozeError) -> StatusCode {
    match e.kind {
        ErrorKind::ModelNotFound => StatusCode::NOT_FOUND,
        ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
        ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorKind::Overloaded | ErrorKind::InsufficientMemory | ErrorKind::ShuttingDown => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        ErrorKind::ModelFailed if e.retry_after.is_some() => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::ModelFailed | ErrorKind::Inference | ErrorKind::Internal => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
        ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
    }
}

/// Adds `Retry-After` (whole seconds, at least 1) to every 503 and to any error that has one.
pub fn with_retry_after(mut resp: Response, e: &SnoozeError, default: std::time::Duration) -> Response {
    let after = e.retry_after.or((resp.status() == StatusCode::SERVICE_UNAVAILABLE).then_some(default));
    if let Some(after) = after {
        let secs = after.as_secs_f64().ceil().max(1.0) as u64;
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let e = self.0;
        let status = status_of(&e);
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), code = e.kind.code(), error = %e.message, "request failed");
        }
        let body = serde_json::json!({ "error": e.message, "code": e.kind.code() });
        with_retry_after((status, Json(body)).into_response(), &e, std::time::Duration::from_secs(5))
    }
}

/// Maps a body-read failure (size limit, aborted upload) to our error shape.
pub fn body_error(e: axum::extract::rejection::BytesRejection, limit: u64) -> SnoozeError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        SnoozeError::new(
            ErrorKind::PayloadTooLarge,
            format!(
                "the request body is larger than max_request_size ({})",
                snooze_core::units::format_bytes(limit)
            ),
        )
    } else {
        SnoozeError::invalid(format!("cannot read the request body: {e}"))
    }
}
