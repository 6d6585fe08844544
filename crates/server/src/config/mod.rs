//! `snooze.toml`: the `[server]` table (`settings`) and one `[models.NAME]` table per
//! model (`models`).
//!
//! Precedence is flag > `SNOOZE_<KEY>` env > file > default. clap already merges a
//! flag with its env var (see `main.rs`); this module lays the result over the file.
//! Everything is validated before the server starts: a bad value stops the start
//! with the key's name and the reason, and nothing is half-applied.

mod models;
mod pipelines;
mod settings;

use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
};

use serde::Deserialize;

pub use models::{backend_for, discover, Backend, ModelSettings, RawModel};
pub use pipelines::{PipelineSettings, RawPipeline, DEFAULT_DPI, DEFAULT_PAGE_BATCH, DPI_RANGE};
pub use settings::{
    settings_table, MemoryLimit, Origin, RawServer, Scalar, ServerKey, ServerSettings, Setting, SERVER_KEYS,
};

/// The config served when no file is given: the demo models `make prepare` builds.
pub const DEFAULT_CONFIG: &str = include_str!("../default.toml");

/// HTTP and gRPC on one port (the second listener would fail to start, blaming its
/// address as taken); port 0 (any free port) never clashes.
fn listeners_apart(http: &str, grpc: &str) -> Result<(), ConfigError> {
    let (Ok(h), Ok(g)) = (http.parse::<std::net::SocketAddr>(), grpc.parse::<std::net::SocketAddr>()) else {
        return Ok(());
    };
    // `::ffff:127.0.0.1` is 127.0.0.1.
    let (hi, gi) = (h.ip().to_canonical(), g.ip().to_canonical());
    let same_host = hi == gi || hi.is_unspecified() || gi.is_unspecified();
    if h.port() != 0 && h.port() == g.port() && same_host {
        return Err(err(
            "[server] grpc_address",
            format!(
                "{grpc} takes the port of http_address ({http}): each listener needs its own (or \"off\")"
            ),
        ));
    }
    Ok(())
}

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileText {
    #[serde(default)]
    server: BTreeMap<String, Scalar>,
    #[serde(default)]
    models: BTreeMap<String, RawModel>,
    #[serde(default)]
    pipelines: BTreeMap<String, RawPipeline>,
}

/// A parsed file: its `[server]` values (unknown keys are refused in [`resolve`]) and its
/// models, before validation.
#[derive(Debug, Default)]
pub struct FileConfig {
    /// Where the text came from (a path, or the embedded default): errors name it.
    pub origin: String,
    pub server: RawServer,
    pub models: BTreeMap<String, RawModel>,
    pub pipelines: BTreeMap<String, RawPipeline>,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerSettings,
    pub models: Vec<ModelSettings>,
    /// OCR pipelines over those models (`/v1/ocr`).
    pub pipelines: Vec<PipelineSettings>,
}

/// What `check` and `serve` say of a config that serves nothing.
pub const NO_MODELS: &str = "no models are configured: add [models.NAME] tables or model_dir";

/// A refusal naming the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

pub(crate) fn err(key: &str, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("invalid config: {key}: {reason}"))
}

impl ConfigError {
    /// Names the file the refused value was written in.
    fn in_file(self, origin: &str) -> ConfigError {
        match self.0.strip_prefix("invalid config: ") {
            Some(rest) if !origin.is_empty() => ConfigError(format!("invalid config {origin}: {rest}")),
            _ => self,
        }
    }
}

/// Parses TOML text; unknown keys and wrong types are errors naming the key.
pub fn parse_file(text: &str, origin: &str) -> Result<FileConfig, ConfigError> {
    let file: FileText = toml::from_str(text)
        .map_err(|e| ConfigError(format!("invalid config {origin}: {}", e.to_string().trim())))?;
    let server = file.server.into_iter().map(|(k, v)| (k, (v.to_string(), Origin::File(origin.to_string()))));
    Ok(FileConfig {
        origin: origin.to_string(),
        server: RawServer(server.collect()),
        models: file.models,
        pipelines: file.pipelines,
    })
}

/// Validates `file` with `overrides` (flags/env) on top; `base` (the file's folder)
/// resolves the file's relative paths. Paths given by flag or env are the caller's to
/// make absolute (they are relative to the working directory).
pub fn resolve(
    mut file: FileConfig,
    overrides: RawServer,
    model_dir_flag: Option<PathBuf>,
    base: &Path,
) -> Result<Config, ConfigError> {
    let origin = std::mem::take(&mut file.origin);
    let located = |e: ConfigError| e.in_file(&origin);
    file.server.merge(overrides);
    let s = &file.server;
    if let Some(unknown) = s.0.keys().find(|k| !SERVER_KEYS.iter().any(|key| key.name == k.as_str())) {
        return Err(located(err(
            &format!("[server] {unknown}"),
            "unknown key (see the README's list of [server] keys)",
        )));
    }
    let mut server = ServerSettings::from_layers(s)?;
    server.thresholds().validate().map_err(|e| err("[server] memory_*_threshold", e))?;
    listeners_apart(&server.http_address, &server.grpc_address)?;
    if let MemoryLimit::Size(snooze_core::units::MemorySize::Bytes(limit)) = server.host_memory_limit {
        if server.headroom >= limit {
            let (h, l) =
                (snooze_core::units::format_bytes(server.headroom), snooze_core::units::format_bytes(limit));
            return Err(err(
                "[server] headroom",
                format!("{h} leaves nothing of host_memory_limit ({l}) for models"),
            ));
        }
    }
    server.state_dir = base.join(&server.state_dir);
    if server.state_dir.is_file() {
        return Err(err(
            "[server] state_dir",
            format!("{} is a file, not a folder", server.state_dir.display()),
        ));
    }
    if let Some(file) = &server.api_keys_file {
        let file = base.join(file);
        let from_file = matches!(s.0.get("api_keys_file"), Some((_, Origin::File(_))));
        crate::request::auth::read_keys_file(&file).map_err(|e| {
            let e = err("[server] api_keys_file", e);
            if from_file {
                located(e)
            } else {
                e
            }
        })?;
        server.api_keys_file = Some(file);
    }
    let model_dir_from_file = model_dir_flag.is_none();
    if let Some(flag) = model_dir_flag {
        server.model_dir = Some(flag);
    }

    let mut models = Vec::new();
    for (name, raw) in &file.models {
        models.push(models::model_settings(name, raw, &server, base).map_err(located)?);
    }
    if let Some(dir) = &server.model_dir {
        let found = match model_dir_from_file {
            true => discover(&base.join(dir), "[server] model_dir").map_err(located)?,
            false => discover(&base.join(dir), "--model-dir (SNOOZE_MODEL_DIR)")?,
        };
        for (name, path) in found {
            if models.iter().any(|m| m.name == name) {
                continue; // an explicit [models.NAME] entry wins over discovery
            }
            let raw = RawModel { path: Some(path), ..RawModel::default() };
            models.push(models::model_settings(&name, &raw, &server, base)?);
        }
    }
    models.sort_by(|a, b| a.name.cmp(&b.name));
    let pipelines = pipelines::pipelines(&file.pipelines, &models).map_err(located)?;
    // A pipeline's stages run a page's long work: low CPU priority unless set.
    for p in &pipelines {
        for stage in [Some(&p.det), p.cls.as_ref(), Some(&p.rec)].into_iter().flatten() {
            if let Some(m) = models.iter_mut().find(|m| &m.name == stage && !m.cpu_priority_set) {
                m.low_cpu_priority = true;
            }
        }
    }
    Ok(Config { server, models, pipelines })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use snooze_core::units::KeepAlive;

    use super::*;

    /// A model repository of two models and a folder of none, removed when dropped.
    fn dir() -> tempfile::TempDir {
        let t = tempfile::Builder::new().prefix("snooze-config-").tempdir().unwrap();
        let d = t.path();
        std::fs::create_dir_all(d.join("repo/a/1")).unwrap();
        std::fs::create_dir_all(d.join("repo/b")).unwrap();
        std::fs::create_dir_all(d.join("repo/not-a-model")).unwrap();
        std::fs::write(d.join("repo/a/1/model.onnx"), b"x").unwrap();
        std::fs::write(d.join("repo/b/model.onnx"), b"x").unwrap();
        t
    }

    fn load(text: &str, overrides: RawServer) -> Result<Config, ConfigError> {
        resolve(parse_file(text, "test")?, overrides, None, dir().path())
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
    fn model_dir_finds_whisper_folders_too() {
        let t = dir();
        let d = t.path();
        std::fs::create_dir_all(d.join("found/tiny")).unwrap();
        std::fs::write(d.join("found/tiny/whisper.json"), b"{}").unwrap();
        std::fs::create_dir_all(d.join("found/notes")).unwrap();
        let c = resolve(
            parse_file("[server]\nmodel_dir = \"found\"\n", "test").unwrap(),
            RawServer::default(),
            None,
            d,
        )
        .unwrap();
        let names: Vec<_> = c.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["tiny"], "a folder of no model is not one");
    }

    #[test]
    fn cpu_priority_is_low_for_long_work_unless_the_config_says_otherwise() {
        let t = dir();
        let d = t.path();
        std::fs::create_dir_all(d.join("repo/w")).unwrap();
        std::fs::write(d.join("repo/w/whisper.json"), b"{}").unwrap();
        let text = "[models.det]\npath = \"repo/a\"\n[models.rec]\npath = \"repo/b\"\n\
                    [models.cls]\npath = \"repo/b\"\ncpu_priority = \"normal\"\n\
                    [models.plain]\npath = \"repo/b\"\n[models.w]\npath = \"repo/w\"\n\
                    [models.x]\npath = \"repo/b\"\ncpu_priority = \"low\"\n\
                    [pipelines.p]\ndet = \"det\"\ncls = \"cls\"\nrec = \"rec\"\n";
        let c = resolve(parse_file(text, "test").unwrap(), RawServer::default(), None, d).unwrap();
        let low: Vec<_> = c.models.iter().map(|m| (m.name.as_str(), m.low_cpu_priority)).collect();
        assert_eq!(
            low,
            [("cls", false), ("det", true), ("plain", false), ("rec", true), ("w", true), ("x", true)],
            "pipeline stages and Whisper low unless set; the others normal unless set"
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
            ("[server]\ngrpc_address = \"127.0.0.1:8080\"", "[server] grpc_address"),
            (
                "[models.d]\npath = \"repo/b\"\nmax_queue = 2\n[models.r]\npath = \"repo/b\"\n\
                 [pipelines.p]\ndet = \"d\"\nrec = \"r\"\n",
                "[pipelines.p] page_batch",
            ),
            (
                "[server]\nhttp_address = \"0.0.0.0:9000\"\ngrpc_address = \"127.0.0.1:9000\"",
                "[server] grpc_address",
            ),
            ("[server]\nhost_memory_limit = \"100MiB\"\nheadroom = \"1GiB\"", "[server] headroom"),
            (
                "[server]\nhttp_address = \"[::ffff:127.0.0.1]:9000\"\ngrpc_address = \"127.0.0.1:9000\"",
                "[server] grpc_address",
            ),
            ("[server]\nstate_dir = \"repo/b/model.onnx\"", "[server] state_dir"),
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
            ("[models.x]\npath = \"repo/b\"\ncpu_priority = \"idle\"", "[models.x] cpu_priority"),
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
            dir().path(),
        )
        .unwrap_err()
        .0;
        assert!(e.contains("[server] keep_alive = \"soon\" (from a/snooze.toml)"), "{e}");
        let e = load("[server]\nadmin_token = 5", RawServer::default());
        assert!(e.is_ok(), "a token is any text");
    }

    #[test]
    fn mistakes_are_named_by_the_key_and_the_value_written() {
        let t = dir();
        let d = t.path();
        std::fs::create_dir_all(d.join("repo/w")).unwrap();
        std::fs::write(d.join("repo/w/whisper.json"), b"{}").unwrap();
        std::fs::create_dir_all(d.join("repo/st")).unwrap();
        std::fs::write(d.join("repo/st/modules.json"), b"[]").unwrap();
        std::fs::create_dir_all(d.join("repo/st/onnx")).unwrap();
        std::fs::write(d.join("repo/st/onnx/model.onnx"), b"x").unwrap();
        let stage = |extra: &str| {
            format!("[models.b]\npath = \"repo/b\"\n[pipelines.p]\ndet = \"b\"\nrec = \"b\"\n{extra}")
        };
        let cases = [
            (stage("min_score = 1.5"), "[pipelines.p] min_score: 1.5 is not between 0 and 1"),
            (stage("limit_side_len = -5"), "[pipelines.p] limit_side_len: -5 is not a whole number"),
            (stage("limit_side_len = 736.9"), "[pipelines.p] limit_side_len: 736.9 is not a whole number"),
            (
                "[models.w]\npath = \"repo/w\"\n[models.b]\npath = \"repo/b\"\n[pipelines.p]\ndet = \"w\"\nrec = \"b\"".into(),
                "[pipelines.p] det: 'w' is a Whisper model",
            ),
            (
                "[models.s]\npath = \"repo/st\"\n[models.b]\npath = \"repo/b\"\n[pipelines.p]\ndet = \"b\"\nrec = \"s\"".into(),
                "[pipelines.p] rec: 's' is an embedding model",
            ),
            (
                "[models.b]\npath = \"repo/b\"\n[pipelines.b]\ndet = \"b\"\nrec = \"b\"".into(),
                "[pipelines.b]: a model has this name too",
            ),
            ("[models.x]\npath = \"repo/b\"\nbackend = \"candle\"".into(), "\"candle\" serves sentence-transformers"),
            ("[server]\nhttp_address = [\"a\"]".into(), "expected a string, a number or true / false"),
            ("[models.x]\npath = \"repo/b\"\nmax_queue = 99999999999".into(), "from 1 to 4294967295"),
            ("[server]\nhost_memory_limit = \"0\"".into(), "[server] host_memory_limit = \"0\""),
            ("[server]\nmax_request_size = 0".into(), "[server] max_request_size = \"0\""),
            ("[server]\nmax_inflight_request_bytes = \"0MiB\"".into(), "[server] max_inflight_request_bytes"),
        ];
        for (text, expected) in cases {
            let e = parse_file(&text, "test").and_then(|f| resolve(f, RawServer::default(), None, d));
            let e = match e {
                Ok(_) => panic!("{text:?} was accepted"),
                Err(e) => e.0,
            };
            assert!(e.contains(expected), "{text:?} -> {e}");
        }
    }

    #[test]
    fn errors_after_parsing_name_the_file() {
        let at = |text: &str, over: RawServer| {
            resolve(parse_file(text, "a/snooze.toml").unwrap(), over, None, dir().path()).unwrap_err().0
        };
        let e = at("[models.x]\npath = \"missing.onnx\"", RawServer::default());
        assert!(e.starts_with("invalid config a/snooze.toml: [models.x] path:"), "{e}");
        let e = at("[server]\nkeep_alvie = \"1m\"", RawServer::default());
        assert!(e.starts_with("invalid config a/snooze.toml: [server] keep_alvie:"), "{e}");
        let e = at("[server]\nmodel_dir = \"nowhere\"", RawServer::default());
        assert!(e.starts_with("invalid config a/snooze.toml: [server] model_dir: cannot read"), "{e}");
        let e = at(
            "[models.b]\npath = \"repo/b\"\n[pipelines.p]\ndet = \"b\"\nrec = \"c\"",
            RawServer::default(),
        );
        assert!(e.starts_with("invalid config a/snooze.toml: [pipelines.p] rec:"), "{e}");
        // A value from a flag is the flag's, not the file's.
        let e = at("", RawServer::default().set("api_keys_file", "/nonexistent/keys").clone());
        assert!(e.starts_with("invalid config: [server] api_keys_file"), "{e}");
        let t = dir();
        let e = resolve(
            parse_file("", "a/snooze.toml").unwrap(),
            RawServer::default(),
            Some(t.path().join("nowhere")),
            t.path(),
        )
        .unwrap_err()
        .0;
        assert!(e.contains("--model-dir (SNOOZE_MODEL_DIR): cannot read"), "{e}");
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
