//! Running a request against a leased model, and what to do when memory runs out
//! *during inference*: evict idle models and retry once, then split the batch in halves
//! and run them one after the other, then give up with 503 + Retry-After.
//!
//! Also the explicit garbage collection behind `POST /admin/memory/gc`.

use std::sync::Arc;

use crate::{
    backend::{InferError, LoadedModel},
    error::{ErrorKind, SnoozeError},
    lifecycle::StateName,
    manager::{ModelManager, Priority},
    memory,
    tensor::{concat_batch, split_batch, Tensor},
};

/// What a garbage collection did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    pub models_unloaded: Vec<String>,
    /// RSS before minus RSS after (the heap trimmed included).
    pub freed_bytes: u64,
}

impl InferError {
    /// The transport-neutral error a user sees.
    pub fn into_snooze(self, model: &str) -> SnoozeError {
        match self {
            InferError::InvalidInput(m) => SnoozeError::invalid(m),
            InferError::OutOfMemory(m) => SnoozeError::new(
                ErrorKind::InsufficientMemory,
                format!("model '{model}' ran out of memory: {m}"),
            ),
            InferError::Failed(m) => {
                SnoozeError::new(ErrorKind::Inference, format!("model '{model}' failed: {m}"))
            }
        }
    }
}

impl ModelManager {
    /// Unloads every idle, unpinned model but `except`, waits (bounded) until they are
    /// gone and trims the heap.
    pub async fn gc(&self, except: Option<&str>) -> GcReport {
        let before = memory::process_rss_bytes();
        let victims: Vec<String> = self
            .status()
            .await
            .into_iter()
            .filter(|s| {
                s.state == StateName::Ready && s.leases == 0 && !s.pinned && Some(s.name.as_str()) != except
            })
            .map(|s| s.name)
            .collect();
        let mut unloads = tokio::task::JoinSet::new();
        for name in victims.clone() {
            let manager = self.clone();
            unloads.spawn(async move { manager.unload(&name).await });
        }
        while unloads.join_next().await.is_some() {}
        let _ = tokio::task::spawn_blocking(memory::trim_heap).await;
        let freed = before.saturating_sub(memory::process_rss_bytes());
        tracing::info!(models = ?victims, freed_bytes = freed, "garbage collection");
        GcReport { models_unloaded: victims, freed_bytes: freed }
    }

    /// Runs `job` on a lease of `name` on a blocking thread; one eviction-and-retry on a
    /// verified out-of-memory error.
    pub async fn run<T: Send + 'static>(
        &self,
        name: &str,
        priority: Priority,
        job: impl Fn(&dyn LoadedModel) -> Result<T, InferError> + Send + Sync + 'static,
    ) -> Result<T, SnoozeError> {
        let job = Arc::new(job);
        let first = {
            let job = job.clone();
            self.run_once(name, priority, move |m| job(m)).await?
        };
        match first {
            Err(InferError::OutOfMemory(msg)) => {
                tracing::warn!(model = name, error = %msg, "out of memory during inference: evicting idle models and retrying");
                self.gc(Some(name)).await;
                self.run_once(name, priority, move |m| job(m)).await?.map_err(|e| e.into_snooze(name))
            }
            other => other.map_err(|e| e.into_snooze(name)),
        }
    }

    /// KServe inference with the full recovery: evict + retry, then split the batch.
    pub async fn infer(
        &self,
        name: &str,
        priority: Priority,
        inputs: Vec<Tensor>,
        outputs: Vec<String>,
    ) -> Result<Vec<Tensor>, SnoozeError> {
        let outputs = Arc::new(outputs);
        let attempt = |inputs: Vec<Tensor>| {
            let outputs = outputs.clone();
            self.run_once(name, priority, move |m| m.infer(inputs, &outputs))
        };
        // Kept for a retry; a request is bounded by max_request_size.
        let retained = inputs.clone();
        let msg = match attempt(inputs).await? {
            Err(InferError::OutOfMemory(msg)) => msg,
            other => return other.map_err(|e| e.into_snooze(name)),
        };
        tracing::warn!(model = name, error = %msg, "out of memory during inference: evicting idle models and retrying");
        self.gc(Some(name)).await;
        match attempt(retained.clone()).await? {
            Err(InferError::OutOfMemory(_)) => {}
            other => return other.map_err(|e| e.into_snooze(name)),
        }
        let refuse = |why: &str| {
            SnoozeError::new(
                ErrorKind::InsufficientMemory,
                format!("model '{name}' ran out of memory during inference {why}: {msg}"),
            )
            .retry_after(self.retry_after())
        };
        let Some((left, right)) = split_batch(&retained) else {
            return Err(refuse("even after evicting idle models"));
        };
        tracing::warn!(model = name, "still out of memory: running the batch in two halves");
        drop(retained);
        let left = attempt(left).await?.map_err(|_| refuse("even on half the batch"))?;
        let right = attempt(right).await?.map_err(|_| refuse("even on half the batch"))?;
        concat_batch(left, right).ok_or_else(|| refuse("and its split outputs could not be joined"))
    }

    async fn run_once<T: Send + 'static>(
        &self,
        name: &str,
        priority: Priority,
        job: impl FnOnce(&dyn LoadedModel) -> Result<T, InferError> + Send + 'static,
    ) -> Result<Result<T, InferError>, SnoozeError> {
        let lease = self.acquire_with(name, priority).await?;
        let joined = tokio::task::spawn_blocking(move || {
            let result = job(lease.model());
            drop(lease);
            result
        })
        .await;
        match joined {
            Ok(result) => Ok(result),
            Err(e) => {
                // A panicking backend may have left the model in any state: it is unloaded
                // once its requests end and reloaded, after a backoff, on a later request.
                let why = panic_message(e);
                tracing::error!(model = name, panic = %why, "the backend panicked during inference; the model will be unloaded");
                if let Ok(model) = self.model_id(name) {
                    self.report_panic(model, format!("the backend panicked during inference: {why}"));
                }
                Err(SnoozeError::new(
                    ErrorKind::Inference,
                    format!(
                        "model '{name}' panicked during inference ({why}); it is reloaded on a later request"
                    ),
                ))
            }
        }
    }
}

/// What a panic said, when it said it with a string.
fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into()),
        Err(e) => e.to_string(),
    }
}
