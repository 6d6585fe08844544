//! The `[models.NAME]` tables: each validated into a [`ModelSettings`] (its path must
//! exist; the backend follows the files unless named), and a `model_dir` repository
//! discovered into more of them.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use snooze_core::{
    lifecycle::Priority,
    units::{parse_bytes, parse_duration, KeepAlive},
    Device, Weights,
};

use super::{err, settings::Scalar, ConfigError, ServerSettings};

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub backend: Option<String>,
    pub path: Option<PathBuf>,
    pub memory: Option<Scalar>,
    pub keep_alive: Option<Scalar>,
    pub min_residency: Option<Scalar>,
    pub pinned: Option<bool>,
    pub preload: Option<bool>,
    pub devices: Option<Vec<String>>,
    pub cpu_fallback: Option<bool>,
    pub max_queue: Option<Scalar>,
    pub max_batch_size: Option<Scalar>,
    pub batch_delay: Option<Scalar>,
    pub max_concurrency: Option<Scalar>,
    pub priority: Option<String>,
    pub weights: Option<String>,
    pub cpu_priority: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Onnx,
    Candle,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Onnx => "onnx",
            Backend::Candle => "candle",
        }
    }
}

/// A validated model entry.
#[derive(Debug, Clone)]
pub struct ModelSettings {
    pub name: String,
    pub backend: Backend,
    pub path: PathBuf,
    pub memory: Option<u64>,
    pub keep_alive: KeepAlive,
    pub min_residency: Duration,
    pub pinned: bool,
    pub preload: bool,
    pub devices: Vec<Device>,
    pub cpu_fallback: bool,
    pub max_queue: usize,
    /// Rows per run; 1 = no batching (models without a dynamic batch dimension never batch).
    pub max_batch_size: u32,
    pub batch_delay: Duration,
    /// Runs of this model at once (ONNX models load one session per run).
    pub max_concurrency: u32,
    pub priority: Priority,
    /// How an ONNX model's weights are held (`Auto` is decided at start).
    pub weights: Weights,
    /// `cpu_priority = "low"` (true) or `"normal"` (false). Unset: low for the models
    /// whose runs are long work — Whisper folders here, the stages of a pipeline once
    /// pipelines are read ([`super::resolve`]) — and normal for the others.
    pub low_cpu_priority: bool,
    /// Whether the config set `cpu_priority` (a pipeline then leaves it as it is).
    pub cpu_priority_set: bool,
}

pub(super) fn model_settings(
    name: &str,
    raw: &RawModel,
    server: &ServerSettings,
    base: &Path,
) -> Result<ModelSettings, ConfigError> {
    let key = |k: &str| format!("[models.{name}] {k}");
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(err(
            &format!("[models.{name}]"),
            "a model name may hold only letters, digits, '-', '_' and '.'",
        ));
    }
    let path = raw.path.as_ref().ok_or_else(|| err(&key("path"), "missing: where is the model?"))?;
    let path = base.join(path);
    if !path.exists() {
        return Err(err(&key("path"), format!("{} does not exist", path.display())));
    }
    let backend = match raw.backend.as_deref() {
        None => backend_for(&path),
        Some("onnx") => Backend::Onnx,
        Some("candle") if snooze_text::is_sentence_model(&path) => Backend::Candle,
        Some("candle") => {
            return Err(err(
                &key("backend"),
                format!(
                    "\"candle\" serves sentence-transformers folders (modules.json, config.json, \
                     tokenizer.json, *.safetensors); {} is not one",
                    path.display()
                ),
            ))
        }
        Some(other) => {
            return Err(err(
                &key("backend"),
                format!("unknown backend '{other}' (expected \"onnx\" or \"candle\")"),
            ))
        }
    };
    let memory = match &raw.memory {
        None => None,
        Some(v) => Some(parse_bytes(&v.to_string()).map_err(|e| err(&key("memory"), e))?),
    };
    let keep_alive = match &raw.keep_alive {
        None => server.keep_alive,
        Some(v) => KeepAlive::parse(&v.to_string()).map_err(|e| err(&key("keep_alive"), e))?,
    };
    let min_residency = match &raw.min_residency {
        None => server.min_residency,
        Some(v) => parse_duration(&v.to_string()).map_err(|e| err(&key("min_residency"), e))?,
    };
    let devices = match &raw.devices {
        None => vec![Device::Cpu],
        Some(list) if list.is_empty() => return Err(err(&key("devices"), "must name at least one device")),
        Some(list) => list
            .iter()
            .map(|d| Device::parse(d))
            .collect::<Result<_, _>>()
            .map_err(|e| err(&key("devices"), e))?,
    };
    let whole = |k: &str, v: &Option<Scalar>, default: u64, min: u64| -> Result<u64, ConfigError> {
        let Some(v) = v else { return Ok(default) };
        let text = v.to_string();
        match text.trim().parse::<u64>() {
            Ok(n) if n >= min && n <= u64::from(u32::MAX) => Ok(n),
            _ => Err(err(&key(k), format!("'{text}' is not a whole number from {min} to {}", u32::MAX))),
        }
    };
    let priority = match &raw.priority {
        None => Priority::Normal,
        Some(p) => Priority::parse(p)
            .ok_or_else(|| err(&key("priority"), format!("'{p}' is not \"low\", \"normal\" or \"high\"")))?,
    };
    let weights = match &raw.weights {
        None => Weights::Auto,
        Some(w) => Weights::parse(w).ok_or_else(|| {
            err(&key("weights"), format!("'{w}' is not \"auto\", \"prepacked\", \"compact\" or \"mapped\""))
        })?,
    };
    let low_cpu_priority = match raw.cpu_priority.as_deref() {
        None => snooze_speech::whisper::is_whisper_folder(&path),
        Some("low") => true,
        Some("normal") => false,
        Some(other) => {
            return Err(err(&key("cpu_priority"), format!("'{other}' is not \"low\" or \"normal\"")))
        }
    };
    let batch_delay = match &raw.batch_delay {
        None => Duration::ZERO,
        Some(v) => parse_duration(&v.to_string()).map_err(|e| err(&key("batch_delay"), e))?,
    };
    Ok(ModelSettings {
        max_queue: whole("max_queue", &raw.max_queue, 256, 1)? as usize,
        max_batch_size: whole("max_batch_size", &raw.max_batch_size, 32, 1)? as u32,
        batch_delay,
        max_concurrency: whole("max_concurrency", &raw.max_concurrency, 1, 1)? as u32,
        priority,
        weights,
        low_cpu_priority,
        cpu_priority_set: raw.cpu_priority.is_some(),
        name: name.to_string(),
        backend,
        path,
        memory,
        keep_alive,
        min_residency,
        pinned: raw.pinned.unwrap_or(false),
        preload: raw.preload.unwrap_or(false),
        devices,
        cpu_fallback: raw.cpu_fallback.unwrap_or(true),
    })
}

/// The backend a model's files call for when the config names none: a
/// sentence-embedding folder without an ONNX export (safetensors weights) is
/// Candle's; everything else, ONNX exports included, is ONNX Runtime's.
pub fn backend_for(path: &Path) -> Backend {
    if path.is_dir() && snooze_text::is_sentence_model(path) && snooze_text::onnx_export(path).is_none() {
        Backend::Candle
    } else {
        Backend::Onnx
    }
}

/// A model repository: every sub-folder holding `model.onnx` or `1/model.onnx`, and
/// every sentence-embedding folder (`modules.json`: safetensors or `onnx/model.onnx`).
/// `key`: where `dir` was given, for the error.
pub fn discover(dir: &Path, key: &str) -> Result<Vec<(String, PathBuf)>, ConfigError> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| err(key, format!("cannot read {}: {e}", dir.display())))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else { continue };
        if path.join("model.onnx").is_file()
            || path.join("1").join("model.onnx").is_file()
            || snooze_text::is_sentence_model(&path)
            || snooze_speech::whisper::is_whisper_folder(&path)
        {
            found.push((name, path));
        }
    }
    found.sort();
    Ok(found)
}
