//! KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`),
//! on `grpc_address`: a thin transport over the request layer. Requests decode into
//! the same tensors as REST, through the same header checks, and take the same path
//! from there ([`crate::request::inference`]); errors map to gRPC codes from the same
//! table as HTTP statuses ([`crate::request::errors::wire_codes`]), a refusal's retry
//! delay in the `retry-after` metadata and in the message.

use std::future::Future;

use snooze_core::{lifecycle::StateName, ErrorKind, ModelInfo, SnoozeError};
use tonic::{metadata::MetadataValue, Request, Response, Status};

use crate::request::{
    auth, errors, index_state,
    inference::{self, PriorityValue},
    metrics, AppState, VERSION,
};

mod limit;
mod tensors;

pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("inference");
}

use proto::{
    grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer},
    infer_parameter::ParameterChoice,
    model_metadata_response::TensorMetadata,
    repository_index_response::ModelIndex,
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest,
    ModelReadyResponse, RepositoryIndexRequest, RepositoryIndexResponse, RepositoryModelLoadRequest,
    RepositoryModelLoadResponse, RepositoryModelUnloadRequest, RepositoryModelUnloadResponse,
    ServerLiveRequest, ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest,
    ServerReadyResponse,
};

/// Initial HTTP/2 flow-control window of a stream (a request's message).
const WINDOW: u32 = 4 << 20;

/// `e` as a gRPC status: the code from the shared table, the message, and for refusals
/// the retry delay in `retry-after` metadata (seconds) and in the message.
pub fn status(e: &SnoozeError) -> Status {
    let (http, code) = errors::wire_codes(e);
    if http.is_server_error() {
        tracing::warn!(code = e.kind.code(), error = %e.message, "gRPC request failed");
    }
    let retry = errors::retry_after_secs(e);
    let message = match retry {
        Some(secs) => format!("{} (retry after {secs} s)", e.message),
        None => e.message.clone(),
    };
    let mut s = Status::new(code, message);
    let md = s.metadata_mut();
    md.insert("x-snooze-error-code", MetadataValue::from_static(e.kind.code()));
    if let Some(secs) = retry {
        md.insert("retry-after", MetadataValue::from(secs));
    }
    s
}

fn fail(e: SnoozeError) -> Status {
    status(&e)
}

/// The service, sharing the REST server's state.
#[derive(Clone)]
pub struct Service {
    state: AppState,
}

/// The service with its limits: messages up to `max_request_size`, refused before
/// tonic reads them by `limit::MessageLimitLayer` (tonic's own bound stays as a backstop).
/// Served only behind that layer, which also holds the key and token rules ([`gate`]).
fn service(state: AppState) -> GrpcInferenceServiceServer<Service> {
    let limit = usize::try_from(state.settings.max_request_size).unwrap_or(usize::MAX);
    GrpcInferenceServiceServer::new(Service { state })
        .max_decoding_message_size(limit.saturating_add(1))
        .max_encoding_message_size(usize::MAX)
}

/// Serves gRPC on `listener` until `stop` resolves (then in-flight calls finish).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let s = &state.settings;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let limit = s.max_request_size;
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        // HTTP/2's default 64 KiB windows make every larger tensor wait a round trip
        // for a WINDOW_UPDATE; adaptive windows grow with the connection's throughput.
        .http2_adaptive_window(Some(true))
        .initial_stream_window_size(Some(WINDOW))
        .initial_connection_window_size(Some(WINDOW * 4))
        .concurrency_limit_per_connection(256)
        // No timeout of the whole call: a transcription or a document may take longer
        // than any bound that fits a small request, and REST has none either; the message
        // must arrive within body_read_timeout, and a client may set its own deadline.
        .layer(limit::MessageLimitLayer::new(limit, s.body_read_timeout).with_gate(gate(state.clone())))
        .add_service(service(state.clone()))
        .serve_with_incoming_shutdown(incoming, stop)
        .await?;
    Ok(())
}

/// The key and token rules of every RPC, in one place, asked before its message is read
/// (the handlers behind it do not ask again): health and readiness are open, the
/// repository's load and unload need the admin token, the rest an API key when any is
/// set — as on their REST routes.
fn gate(state: AppState) -> limit::Gate {
    std::sync::Arc::new(move |path: &str, authorization: Option<&str>| {
        match path.rsplit('/').next().unwrap_or_default() {
            "ServerLive" | "ServerReady" | "ModelReady" => Ok(()),
            "RepositoryModelLoad" | "RepositoryModelUnload" => {
                auth::check_admin(state.settings.admin_token.as_deref(), authorization)
            }
            _ => state.keys.check(authorization),
        }
    })
}

fn priority_of(req: &Request<ModelInferRequest>) -> Result<Option<snooze_core::Priority>, SnoozeError> {
    let header = match req.metadata().get("x-snooze-priority") {
        Some(v) => {
            Some(v.to_str().map_err(|_| SnoozeError::invalid("the x-snooze-priority metadata is not text"))?)
        }
        None => None,
    };
    let parameter = match req.get_ref().parameters.get("priority").and_then(|p| p.parameter_choice.as_ref()) {
        None => None,
        Some(ParameterChoice::Int64Param(n)) => Some(PriorityValue::Number(u64::try_from(*n).unwrap_or(3))),
        Some(ParameterChoice::Uint64Param(n)) => Some(PriorityValue::Number(*n)),
        Some(ParameterChoice::StringParam(s)) => Some(PriorityValue::Name(s.clone())),
        Some(_) => return Err(SnoozeError::invalid("parameters.priority must be a name or a number")),
    };
    inference::priority(header, parameter)
}

impl Service {
    async fn infer(
        &self,
        info: &ModelInfo,
        req: Request<ModelInferRequest>,
    ) -> Result<ModelInferResponse, SnoozeError> {
        let state = &self.state;
        state.admit()?;
        let priority = priority_of(&req)?;
        let mut charge = state.request_memory.charge();
        // The message's size as its frame declared it, checked by the limit layer.
        let size = req.extensions().get::<limit::MessageSize>().map_or(0, |s| s.0);
        charge.grow(size)?;
        let req = req.into_inner();
        // Inputs the files did not name when read: they may have been replaced since.
        let named = |sig: &Result<snooze_core::ModelSignature, String>| {
            sig.as_ref()
                .map_or(true, |s| req.inputs.iter().all(|i| s.inputs.iter().any(|x| x.name == i.name)))
        };
        let mut sig = info.signature();
        if !named(&sig) && state.manager.refresh_files(&info.name).await {
            sig = info.signature();
        }
        let sig = sig.as_ref().ok();
        let requested: Vec<String> = req.outputs.iter().map(|o| o.name.clone()).collect();
        inference::check_requested_outputs(sig, &info.name, requested.iter().map(String::as_str))?;
        let inputs = tensors::decode_inputs(state, info, req.inputs, req.raw_input_contents)?;
        let outputs = inference::run(state, info, inputs, requested, priority, &mut charge).await?;
        Ok(tensors::encode_outputs(&info.name, req.id, outputs))
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse { ready: self.state.ready().is_ok() }))
    }

    async fn model_ready(
        &self,
        req: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let req = req.into_inner();
        let info = self.state.model(&req.name, Some(&req.version)).map_err(fail)?;
        let failed = self
            .state
            .manager
            .status()
            .await
            .iter()
            .any(|s| s.name == info.name && s.state == StateName::Failed);
        Ok(Response::new(ModelReadyResponse { ready: !failed && !self.state.is_shutting_down() }))
    }

    async fn server_metadata(
        &self,
        _req: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "snoozeml".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: vec!["model_repository".into(), "binary_tensor_data".into()],
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let req = req.into_inner();
        let info = self.state.model(&req.name, Some(&req.version)).map_err(fail)?;
        self.state.manager.refresh_files(&info.name).await;
        let sig = info.signature();
        let sig = sig.as_ref().map_err(|e| {
            fail(SnoozeError::new(ErrorKind::ModelFailed, format!("cannot read model '{}': {e}", info.name)))
        })?;
        let specs = |v: &[snooze_core::TensorSpec]| {
            v.iter()
                .map(|s| TensorMetadata {
                    name: s.name.clone(),
                    datatype: s.datatype.as_str().to_string(),
                    shape: s.shape.clone(),
                })
                .collect()
        };
        Ok(Response::new(ModelMetadataResponse {
            name: info.name.clone(),
            versions: vec![VERSION.into()],
            platform: sig.platform.clone(),
            inputs: specs(&sig.inputs),
            outputs: specs(&sig.outputs),
        }))
    }

    async fn model_infer(
        &self,
        req: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let r = req.get_ref();
        let info = self.state.model(&r.model_name, Some(&r.model_version)).map_err(fail)?;
        let seen = metrics::Observation::start("grpc", Some(info.name.clone()));
        let result = self.infer(info, req).await;
        seen.finish(result.as_ref().map(drop));
        result.map(Response::new).map_err(|e| status(&e))
    }

    async fn repository_index(
        &self,
        req: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        let ready_only = req.get_ref().ready;
        let models = self
            .state
            .manager
            .status()
            .await
            .iter()
            .filter(|s| !ready_only || s.state == StateName::Ready)
            .map(|s| {
                let (state, reason) = index_state(s);
                ModelIndex { name: s.name.clone(), version: VERSION.into(), state: state.into(), reason }
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        req: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.state.admit().map_err(fail)?;
        let name = &req.get_ref().model_name;
        self.state.manager.info(name).map_err(fail)?;
        self.state.manager.load(name).await.map_err(fail)?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        req: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        let name = &req.get_ref().model_name;
        self.state.manager.info(name).map_err(fail)?;
        self.state.manager.unload(name).await.map_err(fail)?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}
