//! A real memory cgroup for tests that must prove behaviour under a kernel limit
//! (`memory_guard.rs`, `soak.rs`): made inside the test's own cgroup (v1 or v2), with the
//! server started inside it, removed on drop. Where cgroups cannot be made (no
//! permission, no memory controller) `create` says why, and the test fails unless
//! `SNOOZE_ALLOW_SKIP` lets it skip (`common::skip`).
//!
//! Declared by each test that needs it (`#[path = "common/cgroup.rs"] mod cgroup;`), not
//! from `common/mod.rs`, so the other tests do not compile it.

#![allow(dead_code)]

use std::{fs, path::PathBuf, process::Command, time::Duration};

use crate::common::{skip, Server};

/// A memory cgroup made inside our own (v1 here, v2 elsewhere), removed on drop.
pub struct Cgroup {
    pub dir: PathBuf,
    /// cgroup v2 (`memory.max`), else v1 (`memory.limit_in_bytes`).
    pub v2: bool,
}

impl Cgroup {
    pub fn create(limit: u64) -> Result<Cgroup, String> {
        let own =
            fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("no /proc/self/cgroup: {e}"))?;
        // One per cgroup, not per process: tests of one binary run at once, and two
        // sharing a cgroup share its limit (the last one written) and each other's memory.
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("snooze-test-{}-{n}", std::process::id());
        for line in own.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) =
                (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let rel = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                let dir = PathBuf::from("/sys/fs/cgroup/memory").join(rel).join(&name);
                fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                let cg = Cgroup { dir, v2: false };
                cg.write("memory.limit_in_bytes", &limit.to_string())?;
                let _ = cg.write("memory.memsw.limit_in_bytes", &limit.to_string());
                return Ok(cg);
            }
        }
        for line in own.lines() {
            if let Some(rel) = line.strip_prefix("0::") {
                let parent = PathBuf::from("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
                let _ = fs::write(parent.join("cgroup.subtree_control"), "+memory");
                let dir = parent.join(&name);
                fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                let cg = Cgroup { dir, v2: true };
                cg.write("memory.max", &limit.to_string())?;
                let _ = cg.write("memory.swap.max", "0");
                return Ok(cg);
            }
        }
        Err("no memory cgroup found in /proc/self/cgroup".into())
    }

    /// A cgroup of `limit` bytes for `test`; `None` when none can be made here and
    /// `SNOOZE_ALLOW_SKIP` lets `test` skip (otherwise the test fails, saying why).
    pub fn create_or_skip(limit: u64, test: &str) -> Option<Cgroup> {
        match Cgroup::create(limit) {
            Ok(cg) => Some(cg),
            Err(reason) => {
                skip(test, &format!("memory cgroups unavailable: {reason}"));
                None
            }
        }
    }

    /// `snooze serve` with `config_toml`, started inside this cgroup; checks that the
    /// server found the cgroup's limit.
    pub fn serve(&self, tag: &str, config_toml: &str) -> Server {
        let tmp = std::env::temp_dir().join(format!("snooze-{tag}-{}", std::process::id()));
        fs::create_dir_all(&tmp).expect("tmp");
        fs::write(tmp.join("snooze.toml"), config_toml).expect("config");
        let mut cmd = self.command(env!("CARGO_BIN_EXE_snooze"));
        cmd.arg("serve").arg("--config").arg(tmp.join("snooze.toml"));
        let s = Server::start_with(&mut cmd, &[], tmp);
        let (_, admin) = s.get("/admin/models");
        let source = if self.v2 { "cgroup_v2" } else { "cgroup_v1" };
        assert_eq!(admin["memory"]["limit_source"], source, "the server did not see the cgroup's limit");
        s
    }

    pub fn write(&self, file: &str, value: &str) -> Result<(), String> {
        fs::write(self.dir.join(file), value).map_err(|e| format!("cannot write {file}: {e}"))
    }

    pub fn read_field(&self, file: &str, key: &str) -> u64 {
        fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }

    pub fn oom_kills(&self) -> u64 {
        if self.v2 {
            self.read_field("memory.events", "oom_kill ")
        } else {
            self.read_field("memory.oom_control", "oom_kill ")
        }
    }

    pub fn peak(&self) -> u64 {
        let file = if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" };
        fs::read_to_string(self.dir.join(file)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    pub fn failcnt(&self) -> u64 {
        fs::read_to_string(self.dir.join("memory.failcnt"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// A command that joins this cgroup, then execs `program`.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("sh");
        let procs = self.dir.join("cgroup.procs");
        c.arg("-c").arg(format!("echo $$ > '{}' && exec \"$0\" \"$@\"", procs.display())).arg(program);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("could not remove {}", self.dir.display());
    }
}
