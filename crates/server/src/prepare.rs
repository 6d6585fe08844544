//! One-time preparations (ORT-format and prepacked copies) in a child process: the
//! `snooze prepare-model` the server starts for each one, in the background.
//!
//! A conversion holds 2-3x its model for a second or more. In the server's own process
//! that memory would mix with what the server measures — a load or a run beside it
//! could not be told from it — and the heap it leaves is not always given back. In a
//! child, the server's measurements stay true, the memory is all returned when the child
//! exits, and the child runs at a lower CPU priority (10 below the server's) than requests. Its peak is
//! still accounted by the scheduler while it runs, and a memory cgroup sees it as ours.

use std::{
    io::Read,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
};

use snooze_core::{Backend, LoadError, LoadSpec, Preparer};

/// Runs `snooze prepare-model` (this executable) for each preparation.
#[derive(Debug, Clone)]
pub struct ChildPreparer {
    exe: PathBuf,
    state_dir: PathBuf,
    intra_op_threads: usize,
    /// The child at work, while it runs: `stop` kills it (a request needs its memory).
    running: Arc<Mutex<Option<Child>>>,
}

impl ChildPreparer {
    pub fn new(state_dir: &Path, intra_op_threads: usize) -> Result<ChildPreparer, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find the snooze executable: {e}"))?;
        Ok(ChildPreparer {
            exe,
            state_dir: state_dir.to_path_buf(),
            intra_op_threads,
            running: Arc::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Preparer for ChildPreparer {
    fn prepare(&self, backend: &dyn Backend, spec: &LoadSpec) -> Result<(), LoadError> {
        let mut command = Command::new(&self.exe);
        // It dies with the server (with this thread, which waits for it): a conversion
        // must not go on writing into the state dir of a server that stopped.
        // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .arg("prepare-model")
            .args(["--backend", backend.name(), "--weights", spec.weights.as_str()])
            .arg("--path")
            .arg(&spec.path)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--intra-op-threads", &self.intra_op_threads.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                LoadError::Failed(format!("cannot start {} prepare-model: {e}", self.exe.display()))
            })?;
        // Below requests: raising a child's nice value needs no privilege.
        let low = snooze_core::memory::low_priority_nice();
        // SAFETY: setpriority on our own child's pid changes only its nice value.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, child.id() as libc::id_t, low) };
        let stderr = child.stderr.take();
        *self.lock() = Some(child);
        // Its messages until it exits (or is killed by `stop`), then its status; the
        // child stays where `stop` finds it until it is reaped, so a kill never reaches
        // a pid the system gave to another process.
        let mut err = Vec::new();
        let read = stderr.map_or(Ok(0), |mut e| e.read_to_end(&mut err));
        let waited = match self.lock().take() {
            Some(mut child) => child.wait(),
            None => Err(std::io::Error::other("its process is gone")),
        };
        let status = read
            .and(waited)
            .map_err(|e| LoadError::Failed(format!("prepare-model for '{}' was lost: {e}", spec.name)))?;
        let err = String::from_utf8_lossy(&err);
        if status.success() {
            // What the child did to the cache (copies made, a stopped process's leftovers
            // removed) belongs in the server's log, not in a dropped pipe.
            for line in err.lines().map(str::trim).filter(|l| !l.is_empty()) {
                tracing::info!(model = %spec.name, "prepare-model: {line}");
            }
            return Ok(());
        }
        let why = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message").trim().to_string();
        Err(LoadError::Failed(format!("preparing model '{}' failed ({status}): {why}", spec.name)))
    }

    fn in_process(&self) -> bool {
        false
    }

    fn stop(&self) -> bool {
        match self.lock().as_mut() {
            Some(child) => child.kill().is_ok(),
            None => false,
        }
    }
}
