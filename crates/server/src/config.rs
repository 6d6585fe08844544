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

/// Declares every `[server]` key once: its doc comment is the help of `--help` and of
/// the README's table, then `name: Type = "default"` (as written in the file; `""` =
/// unset), then optional checks. From this come the [`ServerSettings`] field, the TOML
/// key, the `--flag` and `SNOOZE_<KEY>` variable (`main.rs`), the default, the parse
/// (by the field's type, see [`Setting`]) and the README table ([`settings_table`]).
macro_rules! server_settings {
    ($( $(#[doc = $doc:literal])+ $name:ident : $ty:ty = $default:literal $(, check $check:path)* ; )+) => {
        /// Validated `[server]` settings (see the README's table, generated from here).
        #[derive(Debug, Clone)]
        pub struct ServerSettings {
            $( $(#[doc = $doc])+ pub $name: $ty, )+
        }

        /// Every `[server]` key, in the order of the README's table.
        pub const SERVER_KEYS: &[ServerKey] = &[
            $( ServerKey { name: stringify!($name), default: $default, doc: concat!($($doc, "\n"),+) }, )+
        ];

        impl ServerSettings {
            fn from_layers(layers: &RawServer) -> Result<ServerSettings, ConfigError> {
                Ok(ServerSettings {
                    $( $name: layers.get::<$ty>(stringify!($name), $default, &[$($check),*])?, )+
                })
            }
        }
    };
}

server_settings! {
    /// Where to listen; port 0 picks a free one.
    http_address: String = "127.0.0.1:8080", check socket_address;
    /// Where the KServe v2 gRPC service (`inference.GRPCInferenceService`) listens; port 0
    /// picks a free one; `off` = no gRPC.
    grpc_address: String = "127.0.0.1:8081", check socket_address_or_off;
    /// Memory budget of the whole process: `auto` (what the machine or its memory cgroup
    /// allows, minus `headroom`), a percentage of what exists (`80%`), or a size (`6GiB`).
    host_memory_limit: MemoryLimit = "auto";
    /// Kept free on top of each model's footprint; `auto` also subtracts it from the limit.
    headroom: u64 = "64MiB";
    /// Idle time before a model unloads; `0` = after each request, `-1` = never.
    keep_alive: KeepAlive = "5m";
    /// A model is not evicted sooner than this after loading; a load that needs its room
    /// waits for it (a model just loaded always serves the requests that waited for it
    /// before it may be evicted).
    min_residency: Duration = "0s";
    /// Longest a request waits in its model's queue (for memory, a load, a free run
    /// slot); then 503 + `Retry-After`.
    queue_timeout: Duration = "30s", check positive;
    /// Longest a model waiting to load lets resident models serve their queued requests
    /// before one of them is evicted anyway (no cold model is starved). A swap is due
    /// sooner when it is cheap: after 4x the waiting model's measured swap cost (last
    /// load + first run after it), at least 10 ms.
    max_swap_delay: Duration = "200ms";
    /// Runs (batches) at once across all models; `0` = no cap.
    max_concurrent_inferences: u32 = "0";
    /// Let ONNX Runtime's one shared thread pool spin while it waits for work. Measured
    /// with the Zipf benchmark's hot-model rows on 2 cores, two runs each: 658 vs 691
    /// req/s batched and 168 vs 175 unbatched (on vs off): no faster, and spinning takes
    /// CPU from everything else.
    intra_op_spinning: bool = "false";
    /// Most models resident at once; `0` = no cap.
    max_loaded_models: usize = "0";
    /// `Retry-After` of refusals with no better estimate.
    retry_after: Duration = "5s", check at_least_a_second;
    /// Where the server keeps its state (learned footprints, weight caches); relative to
    /// the config file.
    state_dir: PathBuf = ".snooze";
    /// A model repository: each sub-folder with `model.onnx` or `1/model.onnx`, or a
    /// sentence-transformers folder (`modules.json`), is a model named after the folder
    /// (a `[models.NAME]` entry of the same name wins).
    model_dir: Option<PathBuf> = "";
    /// On SIGTERM/SIGINT, how long requests in flight may finish before models are
    /// unloaded.
    shutdown_timeout: Duration = "30s";
    /// Longest a request waits for its model to load, and a repository load or unload
    /// for its model (then 503; the load or unload goes on).
    acquire_timeout: Duration = "120s", check positive;
    /// Larger bodies get 413, refused by `Content-Length` before they are read.
    max_request_size: u64 = "64MiB";
    /// Memory all requests in flight may hold (bodies, decoded tensors, the copy kept for
    /// an out-of-memory retry), as a size or a share of the memory budget; past it new
    /// requests get 503 + `Retry-After`, a request that alone exceeds it 413.
    max_inflight_request_bytes: MemorySize = "10%";
    /// A request line and headers must arrive within this once they started; slower
    /// connections are closed.
    header_read_timeout: Duration = "10s", check positive;
    /// A request body must arrive within this; slower ones get 408 and the connection is
    /// closed.
    body_read_timeout: Duration = "30s", check positive;
    /// A kept-alive connection without a request for this long is closed.
    idle_timeout: Duration = "60s", check positive;
    /// Most client connections at once; more wait in the kernel's accept queue (the
    /// open-file limit is raised to fit).
    max_connections: usize = "1024", check at_least_one;
    /// Threads of ONNX Runtime's one thread pool, shared by every session (N loaded
    /// models do not start N pools); `0` = one per core.
    intra_op_threads: usize = "0";
    /// Most texts in one embeddings request, on `/v1/embeddings` and KServe BYTES alike
    /// (more: 400).
    max_embedding_inputs: usize = "256";
    /// Longest embedding text in characters, and longest token-id list (longer: 400).
    max_input_chars: usize = "100000";
    /// RSS / budget that records an alert.
    memory_warning_threshold: f64 = "0.80";
    /// Loads must evict first; low-priority requests get 503.
    memory_critical_threshold: f64 = "0.95";
    /// Every idle, unpinned model is unloaded.
    memory_emergency_threshold: f64 = "0.98";
    /// How often the monitor reads memory (also after each load).
    memory_check_interval: Duration = "5s", check at_least_10ms;
    /// One malloc arena and a 64 KiB mmap threshold; trim the heap after requests of
    /// 1 MiB or more.
    low_ram_mode: bool = "false";
    /// When set, every admin endpoint (repository load/unload, `/admin/*` reads, gc, the
    /// memory dump, `/metrics`, the dashboard's data) needs `Authorization: Bearer
    /// <token>` (see the README's Security section); unset = open.
    admin_token: Option<String> = "";
}

impl ServerSettings {
    /// The pressure levels, from the three `memory_*_threshold` keys.
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            warning: self.memory_warning_threshold,
            critical: self.memory_critical_threshold,
            emergency: self.memory_emergency_threshold,
        }
    }
}

/// One `[server]` key, as [`server_settings!`] declared it.
#[derive(Debug, Clone, Copy)]
pub struct ServerKey {
    pub name: &'static str,
    /// As it would be written in the file; `""` = unset.
    pub default: &'static str,
    /// The doc comment, one source line per line.
    doc: &'static str,
}

impl ServerKey {
    /// The help text on one line.
    pub fn help(&self) -> String {
        self.doc.split('\n').map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
    }

    pub fn flag(&self) -> String {
        format!("--{}", self.name.replace('_', "-"))
    }

    pub fn env(&self) -> String {
        format!("SNOOZE_{}", self.name.to_uppercase())
    }

    /// Its value is hidden from `--help` and from error messages.
    pub fn secret(&self) -> bool {
        self.name.ends_with("token")
    }
}

/// The README's `[server]` table, rendered from [`SERVER_KEYS`] (a test keeps the
/// README equal to it; `SNOOZE_BLESS=1` rewrites it).
pub fn settings_table() -> String {
    let mut out = String::from("| `[server]` key | flag / env | default | meaning |\n|---|---|---|---|\n");
    for k in SERVER_KEYS {
        let default = if k.default.is_empty() { "unset".to_string() } else { format!("`{}`", k.default) };
        out.push_str(&format!(
            "| `{}` | `{}` / `{}` | {default} | {} |\n",
            k.name,
            k.flag(),
            k.env(),
            k.help()
        ));
    }
    out
}

/// A value's type says how its text parses: once, at start.
pub trait Setting: Sized {
    fn parse_setting(text: &str) -> Result<Self, String>;
}

macro_rules! setting {
    ($($(#[$meta:meta])* $ty:ty => $parse:expr;)+) => {
        $( $(#[$meta])* impl Setting for $ty {
            fn parse_setting(text: &str) -> Result<Self, String> {
                $parse(text)
            }
        } )+
    };
}

setting! {
    Duration => parse_duration;
    /// Sizes in bytes (`"64MiB"`, `1048576`).
    u64 => parse_bytes;
    usize => |t: &str| t.trim().parse().map_err(|_| "not a whole number >= 0".to_string());
    u32 => |t: &str| t.trim().parse().map_err(|_| format!("not a whole number from 0 to {}", u32::MAX));
    bool => |t: &str| match t.trim() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err("not true or false".to_string()),
    };
    /// Shares of the memory budget.
    f64 => |t: &str| match t.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err("not a fraction in (0, 1]".to_string()),
    };
    KeepAlive => KeepAlive::parse;
    MemorySize => MemorySize::parse;
    MemoryLimit => |t: &str| match t.trim() {
        "auto" => Ok(MemoryLimit::Auto),
        _ => MemorySize::parse(t).map(MemoryLimit::Size).map_err(|e| format!("{e} (or \"auto\")")),
    };
    String => |t: &str| Ok(t.to_string());
    PathBuf => |t: &str| Ok(PathBuf::from(t));
}

/// `""` = unset.
impl<T: Setting> Setting for Option<T> {
    fn parse_setting(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Ok(None);
        }
        T::parse_setting(text).map(Some)
    }
}

fn positive(d: &Duration) -> Result<(), String> {
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(())
}

fn at_least_a_second(d: &Duration) -> Result<(), String> {
    if *d < Duration::from_secs(1) {
        return Err("must be at least 1s (Retry-After counts whole seconds)".into());
    }
    Ok(())
}

fn at_least_10ms(d: &Duration) -> Result<(), String> {
    if *d < Duration::from_millis(10) {
        return Err("must be at least 10ms".into());
    }
    Ok(())
}

fn at_least_one(n: &usize) -> Result<(), String> {
    if *n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(())
}

#[allow(clippy::ptr_arg)] // a check of a `String` setting
fn socket_address(a: &String) -> Result<(), String> {
    match a.parse::<std::net::SocketAddr>() {
        Ok(_) => Ok(()),
        Err(_) => Err("not an address like \"127.0.0.1:8080\"".into()),
    }
}

/// A check a value must pass beyond parsing (`check positive` in [`server_settings!`]).
type Check<T> = fn(&T) -> Result<(), String>;

#[allow(clippy::ptr_arg)] // a check of a `String` setting
fn socket_address_or_off(a: &String) -> Result<(), String> {
    match a.as_str() {
        "off" => Ok(()),
        _ => socket_address(a).map_err(|e| format!("{e} or \"off\"")),
    }
}

/// Where a `[server]` value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    /// The config file (its path, or "(embedded default)").
    File(String),
    /// `SNOOZE_<KEY>`.
    Env,
    /// `--<key>`.
    Flag,
}

/// The `[server]` values as written, each with where it came from; the file's, then the
/// flags' and environment's laid over them ([`RawServer::merge`]).
#[derive(Debug, Default, Clone)]
pub struct RawServer(pub BTreeMap<String, (String, Origin)>);

impl RawServer {
    /// Lays `over`'s set keys over ours.
    pub fn merge(&mut self, over: RawServer) {
        self.0.extend(over.0);
    }

    /// Sets `key` as a flag would.
    pub fn set(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.set_from(key, value, Origin::Flag)
    }

    pub fn set_from(&mut self, key: &str, value: impl Into<String>, origin: Origin) -> &mut Self {
        self.0.insert(key.to_string(), (value.into(), origin));
        self
    }

    /// Parses `key` by its type (else its default) and checks it; an error names the
    /// key, the value and where it came from.
    fn get<T: Setting>(&self, key: &str, default: &str, checks: &[Check<T>]) -> Result<T, ConfigError> {
        let (text, origin) = match self.0.get(key) {
            Some((t, o)) => (t.as_str(), o.clone()),
            None => (default, Origin::Default),
        };
        let value = T::parse_setting(text);
        match value.and_then(|v| checks.iter().try_for_each(|c| c(&v)).map(|()| v)) {
            Ok(v) => Ok(v),
            Err(reason) => {
                let shown = if key.ends_with("token") { "***".to_string() } else { format!("{text:?}") };
                let from = match origin {
                    Origin::Default => "the default".to_string(),
                    Origin::File(f) => f,
                    Origin::Env => format!("env SNOOZE_{}", key.to_uppercase()),
                    Origin::Flag => format!("flag --{}", key.replace('_', "-")),
                };
                Err(ConfigError(format!("invalid config: [server] {key} = {shown} (from {from}): {reason}")))
            }
        }
    }
}

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileText {
    #[serde(default)]
    server: BTreeMap<String, Scalar>,
    #[serde(default)]
    models: BTreeMap<String, RawModel>,
}

/// A parsed file: its `[server]` values (unknown keys are refused in [`resolve`]) and its
/// models, before validation.
#[derive(Debug, Default)]
pub struct FileConfig {
    pub server: RawServer,
    pub models: BTreeMap<String, RawModel>,
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
    let file: FileText = toml::from_str(text)
        .map_err(|e| ConfigError(format!("invalid config {origin}: {}", e.to_string().trim())))?;
    let server = file.server.into_iter().map(|(k, v)| (k, (v.to_string(), Origin::File(origin.to_string()))));
    Ok(FileConfig { server: RawServer(server.collect()), models: file.models })
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
    let mut server = ServerSettings::from_layers(s)?;
    server.thresholds().validate().map_err(|e| err("[server] memory_*_threshold", e))?;
    server.state_dir = base.join(&server.state_dir);
    if let Some(flag) = model_dir_flag {
        server.model_dir = Some(flag);
    }

    let mut models = Vec::new();
    for (name, raw) in &file.models {
        models.push(model_settings(name, raw, &server, base)?);
    }
    if let Some(dir) = &server.model_dir {
        for (name, path) in discover(&base.join(dir))? {
            if models.iter().any(|m| m.name == name) {
                continue; // an explicit [models.NAME] entry wins over discovery
            }
            let raw = RawModel { path: Some(path), ..RawModel::default() };
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
    let path = raw.path.as_ref().ok_or_else(|| err(&key("path"), "missing: where is the model?"))?;
    let path = base.join(path);
    if !path.exists() {
        return Err(err(&key("path"), format!("{} does not exist", path.display())));
    }
    let backend = match raw.backend.as_deref() {
        None => backend_for(&path),
        Some("onnx") => Backend::Onnx,
        Some("candle") => Backend::Candle,
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

/// The backend a model's files call for when the config names none: a
/// sentence-embedding folder without an ONNX export (safetensors weights) is
/// Candle's; everything else, ONNX exports included, is ONNX Runtime's.
fn backend_for(path: &Path) -> Backend {
    if path.is_dir() && snooze_text::is_sentence_model(path) && snooze_text::onnx_export(path).is_none() {
        Backend::Candle
    } else {
        Backend::Onnx
    }
}

/// A model repository: every sub-folder holding `model.onnx` or `1/model.onnx`, and
/// every sentence-embedding folder (`modules.json`: safetensors or `onnx/model.onnx`).
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
        if path.join("model.onnx").is_file()
            || path.join("1").join("model.onnx").is_file()
            || snooze_text::is_sentence_model(&path)
        {
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

    /// The README's table is [`settings_table`]; `SNOOZE_BLESS=1` rewrites it.
    #[test]
    fn the_readme_settings_table_is_generated_from_the_keys() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
        let readme = std::fs::read_to_string(&path).expect("README.md");
        let (start, end) = ("<!-- server-settings:start -->\n", "<!-- server-settings:end -->");
        let a = readme.find(start).expect("README lacks the server-settings:start marker") + start.len();
        let b = readme.find(end).expect("README lacks the server-settings:end marker");
        let table = settings_table();
        if readme[a..b] != table {
            if std::env::var_os("SNOOZE_BLESS").is_some() {
                std::fs::write(&path, format!("{}{table}{}", &readme[..a], &readme[b..]))
                    .expect("write README");
            } else {
                panic!("README's [server] table is stale: run `SNOOZE_BLESS=1 cargo test -p snooze-server the_readme_settings_table`");
            }
        }
    }

    #[test]
    fn errors_say_where_the_value_came_from() {
        let mut over = RawServer::default();
        over.set_from("idle_timeout", "0s", Origin::Env);
        let e = load("", over).unwrap_err().0;
        assert!(
            e.contains("[server] idle_timeout = \"0s\" (from env SNOOZE_IDLE_TIMEOUT): must be more than 0"),
            "{e}"
        );
        let e = load("", RawServer::default().set("headroom", "x").clone()).unwrap_err().0;
        assert!(e.contains("(from flag --headroom)"), "{e}");
        let e = resolve(
            parse_file("[server]\nkeep_alive = \"soon\"", "a/snooze.toml").unwrap(),
            RawServer::default(),
            None,
            &dir(),
        )
        .unwrap_err()
        .0;
        assert!(e.contains("[server] keep_alive = \"soon\" (from a/snooze.toml)"), "{e}");
        let e = load("[server]\nadmin_token = 5", RawServer::default());
        assert!(e.is_ok(), "a token is any text");
    }

    #[test]
    fn every_default_parses_and_every_key_has_help() {
        let c = load("", RawServer::default()).unwrap();
        assert_eq!(c.server.thresholds().critical, 0.95);
        for k in SERVER_KEYS {
            assert!(k.help().len() > 10 && !k.help().contains('\n'), "{}", k.name);
        }
    }

    #[test]
    fn the_embedded_default_parses() {
        parse_file(DEFAULT_CONFIG, "default").unwrap();
    }
}
