//! Reading a request body without trusting the client: refused by `Content-Length`
//! before a byte is read when it declares more than could ever fit, cut off when it
//! sends too slowly, and charged to the request-memory budget as it arrives — never
//! allocated or charged by a number the client declared.

use axum::{
    body::{Body, Bytes},
    http::{header, HeaderMap},
};
use http_body_util::BodyExt;
use snooze_core::{units::format_bytes as fb, ErrorKind, SnoozeError};

use super::AppState;
use crate::request::memory::Charge;

/// Bodies of repository and admin requests (a few optional parameters).
pub const SMALL_BODY_LIMIT: u64 = 64 << 10;

fn too_large(state: &AppState, limit: u64, what: &str) -> SnoozeError {
    let setting = if limit == state.settings.max_request_size { " (max_request_size)" } else { "" };
    SnoozeError::new(
        ErrorKind::PayloadTooLarge,
        format!("the request body {what} is larger than this endpoint's limit of {}{setting}", fb(limit)),
    )
}

/// Reads the whole body, at most `limit` bytes within `body_read_timeout`, charging
/// its bytes to `charge`.
pub async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    charge: &mut Charge,
) -> Result<Bytes, SnoozeError> {
    let declared = match headers.get(header::CONTENT_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| SnoozeError::invalid("Content-Length is not a byte count"))?,
        ),
    };
    if let Some(n) = declared {
        if n > limit {
            return Err(too_large(state, limit, &format!("({})", fb(n))));
        }
        // Refused at once if it could never fit, or not now; charged as it arrives, never
        // by the number: connections that declare much and send nothing hold nothing.
        charge.fits_now(n)?;
    }
    let timeout = state.settings.body_read_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut body = body;
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total: u64 = 0;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(SnoozeError::new(
                    ErrorKind::RequestTimeout,
                    format!(
                        "the request body was not received within body_read_timeout ({:.0}s): {} arrived",
                        timeout.as_secs_f64(),
                        fb(total)
                    ),
                ))
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(SnoozeError::invalid(format!("cannot read the request body: {e}")))
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue }; // trailers
        total += data.len() as u64;
        if total > limit {
            return Err(too_large(state, limit, "(sent without a Content-Length)"));
        }
        charge.grow(data.len() as u64)?;
        chunks.push(data);
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            // Exactly what arrived, in one buffer.
            let mut all = Vec::with_capacity(total as usize);
            for c in chunks {
                all.extend_from_slice(&c);
            }
            Bytes::from(all)
        }
    })
}

/// An optional JSON body: empty means `T::default()`.
pub fn optional_json<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, SnoozeError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| SnoozeError::invalid(format!("the request body is not valid JSON: {e}")))
}
