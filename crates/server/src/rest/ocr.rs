//! `POST /v1/ocr` — an image (PNG, JPEG, WebP, TIFF, BMP) or a PDF in, its pages of text
//! lines out — and `GET /v1/ocr/pipelines`. The document comes as a multipart `file` or
//! as JSON `{"file": "<base64>"}`, with the options `pipeline` (default `ocr`),
//! `use_cls`, `min_score`, `pages` and `dpi` beside it. The body is read under
//! `max_request_size` and charged to request memory; the rest is the shared path
//! (`request::ocr`). Errors take the shape of the `/v1` API.

use axum::{
    body::Body,
    extract::State,
    http::{header, HeaderMap},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use snooze_core::SnoozeError;

use super::{body::read_body, kserve::priority, openai::OpenAiError, AppState};
use crate::request::ocr::{self, Request};

/// The pipeline a request gets when it names none.
pub const DEFAULT_PIPELINE: &str = "ocr";

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/ocr", post(read)).route("/v1/ocr/pipelines", get(pipelines))
}

fn bad(param: &'static str, msg: impl Into<String>) -> OpenAiError {
    OpenAiError::about(param, SnoozeError::invalid(msg))
}

/// The JSON form of a request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    file: String,
    pipeline: Option<String>,
    use_cls: Option<bool>,
    min_score: Option<f32>,
    pages: Option<Value>,
    dpi: Option<f32>,
}

async fn read(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let started = std::time::Instant::now();
    let mut name = None;
    let result = read_once(&state, headers, body, &mut name).await;
    if let Some(n) = &name {
        let outcome = result.as_ref().map(drop).map_err(|e| e.error());
        crate::request::metrics::observe(n, "openai", started, outcome);
    }
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn read_once(
    state: &AppState,
    headers: HeaderMap,
    body: Body,
    seen: &mut Option<String>,
) -> Result<Response, OpenAiError> {
    state.admit()?;
    let mut charge = state.request_memory.charge();
    let content_type =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = read_body(state, &headers, body, state.settings.max_request_size, &mut charge).await?;
    let (file, pipeline, request) = if content_type.starts_with("multipart/form-data") {
        let boundary = multer::parse_boundary(&content_type)
            .map_err(|_| bad("file", "the multipart Content-Type has no boundary"))?;
        from_form(body.clone(), boundary).await?
    } else if content_type.starts_with("application/json") {
        from_json(&body)?
    } else {
        return Err(bad(
            "file",
            "send the document as multipart/form-data (a `file` field) or as JSON {\"file\": \"<base64>\"}",
        ));
    };
    let pipeline = state.pipelines.get(pipeline.as_deref().unwrap_or(DEFAULT_PIPELINE))?;
    *seen = Some(pipeline.settings.name.clone());
    let file =
        file.ok_or_else(|| bad("file", "the request has no `file`: send the image or PDF as `file`"))?;
    // The document is decoded from its own copy: the body goes as soon as it is made.
    let bytes = file.to_vec();
    charge.grow(bytes.len() as u64)?;
    drop(body);
    let priority = priority(&headers, None)?;
    let result = ocr::read(state, pipeline, bytes, request, priority).await?;
    Ok(Json(result).into_response())
}

/// `pages` as a string ("1-3,7") or a number.
fn pages_text(v: &Value) -> Result<String, OpenAiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err(bad("pages", "`pages` is a selection like \"1-3,7\" or a page number")),
    }
}

fn from_json(body: &[u8]) -> Result<(Option<Bytes>, Option<String>, Request), OpenAiError> {
    let req: JsonRequest = serde_json::from_slice(body)
        .map_err(|e| bad("file", format!("the body is not a valid OCR request: {e}")))?;
    let file = base64::engine::general_purpose::STANDARD
        .decode(req.file.as_bytes())
        .map_err(|e| bad("file", format!("`file` is not base64: {e}")))?;
    let pages = req.pages.as_ref().map(pages_text).transpose()?;
    let request = Request { use_cls: req.use_cls, min_score: req.min_score, pages, dpi: req.dpi };
    Ok((Some(Bytes::from(file)), req.pipeline, request))
}

async fn from_form(
    body: Bytes,
    boundary: String,
) -> Result<(Option<Bytes>, Option<String>, Request), OpenAiError> {
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let broken = |e: multer::Error| bad("file", format!("the multipart body is malformed: {e}"));
    let (mut file, mut pipeline, mut request) = (None, None, Request::default());
    while let Some(field) = multipart.next_field().await.map_err(broken)? {
        let name = field.name().unwrap_or("").to_string();
        let value = field.bytes().await.map_err(broken)?;
        if name == "file" {
            file = Some(value);
            continue;
        }
        let text = std::str::from_utf8(&value)
            .map_err(|_| bad("file", format!("the form field '{name}' is not text")))?;
        let text = text.trim();
        let flag = |param: &'static str| match text {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(bad(param, format!("{param} '{text}' is not true or false"))),
        };
        let number = |param: &'static str| {
            text.parse::<f32>().map_err(|_| bad(param, format!("{param} '{text}' is not a number")))
        };
        match name.as_str() {
            "pipeline" | "model" => pipeline = Some(text.to_string()),
            "use_cls" => request.use_cls = Some(flag("use_cls")?),
            "min_score" => request.min_score = Some(number("min_score")?),
            "dpi" => request.dpi = Some(number("dpi")?),
            "pages" => request.pages = Some(text.to_string()),
            _ => {}
        }
    }
    Ok((file, pipeline, request))
}

async fn pipelines(State(state): State<AppState>) -> Response {
    let data: Vec<Value> = state
        .pipelines
        .all()
        .iter()
        .map(|p| {
            let s = &p.settings;
            json!({
                "id": s.name,
                "object": "ocr.pipeline",
                "det": s.det,
                "cls": s.cls,
                "rec": s.rec,
                "use_cls": s.options.use_cls,
                "min_score": s.options.text_score,
                "dpi": s.dpi,
                "page_batch": s.page_batch,
                "limit_side_len": s.options.limit_side_len,
                "detector_bytes_per_pixel": p.memory.bytes_per_pixel().round(),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}
