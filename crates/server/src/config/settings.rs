//! The `[server]` settings: each key declared once (its doc comment, type, default and
//! checks) in [`server_settings!`], from which come the [`ServerSettings`] field, the
//! TOML key, the `--flag`, the `SNOOZE_<KEY>` variable, the parse and the README's
//! table; and the layers (file, env, flags) a value may come from.

use std::{collections::BTreeMap, fmt, path::PathBuf, time::Duration};

use serde::Deserialize;
use snooze_core::{
    pressure::Thresholds,
    units::{parse_bytes, parse_duration, KeepAlive, MemorySize},
};

use super::ConfigError;

/// A value that may be written as a string or a bare number.
#[derive(Debug, Clone)]
pub enum Scalar {
    Bool(bool),
    Str(String),
    Int(i64),
    Float(f64),
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a number or true / false")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Scalar, E> {
                i64::try_from(v).map(Scalar::Int).map_err(|_| E::custom(format!("{v} is too large")))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar::Str(v))
            }
        }
        d.deserialize_any(Visitor)
    }
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
            pub(super) fn from_layers(layers: &RawServer) -> Result<ServerSettings, ConfigError> {
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
    host_memory_limit: MemoryLimit = "auto", check some_memory;
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
    /// sooner when it is cheap: after 4x its measured cost (last load + first run after
    /// it) for the waiting model or the one evicted, whichever is more, at least 10 ms.
    max_swap_delay: Duration = "200ms";
    /// Runs (batches) at once across all models; `0` = no cap. Every ONNX session shares one
    /// intra-op pool as wide as the machine: many small models on a small machine serve more
    /// with `1` (Zipf benchmark, 2 cores: 269 -> 401 req/s all resident), while a cap makes
    /// short requests wait for whole slices of long jobs (OCR, speech) in a mix.
    max_concurrent_inferences: u32 = "0";
    /// Slices of long work (transcription steps, OCR stages: task jobs) running at once
    /// across all models; `0` = no cap. Each slice already draws on the whole intra-op pool
    /// (`intra_op_threads`, by default every core), so side by side they only slow each
    /// other; requests that are not task jobs (embeddings, KServe) are not counted and run
    /// beside a slice. `1` on the mix benchmark at half memory (2 cores, half rates):
    /// short requests' p99 about halved (`mlp-10m` 2.6-3.1 s -> 1.2 s), transcriptions'
    /// doubled (a decoder step then waits for a whole OCR page): not the default.
    max_concurrent_slices: u32 = "0";
    /// Let ONNX Runtime's one shared thread pool spin while it waits for work. Measured
    /// with the Zipf benchmark's hot-model rows on 2 cores, two runs each: 658 vs 691
    /// req/s batched and 168 vs 175 unbatched (on vs off): no faster, and spinning takes
    /// CPU from everything else.
    intra_op_spinning: bool = "false";
    /// Hand each ONNX run's activations back to the system when the run ends. Kept
    /// (`false`), ONNX Runtime's arena holds the largest run's activations while the model
    /// stays resident: ~190 MiB for an OCR detector of 10 MiB after one 736x960 page,
    /// ~240 MiB for Whisper tiny's encoder after one window. Released, those runs take
    /// 6-15% longer (no difference on small runs), and the memory is held against the
    /// budget only while the model runs. Unset: released when memory is bounded —
    /// `host_memory_limit` a size, or `auto` under a memory cgroup's limit (a
    /// container's) — and kept under `auto` on a whole machine. Kept under a cgroup's
    /// limit, an arena grown by one run hides what a larger run needs from the working
    /// set the scheduler learns: the mix benchmark in a 928 MiB cgroup was OOM-killed
    /// that way. `/admin/models` (`memory.release_activations`) and the start-up log
    /// say which.
    release_activations: Option<bool> = "";
    /// Most models resident at once; `0` = no cap.
    max_loaded_models: usize = "0";
    /// `Retry-After` of refusals with no better estimate.
    retry_after: Duration = "5s", check at_least_a_second;
    /// Where the server keeps its state (learned footprints, weight caches); relative to
    /// the config file (to the working directory when given by flag or env).
    state_dir: PathBuf = ".snooze";
    /// A model repository: each sub-folder with `model.onnx` or `1/model.onnx`, a
    /// sentence-transformers folder (`modules.json`) or a Whisper folder (`whisper.json`)
    /// is a model named after the folder (a `[models.NAME]` entry of the same name wins;
    /// an OCR pipeline still needs its `[pipelines.NAME]`). Relative to the config file (to
    /// the working directory when given by flag or env).
    model_dir: Option<PathBuf> = "";
    /// On SIGTERM/SIGINT, how long requests in flight may finish before models are
    /// unloaded; one still running then has its connection closed, and the server exits.
    shutdown_timeout: Duration = "30s";
    /// Longest a request waits for its model to load, and a repository load or unload
    /// for its model (then 503; the load or unload goes on).
    acquire_timeout: Duration = "120s", check positive;
    /// Larger bodies get 413, refused by `Content-Length` before they are read.
    max_request_size: u64 = "64MiB", check some_bytes;
    /// Memory all requests in flight may hold (bodies, decoded tensors, the copy kept for
    /// an out-of-memory retry), as a size or a share of the memory budget; past it new
    /// requests get 503 + `Retry-After`, a request that alone exceeds it 413. A request
    /// that held 1 MiB or more gives it back to the OS when it ends (the heap is trimmed
    /// within 0.2 s, once for all such requests of that moment).
    max_inflight_request_bytes: MemorySize = "10%", check some_size;
    /// A request line and headers must arrive within this once they started; slower
    /// connections are closed.
    header_read_timeout: Duration = "10s", check positive;
    /// A request body must arrive within this; slower ones get 408 and the connection is
    /// closed (a gRPC message: DEADLINE_EXCEEDED).
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
    /// Most pixels an image or a rendered page may have (`/v1/ocr`), checked from the
    /// image's header before any pixel is decoded; more: 413 naming it (a PDF page is
    /// rendered at a lower DPI that fits instead, and the answer says so).
    max_image_pixels: usize = "40000000", check at_least_one;
    /// Most pages of a PDF or TIFF one `/v1/ocr` request may read (all pages, or those
    /// its `pages` selects); more: 413 naming it.
    max_pages: usize = "1000", check at_least_one;
    /// Longest audio a transcription takes, in seconds, counted while decoding (never read
    /// from a header); longer: 413 naming it. An hour is transcribed window by window
    /// holding its upload plus a few MB; the upload must also fit `max_request_size` (64
    /// MiB is ~35 min of 16 kHz mono WAV, 6 min of 44.1 kHz stereo WAV, 2 h of 64 kbit/s
    /// MP3).
    max_audio_seconds: usize = "10800", check at_least_one;
    /// RSS / budget that records an alert.
    memory_warning_threshold: f64 = "0.80";
    /// Loads must evict first; low-priority requests get 503.
    memory_critical_threshold: f64 = "0.95";
    /// Idle, unpinned models are unloaded, the least worth first, until they cover the
    /// excess over the critical threshold.
    memory_emergency_threshold: f64 = "0.98";
    /// How often the monitor reads memory (also after each load).
    memory_check_interval: Duration = "5s", check at_least_10ms;
    /// One malloc arena and a 64 KiB mmap threshold.
    low_ram_mode: bool = "false";
    /// When set, every admin endpoint (repository load/unload, `/admin/*` reads, gc, the
    /// memory dump, `/metrics`, the dashboard's data) needs `Authorization: Bearer
    /// <token>` (see the README's Security section); unset = open.
    admin_token: Option<String> = "";
    /// API keys, comma-separated: when set, every inference endpoint (KServe REST and
    /// gRPC metadata, inference and index, the OpenAI routes) needs `Authorization:
    /// Bearer <key>` (gRPC: `authorization` metadata); health and readiness stay open.
    /// Separate from `admin_token`. Unset = open.
    api_keys: Option<String> = "";
    /// A file of API keys, one per line (`#` comments), added to `api_keys`; read at
    /// start and again on SIGHUP, so keys rotate without a restart. Relative to the config
    /// file (to the working directory when given by flag or env).
    api_keys_file: Option<PathBuf> = "";
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
        is_secret(self.name)
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

fn some_bytes(n: &u64) -> Result<(), String> {
    if *n == 0 {
        return Err("must be more than 0 bytes".into());
    }
    Ok(())
}

fn some_size(s: &MemorySize) -> Result<(), String> {
    match s {
        MemorySize::Bytes(b) => some_bytes(b),
        MemorySize::Percent(_) => Ok(()),
    }
}

fn some_memory(limit: &MemoryLimit) -> Result<(), String> {
    match limit {
        MemoryLimit::Size(s) => some_size(s),
        MemoryLimit::Auto => Ok(()),
    }
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

/// Keys whose values are never shown.
fn is_secret(key: &str) -> bool {
    key.ends_with("token") || key == "api_keys"
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
                let shown = if is_secret(key) { "***".to_string() } else { format!("{text:?}") };
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

/// How the memory budget is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// What the machine or its memory cgroup allows, minus headroom.
    Auto,
    Size(MemorySize),
}
