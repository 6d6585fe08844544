//! What the transports know of a model without asking the actor.

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
};

use crate::{
    backend::{Task, Weights},
    tensor::ModelSignature,
};

/// What the transports know of a model without asking the actor.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub backend: &'static str,
    pub task: Task,
    pub path: PathBuf,
    /// Read from the files at start, and again when they were replaced (see
    /// [`ModelInfo::signature`]).
    pub(super) signature: Arc<RwLock<Result<ModelSignature, String>>>,
    /// Requests may share a run (the batch dimension is dynamic, `max_batch_size > 1` and
    /// the answers do not depend on the batch).
    pub batchable: bool,
    /// How its weights are held.
    pub weights: Weights,
}

impl ModelInfo {
    pub fn new(
        name: String,
        backend: &'static str,
        task: Task,
        path: PathBuf,
        signature: Result<ModelSignature, String>,
        batchable: bool,
        weights: Weights,
    ) -> ModelInfo {
        ModelInfo {
            name,
            backend,
            task,
            path,
            signature: Arc::new(RwLock::new(signature)),
            batchable,
            weights,
        }
    }

    /// The model's inputs and outputs as its files declare them (`Err`: they cannot be
    /// read); read again before a load when the files were replaced since.
    pub fn signature(&self) -> Result<ModelSignature, String> {
        self.signature.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
