//! The HTTP side of `request::auth`: middleware for the admin routes (admin token) and
//! the inference routes (API keys), reading `Authorization`.

use axum::{
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};

use super::{error::AppError, openai::OpenAiError, AppState};
use crate::request::auth::check_admin;

fn authorization(req: &Request) -> Option<&str> {
    req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())
}

/// Middleware for the admin routes.
pub async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match check_admin(state.settings.admin_token.as_deref(), authorization(&req)) {
        Ok(()) => next.run(req).await,
        Err(e) => AppError(e).into_response(),
    }
}

/// Middleware for the inference routes: a 401 in the error shape of the path's API.
pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match state.keys.check(authorization(&req)) {
        Ok(()) => next.run(req).await,
        Err(e) if req.uri().path().starts_with("/v1/") => OpenAiError::from(e).into_response(),
        Err(e) => AppError(e).into_response(),
    }
}
