//! The `snooze` command line: validation before serving, clear start-up errors,
//! model-dir discovery, and a clean exit on SIGTERM.

mod common;

use std::process::Command;

use common::*;
use serde_json::json;

fn snooze() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_snooze"));
    c.current_dir(repo_root());
    c
}

/// A file written for one test in a temp folder of its own, removed when dropped.
struct Written {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

impl std::ops::Deref for Written {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for Written {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}

impl AsRef<std::path::Path> for Written {
    fn as_ref(&self) -> &std::path::Path {
        &self.path
    }
}

fn write(name: &str, text: &str) -> Written {
    let dir = tempfile::Builder::new().prefix("snooze-cli-").tempdir().expect("dir");
    let path = dir.path().join(name);
    std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
    std::fs::write(&path, text).expect("write");
    Written { _dir: dir, path }
}

#[test]
fn check_accepts_a_good_config_and_names_the_bad_key() {
    let good = write("good.toml", &format!("[models.a]\npath = \"{}/mlp-10m\"\n", models_dir().display()));
    let out = snooze().arg("check").arg(&good).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("model:    a (onnx"));

    let cases = [
        ("[server]\nheadroom = \"-1GiB\"\n", "[server] headroom"),
        ("[server]\nhost_memory_limit = \"lots\"\n", "[server] host_memory_limit"),
        ("[server]\nunknown_key = 1\n", "unknown_key"),
        ("[models.a]\npath = \"/does/not/exist.onnx\"\n", "[models.a] path"),
    ];
    for (i, (text, key)) in cases.iter().enumerate() {
        let bad = write(&format!("bad{i}.toml"), text);
        let out = snooze().arg("check").arg(&bad).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(key), "{text:?}: {err}");
        // serve refuses the same file before binding anything.
        let out = snooze().args(["serve", "--config"]).arg(&bad).output().expect("run");
        assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains(key));
    }
}

#[test]
fn flags_and_env_override_the_file() {
    let cfg = write("over.toml", "[server]\nkeep_alive = \"1m\"\n");
    // A bad value from the environment is reported under its key: env is read.
    let out = snooze()
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("SNOOZE_KEEP_ALIVE", "soon")
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&out.stderr).contains("[server] keep_alive"));
    // A flag wins over the environment.
    let out = snooze()
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("SNOOZE_KEEP_ALIVE", "soon")
        .args(["--keep-alive", "2m", "--min-residency", "never"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("keep_alive") && err.contains("[server] min_residency"), "{err}");
}

#[test]
fn check_sees_what_serve_would_and_paths_follow_where_they_were_given() {
    let good = write("seen.toml", &format!("[models.a]\npath = \"{}/mlp-10m\"\n", models_dir().display()));
    let out = snooze().arg("check").arg(&good).env("SNOOZE_KEEP_ALIVE", "soon").output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("(from env SNOOZE_KEEP_ALIVE)"), "{err}");
    let out = snooze().arg("check").arg(&good).args(["--min-residency", "never"]).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("(from flag --min-residency)"), "{err}");
    // The file itself from SNOOZE_CONFIG, as `serve` takes it.
    let out = snooze().arg("check").env("SNOOZE_CONFIG", &good).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("seen.toml: ok"));
    let empty = write("sub/empty.toml", "");
    let out = snooze().arg("check").arg(&empty).output().expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("warning:  no models"));

    // A path in the file is relative to the file; one given by flag, to the working directory.
    let cwd = empty.parent().and_then(|p| p.parent()).expect("temp dir").to_path_buf();
    let state = |args: &[&str]| {
        let out = snooze()
            .current_dir(&cwd)
            .args(["prepare", "--config", "sub/empty.toml"])
            .args(args)
            .env("ORT_DYLIB_PATH", ort_dylib())
            .output()
            .expect("run");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    assert!(state(&["--state-dir", "st"]).contains(&format!("state_dir: {}", cwd.join("st").display())));
    std::fs::write(&empty, "[server]\nstate_dir = \"st\"\n").expect("write");
    assert!(state(&[]).contains(&format!("state_dir: {}", cwd.join("sub").join("st").display())));
    // A log filter with a typo is said, not silently replaced by the defaults.
    let out = snooze()
        .current_dir(&cwd)
        .args(["prepare", "--config", "sub/empty.toml"])
        .env("ORT_DYLIB_PATH", ort_dylib())
        .env("SNOOZE_LOG", "==garbage[")
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("SNOOZE_LOG is not a log filter"), "{err}");
}

#[test]
fn missing_onnx_runtime_is_a_clear_error() {
    let cfg = write("ort.toml", &format!("[models.a]\npath = \"{}/mlp-10m\"\n", models_dir().display()));
    let out = snooze()
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("libonnxruntime") && !err.contains("panicked"), "{err}");
}

#[test]
fn help_documents_every_flag() {
    let out = snooze().args(["serve", "--help"]).output().expect("run");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--model-dir",
        "--http-address",
        "--host-memory-limit",
        "--headroom",
        "--keep-alive",
        "--min-residency",
        "--max-loaded-models",
        "--retry-after",
        "--state-dir",
        "--shutdown-timeout",
        "--log-format",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    assert!(help.contains("SNOOZE_HOST_MEMORY_LIMIT"), "env vars are documented");
}

#[test]
fn estimate_prints_the_derivation() {
    let estimate = |model: &str| {
        let out = snooze()
            .arg("estimate")
            .arg(models_dir().join(model))
            .env("ORT_DYLIB_PATH", ort_dylib())
            .output()
            .expect("run");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), out.stderr)
    };
    let (ok, text, err) = estimate("mlp-400m");
    assert!(ok, "{}", String::from_utf8_lossy(&err));
    assert!(text.contains("steady:") && text.contains("peak:") && text.contains("external data"), "{text}");
    // A sentence-transformers folder with an ONNX export: the backend the server would pick.
    let (_, text, _) = estimate("minilm-onnx");
    assert!(text.contains("backend:  onnx") && !text.contains("indeterminate"), "{text}");
    let (ok, _, err) = estimate("no-such-model");
    assert!(
        !ok && String::from_utf8_lossy(&err).contains("does not exist"),
        "a path that is not there fails"
    );

    // With the state dir `snooze prepare` filled, `mapped` is estimated as loaded from its copy.
    let state = std::env::temp_dir().join(format!("snooze-cli-estimate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let config = write(
        "estimate.toml",
        &format!("[models.m]\npath = \"{}/mlp-10m\"\nweights = \"mapped\"\n", models_dir().display()),
    );
    let prepared = snooze()
        .args(["prepare", "--config"])
        .arg(&config)
        .arg("--state-dir")
        .arg(&state)
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .expect("run");
    assert!(prepared.status.success(), "{}", String::from_utf8_lossy(&prepared.stderr));
    let mapped = |state_dir: Option<&std::path::Path>| {
        let mut c = snooze();
        c.args(["estimate", "--weights", "mapped"]).arg(models_dir().join("mlp-10m"));
        if let Some(dir) = state_dir {
            c.arg("--state-dir").arg(dir);
        }
        String::from_utf8_lossy(&c.env("ORT_DYLIB_PATH", ort_dylib()).output().expect("run").stdout)
            .into_owned()
    };
    let text = mapped(Some(&state));
    assert!(text.contains("weights = mapped") && !text.contains("not converted yet"), "{text}");
    assert!(mapped(None).contains("not converted yet"), "without the state dir, before the copy");
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn model_dir_discovery_and_sigterm_exits_cleanly() {
    let dir = std::env::temp_dir().join(format!("snooze-cli-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut cmd = snooze();
    cmd.args(["serve", "--model-dir"]).arg(models_dir()).args(["--host-memory-limit", "2GiB"]);
    let s = Server::start_with(&mut cmd, &[], dir);
    let (_, index, _) = s.post("/v2/repository/index", &json!({}));
    let names: Vec<&str> =
        index.as_array().expect("index").iter().map(|m| m["name"].as_str().expect("name")).collect();
    assert!(
        names.contains(&"mlp-10m") && names.contains(&"mlp-100m-6") && names.contains(&"mlp-400m"),
        "{names:?}"
    );
    assert!(!names.contains(&"test"), "folders without model.onnx are not models");
    let r = reference("mlp-10m");
    assert_eq!(s.post("/v2/models/mlp-10m/infer", &infer_body(&r)).0, 200);
    let logs = s.logs.clone();
    let status = s.terminate();
    assert!(status.success(), "{status:?}");
    let logs = logs.lock().expect("logs");
    assert!(logs.iter().any(|l| l.contains("all models unloaded")), "{logs:?}");
    assert!(logs.iter().any(|l| l.contains("Shutdown")), "the unload is logged with its reason");
    assert!(logs.iter().all(|l| !l.contains('\u{1b}')), "no colour codes in a log that is not a terminal");
}

/// `snooze ps|load|unload|gc|stats` against a running server, with its admin token.
#[test]
fn client_commands_drive_a_running_server() {
    let mlp = models_dir();
    let toml = format!(
        "[server]\nadmin_token = \"s3cret\"\nkeep_alive = \"5m\"\n\n[models.small]\npath = \"{0}/mlp-10m\"\n\n[models.big]\npath = \"{0}/mlp-100m-1\"\n",
        mlp.display()
    );
    let s = Server::start("cli-client", &toml, &[]).with_token("s3cret");
    let run = |args: &[&str], token: Option<&str>| {
        let mut c = snooze();
        c.args(args).env("SNOOZE_URL", &s.base).env_remove("SNOOZE_ADMIN_TOKEN");
        if let Some(t) = token {
            c.env("SNOOZE_ADMIN_TOKEN", t);
        }
        let out = c.output().expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let tok = Some("s3cret");

    // Without the token: a clear message, exit 1.
    let (code, _, err) = run(&["ps"], None);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("admin token"), "{err}");
    // With a wrong one: said so, not asked for one.
    let (code, _, err) = run(&["ps"], Some("wrong"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("refused the token"), "{err}");

    let (code, out, err) = run(&["load", "small"], tok);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("small: loaded"), "{out}");

    let (code, out, err) = run(&["ps"], tok);
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].split_whitespace().eq([
            "NAME",
            "STATE",
            "DEVICE",
            "MEMORY",
            "(est/measured)",
            "LEASES",
            "QUEUED",
            "UNTIL"
        ]),
        "{out}"
    );
    let small = lines.iter().find(|l| l.starts_with("small")).expect("small row");
    assert!(
        small.contains("ready")
            && small.contains("cpu")
            && (small.contains("in 4m") || small.contains("in 5m")),
        "{out}"
    );
    let big = lines.iter().find(|l| l.starts_with("big")).expect("big row");
    assert!(big.contains("unloaded") && big.contains("/ -"), "{out}");

    // A reader that stops early (`snooze ps | head -c 100`) ends the command quietly, by
    // SIGPIPE as other tools end, not with a panic about a broken pipe. The pipe's reading
    // end is closed before the command starts, so its first write fails every time.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut c = snooze();
    c.args(["ps", "--json"]).env("SNOOZE_URL", &s.base).env("SNOOZE_ADMIN_TOKEN", "s3cret");
    let out = c.stdout(writer).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {err}", out.status);

    // --json is the admin API's list, with the measured footprint.
    let (_, out, _) = run(&["ps", "--json"], tok);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let small = v.as_array().expect("list").iter().find(|m| m["name"] == "small").expect("small");
    assert_eq!(small["state"], "ready");
    assert!(small["footprint_measured_bytes"].as_u64().is_some(), "{small}");

    let (code, out, err) = run(&["stats"], tok);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("cpu: budget ") && out.contains("process ") && out.contains("level "), "{out}");
    let (_, out, _) = run(&["stats", "--json"], tok);
    assert!(serde_json::from_str::<serde_json::Value>(&out).expect("json")["devices"].is_array());

    // Load and unload what the server knows; an unknown model is the server's 404, exit 1.
    assert_eq!(run(&["load", "big"], tok).0, Some(0));
    let (code, out, _) = run(&["unload", "big"], tok);
    assert_eq!(code, Some(0));
    assert!(out.contains("big: unloaded"));
    let (code, _, err) = run(&["load", "nope"], tok);
    assert_eq!(code, Some(1));
    assert!(err.contains("404") && err.contains("nope"), "{err}");

    // gc unloads the idle model and says so.
    let (code, out, err) = run(&["gc"], tok);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("unloaded 1 model(s): small"), "{out}");
    let (_, out, _) = run(&["ps"], tok);
    assert!(out.lines().find(|l| l.starts_with("small")).expect("row").contains("unloaded"), "{out}");

    // top redraws every second until interrupted: read two frames, then stop it.
    let mut top = snooze()
        .arg("top")
        .env("SNOOZE_URL", &s.base)
        .env("SNOOZE_ADMIN_TOKEN", "s3cret")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("top");
    let mut stdout = top.stdout.take().expect("stdout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("\x1b[2J").count() < 2 {
        use std::io::Read;
        let n = stdout.read(&mut buf).expect("read");
        assert!(n > 0, "top exited: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let _ = top.kill();
    let _ = top.wait();
    let frames = String::from_utf8_lossy(&seen);
    assert!(
        frames.contains("cpu: budget") && frames.contains("NAME") && frames.contains("small"),
        "{frames}"
    );
}

#[test]
fn client_commands_say_when_the_server_is_unreachable() {
    // A port nobody listens on: bind, read the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    for args in [&["ps"][..], &["load", "x"], &["unload", "x"], &["gc"], &["stats"], &["top"]] {
        let out =
            snooze().args(args).args(["--url", &format!("http://127.0.0.1:{port}")]).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot reach the server") && err.contains(&port.to_string()),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_run_still_going_at_shutdown_timeout_does_not_hold_the_exit() {
    let config = format!(
        "[server]\nshutdown_timeout = \"1s\"\nintra_op_threads = 1\n\
         [models.m]\npath = \"{}/mlp-100m-1\"\nmax_batch_size = 4096\n",
        models_dir().display()
    );
    let s = Server::start("shutdown-timeout", &config, &[]);
    let r = reference("mlp-100m-1");
    assert_eq!(s.post("/v2/models/m/infer", &infer_body(&r)).0, 200);
    // One run of 4096 rows on one thread: seconds, past shutdown_timeout.
    let rows = 4096;
    let body = json!({"inputs": [{"name": "x", "shape": [rows, 256], "datatype": "FP32", "data": vec![0.5f32; rows * 256]}]});
    let url = s.url("/v2/models/m/infer");
    let long = std::thread::spawn(move || client().post(url).json(&body).send().map(|r| r.status().as_u16()));
    s.wait_for("the long run to start", |s| s.model("m")["leases"].as_u64() == Some(1));
    let started = std::time::Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let mut s = s;
    let status = loop {
        if let Some(status) = s.child.try_wait().expect("wait") {
            break status;
        }
        assert!(started.elapsed().as_secs() < 30, "the server still runs 30 s after SIGTERM");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let took = started.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(took.as_secs_f64() < 6.0, "exited {took:?} after SIGTERM with shutdown_timeout = 1s");
    // Cut off at shutdown_timeout, not answered once the run ended (what held the exit).
    assert!(long.join().expect("client").is_err(), "the request still running got an answer");
    assert!(!s.log_lines("closing their connections and exiting").is_empty());
}
