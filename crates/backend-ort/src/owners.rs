//! Who wrote a half-made cache entry, and whether it still runs.
//!
//! Every cache entry is written under a name of its own, `<target>.tmp-<owner>-<n>`, and
//! renamed into place when complete; what a process killed mid-way left (an
//! out-of-memory kill during a conversion: up to a few times the model's size) is
//! removed by the next process that writes to the cache. A pid alone cannot say whether
//! the writer still runs: in a container every process is pid 1 of its own namespace
//! (the init container that ran `snooze prepare`, then the server), so its leftovers
//! looked alive forever. The owner is a token (pid and start time) and the proof of life
//! a lock: each process holds an exclusive `flock` on `.lock-<token>` in every cache
//! folder it writes to, for as long as it runs. The kernel drops the lock with the
//! process, in any namespace, and on a volume other hosts mount (NFS emulates it).

use std::{
    fs::File,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex, OnceLock,
    },
    time::{SystemTime, UNIX_EPOCH},
};

/// This process's token: its pid and start time (ns), apart from any other process's.
fn token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        format!("{}.{nanos:x}", std::process::id())
    })
}

/// Set when a cache folder would not take this process's lock (a file system without
/// `flock`): its entries are then named by its pid, as before tokens, so that no other
/// process takes them for a stopped one's.
static LOCKLESS: AtomicBool = AtomicBool::new(false);

/// Where a cache entry is written before it is renamed to `target`: a name of its own
/// per attempt (two conversions or copies never share one) that says who wrote it.
pub(crate) fn tmp_path(target: &Path) -> PathBuf {
    static ATTEMPT: AtomicU64 = AtomicU64::new(0);
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("entry");
    let attempt = ATTEMPT.fetch_add(1, Ordering::Relaxed);
    let owner = match LOCKLESS.load(Ordering::Relaxed) {
        true => std::process::id().to_string(),
        false => token().to_string(),
    };
    target.with_file_name(format!("{name}.tmp-{owner}-{attempt}"))
}

/// Who wrote an entry: a token (this version) or a bare pid (earlier ones).
#[derive(Debug, PartialEq, Eq)]
enum Owner<'a> {
    Token(&'a str),
    Pid(u32),
}

fn owner_of(name: &str) -> Option<Owner<'_>> {
    let (_, tail) = name.rsplit_once(".tmp-")?;
    let (who, attempt) = tail.rsplit_once('-').unwrap_or((tail, "0"));
    attempt.parse::<u64>().ok()?;
    match who.split_once('.') {
        Some((pid, start)) if pid.parse::<u32>().is_ok() && u128::from_str_radix(start, 16).is_ok() => {
            Some(Owner::Token(who))
        }
        Some(_) => None,
        None => who.parse().ok().map(Owner::Pid),
    }
}

/// Holds this process's lock in `cache_dir` (once per folder, for the process's life);
/// where the folder will not take one, names this process's entries by its pid.
pub(crate) fn hold_lock(cache_dir: &Path) {
    if let Err(e) = lock(cache_dir) {
        tracing::debug!(cache = %cache_dir.display(), error = %e, "no lock file: cache entries are named by pid");
        LOCKLESS.store(true, Ordering::Relaxed);
    }
}

/// Made under a temporary name and locked before it gets its own, so no process ever
/// sees the lock file unlocked while its owner runs.
fn lock(cache_dir: &Path) -> std::io::Result<()> {
    static HELD: Mutex<Vec<(PathBuf, File)>> = Mutex::new(Vec::new());
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if held.iter().any(|(d, _)| d == cache_dir) {
        return Ok(());
    }
    let path = cache_dir.join(format!(".lock-{}", token()));
    let making = cache_dir.join(format!(".lock-{}.new", token()));
    let file = File::create(&making)?;
    file.lock()?;
    std::fs::rename(&making, &path)?;
    held.push((cache_dir.to_path_buf(), file));
    Ok(())
}

/// Whether the process with `token` still runs: its lock in `cache_dir` is held.
fn alive(cache_dir: &Path, token: &str) -> bool {
    if token == self::token() {
        return true;
    }
    let Ok(file) = File::open(cache_dir.join(format!(".lock-{token}"))) else { return false };
    match file.try_lock() {
        Ok(()) => false,
        Err(std::fs::TryLockError::WouldBlock) => true,
        // Cannot tell: keep its entries.
        Err(std::fs::TryLockError::Error(_)) => true,
    }
}

/// Removes what a process that no longer runs left half-written in `cache_dir`, and
/// the lock files of processes gone. Entries of processes still running — a `snooze
/// prepare` beside the server, this process — stay. Entries named by a bare pid (made
/// before owners had tokens) go when no such process runs here; where running processes
/// cannot be told (no `/proc`), they stay.
pub(crate) fn sweep(cache_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(cache_dir) else { return };
    let proc = Path::new("/proc/self").exists();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = if name.starts_with(".lock-") {
            // A lock file of a process gone (or one killed before it renamed it).
            File::open(entry.path()).is_ok_and(|f| f.try_lock().is_ok())
        } else {
            match owner_of(name) {
                None => false,
                Some(Owner::Token(token)) => !alive(cache_dir, token),
                Some(Owner::Pid(pid)) => {
                    proc && pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
                }
            }
        };
        if !stale {
            continue;
        }
        let path = entry.path();
        let removed =
            if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        match removed {
            Ok(()) => {
                tracing::info!(entry = %path.display(), "removed what a stopped process left in the cache")
            }
            Err(e) => {
                tracing::warn!(entry = %path.display(), error = %e, "cannot remove a stale cache entry")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_attempt_writes_a_name_of_its_own_that_says_whose_it_is() {
        let target = Path::new("/cache/mlp-1f.ort");
        let (a, b) = (tmp_path(target), tmp_path(target));
        assert_ne!(a, b);
        for p in [a, b] {
            let name = p.file_name().unwrap().to_str().unwrap();
            assert!(name.starts_with("mlp-1f.ort.tmp-"), "{name}");
            assert_eq!(owner_of(name), Some(Owner::Token(token())));
        }
        assert_eq!(owner_of("mlp-1f.ort"), None);
        assert_eq!(owner_of("mlp-1f.tmp-12"), Some(Owner::Pid(12)), "the names of earlier versions");
        assert_eq!(owner_of("mlp-1f.mapped.tmp-12-3"), Some(Owner::Pid(12)));
        assert_eq!(owner_of("x.tmp-abc"), None);
    }

    #[test]
    fn a_sweep_removes_what_stopped_processes_left_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("snooze-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Another process that runs: its lock is held (here by a second open file, which
        // conflicts as another process's would).
        let running = "1.5f0e4d2a";
        let lock = File::create(dir.join(format!(".lock-{running}"))).unwrap();
        lock.lock().unwrap();
        hold_lock(&dir);
        // Pid 1 runs, here as in every container: a token without its lock is gone all
        // the same (an init container's `snooze prepare` killed mid-way). No process has
        // a pid above pid_max (at most 2^22).
        let gone = [
            ("mlp-1f.mapped.tmp-1.5f0e4d29-0", true),
            ("mlp-1f.mapped.tmp-2147483646-0", true),
            ("mlp-1f.tmp-2147483646", false),
            (".lock-1.5f0e4d29", false),
            (".lock-1.5f0e4d28.new", false),
        ];
        let own = tmp_path(&dir.join("mlp-1f.ort"));
        let own = own.file_name().unwrap().to_str().unwrap().to_string();
        let other = format!("mlp-2f.ort.tmp-{running}-0");
        let kept = [
            (own.as_str(), false),
            (other.as_str(), false),
            ("mlp-1f.ort", false),
            ("mlp-1f.mapped", true),
            ("x.tmp-abc", false),
        ];
        for (name, is_dir) in gone.iter().chain(&kept) {
            let path = dir.join(name);
            if *is_dir {
                std::fs::create_dir_all(&path).unwrap();
                std::fs::write(path.join("model.data"), b"weights").unwrap();
            } else {
                std::fs::write(&path, b"weights").unwrap();
            }
        }
        sweep(&dir);
        for (name, _) in gone {
            assert!(!dir.join(name).exists(), "{name} left by a stopped process");
        }
        for (name, _) in kept {
            assert!(dir.join(name).exists(), "{name} kept");
        }
        assert!(
            dir.join(format!(".lock-{running}")).exists() && dir.join(format!(".lock-{}", token())).exists()
        );
        drop(lock);
        sweep(&dir);
        assert!(!dir.join(&other).exists(), "its owner stopped");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
