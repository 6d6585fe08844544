//! Who may use the admin endpoints.
//!
//! The security model: inference, metadata, health and the OpenAI routes are open —
//! put the server behind your own gateway if they must not be. When `admin_token` is
//! set, every endpoint that changes what is loaded (repository load/unload, gc) and
//! every admin read that reveals internals (`/admin/*`: file paths, `/proc` figures,
//! the memory dump) needs `Authorization: Bearer <admin_token>`. Without a token the
//! admin endpoints are open, which is only safe on a loopback address: the server says
//! so at start and in `/admin/memory/stats` when it listens anywhere else.

use axum::{
    extract::{Request, State},
    http::{header, HeaderMap},
    middleware::Next,
    response::{IntoResponse, Response},
};
use snooze_core::{ErrorKind, SnoozeError};

use super::{error::AppError, AppState};

/// Middleware for the admin routes.
pub async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match check(state.settings.admin_token.as_deref(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => AppError(e).into_response(),
    }
}

/// `Ok` when no token is set or the request carries it.
pub fn check(token: Option<&str>, headers: &HeaderMap) -> Result<(), SnoozeError> {
    let Some(token) = token else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer);
    match given {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(SnoozeError::new(ErrorKind::Unauthorized, "the admin token is wrong")),
        None => Err(SnoozeError::new(
            ErrorKind::Unauthorized,
            "this admin endpoint needs 'Authorization: Bearer <admin_token>'",
        )),
    }
}

/// The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 7235).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim()).filter(|t| !t.is_empty())
}

/// Compares in time that depends only on the length of `given`, which the caller
/// knows anyway: neither the secret's bytes nor its length leak through timing.
fn same_secret(given: &[u8], secret: &[u8]) -> bool {
    if secret.is_empty() {
        return false;
    }
    let mut diff = u64::from(given.len() != secret.len());
    for (i, g) in given.iter().enumerate() {
        diff |= u64::from(g ^ secret[i % secret.len()]);
    }
    diff == 0
}

/// Whether `address` can only be reached from this machine.
pub fn is_loopback(address: &str) -> bool {
    address.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_loopback())
}

/// The warning for an open admin API on a reachable address, if it applies.
pub fn exposure_warning(address: &str, token: Option<&str>) -> Option<String> {
    (token.is_none() && !is_loopback(address)).then(|| {
        format!(
            "the server listens on {address}, beyond loopback, and no admin_token is set: anyone who can \
             reach it can load, unload and garbage-collect models and read /admin/* (file paths, memory \
             figures); set admin_token (or SNOOZE_ADMIN_TOKEN)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(auth).unwrap_or(HeaderValue::from_static("")));
        h
    }

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let t = Some("s3cret");
        assert!(check(t, &with("Bearer s3cret")).is_ok());
        assert!(check(t, &with("bearer s3cret")).is_ok());
        assert!(check(t, &with("BEARER   s3cret ")).is_ok());
        for bad in ["Bearer s3cre", "Bearer s3cret!", "Bearer S3CRET", "Basic s3cret", "s3cret", "Bearer", ""]
        {
            let e = check(t, &with(bad)).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unauthorized, "{bad:?}");
        }
        assert!(check(t, &HeaderMap::new()).is_err());
        assert!(check(None, &HeaderMap::new()).is_ok(), "no token set: open");
    }

    #[test]
    fn secrets_compare_by_content_and_length() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abcabc", b"abc"), "a repeated secret is not the secret");
        assert!(!same_secret(b"ab", b"abc"));
        assert!(!same_secret(b"", b"abc"));
        assert!(!same_secret(b"", b""));
    }

    #[test]
    fn only_non_loopback_without_a_token_warns() {
        assert!(exposure_warning("127.0.0.1:8080", None).is_none());
        assert!(exposure_warning("[::1]:8080", None).is_none());
        assert!(exposure_warning("0.0.0.0:8080", Some("t")).is_none());
        let w = exposure_warning("0.0.0.0:8080", None).unwrap_or_default();
        assert!(w.contains("0.0.0.0:8080") && w.contains("admin_token"), "{w}");
    }
}
