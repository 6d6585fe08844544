//! KServe v2 / Open Inference Protocol over REST, with the binary tensor data and
//! model repository extensions.

use axum::{
    body::Body,
    extract::{Path, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use serde_json::json;
use snooze_core::{lifecycle::StateName, ErrorKind, ModelInfo, Priority, SnoozeError, Tensor};

use super::{
    body::{optional_json, read_body, SMALL_BODY_LIMIT},
    ok_json, AppError, AppState,
};
use crate::request::{
    codec::{self, InferRequest, InferResponse, JsonData, OutputEncoding, ResponseOutput},
    decode, index_state,
    inference::{self, PriorityValue},
    metrics::Observation,
    VERSION,
};

const HEADER_LEN: &str = "inference-header-content-length";

/// Liveness and readiness, of the server and of a model: open to probes and load
/// balancers whatever the API keys.
pub fn health_routes() -> Router<AppState> {
    Router::new()
        .route("/v2/health/live", get(|| async { ok_json(json!({"live": true})) }))
        .route("/v2/health/ready", get(server_ready))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready_v))
}

/// Metadata, inference and the repository index: behind the API keys when any is set.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_v))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_v))
        .route("/v2/repository/index", post(repository_index))
}

/// The repository writes: behind the admin token when one is set.
pub fn admin_routes() -> Router<AppState> {
    Router::new()
        .route("/v2/repository/models/{model}/load", post(repository_load))
        .route("/v2/repository/models/{model}/unload", post(repository_unload))
}

/// Ready unless shutting down or under emergency memory pressure: either way this
/// node cannot take new work now, and a proxy or Kubernetes should send it elsewhere.
async fn server_ready(State(state): State<AppState>) -> Result<Response, AppError> {
    state.ready()?;
    Ok(ok_json(json!({"ready": true})))
}

async fn server_metadata() -> Response {
    ok_json(json!({
        "name": "snoozeml",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": ["model_repository", "binary_tensor_data"],
    }))
}

fn metadata(info: &ModelInfo) -> Result<Response, AppError> {
    let sig = info.signature();
    let sig = sig.as_ref().map_err(|e| {
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
    let info = s.model(&m, None)?;
    s.manager.refresh_files(&info.name).await;
    metadata(info)
}

async fn model_metadata_v(
    State(s): State<AppState>,
    Path((m, v)): Path<(String, String)>,
) -> Result<Response, AppError> {
    let info = s.model(&m, Some(&v))?;
    s.manager.refresh_files(&info.name).await;
    metadata(info)
}

/// Ready = can take a request now: a sleeping model can (it loads on demand); one
/// backing off after a failed load cannot.
async fn ready(state: &AppState, name: &str, version: Option<&str>) -> Result<Response, AppError> {
    state.admit()?;
    let info = state.model(name, version)?;
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
    body: Body,
) -> Result<Response, AppError> {
    run_infer(&s, &m, None, &headers, body).await
}

async fn infer_v(
    State(s): State<AppState>,
    Path((m, v)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    run_infer(&s, &m, Some(&v), &headers, body).await
}

async fn run_infer(
    state: &AppState,
    name: &str,
    version: Option<&str>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let known = state.manager.info(name).is_ok().then(|| name.to_string());
    let seen = Observation::start("kserve", known);
    let result = infer_once(state, name, version, headers, body).await;
    seen.finish(result.as_ref().map(drop).map_err(|e| &e.0));
    result
}

async fn infer_once(
    state: &AppState,
    name: &str,
    version: Option<&str>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    state.admit()?;
    let info = state.model(name, version)?;
    let mut charge = state.request_memory.charge();
    let body = read_body(state, headers, body, state.settings.max_request_size, &mut charge).await?;
    let header_len = headers.get(HEADER_LEN).map(|v| v.to_str().unwrap_or("?"));
    let (json_part, binary) = codec::split_body(&body, header_len)?;
    let req: InferRequest = serde_json::from_slice(json_part).map_err(|e| {
        SnoozeError::invalid(format!("the body is not a valid KServe v2 inference request: {e}"))
    })?;
    // A model whose files could not be read is checked structurally only: its load
    // then fails with the reason, which is the clearer error.
    let mut sig = info.signature();
    let mut plans = decode::plan_inputs(&req, binary.len(), sig.as_ref().ok(), name);
    // Refused by what the files said when read: they may have been replaced since.
    if plans.is_err() && state.manager.refresh_files(name).await {
        sig = info.signature();
        plans = decode::plan_inputs(&req, binary.len(), sig.as_ref().ok(), name);
    }
    let plans = plans?;
    let sig = sig.as_ref().ok();
    for p in &plans {
        inference::check_text_count(state, info, p.name, p.count)?;
    }
    let encoding = OutputEncoding::of(&req);
    inference::check_requested_outputs(sig, name, encoding.requested.iter().map(|(o, _)| o.as_str()))?;
    let inputs = decode::decode(plans, binary)?;
    let priority = priority(headers, Some(&req.parameters))?;
    // The body is given back before the model runs.
    drop(req);
    drop(body);
    let outputs = inference::run(state, info, inputs, encoding.output_names(), priority, &mut charge).await?;
    Ok(encode(name, &encoding, &outputs))
}

/// A request's priority: the `x-snooze-priority` header (`high`, `normal`, `low`), else
/// the KServe `priority` parameter — a name, or Triton's number (1 = high, 2 = normal,
/// 3 and more = low, 0 = the model's default) — else `None`: the model's default.
pub fn priority(
    headers: &HeaderMap,
    parameters: Option<&codec::Parameters<'_>>,
) -> Result<Option<Priority>, SnoozeError> {
    let header = match headers.get("x-snooze-priority") {
        Some(v) => Some(v.to_str().map_err(|_| {
            SnoozeError::invalid(
                "the x-snooze-priority header is not a priority: use \"high\", \"normal\" or \"low\"",
            )
        })?),
        None => None,
    };
    let parameter = match parameters.and_then(|p| p.get("priority")) {
        None => None,
        Some(raw) => Some(match serde_json::from_str::<u64>(raw.get()) {
            Ok(n) => PriorityValue::Number(n),
            Err(_) => PriorityValue::Name(serde_json::from_str(raw.get()).map_err(|_| {
                SnoozeError::invalid(format!(
                    "parameters.priority {} is not a priority: use \"high\", \"normal\" or \"low\"",
                    raw.get()
                ))
            })?),
        }),
    };
    inference::priority(header, parameter)
}

fn encode(name: &str, enc: &OutputEncoding, outputs: &[Tensor]) -> Response {
    let mut binary = Vec::new();
    let outs = outputs
        .iter()
        .map(|t| {
            if enc.wants_binary(&t.name) {
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
    let resp = InferResponse { model_name: name, model_version: VERSION, id: enc.id.clone(), outputs: outs };
    let mut body = serde_json::to_vec(&resp).unwrap_or_default();
    if binary.is_empty() && !outputs.iter().any(|o| enc.wants_binary(&o.name)) {
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

#[derive(serde::Deserialize, Default)]
struct IndexRequest {
    ready: Option<bool>,
}

async fn repository_index(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let mut charge = state.request_memory.charge();
    let body = read_body(&state, &headers, body, SMALL_BODY_LIMIT, &mut charge).await?;
    let req: IndexRequest = optional_json(&body)?;
    let status = state.manager.status().await;
    let list: Vec<_> = status
        .iter()
        .filter(|s| req.ready != Some(true) || s.state == StateName::Ready)
        .map(|s| {
            let (st, reason) = index_state(s);
            json!({"name": s.name, "version": VERSION, "state": st, "reason": reason})
        })
        .collect();
    Ok(ok_json(json!(list)))
}

/// The body of a repository load/unload (its parameters are optional; when present
/// they must be JSON).
async fn repository_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<(), SnoozeError> {
    let mut charge = state.request_memory.charge();
    let body = read_body(state, headers, body, SMALL_BODY_LIMIT, &mut charge).await?;
    let _: serde_json::Value = optional_json(&body)?;
    Ok(())
}

async fn repository_load(
    State(state): State<AppState>,
    Path(m): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    state.admit()?;
    state.manager.info(&m)?;
    repository_body(&state, &headers, body).await?;
    state.manager.load(&m).await?;
    Ok(ok_json(json!({})))
}

async fn repository_unload(
    State(state): State<AppState>,
    Path(m): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    state.manager.info(&m)?;
    repository_body(&state, &headers, body).await?;
    state.manager.unload(&m).await?;
    Ok(ok_json(json!({})))
}
