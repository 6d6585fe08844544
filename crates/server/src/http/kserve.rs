//! KServe v2 / Open Inference Protocol over REST, with the binary tensor data and
//! model repository extensions.

use std::collections::HashSet;

use axum::{
    body::Bytes,
    extract::{rejection::BytesRejection, Path, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use serde_json::json;
use snooze_core::{
    lifecycle::StateName, ErrorKind, ModelInfo, ModelSignature, Priority, SnoozeError, Tensor,
};

use super::{
    body_error,
    codec::{self, InferRequest, InferResponse, JsonData, RequestOutput, ResponseOutput},
    memory::require_admin,
    ok_json, AppError, AppState,
};

/// The one version every model has (a model-repository `1/` folder, or a plain file).
const VERSION: &str = "1";
const HEADER_LEN: &str = "inference-header-content-length";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v2/health/live", get(|| async { ok_json(json!({"live": true})) }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_v))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready_v))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_v))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/models/{model}/load", post(repository_load))
        .route("/v2/repository/models/{model}/unload", post(repository_unload))
}

async fn server_ready(State(state): State<AppState>) -> Result<Response, AppError> {
    state.admit()?;
    Ok(ok_json(json!({"ready": true})))
}

async fn server_metadata() -> Response {
    ok_json(json!({
        "name": "snoozeml",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["model_repository", "binary_tensor_data"],
    }))
}

fn model<'a>(state: &'a AppState, name: &str, version: Option<&str>) -> Result<&'a ModelInfo, SnoozeError> {
    let info = state.manager.info(name)?;
    match version {
        None | Some(VERSION) | Some("") => Ok(info),
        Some(v) => Err(SnoozeError::new(
            ErrorKind::ModelNotFound,
            format!("model '{name}' has no version '{v}' (versions: {VERSION})"),
        )),
    }
}

fn metadata(info: &ModelInfo) -> Result<Response, AppError> {
    let sig = info.signature.as_ref().map_err(|e| {
        SnoozeError::new(ErrorKind::ModelFailed, format!("cannot read model '{}': {e}", info.name))
    })?;
    let specs = |v: &[snooze_core::TensorSpec]| {
        v.iter()
            .map(|s| json!({"name": s.name, "datatype": s.datatype, "shape": s.shape}))
            .collect::<Vec<_>>()
    };
    Ok(ok_json(json!({
        "name": info.name,
        "versions": [VERSION],
        "platform": sig.platform,
        "inputs": specs(&sig.inputs),
        "outputs": specs(&sig.outputs),
    })))
}

async fn model_metadata(State(s): State<AppState>, Path(m): Path<String>) -> Result<Response, AppError> {
    metadata(model(&s, &m, None)?)
}

async fn model_metadata_v(
    State(s): State<AppState>,
    Path((m, v)): Path<(String, String)>,
) -> Result<Response, AppError> {
    metadata(model(&s, &m, Some(&v))?)
}

/// Ready = can take a request now: a sleeping model can (it loads on demand); one
/// backing off after a failed load cannot.
async fn ready(state: &AppState, name: &str, version: Option<&str>) -> Result<Response, AppError> {
    state.admit()?;
    let info = model(state, name, version)?;
    let status = state.manager.status().await;
    if let Some(st) = status.iter().find(|s| s.name == info.name) {
        if st.state == StateName::Failed {
            return Err(SnoozeError::new(
                ErrorKind::ModelFailed,
                format!("model '{name}' failed to load: {}", st.last_error.clone().unwrap_or_default()),
            )
            .retry_after(state.settings.retry_after)
            .into());
        }
    }
    Ok(ok_json(json!({"name": info.name, "ready": true})))
}

async fn model_ready(State(s): State<AppState>, Path(m): Path<String>) -> Result<Response, AppError> {
    ready(&s, &m, None).await
}

async fn model_ready_v(
    State(s): State<AppState>,
    Path((m, v)): Path<(String, String)>,
) -> Result<Response, AppError> {
    ready(&s, &m, Some(&v)).await
}

async fn infer(
    State(s): State<AppState>,
    Path(m): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AppError> {
    run_infer(&s, &m, None, &headers, body).await
}

async fn infer_v(
    State(s): State<AppState>,
    Path((m, v)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AppError> {
    run_infer(&s, &m, Some(&v), &headers, body).await
}

async fn run_infer(
    state: &AppState,
    name: &str,
    version: Option<&str>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AppError> {
    state.admit()?;
    let info = model(state, name, version)?;
    let body = body.map_err(|e| body_error(e, state.settings.max_request_size))?;
    let header_len = headers.get(HEADER_LEN).map(|v| v.to_str().unwrap_or("?"));
    let (json_part, binary) = codec::split_body(&body, header_len)?;
    let mut req: InferRequest = serde_json::from_slice(json_part).map_err(|e| {
        SnoozeError::invalid(format!("the body is not a valid KServe v2 inference request: {e}"))
    })?;
    let inputs = codec::decode_inputs(&mut req, binary)?;
    // A model whose files could not be read is not validated here: its load fails
    // with the reason, which is the clearer error.
    if let Ok(sig) = &info.signature {
        validate(name, sig, &inputs, &req.outputs)?;
    }
    let wanted: Vec<String> = req.outputs.iter().map(|o| o.name.clone()).collect();
    let outputs = state.manager.infer(name, priority(headers), inputs, wanted).await?;
    let response = encode(name, &req, &outputs);
    if state.settings.low_ram_mode && body.len() >= LARGE_REQUEST {
        drop((body, req, outputs));
        tokio::task::spawn_blocking(snooze_core::memory::trim_heap);
    }
    Ok(response)
}

/// In low-RAM mode the heap is trimmed after requests at least this large.
const LARGE_REQUEST: usize = 1 << 20;

/// `x-snooze-priority: low` marks work that may be refused under critical memory pressure.
pub fn priority(headers: &HeaderMap) -> Priority {
    match headers.get("x-snooze-priority").and_then(|v| v.to_str().ok()) {
        Some(p) if p.eq_ignore_ascii_case("low") => Priority::Low,
        _ => Priority::Normal,
    }
}

/// Checks names, datatypes and shapes against the model's declared signature.
fn validate(
    name: &str,
    sig: &ModelSignature,
    inputs: &[Tensor],
    outputs: &[RequestOutput],
) -> Result<(), SnoozeError> {
    let list =
        |v: &[snooze_core::TensorSpec]| v.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ");
    let mut seen = HashSet::new();
    for t in inputs {
        if !seen.insert(t.name.as_str()) {
            return Err(SnoozeError::invalid(format!("input '{}' is given twice", t.name)));
        }
        let spec = sig.inputs.iter().find(|s| s.name == t.name).ok_or_else(|| {
            SnoozeError::invalid(format!(
                "model '{name}' has no input '{}' (inputs: {})",
                t.name,
                list(&sig.inputs)
            ))
        })?;
        spec.check(t).map_err(SnoozeError::invalid)?;
    }
    if let Some(missing) = sig.inputs.iter().find(|s| !seen.contains(s.name.as_str())) {
        return Err(SnoozeError::invalid(format!("input '{}' is missing", missing.name)));
    }
    for o in outputs {
        if !sig.outputs.iter().any(|s| s.name == o.name) {
            return Err(SnoozeError::invalid(format!(
                "model '{name}' has no output '{}' (outputs: {})",
                o.name,
                list(&sig.outputs)
            )));
        }
    }
    Ok(())
}

fn encode(name: &str, req: &InferRequest, outputs: &[Tensor]) -> Response {
    let mut binary = Vec::new();
    let outs = outputs
        .iter()
        .map(|t| {
            if codec::wants_binary(req, &t.name) {
                let start = binary.len();
                codec::to_binary(&t.data, &mut binary);
                ResponseOutput {
                    name: &t.name,
                    datatype: t.datatype().as_str(),
                    shape: &t.shape,
                    parameters: Some(json!({"binary_data_size": binary.len() - start})),
                    data: None,
                }
            } else {
                ResponseOutput {
                    name: &t.name,
                    datatype: t.datatype().as_str(),
                    shape: &t.shape,
                    parameters: None,
                    data: Some(JsonData(&t.data)),
                }
            }
        })
        .collect();
    let resp = InferResponse { model_name: name, model_version: VERSION, id: req.id.clone(), outputs: outs };
    let mut body = serde_json::to_vec(&resp).unwrap_or_default();
    if binary.is_empty() && !req.outputs.iter().any(|o| codec::wants_binary(req, &o.name)) {
        return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    }
    let json_len = body.len();
    body.extend_from_slice(&binary);
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    h.insert(HEADER_LEN, HeaderValue::from(json_len));
    r
}

/// An optional JSON body: empty means `default`.
fn optional_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, SnoozeError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| SnoozeError::invalid(format!("the request body is not valid JSON: {e}")))
}

#[derive(serde::Deserialize, Default)]
struct IndexRequest {
    ready: Option<bool>,
}

async fn repository_index(State(state): State<AppState>, body: Bytes) -> Result<Response, AppError> {
    let req: IndexRequest = optional_body(&body)?;
    let status = state.manager.status().await;
    let list: Vec<_> = status
        .iter()
        .filter(|s| req.ready != Some(true) || s.state == StateName::Ready)
        .map(|s| {
            let (st, reason) = match s.state {
                StateName::Ready => ("READY", String::new()),
                StateName::Loading => ("LOADING", String::new()),
                StateName::Unloading => ("UNLOADING", String::new()),
                StateName::Unloaded => ("UNAVAILABLE", "unloaded; loads on its first request".to_string()),
                StateName::Failed => ("UNAVAILABLE", s.last_error.clone().unwrap_or_default()),
            };
            json!({"name": s.name, "version": VERSION, "state": st, "reason": reason})
        })
        .collect();
    Ok(ok_json(json!(list)))
}

async fn repository_load(
    State(state): State<AppState>,
    Path(m): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, AppError> {
    state.admit()?;
    require_admin(&state, &headers)?;
    // The body (parameters) is optional; when present it must be JSON.
    let _: serde_json::Value = optional_body(&body)?;
    state.manager.load(&m).await?;
    Ok(ok_json(json!({})))
}

async fn repository_unload(
    State(state): State<AppState>,
    Path(m): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, AppError> {
    require_admin(&state, &headers)?;
    let _: serde_json::Value = optional_body(&body)?;
    state.manager.unload(&m).await?;
    Ok(ok_json(json!({})))
}
