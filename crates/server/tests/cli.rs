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

fn write(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("snooze-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
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
    let out = snooze()
        .arg("estimate")
        .arg(models_dir().join("mlp-400m"))
        .env("ORT_DYLIB_PATH", ort_dylib())
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("steady:") && text.contains("peak:") && text.contains("external data"), "{text}");
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
}
