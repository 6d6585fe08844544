//! KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`),
//! on `grpc_address`. Requests decode into the same tensors as REST, through the same
//! header checks, and take the same path from there ([`crate::inference`]); errors
//! map to gRPC codes from the same table as HTTP statuses
//! ([`crate::http::error::wire_codes`]), a refusal's retry delay in the `retry-after`
//! metadata and in the message.

use std::{collections::HashSet, future::Future};

use snooze_core::{lifecycle::StateName, DataType, ErrorKind, ModelInfo, SnoozeError, Tensor, TensorData};
use tonic::{metadata::MetadataValue, Request, Response, Status};

use crate::{
    http::{self, codec, decode, AppState},
    inference::{self, PriorityValue},
};

pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("inference");
}

use proto::{
    grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer},
    infer_parameter::ParameterChoice,
    model_infer_request::InferInputTensor,
    model_infer_response::InferOutputTensor,
    model_metadata_response::TensorMetadata,
    repository_index_response::ModelIndex,
    InferTensorContents, ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse,
    ModelReadyRequest, ModelReadyResponse, RepositoryIndexRequest, RepositoryIndexResponse,
    RepositoryModelLoadRequest, RepositoryModelLoadResponse, RepositoryModelUnloadRequest,
    RepositoryModelUnloadResponse, ServerLiveRequest, ServerLiveResponse, ServerMetadataRequest,
    ServerMetadataResponse, ServerReadyRequest, ServerReadyResponse,
};

/// Initial HTTP/2 flow-control window of a stream (a request's message).
const WINDOW: u32 = 4 << 20;

/// The one version every model has.
const VERSION: &str = "1";

/// `e` as a gRPC status: the code from the shared table, the message, and for refusals
/// the retry delay in `retry-after` metadata (seconds) and in the message.
pub fn status(e: &SnoozeError) -> Status {
    let (http, code) = http::error::wire_codes(e);
    if http.is_server_error() {
        tracing::warn!(code = e.kind.code(), error = %e.message, "gRPC request failed");
    }
    let retry = http::error::retry_after_secs(e);
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

/// The service with its limits: messages up to `max_request_size`.
pub fn service(state: AppState) -> GrpcInferenceServiceServer<Service> {
    let limit = usize::try_from(state.settings.max_request_size).unwrap_or(usize::MAX);
    GrpcInferenceServiceServer::new(Service { state })
        .max_decoding_message_size(limit)
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
        .timeout(s.acquire_timeout + s.queue_timeout)
        .concurrency_limit_per_connection(256)
        .layer(tower::util::MapResponseLayer::new(move |r| too_large_is_resource_exhausted(r, limit)))
        .add_service(service(state.clone()))
        .serve_with_incoming_shutdown(incoming, stop)
        .await?;
    Ok(())
}

/// tonic refuses a message over `max_decoding_message_size` with OUT_OF_RANGE before
/// any handler runs; the shared table says a request too large is RESOURCE_EXHAUSTED
/// (HTTP 413), with a message naming the setting.
fn too_large_is_resource_exhausted<B>(mut r: axum::http::Response<B>, limit: u64) -> axum::http::Response<B> {
    let h = r.headers_mut();
    let too_large = h.get("grpc-status").is_some_and(|v| v == "11")
        && h.get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|m| m.replace("%20", " ").contains("message length too large"));
    if too_large {
        let e = SnoozeError::new(
            ErrorKind::PayloadTooLarge,
            format!("the request message is larger than max_request_size ({limit} bytes)"),
        );
        let _ = status(&e).add_header(h);
    }
    r
}

/// Repository RPCs need the admin token (metadata `authorization: Bearer ...`) when
/// one is set, like their REST routes.
fn require_admin<T>(state: &AppState, req: &Request<T>) -> Result<(), Status> {
    let headers = req.metadata().clone().into_headers();
    http::auth::check(state.settings.admin_token.as_deref(), &headers).map_err(fail)
}

fn model<'a>(state: &'a AppState, name: &str, version: &str) -> Result<&'a ModelInfo, Status> {
    let info = state.manager.info(name).map_err(fail)?;
    match version {
        "" | VERSION => Ok(info),
        v => Err(fail(SnoozeError::new(
            ErrorKind::ModelNotFound,
            format!("model '{name}' has no version '{v}' (versions: {VERSION})"),
        ))),
    }
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

/// Typed `contents` of one input, checked element by element against its datatype
/// (its length was checked against the shape before anything was converted).
fn typed(name: &str, datatype: DataType, c: InferTensorContents) -> Result<TensorData, SnoozeError> {
    fn narrow<S: Copy, T: TryFrom<S>>(name: &str, v: Vec<S>, dt: DataType) -> Result<Vec<T>, SnoozeError> {
        v.into_iter()
            .enumerate()
            .map(|(i, x)| {
                T::try_from(x).map_err(|_| {
                    SnoozeError::invalid(format!("input '{name}' element {i} is out of range for {dt}"))
                })
            })
            .collect()
    }
    Ok(match datatype {
        DataType::Bool => TensorData::Bool(c.bool_contents),
        DataType::Int8 => TensorData::Int8(narrow(name, c.int_contents, datatype)?),
        DataType::Int16 => TensorData::Int16(narrow(name, c.int_contents, datatype)?),
        DataType::Int32 => TensorData::Int32(c.int_contents),
        DataType::Int64 => TensorData::Int64(c.int64_contents),
        DataType::Uint8 => TensorData::Uint8(narrow(name, c.uint_contents, datatype)?),
        DataType::Uint16 => TensorData::Uint16(narrow(name, c.uint_contents, datatype)?),
        DataType::Uint32 => TensorData::Uint32(c.uint_contents),
        DataType::Uint64 => TensorData::Uint64(c.uint64_contents),
        DataType::Fp32 => TensorData::Fp32(c.fp32_contents),
        DataType::Fp64 => TensorData::Fp64(c.fp64_contents),
        DataType::Bytes => TensorData::Bytes(c.bytes_contents),
        DataType::Fp16 => {
            return Err(SnoozeError::invalid(format!(
                "input '{name}': FP16 has no typed contents in the protocol; send it in raw_input_contents"
            )))
        }
    })
}

/// How many elements the typed contents hold for `datatype`, and whether another
/// field holds any (a client that filled the wrong one).
fn typed_len(datatype: DataType, c: &InferTensorContents) -> (usize, usize) {
    let lens = [
        c.bool_contents.len(),
        c.int_contents.len(),
        c.int64_contents.len(),
        c.uint_contents.len(),
        c.uint64_contents.len(),
        c.fp32_contents.len(),
        c.fp64_contents.len(),
        c.bytes_contents.len(),
    ];
    let field = match datatype {
        DataType::Bool => 0,
        DataType::Int8 | DataType::Int16 | DataType::Int32 => 1,
        DataType::Int64 => 2,
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => 3,
        DataType::Uint64 => 4,
        DataType::Fp32 => 5,
        DataType::Fp64 => 6,
        DataType::Bytes => 7,
        DataType::Fp16 => return (0, lens.iter().sum()),
    };
    (lens[field], lens.iter().sum::<usize>() - lens[field])
}

/// Decodes a `ModelInferRequest`'s inputs: headers first (names, datatypes, shapes
/// against the model), then data: raw bytes in the binary layout, or typed contents
/// whose length must match the shape before anything is converted.
fn decode_inputs(
    state: &AppState,
    info: &ModelInfo,
    inputs: Vec<InferInputTensor>,
    raw: Vec<Vec<u8>>,
) -> Result<Vec<Tensor>, SnoozeError> {
    let sig = info.signature.as_ref().ok();
    let model = info.name.as_str();
    if !raw.is_empty() && raw.len() != inputs.len() {
        return Err(SnoozeError::invalid(format!(
            "raw_input_contents has {} entries for {} inputs (one per input, or none)",
            raw.len(),
            inputs.len()
        )));
    }
    let mut seen = HashSet::new();
    let mut headers = Vec::with_capacity(inputs.len());
    for input in &inputs {
        let (dt, count) =
            decode::check_header(&input.name, &input.datatype, &input.shape, sig, model, &mut seen)?;
        inference::check_text_count(state, info, &input.name, count)?;
        headers.push((dt, count));
    }
    decode::check_complete(sig, &seen)?;
    if !raw.is_empty() {
        if let Some(i) = inputs.iter().position(|i| i.contents.is_some()) {
            return Err(SnoozeError::invalid(format!(
                "input '{}' has contents while the request has raw_input_contents (use one or the other)",
                inputs[i].name
            )));
        }
        let plans = inputs
            .iter()
            .zip(&headers)
            .zip(&raw)
            .map(|((input, (dt, count)), bytes)| {
                decode::plan_raw(&input.name, *dt, &input.shape, *count, bytes)
            })
            .collect::<Result<Vec<_>, _>>()?;
        return decode::decode(plans, &[]);
    }
    inputs
        .into_iter()
        .zip(headers)
        .map(|(input, (dt, count))| {
            let name = input.name;
            let contents = input.contents.unwrap_or_default();
            let (len, others) = typed_len(dt, &contents);
            if others > 0 {
                return Err(SnoozeError::invalid(format!(
                    "input '{name}' ({dt}) has values in a contents field of another datatype"
                )));
            }
            if len != count {
                return Err(SnoozeError::invalid(format!(
                    "input '{name}' has {len} elements but its shape {:?} needs {count}",
                    input.shape
                )));
            }
            let data = typed(&name, dt, contents)?;
            Ok(Tensor::new(name, input.shape, data))
        })
        .collect()
}

/// Outputs are always sent in `raw_output_contents` (as Triton does): the binary
/// layout, which every client reads, at no conversion cost.
fn encode_outputs(name: &str, id: String, outputs: Vec<Tensor>) -> ModelInferResponse {
    let mut raw = Vec::with_capacity(outputs.len());
    let tensors = outputs
        .into_iter()
        .map(|t| {
            let mut bytes = Vec::new();
            codec::to_binary(&t.data, &mut bytes);
            raw.push(bytes);
            InferOutputTensor {
                datatype: t.datatype().as_str().to_string(),
                name: t.name,
                shape: t.shape,
                parameters: Default::default(),
                contents: None,
            }
        })
        .collect();
    ModelInferResponse {
        model_name: name.to_string(),
        model_version: VERSION.to_string(),
        id,
        parameters: Default::default(),
        outputs: tensors,
        raw_output_contents: raw,
    }
}

impl Service {
    async fn infer(&self, req: Request<ModelInferRequest>) -> Result<ModelInferResponse, SnoozeError> {
        let state = &self.state;
        state.admit()?;
        let priority = priority_of(&req)?;
        let mut charge = state.request_memory.charge();
        // The message as received: tonic bounds it by max_request_size before decoding.
        charge.grow(prost::Message::encoded_len(req.get_ref()) as u64)?;
        let req = req.into_inner();
        let info = state.manager.info(&req.model_name)?;
        if !matches!(req.model_version.as_str(), "" | VERSION) {
            return Err(SnoozeError::new(
                ErrorKind::ModelNotFound,
                format!(
                    "model '{}' has no version '{}' (versions: {VERSION})",
                    req.model_name, req.model_version
                ),
            ));
        }
        let sig = info.signature.as_ref().ok();
        let requested: Vec<String> = req.outputs.iter().map(|o| o.name.clone()).collect();
        inference::check_requested_outputs(sig, &info.name, requested.iter().map(String::as_str))?;
        let inputs = decode_inputs(state, info, req.inputs, req.raw_input_contents)?;
        let outputs = inference::run(state, info, inputs, requested, priority, &mut charge).await?;
        Ok(encode_outputs(&info.name, req.id, outputs))
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
        Ok(Response::new(ServerReadyResponse { ready: !self.state.is_shutting_down() }))
    }

    async fn model_ready(
        &self,
        req: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let req = req.into_inner();
        let info = model(&self.state, &req.name, &req.version)?;
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
        _: Request<ServerMetadataRequest>,
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
        let info = model(&self.state, &req.name, &req.version)?;
        let sig = info.signature.as_ref().map_err(|e| {
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
        let started = std::time::Instant::now();
        let name = req.get_ref().model_name.clone();
        let result = self.infer(req).await;
        if self.state.manager.info(&name).is_ok() {
            http::metrics::observe(&name, "grpc", started, result.as_ref().map(drop));
        }
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
                let (state, reason) = http::kserve::index_state(s);
                ModelIndex { name: s.name.clone(), version: VERSION.into(), state: state.into(), reason }
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        req: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        require_admin(&self.state, &req)?;
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
        require_admin(&self.state, &req)?;
        let name = &req.get_ref().model_name;
        self.state.manager.info(name).map_err(fail)?;
        self.state.manager.unload(name).await.map_err(fail)?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}
