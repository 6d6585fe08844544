//! Learned footprints: what each model really took on its last load, kept in a small
//! JSON file in the server's state directory so the next run admits it by measurement
//! rather than by a guess from its file sizes.
//!
//! An entry is only trusted while the model's files are unchanged (same fingerprint:
//! total size and newest modification time), so a replaced model is estimated afresh.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::{SystemTime, UNIX_EPOCH},
};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LearnedFootprint {
    /// Which files were measured (see [`fingerprint`]).
    pub fingerprint: String,
    pub device: String,
    pub steady_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    /// Unix seconds.
    pub measured_at: u64,
}

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct StateFile {
    /// Each model's latest measurement, whatever the form of its weights: what readers of
    /// the file (`deploy/capacity.py`) look a model up by.
    footprints: BTreeMap<String, LearnedFootprint>,
    /// Each model's measurement per form of its weights, under [`entry_key`].
    #[serde(default)]
    forms: BTreeMap<String, LearnedFootprint>,
}

/// Keeps in `ours` what `theirs` measured later, entry by entry.
fn merge_newer(ours: &mut BTreeMap<String, LearnedFootprint>, theirs: BTreeMap<String, LearnedFootprint>) {
    for (name, t) in theirs {
        match ours.get(&name) {
            Some(o) if o.measured_at >= t.measured_at => {}
            _ => {
                ours.insert(name, t);
            }
        }
    }
}

/// The store; writes are atomic (temp file + rename) so a crash never leaves half a file.
/// Several processes may share the file (replicas on one volume, `snooze prepare` beside
/// the server): each write starts from what is on disk, so one's entries survive
/// another's, and each writes a temporary file of its own.
#[derive(Debug)]
pub struct FootprintStore {
    path: PathBuf,
    state: Mutex<StateFile>,
    /// A failed save is logged once, not at every load.
    warned: AtomicBool,
}

impl FootprintStore {
    /// Opens `dir/footprints.json`; a missing or unreadable file starts empty (logged).
    pub fn open(dir: &Path) -> FootprintStore {
        let path = dir.join("footprints.json");
        let state = match fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable footprint state file");
                StateFile::default()
            }),
            Err(_) => StateFile::default(),
        };
        FootprintStore { path, state: Mutex::new(state), warned: AtomicBool::new(false) }
    }

    /// The learned footprint of `model`, if measured on these same files.
    pub fn get(&self, model: &str, fingerprint: &str) -> Option<LearnedFootprint> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let trusted = |l: &&LearnedFootprint| l.fingerprint == fingerprint;
        let by_form = state.forms.get(&entry_key(model, fingerprint)).filter(trusted);
        by_form.or(state.footprints.get(model).filter(trusted)).cloned()
    }

    pub fn record(&self, model: &str, learned: LearnedFootprint) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // One save at a time among the processes sharing the file (a file system without
        // locks saves without: a save may then miss another's entry, never corrupt one).
        let _lock = self.path.parent().and_then(|dir| {
            let _ = fs::create_dir_all(dir);
            let file = fs::File::create(dir.join("footprints.lock")).ok()?;
            file.lock().ok().map(|()| file)
        });
        // What other processes sharing the file learned since it was read: the newer
        // measurement of each model wins.
        let disk: Option<StateFile> =
            fs::read_to_string(&self.path).ok().and_then(|text| serde_json::from_str(&text).ok());
        if let Some(disk) = disk {
            merge_newer(&mut state.footprints, disk.footprints);
            merge_newer(&mut state.forms, disk.forms);
        }
        state.forms.insert(entry_key(model, &learned.fingerprint), learned.clone());
        state.footprints.insert(model.to_string(), learned);
        match self.write(&state) {
            Ok(()) => self.warned.store(false, Ordering::Relaxed),
            Err(e) if !self.warned.swap(true, Ordering::Relaxed) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot save learned footprints (said once until a save succeeds)");
            }
            Err(_) => {}
        }
    }

    fn write(&self, state: &StateFile) -> std::io::Result<()> {
        static WRITES: AtomicU64 = AtomicU64::new(0);
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir)?;
        }
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = self.path.with_extension(format!("json.tmp-{}-{n}", std::process::id()));
        let written =
            fs::write(&tmp, serde_json::to_vec_pretty(state)?).and_then(|()| fs::rename(&tmp, &self.path));
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }
}

/// What separates a model's files from the form of its weights in its fingerprint.
const FORM: &str = "|weights=";

/// The key of a model's footprint among `forms`: its name and the way its weights are
/// held ([`model_fingerprint`]'s last part). Each form keeps its own figures: `auto`
/// picks another form when `host_memory_limit` changes, and one entry per name meant
/// every restart across budgets dropped what the other form had learned (a model learned
/// prepacked was estimated afresh, mapped, and maybe refused, at the next budget).
fn entry_key(model: &str, fingerprint: &str) -> String {
    match fingerprint.rsplit_once(FORM) {
        Some((_, form)) => format!("{model}|{form}"),
        None => model.to_string(),
    }
}

/// What a learned footprint is kept under: the model's files (their engine's
/// [`Backend::fingerprint`](crate::backend::Backend::fingerprint)) and the way its
/// weights are held (each has its own footprint to learn).
pub fn model_fingerprint(
    backend: &dyn crate::backend::Backend,
    path: &Path,
    weights: crate::backend::Weights,
) -> String {
    format!("{}{FORM}{}", backend.fingerprint(path), weights.as_str())
}

/// Identifies a model's files: their total size, newest modification time, and a hash
/// of a sample of their bytes ([`sample_hash`]): a retrained model of the same
/// architecture has the same size, and `cp -p`, `rsync -a`, `tar x` and image layers
/// keep modification times, so those two alone took a new version for the old one (its
/// cached copies served the old weights).
pub fn fingerprint(path: &Path) -> String {
    let (mut bytes, mut newest, mut sampled) = (0u64, 0u64, 0u64);
    let mut visit = |p: &Path| {
        if let Ok(m) = fs::metadata(p) {
            if m.is_file() {
                // Summed: the order files are listed in does not matter.
                sampled = sampled.wrapping_add(sample_hash(p, m.len()));
                bytes += m.len();
                let t = m
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                newest = newest.max(t);
            }
        }
    };
    match fs::read_dir(path) {
        Ok(entries) => {
            // Each folder once: a link back to the folder or to one above it (`self -> .`)
            // walked for ever, and the server never started.
            let mut seen: std::collections::HashSet<PathBuf> = fs::canonicalize(path).into_iter().collect();
            let mut stack: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            while let Some(p) = stack.pop() {
                match fs::read_dir(&p) {
                    Ok(more) => {
                        if fs::canonicalize(&p).map_or(true, |c| seen.insert(c)) {
                            stack.extend(more.flatten().map(|e| e.path()));
                        }
                    }
                    Err(_) => visit(&p),
                }
            }
        }
        Err(_) => visit(path),
    }
    format!("{bytes}:{newest}:{sampled:016x}")
}

/// Blocks read from each file by [`sample_hash`], and their size: eight 4 KiB reads,
/// spread from the first byte to the last (the weights of a new version differ all
/// through; a header alone may not).
const SAMPLES: u64 = 8;
const SAMPLE_BYTES: usize = 4096;

/// FNV-1a over the file's name and its sampled blocks (stable across builds, unlike
/// the standard library's hasher).
fn sample_hash(path: &Path, len: u64) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(path.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
    let Ok(mut file) = fs::File::open(path) else { return h };
    let mut block = vec![0u8; SAMPLE_BYTES];
    let span = len.saturating_sub(SAMPLE_BYTES as u64);
    for k in 0..SAMPLES {
        let at = span * k / (SAMPLES - 1);
        let Ok(_) = file.seek(SeekFrom::Start(at)) else { break };
        let Ok(n) = file.read(&mut block) else { break };
        feed(&block[..n]);
    }
    h
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model folder with links back to itself and to its parent is walked once:
    /// the fingerprint is the one without the links, and it comes back.
    #[cfg(unix)]
    #[test]
    fn links_back_up_a_model_folder_are_walked_once() {
        let root = std::env::temp_dir().join(format!("snooze-learned-loop-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let model = root.join("model");
        fs::create_dir_all(&model).unwrap();
        fs::write(model.join("model.onnx"), b"graph and weights").unwrap();
        let plain = fingerprint(&model);
        std::os::unix::fs::symlink(".", model.join("self")).unwrap();
        std::os::unix::fs::symlink("..", model.join("up")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let walked = model.clone();
        std::thread::spawn(move || tx.send(fingerprint(&walked)));
        let linked = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("the walk ends");
        assert_eq!(linked, plain);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn survives_a_restart_and_forgets_changed_files() {
        let dir = std::env::temp_dir().join(format!("snooze-learned-{}", std::process::id()));
        let model = dir.join("m.onnx");
        fs::create_dir_all(&dir).unwrap();
        fs::write(&model, b"abc").unwrap();
        let fp = fingerprint(&model);
        assert!(fp.starts_with("3:"));
        let learned = LearnedFootprint {
            fingerprint: fp.clone(),
            device: "cpu".into(),
            steady_bytes: Some(100),
            peak_bytes: Some(150),
            measured_at: 1,
        };
        // The same size and modification time, other bytes: another version.
        let mtime = fs::metadata(&model).unwrap().modified().unwrap();
        fs::write(&model, b"abd").unwrap();
        fs::File::options().write(true).open(&model).unwrap().set_modified(mtime).unwrap();
        assert_ne!(fingerprint(&model), fp, "a retrained model of the same size, copied with cp -p");
        fs::write(&model, b"abc").unwrap();
        fs::File::options().write(true).open(&model).unwrap().set_modified(mtime).unwrap();
        assert_eq!(fingerprint(&model), fp);
        FootprintStore::open(&dir.join("state")).record("m", learned.clone());
        let reopened = FootprintStore::open(&dir.join("state"));
        assert_eq!(reopened.get("m", &fp), Some(learned.clone()));
        assert_eq!(reopened.get("m", "4:0"), None, "other files: not trusted");
        assert_eq!(reopened.get("other", &fp), None);
        // A second process sharing the state: neither loses the other's entries.
        let (a, b) = (FootprintStore::open(&dir.join("state")), FootprintStore::open(&dir.join("state")));
        a.record("from-a", learned.clone());
        b.record("from-b", learned.clone());
        let both = FootprintStore::open(&dir.join("state"));
        assert!(
            both.get("from-a", &fp).is_some()
                && both.get("from-b", &fp).is_some()
                && both.get("m", &fp).is_some()
        );
        // The newer measurement of a model wins over an older one kept in memory.
        let newer = LearnedFootprint { steady_bytes: Some(200), measured_at: 2, ..learned.clone() };
        b.record("m", newer.clone());
        a.record("from-a", learned.clone());
        assert_eq!(FootprintStore::open(&dir.join("state")).get("m", &fp), Some(newer));
        let mut left: Vec<_> =
            fs::read_dir(dir.join("state")).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["footprints.json", "footprints.lock"], "no temporary file is left");
        // Each way of holding the weights keeps its own figures across restarts.
        let (prepacked, mapped) = (format!("{fp}|weights=prepacked"), format!("{fp}|weights=mapped"));
        let as_form = |f: &String, steady| LearnedFootprint {
            fingerprint: f.clone(),
            steady_bytes: Some(steady),
            ..learned.clone()
        };
        a.record("m", as_form(&prepacked, 300));
        b.record("m", as_form(&mapped, 120));
        let reopened = FootprintStore::open(&dir.join("state"));
        assert_eq!(reopened.get("m", &prepacked).and_then(|l| l.steady_bytes), Some(300));
        assert_eq!(reopened.get("m", &mapped).and_then(|l| l.steady_bytes), Some(120));
        // The latest is kept by name too, for readers of the file (deploy/capacity.py).
        let file: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join("state/footprints.json")).unwrap()).unwrap();
        assert_eq!(file["footprints"]["m"]["steady_bytes"], 120);
        fs::write(dir.join("state/footprints.json"), b"{not json").unwrap();
        assert_eq!(FootprintStore::open(&dir.join("state")).get("m", &fp), None);
        fs::remove_dir_all(dir).unwrap();
    }
}
