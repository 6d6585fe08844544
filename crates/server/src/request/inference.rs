//! One request path for every protocol. KServe REST (JSON or binary) and gRPC (typed
//! or raw contents) decode into the same tensors through the same header checks
//! (`decode::check_header`); from there this module applies the same rules (embedding
//! limits, requested outputs, priority, request memory) and hands the request to the
//! same admission, queue and lease in the model manager. Errors map to HTTP statuses
//! and gRPC codes from one table (`errors::wire_codes`).

use snooze_core::{ModelInfo, ModelSignature, Priority, SnoozeError, Task, Tensor, TensorData};

use super::{memory::Charge, AppState};

/// A priority as a protocol carries it: a name, or Triton's number (1 = high,
/// 2 = normal, 3 and more = low, 0 = the model's default).
pub enum PriorityValue {
    Name(String),
    Number(u64),
}

/// A request's priority: the `x-snooze-priority` header (or gRPC metadata), else the
/// request's `priority` parameter, else `None`: the model's default.
pub fn priority(
    header: Option<&str>,
    parameter: Option<PriorityValue>,
) -> Result<Option<Priority>, SnoozeError> {
    let bad = |what: &str| {
        SnoozeError::invalid(format!("{what} is not a priority: use \"high\", \"normal\" or \"low\""))
    };
    if let Some(text) = header {
        return Priority::parse(text).map(Some).ok_or_else(|| bad(&format!("x-snooze-priority '{text}'")));
    }
    match parameter {
        None | Some(PriorityValue::Number(0)) => Ok(None),
        Some(PriorityValue::Number(1)) => Ok(Some(Priority::High)),
        Some(PriorityValue::Number(2)) => Ok(Some(Priority::Normal)),
        Some(PriorityValue::Number(_)) => Ok(Some(Priority::Low)),
        Some(PriorityValue::Name(text)) => {
            Priority::parse(&text).map(Some).ok_or_else(|| bad(&format!("parameters.priority '{text}'")))
        }
    }
}

/// An embedding model's BYTES inputs obey the limits of `/v1/embeddings`: the count of
/// texts, checked from the header before anything is decoded, ...
pub fn check_text_count(
    state: &AppState,
    info: &ModelInfo,
    name: &str,
    count: usize,
) -> Result<(), SnoozeError> {
    let max = state.settings.max_embedding_inputs;
    if info.task == Task::Embedding && count > max {
        return Err(SnoozeError::invalid(format!(
            "input '{name}' holds {count} texts, more than max_embedding_inputs ({max})"
        )));
    }
    Ok(())
}

/// ... and the length of each text once decoded.
fn check_text_lengths(state: &AppState, inputs: &[Tensor]) -> Result<(), SnoozeError> {
    let max = state.settings.max_input_chars;
    for t in inputs {
        let TensorData::Bytes(items) = &t.data else { continue };
        for (i, b) in items.iter().enumerate() {
            // Bytes bound the characters: count only what could be too long.
            if b.len() > max {
                let chars = String::from_utf8_lossy(b).chars().count();
                if chars > max {
                    return Err(SnoozeError::invalid(format!(
                        "input '{}' element {i} has {chars} characters, more than max_input_chars ({max})",
                        t.name
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Outputs asked for must exist (when the model's files could be read).
pub fn check_requested_outputs<'a>(
    sig: Option<&ModelSignature>,
    model: &str,
    mut requested: impl Iterator<Item = &'a str>,
) -> Result<(), SnoozeError> {
    let Some(sig) = sig else { return Ok(()) };
    match requested.find(|o| !sig.outputs.iter().any(|s| s.name == *o)) {
        Some(o) => {
            let outputs = sig.outputs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ");
            Err(SnoozeError::invalid(format!("model '{model}' has no output '{o}' (outputs: {outputs})")))
        }
        None => Ok(()),
    }
}

/// Runs decoded `inputs`: what every protocol shares once its request is decoded.
/// `charge` holds the request's bytes so far (body or message); from here the request
/// is charged its tensors and the copy kept for an out-of-memory retry, the rest being
/// given back by the caller dropping what it decoded from.
pub async fn run(
    state: &AppState,
    info: &ModelInfo,
    inputs: Vec<Tensor>,
    outputs: Vec<String>,
    priority: Option<Priority>,
    charge: &mut Charge,
) -> Result<Vec<Tensor>, SnoozeError> {
    if info.task == Task::Embedding {
        check_text_lengths(state, &inputs)?;
    }
    if info.task == Task::Transcription {
        return transcribe_files(state, info, inputs, priority).await;
    }
    let decoded: u64 = inputs.iter().map(|t| t.data.byte_size() as u64).sum();
    charge.grow(decoded.saturating_mul(2))?;
    charge.set(decoded.saturating_mul(2))?;
    state.manager.infer(&info.name, priority, inputs, outputs).await
}

/// A speech model over KServe: every element of its BYTES input is an audio file; each
/// is transcribed as `/v1/audio/transcriptions` would (default options), all at once so
/// their decoder steps share slices, and the texts come back as the `text` output.
async fn transcribe_files(
    state: &AppState,
    info: &ModelInfo,
    inputs: Vec<Tensor>,
    priority: Option<Priority>,
) -> Result<Vec<Tensor>, SnoozeError> {
    let [input] = <[Tensor; 1]>::try_from(inputs).map_err(|inputs| {
        SnoozeError::invalid(format!(
            "model '{}' takes one BYTES input of audio files, not {} inputs",
            info.name,
            inputs.len()
        ))
    })?;
    let TensorData::Bytes(files) = input.data else {
        return Err(SnoozeError::invalid(format!(
            "input '{}' must be BYTES (audio files), not {}",
            input.name,
            input.data.datatype()
        )));
    };
    let jobs = files
        .into_iter()
        .map(|file| super::speech::transcribe(state, info, file.into(), Default::default(), priority));
    let mut texts = Vec::new();
    for (i, result) in futures_util::future::join_all(jobs).await.into_iter().enumerate() {
        let result = result.map_err(|e| SnoozeError {
            message: format!("audio file {i}: {}", e.error.message),
            ..e.error
        })?;
        texts.push(result.text().into_bytes());
    }
    let n = texts.len() as i64;
    Ok(vec![Tensor::new(snooze_speech::whisper::TEXT_OUTPUT, vec![n], TensorData::Bytes(texts))])
}
