//! `POST /v1/ocr` — an image (PNG, JPEG, WebP, TIFF, BMP) or a PDF in, its pages of text
//! lines out — and `GET /v1/ocr/pipelines`. The document comes as a multipart `file` or
//! as JSON `{"file": "<base64>"}`, with the options `pipeline` (default `ocr`),
//! `use_cls`, `min_score`, `pages` and `dpi` beside it. The body is read under
//! `max_request_size` and charged to request memory; the rest is the shared path
//! (`request::ocr`). Errors take the shape of the `/v1` API.

use axum::{
    body::Body,
    extract::State,
    http::{header, HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use base64::Engine;
use bytes::Bytes;
use serde_json::{json, Value};
use snooze_core::SnoozeError;

use super::{
    body::read_body,
    kserve::priority,
    openai::{OpenAiError, SeenFields, MODEL_HEADER},
    AppState,
};
use crate::request::{
    metrics::Observation,
    ocr::{self, Request},
};

/// The pipeline a request gets when it names none.
pub const DEFAULT_PIPELINE: &str = "ocr";

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/ocr", post(read)).route("/v1/ocr/pipelines", get(pipelines))
}

fn bad(param: impl Into<std::borrow::Cow<'static, str>>, msg: impl Into<String>) -> OpenAiError {
    OpenAiError::about(param, SnoozeError::invalid(msg))
}

async fn read(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let mut seen = Observation::start("openai", None);
    let result = read_once(&state, headers, body, &mut seen.model).await;
    let name = seen.model.clone();
    seen.finish(result.as_ref().map(drop).map_err(|e| e.error()));
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    // The pipeline, as every answer about a model names it: what a proxy routes by.
    if let Some(value) = name.and_then(|n| HeaderValue::from_str(&n).ok()) {
        response.headers_mut().insert(MODEL_HEADER, value);
    }
    response
}

async fn read_once(
    state: &AppState,
    headers: HeaderMap,
    body: Body,
    seen: &mut Option<String>,
) -> Result<Response, OpenAiError> {
    // Its stages are requests of their own: a shutdown lets the document finish first.
    let _in_flight = state.admit_document()?;
    let mut charge = state.request_memory.charge();
    // Media types are case-insensitive (`Application/JSON`); the boundary is not, and is
    // parsed from the header as sent.
    let sent_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let content_type = sent_type.to_ascii_lowercase();
    let body = read_body(state, &headers, body, state.settings.max_request_size, &mut charge).await?;
    let (file, pipeline, request) = if content_type.starts_with("multipart/form-data") {
        let boundary = multer::parse_boundary(sent_type)
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
    let asked = pipeline.as_deref().unwrap_or(DEFAULT_PIPELINE);
    let pipeline = state.pipelines.get(asked).map_err(|e| OpenAiError::about("pipeline", e).naming(asked))?;
    *seen = Some(pipeline.settings.name.clone());
    request.check(&pipeline.settings).map_err(|(param, e)| OpenAiError::about(param, e))?;
    let file =
        file.ok_or_else(|| bad("file", "the request has no `file`: send the image or PDF as `file`"))?;
    // The document is decoded from its own copy: the body goes as soon as it is made.
    let bytes = file.to_vec();
    charge.grow(bytes.len() as u64)?;
    drop(body);
    let priority = priority(&headers, None)?;
    let result = ocr::read(state, pipeline, bytes, request, priority)
        .await
        .map_err(|ocr::ReadError(e, param)| OpenAiError::about(param.unwrap_or(""), e))?;
    Ok(Json(result).into_response())
}

/// The options beside the document, by name; JSON and form fields alike.
const OPTIONS: &str = "file, pipeline (or model), use_cls, min_score, pages, dpi";

/// Sets the option `name` of a request from its text (a form field, or a JSON value
/// written as text); an unknown name is refused rather than ignored: a misspelt `page`
/// would otherwise read the whole document.
fn set_option(
    name: &str,
    text: &str,
    pipeline: &mut Option<String>,
    request: &mut Request,
) -> Result<(), OpenAiError> {
    let text = text.trim();
    let number = |param: &'static str| {
        text.parse::<f32>().map_err(|_| bad(param, format!("{param} '{text}' is not a number")))
    };
    match name {
        // `model`, as the rest of the `/v1` API names what serves a request.
        "pipeline" | "model" if pipeline.is_some() => {
            return Err(bad(name.to_string(), "`pipeline` and `model` name the same thing: send one"))
        }
        "pipeline" | "model" => *pipeline = Some(text.to_string()),
        "use_cls" => {
            // Any case: Python's `requests` sends `data={"use_cls": False}` as "False".
            request.use_cls = Some(match text.to_ascii_lowercase().as_str() {
                "true" | "1" => true,
                "false" | "0" => false,
                _ => return Err(bad("use_cls", format!("use_cls '{text}' is not true or false"))),
            })
        }
        "min_score" => request.min_score = Some(number("min_score")?),
        "dpi" => request.dpi = Some(number("dpi")?),
        "pages" => request.pages = Some(text.to_string()),
        _ => {
            return Err(bad(name.to_string(), format!("unknown field '{name}' (the fields are: {OPTIONS})")))
        }
    }
    Ok(())
}

/// A JSON option as the text a form would carry: a string as it is, a number or a flag
/// as written (`null` is an option not given).
fn option_text(name: &str, v: &Value) -> Result<String, OpenAiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        _ => {
            Err(bad(name.to_string(), format!("`{name}` must be a string, a number or true/false, not {v}")))
        }
    }
}

/// A base64 document as people paste it: wrapped lines (what `base64` prints), a `data:`
/// URL prefix (the scheme in any case), the URL-safe alphabet (`-`, `_`) and missing
/// `=` padding are taken (browsers' and Python's `urlsafe_b64encode` write those).
fn decode_base64(text: &str) -> Result<Vec<u8>, OpenAiError> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let text = match text.get(..5).filter(|scheme| scheme.eq_ignore_ascii_case("data:")) {
        Some(_) => text[5..].split_once(";base64,").map(|(_, b)| b).ok_or_else(|| {
            bad("file", "`file` is a data: URL without \";base64,\": send the document base64-encoded")
        })?,
        None => text,
    };
    // A copy without the line breaks only when there are some: the text may be most of
    // `max_request_size`.
    let text: std::borrow::Cow<[u8]> = if text.bytes().any(|b| b.is_ascii_whitespace()) {
        text.bytes().filter(|b| !b.is_ascii_whitespace()).collect::<Vec<u8>>().into()
    } else {
        text.as_bytes().into()
    };
    let config = GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    let url_safe = text.iter().any(|&b| b == b'-' || b == b'_');
    let alphabet = if url_safe { &base64::alphabet::URL_SAFE } else { &base64::alphabet::STANDARD };
    GeneralPurpose::new(alphabet, config).decode(&text).map_err(|e| {
        let why = match e {
            base64::DecodeError::InvalidByte(_, byte) | base64::DecodeError::InvalidLastSymbol(_, byte)
                if !byte.is_ascii_graphic() =>
            {
                format!("it holds the byte 0x{byte:02x}, which base64 has no place for")
            }
            base64::DecodeError::InvalidByte(_, byte) => {
                format!("it holds '{}', which is not a base64 character", byte as char)
            }
            base64::DecodeError::InvalidLastSymbol(..) | base64::DecodeError::InvalidLength(_) => {
                "its length or its last characters do not end a base64 text (cut short?)".to_string()
            }
            other => other.to_string(),
        };
        bad("file", format!("`file` is not base64: {why}"))
    })
}

/// A JSON object's members in the order written, repeats kept: `serde_json::Map` keeps the
/// last of a repeated member, so `{"pages": "1", "pages": "2-9"}` would read nine pages
/// where the multipart form refuses the same repeat.
struct Members(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visit)
    }
}

fn from_json(body: &[u8]) -> Result<(Option<Bytes>, Option<String>, Request), OpenAiError> {
    let Members(fields) = serde_json::from_slice(body)
        .map_err(|e| bad("", format!("the body is not a JSON object of an OCR request: {e}")))?;
    let (mut file, mut pipeline, mut request) = (None, None, Request::default());
    let mut seen = SeenFields::members();
    for (name, value) in &fields {
        seen.once(name)?;
        if name == "file" {
            let Value::String(text) = value else {
                return Err(bad("file", "`file` must be the document as a base64 string"));
            };
            file = Some(Bytes::from(decode_base64(text)?));
        } else if !value.is_null() {
            set_option(name, &option_text(name, value)?, &mut pipeline, &mut request)?;
        }
    }
    Ok((file, pipeline, request))
}

async fn from_form(
    body: Bytes,
    boundary: String,
) -> Result<(Option<Bytes>, Option<String>, Request), OpenAiError> {
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let broken = |e: multer::Error| bad("file", format!("the multipart body is malformed: {e}"));
    let (mut file, mut pipeline, mut request) = (None, None, Request::default());
    let mut seen = SeenFields::default();
    while let Some(field) = multipart.next_field().await.map_err(broken)? {
        let name = field.name().unwrap_or("").to_string();
        seen.once(&name)?;
        let uploaded = field.file_name().is_some();
        let value = field.bytes().await.map_err(broken)?;
        if name == "file" {
            file = Some(value);
            continue;
        }
        if uploaded {
            return Err(bad(
                name.clone(),
                format!("the form field '{name}' holds a file: send the document as `file`"),
            ));
        }
        let text = std::str::from_utf8(&value)
            .map_err(|_| bad(name.clone(), format!("the form field '{name}' is not text")))?;
        set_option(&name, text, &mut pipeline, &mut request)?;
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
                "min_score": as_written(s.options.text_score),
                "dpi": s.dpi,
                "page_batch": s.page_batch,
                "limit_side_len": s.options.limit_side_len,
                "limit_type": s.options.limit_type,
                "det_thresh": as_written(s.options.det_thresh),
                "box_thresh": as_written(s.options.box_thresh),
                "unclip_ratio": as_written(s.options.unclip_ratio),
                "detector_bytes_per_pixel": p.memory.bytes_per_pixel().round(),
                // Why every request to it is refused (a stage that is no such model).
                "error": p.problem(),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// An `f32` setting as the config wrote it (`0.6`, not its widened `0.6000000238418579`).
fn as_written(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
