//! Runs the real `snooze` binary on an ephemeral port for integration tests.

#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::{json, Value};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

pub fn models_dir() -> PathBuf {
    let dir = repo_root().join("models");
    assert!(
        dir.join("mlp-100m-1/model.onnx").exists(),
        "the test models are missing: run `make prepare` (or `make test`)"
    );
    dir
}

/// ORT_DYLIB_PATH as `make test` sets it; fails loudly when missing.
pub fn ort_dylib() -> String {
    std::env::var("ORT_DYLIB_PATH")
        .ok()
        .filter(|p| Path::new(p).exists())
        .expect("ORT_DYLIB_PATH must point at libonnxruntime.so: run the tests with `make test`")
}

pub struct Server {
    pub child: Child,
    pub base: String,
    /// `host:port` of the gRPC service, unless it is off.
    pub grpc: Option<String>,
    pub logs: Arc<Mutex<Vec<String>>>,
    pub dir: PathBuf,
    /// Sent as `Authorization: Bearer` by `get`/`post` when set.
    pub token: Option<String>,
}

impl Server {
    /// Starts `snooze serve --config <toml>` in a fresh temp dir.
    pub fn start(name: &str, config_toml: &str, extra_args: &[&str]) -> Server {
        Server::start_env(name, config_toml, extra_args, &[])
    }

    /// [`Server::start`] with environment variables set for the server.
    pub fn start_env(name: &str, config_toml: &str, extra_args: &[&str], env: &[(&str, &str)]) -> Server {
        let dir = std::env::temp_dir().join(format!("snooze-it-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("snooze.toml");
        std::fs::write(&config, config_toml).expect("write config");
        Server::start_with(
            Command::new(env!("CARGO_BIN_EXE_snooze"))
                .arg("serve")
                .arg("--config")
                .arg(&config)
                .envs(env.iter().copied()),
            extra_args,
            dir,
        )
    }

    pub fn start_with(cmd: &mut Command, extra_args: &[&str], dir: PathBuf) -> Server {
        cmd.args(["--http-address", "127.0.0.1:0"]);
        if !extra_args.contains(&"--grpc-address") {
            cmd.args(["--grpc-address", "127.0.0.1:0"]);
        }
        if !extra_args.contains(&"--state-dir") {
            cmd.arg("--state-dir").arg(dir.join("state"));
        }
        let mut child = cmd
            .args(extra_args)
            .env("ORT_DYLIB_PATH", ort_dylib())
            .env("NO_COLOR", "1")
            .env("SNOOZE_LOG_FORMAT", "json")
            .current_dir(repo_root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn snooze");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = logs.clone();
        let grpc = Arc::new(Mutex::new(None));
        let grpc_sink = grpc.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("gRPC on grpc://").nth(1) {
                    let addr: String = addr.chars().take_while(|c| !c.is_whitespace() && *c != '"').collect();
                    *grpc_sink.lock().expect("grpc") = Some(addr);
                }
                if let Some(addr) = line.split("listening on http://").nth(1) {
                    let addr: String = addr.chars().take_while(|c| !c.is_whitespace() && *c != '"').collect();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
                sink.lock().expect("logs").push(line);
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("server did not start: {:?}", logs.lock().expect("logs"))
        });
        let grpc = grpc.lock().expect("grpc").clone();
        Server { child, base: format!("http://{addr}"), grpc, logs, dir, token: None }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Authenticates the helpers' requests from now on.
    pub fn with_token(mut self, token: &str) -> Server {
        self.token = Some(token.to_string());
        self
    }

    fn authed(&self, r: reqwest::blocking::RequestBuilder) -> reqwest::blocking::RequestBuilder {
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// GET with a bearer token; the JSON body.
    pub fn get_with_token(&self, path: &str, token: &str) -> Value {
        client().get(self.url(path)).bearer_auth(token).send().expect("GET").json().unwrap_or(Value::Null)
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let r = self.authed(client().get(self.url(path))).send().expect("GET");
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// `GET /metrics`: the Prometheus text.
    pub fn metrics(&self) -> String {
        client().get(self.url("/metrics")).send().expect("metrics").text().expect("metrics text")
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value, Option<String>) {
        let r = self.authed(client().post(self.url(path))).json(body).send().expect("POST");
        let status = r.status().as_u16();
        let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap_or("").to_string());
        (status, r.json().unwrap_or(Value::Null), retry)
    }

    /// The admin entry of one model.
    pub fn model(&self, name: &str) -> Value {
        let (_, v) = self.get("/admin/models");
        v["models"]
            .as_array()
            .expect("models")
            .iter()
            .find(|m| m["name"] == name)
            .cloned()
            .expect("model listed")
    }

    pub fn rss(&self) -> u64 {
        self.get("/admin/models").1["memory"]["process_rss_bytes"].as_u64().expect("rss")
    }

    /// Waits (bounded) for `pred` on the admin view.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&Server) -> bool) {
        // Generous: first loads convert models to the ORT format, slower on a busy machine.
        let deadline = Instant::now() + Duration::from_secs(90);
        while !pred(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.logs.lock().expect("logs").iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A test that cannot run here fails, naming `reason`, unless `SNOOZE_ALLOW_SKIP` lists
/// `test` (comma-separated names, or `all`): only then does it skip, saying so on stderr
/// and appending a line to the file `SNOOZE_SKIP_LOG` names, which `make test` prints at
/// the end. cargo shows a returned test as `ok` with its output hidden: without this, a
/// run could pass with a guarantee unchecked and nobody told. Returns when the skip is
/// allowed; the caller then returns.
#[track_caller]
pub fn skip(test: &str, reason: &str) {
    let allowed = std::env::var("SNOOZE_ALLOW_SKIP").unwrap_or_default();
    if !allowed.split(',').map(str::trim).any(|name| name == test || name == "all") {
        panic!("{test} cannot run here: {reason}. Fix that, or set SNOOZE_ALLOW_SKIP={test} to let it skip");
    }
    let line = format!("SKIPPED {test}: {reason}");
    eprintln!("{line}");
    if let Some(log) = std::env::var_os("SNOOZE_SKIP_LOG") {
        use std::io::Write;
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = appended {
            panic!("cannot record the skip in {}: {e}", Path::new(&log).display());
        }
    }
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().expect("client")
}

/// The reference input and numpy output written by scripts/gen_models.py.
pub struct Reference {
    pub shape: Vec<i64>,
    pub input: Vec<f32>,
    pub output: Vec<f32>,
}

pub fn reference(model: &str) -> Reference {
    let path = models_dir().join(model).join("reference.json");
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference.json")).expect("json");
    let floats =
        |v: &Value| v.as_array().expect("array").iter().map(|x| x.as_f64().expect("f64") as f32).collect();
    Reference {
        shape: v["shape"].as_array().expect("shape").iter().map(|d| d.as_i64().expect("dim")).collect(),
        input: floats(&v["input"]["x"]),
        output: floats(&v["output"]["y"]),
    }
}

pub fn infer_body(r: &Reference) -> Value {
    json!({"inputs": [{"name": "x", "shape": r.shape, "datatype": "FP32", "data": r.input}]})
}

/// The largest `|a - b|` over two outputs of one length. A NaN anywhere makes it NaN, so
/// `diff <= tolerance` fails on a broken output (`fold(0.0, f32::max)` would skip it).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "outputs of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |worst, d| if d > worst || d.is_nan() { d } else { worst })
}

/// The TCP ports process `pid` listens on: its socket inodes (`/proc/PID/fd`) matched
/// against the kernel's socket tables in the `LISTEN` state.
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().to_string();
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st ... uid timeout inode
            if fields.len() > 9 && fields[3] == "0A" && inodes.contains(fields[9]) {
                let port = fields[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
                ports.extend(port);
            }
        }
    }
    ports.sort_unstable();
    ports
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}
