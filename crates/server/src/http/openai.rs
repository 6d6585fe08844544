//! OpenAI-compatible `POST /v1/embeddings` and `GET /v1/models`, so the official SDKs
//! work unchanged. Errors take OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use std::time::UNIX_EPOCH;

use axum::{
    body::Bytes,
    extract::{rejection::BytesRejection, State},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use snooze_core::{EmbedInput, ErrorKind, InferError, SnoozeError};

use super::{body_error, kserve::priority, status_of, with_retry_after, AppState};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/embeddings", post(embeddings)).route("/v1/models", get(models))
}

/// An error in OpenAI's shape.
pub struct OpenAiError(SnoozeError, Option<&'static str>);

impl From<SnoozeError> for OpenAiError {
    fn from(e: SnoozeError) -> Self {
        OpenAiError(e, None)
    }
}

fn invalid(param: &'static str, msg: impl Into<String>) -> OpenAiError {
    OpenAiError(SnoozeError::invalid(msg), Some(param))
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let OpenAiError(e, param) = self;
        let status = status_of(&e);
        let kind = match e.kind {
            ErrorKind::InvalidInput | ErrorKind::PayloadTooLarge => "invalid_request_error",
            ErrorKind::ModelNotFound => "invalid_request_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Overloaded | ErrorKind::InsufficientMemory | ErrorKind::ShuttingDown => {
                "service_unavailable"
            }
            _ => "server_error",
        };
        let body =
            json!({"error": {"message": e.message, "type": kind, "param": param, "code": e.kind.code()}});
        with_retry_after((status, Json(body)).into_response(), &e, std::time::Duration::from_secs(5))
    }
}

#[derive(Deserialize)]
struct EmbeddingsRequest {
    model: String,
    input: Value,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

/// `str | [str] | [int] | [[int]]` → what the embedder takes.
fn parse_input(v: Value, max_inputs: usize, max_chars: usize) -> Result<EmbedInput, OpenAiError> {
    let too_many = |n: usize| {
        invalid("input", format!("{n} inputs is more than the {max_inputs} allowed in one request"))
    };
    let token = |v: &Value| {
        v.as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| invalid("input", format!("token ids must be integers >= 0, got {v}")))
    };
    let check_text = |i: usize, s: &str| {
        let n = s.chars().count();
        if n > max_chars {
            return Err(invalid(
                "input",
                format!("input {i} has {n} characters, more than max_input_chars ({max_chars})"),
            ));
        }
        Ok(())
    };
    let items = match v {
        Value::String(s) => {
            check_text(0, &s)?;
            return Ok(EmbedInput::Texts(vec![s]));
        }
        Value::Array(items) => items,
        other => return Err(invalid("input", format!("input must be a string or an array, got {other}"))),
    };
    if items.is_empty() {
        return Err(invalid("input", "input must not be empty"));
    }
    match &items[0] {
        Value::String(_) => {
            if items.len() > max_inputs {
                return Err(too_many(items.len()));
            }
            let texts = items
                .into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => check_text(i, &s).map(|_| s),
                    other => {
                        Err(invalid("input", format!("input {i} is {other}, but the array holds strings")))
                    }
                })
                .collect::<Result<_, _>>()?;
            Ok(EmbedInput::Texts(texts))
        }
        Value::Number(_) => {
            Ok(EmbedInput::TokenIds(vec![items.iter().map(token).collect::<Result<_, _>>()?]))
        }
        Value::Array(_) => {
            if items.len() > max_inputs {
                return Err(too_many(items.len()));
            }
            let lists = items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Array(ids) if !ids.is_empty() => {
                        ids.iter().map(token).collect::<Result<Vec<_>, _>>()
                    }
                    other => Err(invalid(
                        "input",
                        format!("input {i} is {other}, but the array holds token-id arrays"),
                    )),
                })
                .collect::<Result<_, _>>()?;
            Ok(EmbedInput::TokenIds(lists))
        }
        other => Err(invalid("input", format!("input must hold strings or token ids, got {other}"))),
    }
}

async fn embeddings(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    state.admit()?;
    let body = body.map_err(|e| body_error(e, state.settings.max_request_size))?;
    let req: EmbeddingsRequest = serde_json::from_slice(&body)
        .map_err(|e| invalid("input", format!("the body is not a valid embeddings request: {e}")))?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(invalid(
                "encoding_format",
                format!("encoding_format '{other}' is not \"float\" or \"base64\""),
            ))
        }
    };
    let info = state.manager.info(&req.model).map_err(|e| OpenAiError(e, Some("model")))?;
    if info.backend != "candle" {
        return Err(invalid("model", format!("model '{}' is not a text-embedding model", req.model)));
    }
    let input = parse_input(req.input, state.settings.max_embedding_inputs, state.settings.max_input_chars)?;
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d >= 1 => Some(d as usize),
        Some(d) => return Err(invalid("dimensions", format!("dimensions must be at least 1, got {d}"))),
    };
    let result = state.manager.run(&req.model, priority(&headers), move |m| {
        let e = m.as_embedder().ok_or_else(|| InferError::InvalidInput("this model does not produce embeddings".into()))?;
        if let Some(d) = dimensions {
            if d > e.dimensions() {
                return Err(InferError::InvalidInput(format!(
                    "dimensions {d} is more than the model's {}",
                    e.dimensions()
                )));
            }
            if !e.normalized() {
                return Err(InferError::InvalidInput(
                    "this model's vectors are not normalized, so they cannot be shortened with dimensions".into(),
                ));
            }
        }
        let mut out = e.embed(&input)?;
        if let Some(d) = dimensions {
            for v in &mut out.vectors {
                v.truncate(d);
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                v.iter_mut().for_each(|x| *x /= norm);
            }
        }
        Ok(out)
    })
    .await?;
    let data: Vec<Value> = result
        .vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }))
    .into_response())
}

async fn models(State(state): State<AppState>) -> Response {
    let created = state.started.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let data: Vec<Value> = state
        .manager
        .models()
        .iter()
        .map(|m| json!({"id": m.name, "object": "model", "created": created, "owned_by": "snoozeml"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_forms() {
        let p = |v: Value| parse_input(v, 4, 10).map_err(|e| e.0.message);
        assert_eq!(p(json!("hi")).unwrap(), EmbedInput::Texts(vec!["hi".into()]));
        assert_eq!(p(json!(["a", "b"])).unwrap(), EmbedInput::Texts(vec!["a".into(), "b".into()]));
        assert_eq!(p(json!([1, 2])).unwrap(), EmbedInput::TokenIds(vec![vec![1, 2]]));
        assert_eq!(p(json!([[1], [2, 3]])).unwrap(), EmbedInput::TokenIds(vec![vec![1], vec![2, 3]]));
        assert!(p(json!([])).unwrap_err().contains("empty"));
        assert!(p(json!(["a", 1])).unwrap_err().contains("input 1"));
        assert!(p(json!(vec!["a"; 5])).unwrap_err().contains("5 inputs"));
        assert!(p(json!("x".repeat(11))).unwrap_err().contains("max_input_chars"));
        assert!(p(json!([-1])).unwrap_err().contains("token ids"));
        assert!(p(json!({"a": 1})).unwrap_err().contains("string or an array"));
    }
}
