//! REST over HTTP (axum): KServe v2 (`kserve`), the OpenAI-compatible API (`openai`),
//! the admin API (`admin`, `memory`, `metrics`) and the dashboard — thin handlers over
//! the shared request layer (`crate::request`).
//!
//! Nothing a client sends is trusted: bodies are read under a size limit, a deadline
//! and the request-memory budget (`body`), tensors are decoded bounded by the bytes
//! that arrived (`request::decode`), inference routes sit behind the API keys and admin
//! routes behind the admin token (`auth`), and every error — axum's own included —
//! leaves as JSON (`error`).

pub mod admin;
pub mod audio;
pub mod auth;
pub mod body;
pub mod dashboard;
pub mod error;
pub mod kserve;
pub mod memory;
pub mod metrics;
pub mod ocr;
pub mod openai;

use axum::{middleware, Router};
use tower_http::catch_panic::CatchPanicLayer;

pub use error::AppError;

pub use crate::request::AppState;

/// The whole HTTP API.
pub fn router(state: AppState) -> Router {
    let admin = Router::new()
        .merge(admin::routes())
        .merge(memory::routes())
        .merge(kserve::admin_routes())
        .merge(metrics::routes())
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_admin));
    let inference = Router::new()
        .merge(kserve::routes())
        .merge(openai::routes())
        .merge(audio::routes())
        .merge(ocr::routes())
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    let routes = Router::new()
        .merge(kserve::health_routes())
        .merge(inference)
        .merge(dashboard::routes())
        .merge(admin)
        // Plain text: `json_errors` gives it the error shape of its path.
        .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state);
    // The layers wrap the routes as one service: a router's own layers wrap each route's
    // handlers, inside the code that adds a 405's `Allow` header, which `json_errors`
    // names in its message.
    Router::new()
        .fallback_service(routes)
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
