//! The request layer every transport stands on: what REST (`rest/`, axum) and gRPC
//! (`grpc/`, tonic) share once they have parsed their wire format — the shared state,
//! model lookup and versions, decoding bounds and codecs, the error table, keys and
//! tokens, request memory, request metrics, and the one inference path. Nothing here
//! imports a transport module; each transport is a thin layer over this one, and a new
//! task endpoint (audio, OCR) goes the same way: a task crate beside `snooze-text`, a
//! thin handler per transport.

pub mod auth;
pub mod codec;
pub mod decode;
pub mod errors;
pub mod inference;
pub mod memory;
pub mod metrics;
pub mod ocr;
pub mod speech;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::SystemTime,
};

use snooze_core::{
    lifecycle::ModelStatus, lifecycle::StateName, ErrorKind, ModelInfo, ModelManager, SnoozeError,
};

use crate::{config::ServerSettings, ServerMemory};
use memory::RequestMemory;

/// The one version every model has (a model-repository `1/` folder, or a plain file).
pub const VERSION: &str = "1";

/// What every handler of every transport shares; cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub manager: ModelManager,
    pub settings: ServerSettings,
    pub memory: ServerMemory,
    /// Bytes held by requests in flight, against `max_inflight_request_bytes`.
    pub request_memory: Arc<RequestMemory>,
    /// Who may call inference endpoints (`api_keys`), re-read on SIGHUP.
    pub keys: auth::ApiKeys,
    /// The OCR pipelines (`/v1/ocr`).
    pub pipelines: ocr::Pipelines,
    pub shutting_down: AtomicBool,
    /// Documents being read (`/v1/ocr`): each stage is a request of its own to the core,
    /// so a shutdown waits for these before the core refuses new work (see `serve`).
    pub documents_in_flight: AtomicUsize,
    pub started: SystemTime,
}

/// Counts one document in flight while it lives (see [`Inner::documents_in_flight`]).
pub struct DocumentInFlight<'a>(&'a AtomicUsize);

impl Drop for DocumentInFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(
        manager: ModelManager,
        settings: ServerSettings,
        memory: ServerMemory,
        pipelines: &[crate::config::PipelineSettings],
    ) -> AppState {
        let inflight = settings.max_inflight_request_bytes.resolve(memory.budget_bytes);
        let keys = auth::ApiKeys::from_settings(&settings);
        let pipelines = ocr::Pipelines::load(pipelines, manager.models());
        AppState(Arc::new(Inner {
            pipelines,
            manager,
            request_memory: RequestMemory::new(inflight),
            keys,
            settings,
            memory,
            shutting_down: AtomicBool::new(false),
            documents_in_flight: AtomicUsize::new(0),
            started: SystemTime::now(),
        }))
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Admits a document (as [`AppState::admit`]) and counts it in flight until the
    /// returned guard drops: counted before the shutdown flag is read again, so a
    /// shutdown that begins meanwhile either refuses it or waits for it.
    pub fn admit_document(&self) -> Result<DocumentInFlight<'_>, SnoozeError> {
        self.documents_in_flight.fetch_add(1, Ordering::SeqCst);
        let counted = DocumentInFlight(&self.documents_in_flight);
        self.admit()?;
        Ok(counted)
    }

    /// Waits, at most `timeout`, until no document is in flight; how long it waited.
    pub async fn documents_finished(&self, timeout: std::time::Duration) -> std::time::Duration {
        let started = std::time::Instant::now();
        while self.documents_in_flight.load(Ordering::SeqCst) > 0 && started.elapsed() < timeout {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        started.elapsed()
    }

    /// Refuses new work once shutdown began.
    pub fn admit(&self) -> Result<(), SnoozeError> {
        if self.is_shutting_down() {
            return Err(SnoozeError::new(ErrorKind::ShuttingDown, "the server is shutting down")
                .retry_after(self.settings.retry_after));
        }
        Ok(())
    }

    /// Whether this node takes new work now: not while shutting down nor under emergency
    /// memory pressure (a proxy or Kubernetes should send it elsewhere). REST's
    /// `/v2/health/ready` and gRPC's ServerReady both answer from here.
    pub fn ready(&self) -> Result<(), SnoozeError> {
        self.admit()?;
        if self.manager.pressure_level() == snooze_core::pressure::PressureLevel::Emergency {
            return Err(SnoozeError::new(
                ErrorKind::InsufficientMemory,
                "not ready: under emergency memory pressure (idle models are being unloaded)",
            )
            .retry_after(self.settings.retry_after));
        }
        Ok(())
    }

    /// A configured model by name and version (empty or absent: the one version).
    pub fn model(&self, name: &str, version: Option<&str>) -> Result<&ModelInfo, SnoozeError> {
        let info = self.manager.info(name)?;
        match version {
            None | Some(VERSION) | Some("") => Ok(info),
            Some(v) => Err(SnoozeError::new(
                ErrorKind::ModelNotFound,
                format!("model '{name}' has no version '{v}' (versions: {VERSION})"),
            )),
        }
    }
}

/// A model's state in the repository index, with the reason.
pub fn index_state(s: &ModelStatus) -> (&'static str, String) {
    match s.state {
        StateName::Ready => ("READY", String::new()),
        StateName::Loading => ("LOADING", String::new()),
        StateName::Unloading => ("UNLOADING", String::new()),
        StateName::Unloaded => ("UNAVAILABLE", "unloaded; loads on its first request".to_string()),
        StateName::Failed => ("UNAVAILABLE", s.last_error.clone().unwrap_or_default()),
    }
}
