//! The one transcription path: what `/v1/audio/*` and KServe share once their request
//! is parsed. The model must be a speech model; the request's options are checked
//! against it; the upload is decoded once to count its length (never trusting a
//! header) under `max_audio_seconds`, then streamed window by window through a
//! transcription job the scheduler advances slice by slice.

use bytes::Bytes;
use snooze_core::{ErrorKind, ModelInfo, Priority, SnoozeError, Task};
use snooze_speech::{
    audio::AudioLimits,
    openai::{self, Request},
    whisper::{Transcription, TranscriptionResult, WhisperConfig},
};

use super::AppState;

/// A refusal naming the request field that is wrong.
pub struct FieldError {
    pub field: &'static str,
    pub error: SnoozeError,
}

impl From<SnoozeError> for FieldError {
    fn from(error: SnoozeError) -> Self {
        FieldError { field: "", error }
    }
}

/// Transcribes (or translates) `audio` with the speech model `info`.
pub async fn transcribe(
    state: &AppState,
    info: &ModelInfo,
    audio: Bytes,
    request: Request,
    priority: Option<Priority>,
) -> Result<TranscriptionResult, FieldError> {
    if info.task != Task::Transcription {
        return Err(FieldError {
            field: "model",
            error: SnoozeError::invalid(format!(
                "model '{}' does not transcribe audio (it is a {} model)",
                info.name,
                match info.task {
                    Task::Embedding => "text-embedding",
                    _ => "tensor",
                }
            )),
        });
    }
    let limits = AudioLimits { max_seconds: state.settings.max_audio_seconds as f64 };
    let path = info.path.clone();
    // Reading the descriptor and decoding the whole upload once are blocking work.
    let opened = tokio::task::spawn_blocking(move || {
        let config = WhisperConfig::read(&path)
            .map_err(|e| FieldError { field: "model", error: SnoozeError::new(ErrorKind::ModelFailed, e) })?;
        let options = openai::options(&config, &request)
            .map_err(|(field, msg)| FieldError { field, error: SnoozeError::invalid(msg) })?;
        openai::open(audio, &limits, &config, options)
            .map(|(job, _)| job)
            .map_err(|e| FieldError { field: "file", error: SnoozeError::from(e) })
    })
    .await
    .map_err(|e| SnoozeError::new(ErrorKind::Internal, format!("the audio decoder stopped: {e}")))??;
    let done = state.manager.run_task(&info.name, priority, Box::new(opened)).await?;
    let any: Box<dyn std::any::Any> = done;
    let job = any
        .downcast::<Transcription>()
        .map_err(|_| SnoozeError::new(ErrorKind::Internal, "a transcription came back as another job"))?;
    Ok(job.result())
}
