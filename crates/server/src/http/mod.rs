//! HTTP: KServe v2 REST (`kserve`), the admin API (`admin`, `memory`) and the
//! OpenAI-compatible embeddings API (`openai`), over one shared [`AppState`].
//!
//! Nothing a client sends is trusted: bodies are read under a size limit, a deadline
//! and the request-memory budget (`body`, `request_memory`), tensors are decoded
//! bounded by the bytes that arrived (`decode`), admin routes sit behind `auth`, and
//! every error — axum's own included — leaves as JSON (`error`).

pub mod admin;
pub mod auth;
pub mod body;
pub mod codec;
pub mod dashboard;
pub mod decode;
pub mod error;
pub mod kserve;
pub mod memory;
pub mod metrics;
pub mod openai;
pub mod request_memory;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::SystemTime,
};

use axum::{middleware, Router};
use snooze_core::{ErrorKind, ModelManager, SnoozeError};
use tower_http::catch_panic::CatchPanicLayer;

pub use error::{status_of, AppError};

use crate::{config::ServerSettings, ServerMemory};
use request_memory::RequestMemory;

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub manager: ModelManager,
    pub settings: ServerSettings,
    pub memory: ServerMemory,
    /// Bytes held by requests in flight, against `max_inflight_request_bytes`.
    pub request_memory: Arc<RequestMemory>,
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
        let inflight = settings.max_inflight_request_bytes.resolve(memory.budget_bytes);
        AppState(Arc::new(Inner {
            manager,
            request_memory: RequestMemory::new(inflight),
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
    let admin = Router::new()
        .merge(admin::routes())
        .merge(memory::routes())
        .merge(kserve::admin_routes())
        .merge(metrics::routes())
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_admin));
    Router::new()
        .merge(kserve::routes())
        .merge(openai::routes())
        .merge(dashboard::routes())
        .merge(admin)
        // Plain text: `json_errors` gives it the error shape of its path.
        .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
        .layer(CatchPanicLayer::custom(error::panic_response))
        .layer(middleware::from_fn(error::json_errors))
        .layer(middleware::from_fn(model_header))
}

/// Answers about one model (`/v2/models/{name}/...`) say which in `x-snooze-model`, as
/// `/v1/embeddings` answers do: what a proxy routing by model name can log and check.
async fn model_header(request: axum::extract::Request, next: middleware::Next) -> axum::response::Response {
    let name = request
        .uri()
        .path()
        .strip_prefix("/v2/models/")
        .and_then(|rest| rest.split('/').next())
        .and_then(|name| axum::http::HeaderValue::from_str(name).ok());
    let mut response = next.run(request).await;
    if let Some(name) = name {
        response.headers_mut().entry(openai::MODEL_HEADER).or_insert(name);
    }
    response
}

pub(crate) fn ok_json(value: serde_json::Value) -> axum::response::Response {
    axum::response::IntoResponse::into_response(axum::Json(value))
}
