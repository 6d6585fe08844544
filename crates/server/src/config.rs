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
    lifecycle::Priority,
    pressure::Thresholds,
    units::{parse_bytes, parse_duration, KeepAlive, MemorySize},
    Device, Weights,
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

/// One `[server]` key: the single place that names it, gives its default and says
/// what it does. The file parser, the `--flag` / `SNOOZE_<KEY>` overrides and the
/// README's table (checked by a test) all come from [`SERVER_KEYS`].
#[derive(Debug, Clone, Copy)]
pub struct ServerKey {
    pub name: &'static str,
    /// As it would be written in the file; `None` = unset.
    pub default: Option<&'static str>,
    pub help: &'static str,
    /// Hidden from `--help`'s environment values.
    pub secret: bool,
}

const fn key(name: &'static str, default: &'static str, help: &'static str) -> ServerKey {
    ServerKey { name, default: Some(default), help, secret: false }
}

pub const SERVER_KEYS: &[ServerKey] = &[
    key("http_address", "127.0.0.1:8080", "Address to listen on; port 0 picks a free port."),
    key("host_memory_limit", "auto", "Memory budget of the whole process: \"auto\" (machine or cgroup limit minus headroom), a percentage of what exists (\"80%\"), or a size (\"6GiB\")."),
    key("headroom", "64MiB", "Memory kept free on top of each model's footprint; \"auto\" also subtracts it from the limit."),
    key("keep_alive", "5m", "How long an idle model stays loaded after its last request; 0 = unload at once, -1 = never."),
    key("min_residency", "0s", "A model is not evicted sooner than this after loading; a load that needs its room waits (a model just loaded always serves the requests that waited for it first)."),
    key("max_loaded_models", "0", "Most models loaded at once; 0 = no cap."),
    key("retry_after", "5s", "Retry-After sent with refusals that have no better estimate."),
    key("state_dir", ".snooze", "Where the server keeps its state (learned footprints)."),
    ServerKey { name: "model_dir", default: None, help: "A model repository: every sub-folder holding model.onnx or 1/model.onnx is served under the folder's name.", secret: false },
    key("shutdown_timeout", "30s", "On SIGTERM/SIGINT, how long requests in flight may finish before models are unloaded."),
    key("queue_timeout", "30s", "Longest a request waits in its model's queue (for memory, a load, a free run slot); then 503 + Retry-After."),
    key("max_swap_delay", "200ms", "Longest a model waiting to load lets resident models serve their queued requests before one of them is evicted anyway; bounds how long a cold model can be starved (a cheap swap is due sooner: 4x its measured cost, at least 10 ms)."),
    key("max_concurrent_inferences", "0", "Runs (batches) at once across all models; 0 = no cap."),
    key("intra_op_spinning", "false", "Let ONNX Runtime's shared thread pool spin while waiting for work (measured: no faster under load on 2 cores, and it takes CPU from everything else)."),
    key("acquire_timeout", "120s", "Longest a request waits for its model to load, and a repository load or unload for its model (then 503)."),
    key("max_request_size", "64MiB", "Largest request body; larger ones get 413, refused by Content-Length before they are read."),
    key("max_inflight_request_bytes", "10%", "Memory that requests being decoded and served may hold in all (bodies, decoded tensors, the copy kept for an out-of-memory retry), as a size or a percentage of the memory budget; past it new requests get 503 + Retry-After."),
    key("header_read_timeout", "10s", "Time a client has to send a request's line and headers once it started; slower connections are closed."),
    key("body_read_timeout", "30s", "Time a client has to send a request's whole body; slower ones get 408 and the connection is closed."),
    key("idle_timeout", "60s", "A kept-alive connection with no request for this long is closed."),
    key("max_connections", "1024", "Most client connections at once; further ones wait in the kernel's accept queue."),
    key("intra_op_threads", "0", "Threads one inference may use inside ONNX Runtime; 0 = runtime default."),
    key("max_embedding_inputs", "256", "Most texts in one embeddings request, on /v1/embeddings and on KServe BYTES alike (more: 400)."),
    key("max_input_chars", "100000", "Longest text (in characters) one embedding input may have (longer: 400)."),
    key("memory_warning_threshold", "0.80", "Share of the budget (RSS / budget) that records an alert."),
    key("memory_critical_threshold", "0.95", "Share of the budget at which loads must evict first and low-priority requests get 503."),
    key("memory_emergency_threshold", "0.98", "Share of the budget at which every idle, unpinned model is unloaded."),
    key("memory_check_interval", "5s", "How often the memory monitor reads the probe (also after every load)."),
    key("low_ram_mode", "false", "One malloc arena and a 64 KiB mmap threshold; trim the heap after requests of 1 MiB or more."),
    ServerKey { name: "admin_token", default: None, help: "Bearer token guarding every admin endpoint: repository load/unload, /admin/* (reads too) and gc; unset = open.", secret: true },
];

/// The file as written (every field optional; defaults come later).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub models: BTreeMap<String, RawModel>,
}

/// `[server]` keys as written, before validation; the flag/env overrides come in the
/// same shape. Unknown keys are refused in [`resolve`].
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(transparent)]
pub struct RawServer(pub BTreeMap<String, Scalar>);

impl RawServer {
    /// Lays `over`'s set keys over ours.
    pub fn merge(&mut self, over: RawServer) {
        self.0.extend(over.0);
    }

    pub fn set(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.0.insert(key.to_string(), Scalar::Str(value.into()));
        self
    }

    /// The value as text, else the key's default.
    fn text(&self, key: &str) -> Option<String> {
        match self.0.get(key) {
            Some(v) => Some(v.to_string()),
            None => SERVER_KEYS.iter().find(|k| k.name == key).and_then(|k| k.default).map(str::to_string),
        }
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
    pub max_queue: Option<Scalar>,
    pub max_batch_size: Option<Scalar>,
    pub batch_delay: Option<Scalar>,
    pub max_concurrency: Option<Scalar>,
    pub priority: Option<String>,
    pub weights: Option<String>,
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
    pub queue_timeout: Duration,
    pub max_swap_delay: Duration,
    pub max_concurrent_inferences: u32,
    pub intra_op_spinning: bool,
    pub retry_after: Duration,
    pub state_dir: PathBuf,
    pub shutdown_timeout: Duration,
    pub acquire_timeout: Duration,
    pub max_request_size: u64,
    /// Resolved against the memory budget at start (see `build`).
    pub max_inflight_request_bytes: MemorySize,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub intra_op_threads: usize,
    pub max_embedding_inputs: usize,
    pub max_input_chars: usize,
    pub thresholds: Thresholds,
    pub memory_check_interval: Duration,
    pub low_ram_mode: bool,
    /// Bearer token the admin endpoints need; `None` = open.
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
    pub max_queue: usize,
    /// Rows per run; 1 = no batching (models without a dynamic batch dimension never batch).
    pub max_batch_size: u32,
    pub batch_delay: Duration,
    /// Runs of this model at once (ONNX models load one session per run).
    pub max_concurrency: u32,
    pub priority: Priority,
    /// How an ONNX model's weights are held (`Auto` is decided at start).
    pub weights: Weights,
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
    if let Some(unknown) = s.0.keys().find(|k| !SERVER_KEYS.iter().any(|key| key.name == k.as_str())) {
        return Err(err(
            &format!("[server] {unknown}"),
            "unknown key (see the README's list of [server] keys)",
        ));
    }
    let get = |key: &str| s.text(key).unwrap_or_default();

    let duration = |key: &str| parse_duration(&get(key)).map_err(|e| err(&format!("[server] {key}"), e));
    let size = |key: &str| parse_bytes(&get(key)).map_err(|e| err(&format!("[server] {key}"), e));
    let count = |key: &str| {
        let text = get(key);
        text.trim()
            .parse::<usize>()
            .map_err(|_| err(&format!("[server] {key}"), format!("'{text}' is not a whole number >= 0")))
    };
    let fraction = |key: &str| {
        let text = get(key);
        match text.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
            _ => Err(err(&format!("[server] {key}"), format!("'{text}' is not a fraction in (0, 1]"))),
        }
    };
    let flag = |key: &str| match get(key).trim() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(err(&format!("[server] {key}"), format!("'{other}' is not true or false"))),
    };
    let positive = |key: &str| {
        let d = duration(key)?;
        if d.is_zero() {
            return Err(err(&format!("[server] {key}"), "must be more than 0"));
        }
        Ok(d)
    };
    let limit_text = get("host_memory_limit");
    let host_memory_limit = if limit_text.trim() == "auto" {
        MemoryLimit::Auto
    } else {
        MemoryLimit::Size(
            MemorySize::parse(&limit_text)
                .map_err(|e| err("[server] host_memory_limit", format!("{e} (or \"auto\")")))?,
        )
    };
    let http_address = get("http_address");
    if http_address.parse::<std::net::SocketAddr>().is_err() {
        return Err(err(
            "[server] http_address",
            format!("'{http_address}' is not an address like \"127.0.0.1:8080\""),
        ));
    }
    let keep_alive_text = get("keep_alive");
    let server = ServerSettings {
        http_address,
        host_memory_limit,
        headroom: size("headroom")?,
        keep_alive: KeepAlive::parse(&keep_alive_text).map_err(|e| err("[server] keep_alive", e))?,
        min_residency: duration("min_residency")?,
        max_loaded_models: count("max_loaded_models")?,
        queue_timeout: positive("queue_timeout")?,
        max_swap_delay: duration("max_swap_delay")?,
        max_concurrent_inferences: u32::try_from(count("max_concurrent_inferences")?)
            .map_err(|_| err("[server] max_concurrent_inferences", "too large"))?,
        intra_op_spinning: flag("intra_op_spinning")?,
        retry_after: duration("retry_after")?,
        state_dir: base.join(get("state_dir")),
        shutdown_timeout: duration("shutdown_timeout")?,
        acquire_timeout: positive("acquire_timeout")?,
        max_request_size: size("max_request_size")?,
        max_inflight_request_bytes: MemorySize::parse(&get("max_inflight_request_bytes"))
            .map_err(|e| err("[server] max_inflight_request_bytes", e))?,
        header_read_timeout: positive("header_read_timeout")?,
        body_read_timeout: positive("body_read_timeout")?,
        idle_timeout: positive("idle_timeout")?,
        max_connections: match count("max_connections")? {
            0 => return Err(err("[server] max_connections", "must be at least 1")),
            n => n,
        },
        intra_op_threads: count("intra_op_threads")?,
        max_embedding_inputs: count("max_embedding_inputs")?,
        max_input_chars: count("max_input_chars")?,
        thresholds: Thresholds {
            warning: fraction("memory_warning_threshold")?,
            critical: fraction("memory_critical_threshold")?,
            emergency: fraction("memory_emergency_threshold")?,
        },
        memory_check_interval: duration("memory_check_interval")?,
        low_ram_mode: flag("low_ram_mode")?,
        admin_token: s.text("admin_token").filter(|t| !t.is_empty()),
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
    let model_dir = model_dir_flag.or_else(|| s.text("model_dir").map(PathBuf::from));
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
    let whole = |k: &str, v: &Option<Scalar>, default: u64, min: u64| -> Result<u64, ConfigError> {
        let Some(v) = v else { return Ok(default) };
        let text = v.to_string();
        match text.trim().parse::<u64>() {
            Ok(n) if n >= min && n <= u64::from(u32::MAX) => Ok(n),
            _ => Err(err(&key(k), format!("'{text}' is not a whole number >= {min}"))),
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
        assert_eq!(c.server.min_residency, Duration::ZERO);
        assert_eq!(c.server.queue_timeout, Duration::from_secs(30));
        assert_eq!(c.server.max_swap_delay, Duration::from_millis(200));
        assert_eq!(c.server.retry_after, Duration::from_secs(5));
        assert_eq!(c.server.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(c.server.max_loaded_models, 0);
    }

    #[test]
    fn overrides_win_over_the_file() {
        let text = "[server]\nkeep_alive = \"1m\"\nheadroom = \"10MiB\"\n";
        let mut over = RawServer::default();
        over.set("keep_alive", "-1");
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
            ("[models.x]\npath = \"repo/b\"\nmax_batch_size = 0", "[models.x] max_batch_size"),
            ("[models.x]\npath = \"repo/b\"\nmax_queue = \"lots\"", "[models.x] max_queue"),
            ("[models.x]\npath = \"repo/b\"\nmax_concurrency = 0", "[models.x] max_concurrency"),
            ("[models.x]\npath = \"repo/b\"\npriority = \"urgent\"", "[models.x] priority"),
            ("[models.x]\npath = \"repo/b\"\nbatch_delay = \"soon\"", "[models.x] batch_delay"),
            ("[models.x]\npath = \"repo/b\"\nweights = \"light\"", "[models.x] weights"),
            ("[server]\nqueue_timeout = \"0s\"", "[server] queue_timeout"),
            ("[server]\nintra_op_spinning = \"maybe\"", "[server] intra_op_spinning"),
            ("[server]\nmemory_warning_threshold = 1.5", "[server] memory_warning_threshold"),
            ("[server]\nmemory_warning_threshold = 0.9\nmemory_critical_threshold = 0.85", "threshold"),
            ("[server]\nlow_ram_mode = \"maybe\"", "[server] low_ram_mode"),
            ("[server]\nbody_read_timeout = \"0s\"", "[server] body_read_timeout"),
            ("[server]\nmax_connections = 0", "[server] max_connections"),
            ("[server]\nmax_inflight_request_bytes = \"lots\"", "[server] max_inflight_request_bytes"),
        ];
        for (text, key) in cases {
            let e = load(text, RawServer::default()).unwrap_err();
            assert!(e.0.contains(key), "{text:?} -> {e}");
        }
    }

    #[test]
    fn every_server_key_is_documented_in_the_readme_with_its_default() {
        let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .expect("README.md");
        for k in SERVER_KEYS {
            let row = readme
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", k.name)))
                .unwrap_or_else(|| panic!("README has no table row for [server] {}", k.name));
            if let Some(d) = k.default {
                assert!(
                    row.contains(&format!("`{d}`")),
                    "README row of {} lacks its default `{d}`: {row}",
                    k.name
                );
            }
        }
    }

    #[test]
    fn the_embedded_default_parses() {
        parse_file(DEFAULT_CONFIG, "default").unwrap();
    }
}
