//! One transport-neutral error kind; each transport maps it to its own status
//! (HTTP in `server::http::error`, gRPC in `server::grpc`).

use std::{fmt, time::Duration};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    ModelNotFound,
    InvalidInput,
    PayloadTooLarge,
    /// The model's queue is full (HTTP 429).
    QueueFull,
    /// The client was too slow sending its request.
    RequestTimeout,
    /// The request was overtaken by a later one (an unload superseded by a load).
    Conflict,
    Overloaded,
    InsufficientMemory,
    ModelFailed,
    Inference,
    Unauthorized,
    ShuttingDown,
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 13] = [
        ErrorKind::ModelNotFound,
        ErrorKind::InvalidInput,
        ErrorKind::PayloadTooLarge,
        ErrorKind::QueueFull,
        ErrorKind::RequestTimeout,
        ErrorKind::Conflict,
        ErrorKind::Overloaded,
        ErrorKind::InsufficientMemory,
        ErrorKind::ModelFailed,
        ErrorKind::Inference,
        ErrorKind::Unauthorized,
        ErrorKind::ShuttingDown,
        ErrorKind::Internal,
    ];

    /// The stable machine-readable code put in error bodies.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::InsufficientMemory => "insufficient_memory",
            ErrorKind::ModelFailed => "model_failed",
            ErrorKind::Inference => "inference_error",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::Internal => "internal_error",
        }
    }
}

/// An error a user sees: a kind, a sentence they can act on, and when to retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnoozeError {
    pub kind: ErrorKind,
    pub message: String,
    /// Set on every refusal that may succeed later (memory, overload, backoff, shutdown).
    pub retry_after: Option<Duration>,
}

impl SnoozeError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        SnoozeError { kind, message: message.into(), retry_after: None }
    }

    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn not_found(model: &str) -> Self {
        SnoozeError::new(ErrorKind::ModelNotFound, format!("model '{model}' is not configured"))
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        SnoozeError::new(ErrorKind::InvalidInput, message)
    }
}

impl fmt::Display for SnoozeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SnoozeError {}
