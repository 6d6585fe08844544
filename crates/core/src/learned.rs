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
    sync::Mutex,
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
    footprints: BTreeMap<String, LearnedFootprint>,
}

/// The store; writes are atomic (temp file + rename) so a crash never leaves half a file.
#[derive(Debug)]
pub struct FootprintStore {
    path: PathBuf,
    state: Mutex<StateFile>,
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
        FootprintStore { path, state: Mutex::new(state) }
    }

    /// The learned footprint of `model`, if measured on these same files.
    pub fn get(&self, model: &str, fingerprint: &str) -> Option<LearnedFootprint> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.footprints.get(model).filter(|l| l.fingerprint == fingerprint).cloned()
    }

    pub fn record(&self, model: &str, learned: LearnedFootprint) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.footprints.insert(model.to_string(), learned);
        if let Err(e) = self.write(&state) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot save learned footprints");
        }
    }

    fn write(&self, state: &StateFile) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(state)?)?;
        fs::rename(tmp, &self.path)
    }
}

/// Identifies a model's files: their total size and newest modification time.
pub fn fingerprint(path: &Path) -> String {
    let (mut bytes, mut newest) = (0u64, 0u64);
    let mut visit = |p: &Path| {
        if let Ok(m) = fs::metadata(p) {
            if m.is_file() {
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
            let mut stack: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            while let Some(p) = stack.pop() {
                match fs::read_dir(&p) {
                    Ok(more) => stack.extend(more.flatten().map(|e| e.path())),
                    Err(_) => visit(&p),
                }
            }
        }
        Err(_) => visit(path),
    }
    format!("{bytes}:{newest}")
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        FootprintStore::open(&dir.join("state")).record("m", learned.clone());
        let reopened = FootprintStore::open(&dir.join("state"));
        assert_eq!(reopened.get("m", &fp), Some(learned));
        assert_eq!(reopened.get("m", "4:0"), None, "other files: not trusted");
        assert_eq!(reopened.get("other", &fp), None);
        fs::write(dir.join("state/footprints.json"), b"{not json").unwrap();
        assert_eq!(FootprintStore::open(&dir.join("state")).get("m", &fp), None);
        fs::remove_dir_all(dir).unwrap();
    }
}
