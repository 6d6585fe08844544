//! `snooze.toml`: the `[server]` table and one `[models.NAME]` table per model.
//!
//! Precedence is flag > `SNOOZE_<KEY>` env > file > default. clap already merges a
//! flag with its env var (see `cli.rs`); this module lays the result over the file.
//! Everything is validated before the server starts: a bad value stops the start
//! with the key's name and the reason, and nothing is half-applied.

use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use snooze_core::{
    pressure::Thresholds,
    units::{parse_bytes, parse_duration, KeepAlive, MemorySize},
    Device,
};

/// The config served when no file is given: the demo models `make prepare` builds.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// A value that may be written as a string or a bare number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    Bool(bool),
    Str(String),
    Int(i64),
    Float(f64),
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Bool(b) => write!(f, "{b}"),
            Scalar::Str(s) => f.write_str(s),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Float(x) => write!(f, "{x}"),
        }
    }
}

/// The file as written (every field optional; defaults come later).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub models: BTreeMap<String, RawModel>,
}

/// `[server]` keys, as strings, before validation. The same struct carries the
/// flag/env overrides, so every key can be set all three ways.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub http_address: Option<Scalar>,
    pub host_memory_limit: Option<Scalar>,
    pub headroom: Option<Scalar>,
    pub keep_alive: Option<Scalar>,
    pub min_residency: Option<Scalar>,
    pub max_loaded_models: Option<Scalar>,
    pub retry_after: Option<Scalar>,
    pub state_dir: Option<Scalar>,
    pub model_dir: Option<Scalar>,
    pub shutdown_timeout: Option<Scalar>,
    pub acquire_timeout: Option<Scalar>,
    pub max_request_size: Option<Scalar>,
    pub intra_op_threads: Option<Scalar>,
    pub max_embedding_inputs: Option<Scalar>,
    pub max_input_chars: Option<Scalar>,
    pub memory_warning_threshold: Option<Scalar>,
    pub memory_critical_threshold: Option<Scalar>,
    pub memory_emergency_threshold: Option<Scalar>,
    pub memory_check_interval: Option<Scalar>,
    pub low_ram_mode: Option<Scalar>,
    pub admin_token: Option<Scalar>,
}

impl RawServer {
    /// Lays `over`'s set keys over ours.
    pub fn merge(&mut self, over: RawServer) {
        macro_rules! take {
            ($($k:ident),*) => { $( if over.$k.is_some() { self.$k = over.$k; } )* };
        }
        take!(
            http_address,
            host_memory_limit,
            headroom,
            keep_alive,
            min_residency,
            max_loaded_models,
            retry_after,
            state_dir,
            model_dir,
            shutdown_timeout,
            acquire_timeout,
            max_request_size,
            intra_op_threads,
            max_embedding_inputs,
            max_input_chars,
            memory_warning_threshold,
            memory_critical_threshold,
            memory_emergency_threshold,
            memory_check_interval,
            low_ram_mode,
            admin_token
        );
    }
}

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
}

/// How the memory budget is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// What the machine or its memory cgroup allows, minus headroom.
    Auto,
    Size(MemorySize),
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

/// Validated server settings.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub http_address: String,
    pub host_memory_limit: MemoryLimit,
    pub headroom: u64,
    pub keep_alive: KeepAlive,
    pub min_residency: Duration,
    pub max_loaded_models: usize,
    pub retry_after: Duration,
    pub state_dir: PathBuf,
    pub shutdown_timeout: Duration,
    pub acquire_timeout: Duration,
    pub max_request_size: u64,
    pub intra_op_threads: usize,
    pub max_embedding_inputs: usize,
    pub max_input_chars: usize,
    pub thresholds: Thresholds,
    pub memory_check_interval: Duration,
    pub low_ram_mode: bool,
    /// Bearer token admin writes need; `None` = open.
    pub admin_token: Option<String>,
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
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerSettings,
    pub models: Vec<ModelSettings>,
}

/// A refusal naming the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn err(key: &str, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("invalid config: {key}: {reason}"))
}

/// Parses TOML text; unknown keys and wrong types are errors naming the key.
pub fn parse_file(text: &str, origin: &str) -> Result<FileConfig, ConfigError> {
    toml::from_str(text)
        .map_err(|e| ConfigError(format!("invalid config {origin}: {}", e.to_string().trim())))
}

/// Validates `file` with `overrides` (flags/env) on top; `base` resolves relative paths.
pub fn resolve(
    mut file: FileConfig,
    overrides: RawServer,
    model_dir_flag: Option<PathBuf>,
    base: &Path,
) -> Result<Config, ConfigError> {
    file.server.merge(overrides);
    let s = &file.server;
    let get = |v: &Option<Scalar>, default: &str| v.as_ref().map_or(default.to_string(), |v| v.to_string());

    let duration = |key: &str, v: &Option<Scalar>, default: &str| {
        parse_duration(&get(v, default)).map_err(|e| err(&format!("[server] {key}"), e))
    };
    let size = |key: &str, v: &Option<Scalar>, default: &str| {
        parse_bytes(&get(v, default)).map_err(|e| err(&format!("[server] {key}"), e))
    };
    let count = |key: &str, v: &Option<Scalar>, default: &str| {
        let text = get(v, default);
        text.trim()
            .parse::<usize>()
            .map_err(|_| err(&format!("[server] {key}"), format!("'{text}' is not a whole number >= 0")))
    };
    let fraction = |key: &str, v: &Option<Scalar>, default: &str| {
        let text = get(v, default);
        match text.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
            _ => Err(err(&format!("[server] {key}"), format!("'{text}' is not a fraction in (0, 1]"))),
        }
    };
    let limit_text = get(&s.host_memory_limit, "auto");
    let host_memory_limit = if limit_text.trim() == "auto" {
        MemoryLimit::Auto
    } else {
        MemoryLimit::Size(
            MemorySize::parse(&limit_text)
                .map_err(|e| err("[server] host_memory_limit", format!("{e} (or \"auto\")")))?,
        )
    };
    let http_address = get(&s.http_address, "127.0.0.1:8080");
    if http_address.parse::<std::net::SocketAddr>().is_err() {
        return Err(err(
            "[server] http_address",
            format!("'{http_address}' is not an address like \"127.0.0.1:8080\""),
        ));
    }
    let keep_alive_text = get(&s.keep_alive, "5m");
    let server = ServerSettings {
        http_address,
        host_memory_limit,
        headroom: size("headroom", &s.headroom, "64MiB")?,
        keep_alive: KeepAlive::parse(&keep_alive_text).map_err(|e| err("[server] keep_alive", e))?,
        min_residency: duration("min_residency", &s.min_residency, "10s")?,
        max_loaded_models: count("max_loaded_models", &s.max_loaded_models, "0")?,
        retry_after: duration("retry_after", &s.retry_after, "5s")?,
        state_dir: base.join(get(&s.state_dir, ".snooze")),
        shutdown_timeout: duration("shutdown_timeout", &s.shutdown_timeout, "30s")?,
        acquire_timeout: duration("acquire_timeout", &s.acquire_timeout, "120s")?,
        max_request_size: size("max_request_size", &s.max_request_size, "64MiB")?,
        intra_op_threads: count("intra_op_threads", &s.intra_op_threads, "0")?,
        max_embedding_inputs: count("max_embedding_inputs", &s.max_embedding_inputs, "256")?,
        max_input_chars: count("max_input_chars", &s.max_input_chars, "100000")?,
        thresholds: Thresholds {
            warning: fraction("memory_warning_threshold", &s.memory_warning_threshold, "0.80")?,
            critical: fraction("memory_critical_threshold", &s.memory_critical_threshold, "0.95")?,
            emergency: fraction("memory_emergency_threshold", &s.memory_emergency_threshold, "0.98")?,
        },
        memory_check_interval: duration("memory_check_interval", &s.memory_check_interval, "5s")?,
        low_ram_mode: match get(&s.low_ram_mode, "false").as_str() {
            "true" | "1" => true,
            "false" | "0" => false,
            other => return Err(err("[server] low_ram_mode", format!("'{other}' is not true or false"))),
        },
        admin_token: s.admin_token.as_ref().map(|t| t.to_string()).filter(|t| !t.is_empty()),
    };
    server.thresholds.validate().map_err(|e| err("[server] memory_*_threshold", e))?;
    if server.memory_check_interval < Duration::from_millis(10) {
        return Err(err("[server] memory_check_interval", "must be at least 10ms"));
    }
    if server.retry_after.is_zero() {
        return Err(err("[server] retry_after", "must be at least 1s"));
    }

    let mut models = Vec::new();
    for (name, raw) in &file.models {
        models.push(model_settings(name, raw, &server, base)?);
    }
    let model_dir = model_dir_flag.or_else(|| s.model_dir.as_ref().map(|d| PathBuf::from(d.to_string())));
    if let Some(dir) = model_dir {
        for (name, path) in discover(&base.join(&dir))? {
            if models.iter().any(|m| m.name == name) {
                continue; // an explicit [models.NAME] entry wins over discovery
            }
            let raw = RawModel { backend: Some("onnx".into()), path: Some(path), ..RawModel::default() };
            models.push(model_settings(&name, &raw, &server, base)?);
        }
    }
    models.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Config { server, models })
}

fn model_settings(
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
    let backend = match raw.backend.as_deref().unwrap_or("onnx") {
        "onnx" => Backend::Onnx,
        "candle" => Backend::Candle,
        other => {
            return Err(err(
                &key("backend"),
                format!("unknown backend '{other}' (expected \"onnx\" or \"candle\")"),
            ))
        }
    };
    let path = raw.path.as_ref().ok_or_else(|| err(&key("path"), "missing: where is the model?"))?;
    let path = base.join(path);
    if !path.exists() {
        return Err(err(&key("path"), format!("{} does not exist", path.display())));
    }
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
    Ok(ModelSettings {
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

/// A model repository: every sub-folder holding `model.onnx` or `1/model.onnx`.
pub fn discover(dir: &Path) -> Result<Vec<(String, PathBuf)>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        err(
            "model_dir",
            format!("cannot read {}: {e} (run `make prepare` for the demo models)", dir.display()),
        )
    })?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else { continue };
        if path.join("model.onnx").is_file() || path.join("1").join("model.onnx").is_file() {
            found.push((name, path));
        }
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "snooze-config-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(d.join("repo/a/1")).unwrap();
        std::fs::create_dir_all(d.join("repo/b")).unwrap();
        std::fs::create_dir_all(d.join("repo/not-a-model")).unwrap();
        std::fs::write(d.join("repo/a/1/model.onnx"), b"x").unwrap();
        std::fs::write(d.join("repo/b/model.onnx"), b"x").unwrap();
        d
    }

    fn load(text: &str, overrides: RawServer) -> Result<Config, ConfigError> {
        resolve(parse_file(text, "test")?, overrides, None, &dir())
    }

    #[test]
    fn defaults() {
        let c = load("", RawServer::default()).unwrap();
        assert_eq!(c.server.http_address, "127.0.0.1:8080");
        assert_eq!(c.server.host_memory_limit, MemoryLimit::Auto);
        assert_eq!(c.server.keep_alive, KeepAlive::For(Duration::from_secs(300)));
        assert_eq!(c.server.min_residency, Duration::from_secs(10));
        assert_eq!(c.server.retry_after, Duration::from_secs(5));
        assert_eq!(c.server.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(c.server.max_loaded_models, 0);
    }

    #[test]
    fn overrides_win_over_the_file() {
        let text = "[server]\nkeep_alive = \"1m\"\nheadroom = \"10MiB\"\n";
        let over = RawServer { keep_alive: Some(Scalar::Str("-1".into())), ..RawServer::default() };
        let c = load(text, over).unwrap();
        assert_eq!(c.server.keep_alive, KeepAlive::Forever);
        assert_eq!(c.server.headroom, 10 << 20);
    }

    #[test]
    fn models_and_discovery() {
        let text = "[server]\nmodel_dir = \"repo\"\n[models.b]\npath = \"repo/b\"\nmemory = \"200MiB\"\npinned = true\nkeep_alive = 0\n";
        let c = load(text, RawServer::default()).unwrap();
        let names: Vec<_> = c.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let b = &c.models[1];
        assert_eq!(
            (b.memory, b.pinned, b.keep_alive),
            (Some(200 << 20), true, KeepAlive::For(Duration::ZERO))
        );
    }

    #[test]
    fn bad_values_name_the_key() {
        let cases = [
            ("[server]\nheadroom = \"-5MiB\"", "[server] headroom"),
            ("[server]\nhost_memory_limit = \"12 parsecs\"", "[server] host_memory_limit"),
            ("[server]\nkeep_alive = \"-3s\"", "[server] keep_alive"),
            ("[server]\nmax_loaded_models = -1", "[server] max_loaded_models"),
            ("[server]\nhttp_address = \"nowhere\"", "[server] http_address"),
            ("[server]\nbogus = 1", "bogus"),
            ("[models.x]\npath = \"missing.onnx\"", "[models.x] path"),
            ("[models.x]\npath = \"repo/b\"\nbackend = \"tf\"", "[models.x] backend"),
            ("[models.x]\npath = \"repo/b\"\nmemory = \"lots\"", "[models.x] memory"),
            ("[models.x]\npath = \"repo/b\"\ncolour = \"red\"", "colour"),
            ("[models.x]\npath = \"repo/b\"\ndevices = [\"tpu\"]", "[models.x] devices"),
            ("[server]\nmemory_warning_threshold = 1.5", "[server] memory_warning_threshold"),
            ("[server]\nmemory_warning_threshold = 0.9\nmemory_critical_threshold = 0.85", "threshold"),
            ("[server]\nlow_ram_mode = \"maybe\"", "[server] low_ram_mode"),
        ];
        for (text, key) in cases {
            let e = load(text, RawServer::default()).unwrap_err();
            assert!(e.0.contains(key), "{text:?} -> {e}");
        }
    }

    #[test]
    fn the_embedded_default_parses() {
        parse_file(DEFAULT_CONFIG, "default").unwrap();
    }
}
