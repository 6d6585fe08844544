//! The dashboard at `/`: one static page embedded in the binary. It holds no data itself
//! (so it is served without the admin token); its script reads the admin API, sending
//! the token the user entered.

use axum::{
    http::header,
    response::{Html, IntoResponse},
    routing::get,
    Router,
};

use super::AppState;

const PAGE: &str = include_str!("dashboard.html");

pub fn routes() -> Router<AppState> {
    Router::new().route("/", get(page))
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CACHE_CONTROL, "no-cache"),
            // Nothing but this page's own inline script and style, and the same origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
            ),
        ],
        Html(PAGE),
    )
}
