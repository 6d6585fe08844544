//! OpenAI's `POST /v1/audio/transcriptions` and `/v1/audio/translations`: a multipart
//! upload (`file`, `model`, `language`, `prompt`, `response_format`, `temperature`,
//! `timestamp_granularities[]`) in, the transcript out as `json`, `text`, `srt`, `vtt` or
//! `verbose_json`, so the official SDKs work unchanged. The body is read under
//! `max_request_size` and charged to request memory; everything after parsing is the
//! shared path (`request::speech`).

use axum::{
    body::Body,
    extract::State,
    http::{header, HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use bytes::Bytes;
use snooze_core::SnoozeError;
use snooze_speech::{
    format::{render, ResponseFormat},
    openai::{self, Request},
    whisper::Task,
};

use super::{
    body::read_body,
    kserve::priority,
    openai::{requested_model, OpenAiError, SeenFields, MODEL_HEADER},
    AppState,
};
use crate::request::{metrics::Observation, speech};

/// Form fields other than `file` are a few words: a larger one is not what it claims.
const MAX_FIELD_BYTES: usize = 64 << 10;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/v1/audio/translations", post(translations))
}

async fn transcriptions(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    answer(state, headers, body, Task::Transcribe).await
}

async fn translations(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    answer(state, headers, body, Task::Translate).await
}

async fn answer(state: AppState, headers: HeaderMap, body: Body, task: Task) -> Response {
    let mut seen = Observation::start("openai", None);
    let result = transcribe_once(&state, headers, body, task, &mut seen.model).await;
    let model = seen.model.clone();
    seen.finish(result.as_ref().map(drop).map_err(|e| e.error()));
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    if let Some(value) = model.and_then(|m| HeaderValue::from_str(&m).ok()) {
        response.headers_mut().insert(MODEL_HEADER, value);
    }
    response
}

/// The form, as sent.
#[derive(Default)]
struct Form {
    file: Option<Bytes>,
    model: Option<String>,
    request: Request,
    format: ResponseFormat,
    word_timestamps: bool,
}

async fn transcribe_once(
    state: &AppState,
    headers: HeaderMap,
    body: Body,
    task: Task,
    model_seen: &mut Option<String>,
) -> Result<Response, OpenAiError> {
    state.admit()?;
    let mut charge = state.request_memory.charge();
    let boundary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| multer::parse_boundary(ct).ok())
        .ok_or_else(|| {
            OpenAiError::about(
                "file",
                SnoozeError::invalid(
                    "the body must be multipart/form-data with a boundary (an audio `file` and its fields)",
                ),
            )
        })?;
    let body = read_body(state, &headers, body, state.settings.max_request_size, &mut charge).await?;
    let form = parse_form(body, boundary, task).await?;
    let name = requested_model(form.model, &headers)?;
    let info = state.manager.info(&name).map_err(|e| OpenAiError::from(e).naming(&name))?;
    *model_seen = Some(info.name.clone());
    let file = form.file.ok_or_else(|| {
        OpenAiError::about(
            "file",
            SnoozeError::invalid("the form has no `file`: upload the audio as the `file` field"),
        )
    })?;
    if form.word_timestamps {
        return Err(OpenAiError::about(
            "timestamp_granularities",
            SnoozeError::invalid("word timestamps are not supported: ask for `segment` granularity"),
        ));
    }
    let priority = priority(&headers, None)?;
    let result = speech::transcribe(state, info, file, form.request, priority)
        .await
        .map_err(|e| OpenAiError::about(e.field, e.error))?;
    let transcript = openai::transcript(&result, task);
    let text = render(&transcript, form.format);
    Ok(([(header::CONTENT_TYPE, form.format.content_type())], text).into_response())
}

fn bad(param: &'static str, msg: impl Into<String>) -> OpenAiError {
    OpenAiError::about(param, SnoozeError::invalid(msg))
}

/// The fields of the form; unknown ones are ignored as OpenAI's API does.
async fn parse_form(body: Bytes, boundary: String, task: Task) -> Result<Form, OpenAiError> {
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut form = Form { request: Request { task, ..Request::default() }, ..Form::default() };
    let broken = |e: multer::Error| bad("file", format!("the multipart body is malformed: {e}"));
    let mut seen = SeenFields::default();
    while let Some(field) = multipart.next_field().await.map_err(broken)? {
        let name = field.name().unwrap_or("").to_string();
        seen.once(&name)?;
        if name == "file" {
            form.file = Some(field.bytes().await.map_err(broken)?);
            continue;
        }
        let value = field.bytes().await.map_err(broken)?;
        if value.len() > MAX_FIELD_BYTES {
            return Err(bad(
                "file",
                format!("the form field '{name}' is larger than {MAX_FIELD_BYTES} bytes"),
            ));
        }
        let text = String::from_utf8(value.to_vec())
            .map_err(|_| bad("file", format!("the form field '{name}' is not UTF-8 text")))?;
        let text = text.trim().to_string();
        // An empty option is one left unset (`-F temperature=`, a form's blank input):
        // it takes its default, as a missing one does (an empty `model` is refused).
        if text.is_empty() && name != "model" {
            continue;
        }
        match name.as_str() {
            "model" => form.model = Some(text),
            // The spoken language, for a translation too (Whisper's prompt names it).
            "language" => form.request.language = Some(text),
            "prompt" => form.request.prompt = Some(text),
            "response_format" => form.format = text.parse().map_err(|e: String| bad("response_format", e))?,
            "temperature" => {
                form.request.temperature = text
                    .parse()
                    .map_err(|_| bad("temperature", format!("temperature '{text}' is not a number")))?
            }
            "timestamp_granularities[]" | "timestamp_granularities" => match text.as_str() {
                "segment" => {}
                "word" => form.word_timestamps = true,
                other => {
                    return Err(bad(
                        "timestamp_granularities",
                        format!("unknown timestamp granularity '{other}': use segment"),
                    ))
                }
            },
            "stream" if text.eq_ignore_ascii_case("true") || text == "1" => {
                return Err(bad("stream", "streamed transcriptions are not supported: leave `stream` false"))
            }
            // Asked for, ignored, the SDK's `logprobs` came back None with no word why.
            "include[]" | "include" => {
                return Err(bad(
                    "include",
                    match text.as_str() {
                        "logprobs" => "token log probabilities are not given by these Whisper models: leave \
                                       `include` out (verbose_json has each segment's avg_logprob)"
                            .to_string(),
                        other => format!("unknown include '{other}': leave `include` out"),
                    },
                ))
            }
            _ => {}
        }
    }
    Ok(form)
}
