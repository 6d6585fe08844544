//! Parsed files kept between a model's loads, while memory allows.
//!
//! Some of a reload's time is parsing small files the model needs again unchanged: a
//! tokenizer takes ~40 ms for MiniLM's and ~145 ms for Whisper's on 2 cores, while the
//! session itself maps its weights in a few milliseconds. A reload over 100 ms counts
//! as slow to the scheduler and waits out other slow loads, so that parse decided
//! whether an embedding model came back at once or after a Whisper load.
//!
//! A [`Kept`] holds such values (a few MiB each) keyed by the file's path, size and
//! modification time, and a variant (a truncation length): an edited file is parsed
//! again. It holds at most [`MOST_KEPT`] entries, and the manager calls [`drop_all`]
//! when memory pressure reaches the critical level (where a load must be paid for by
//! evictions), so what is kept never costs a model its place: the next load parses
//! again. Kept values are not in any model's footprint; they are in the process's RSS,
//! which the pressure levels read.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::SystemTime,
};

/// Entries one [`Kept`] holds at most; the least recently used goes first.
pub const MOST_KEPT: usize = 8;

type Key = (PathBuf, u64, Option<SystemTime>, u64);

/// Values parsed from files, kept between loads (see the module).
pub struct Kept<T> {
    entries: Mutex<Vec<(Key, Arc<T>)>>,
    registered: std::sync::Once,
    /// Whether [`drop_all`] reaches it (always, but in tests of this module, which a
    /// drop by a concurrent test must not disturb).
    listed: bool,
}

trait Droppable: Sync {
    fn drop_entries(&self) -> usize;
}

impl<T: Send + Sync> Droppable for Kept<T> {
    fn drop_entries(&self) -> usize {
        std::mem::take(&mut *self.entries.lock().unwrap_or_else(PoisonError::into_inner)).len()
    }
}

static EVERY: Mutex<Vec<&'static dyn Droppable>> = Mutex::new(Vec::new());

/// Drops what every [`Kept`] holds (values in use stay with their users); returns how
/// many entries were dropped.
pub fn drop_all() -> usize {
    let every = EVERY.lock().unwrap_or_else(PoisonError::into_inner).clone();
    every.iter().map(|k| k.drop_entries()).sum()
}

impl<T: Send + Sync + 'static> Kept<T> {
    pub const fn new() -> Kept<T> {
        Kept { entries: Mutex::new(Vec::new()), registered: std::sync::Once::new(), listed: true }
    }

    #[cfg(test)]
    const fn unlisted() -> Kept<T> {
        Kept { entries: Mutex::new(Vec::new()), registered: std::sync::Once::new(), listed: false }
    }

    /// The value parsed from `path` (with `variant`), kept from an earlier call while
    /// the file is unchanged, else `parse`d now and kept. A file whose size and time
    /// cannot be read is parsed every time.
    pub fn get_or_parse<E>(
        &'static self,
        path: &Path,
        variant: u64,
        parse: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let Some(key) = key_of(path, variant) else { return parse().map(Arc::new) };
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = entries.iter().position(|(k, _)| *k == key) {
                let entry = entries.remove(i);
                let value = Arc::clone(&entry.1);
                entries.push(entry);
                return Ok(value);
            }
        }
        // Parsed outside the lock: two loads of different files do not wait for each other.
        let value = Arc::new(parse()?);
        if self.listed {
            self.registered.call_once(|| EVERY.lock().unwrap_or_else(PoisonError::into_inner).push(self));
        }
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.retain(|(k, _)| k.0 != key.0 || k.3 != key.3);
        if entries.len() >= MOST_KEPT {
            entries.remove(0);
        }
        entries.push((key, Arc::clone(&value)));
        Ok(value)
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Send + Sync + 'static> Default for Kept<T> {
    fn default() -> Self {
        Kept::new()
    }
}

fn key_of(path: &Path, variant: u64) -> Option<Key> {
    let path = std::fs::canonicalize(path).ok()?;
    let meta = std::fs::metadata(&path).ok()?;
    Some((path, meta.len(), meta.modified().ok(), variant))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    static PARSED: AtomicUsize = AtomicUsize::new(0);
    static WORDS: Kept<String> = Kept::unlisted();

    fn parse(path: &Path) -> Result<String, std::io::Error> {
        PARSED.fetch_add(1, Ordering::SeqCst);
        std::fs::read_to_string(path)
    }

    #[test]
    fn a_file_is_parsed_once_until_it_changes_or_memory_runs_short() {
        let dir = std::env::temp_dir().join(format!("snooze-kept-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("vocab.txt");
        std::fs::write(&file, "a b").unwrap();
        let first = WORDS.get_or_parse(&file, 0, || parse(&file)).unwrap();
        let again = WORDS.get_or_parse(&file, 0, || parse(&file)).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(PARSED.load(Ordering::SeqCst), 1);
        WORDS.get_or_parse(&file, 7, || parse(&file)).unwrap();
        assert_eq!((PARSED.load(Ordering::SeqCst), WORDS.len()), (2, 2), "another variant is another entry");

        std::fs::write(&file, "a b c").unwrap();
        let edited = WORDS.get_or_parse(&file, 0, || parse(&file)).unwrap();
        assert_eq!(
            (edited.as_str(), PARSED.load(Ordering::SeqCst)),
            ("a b c", 3),
            "a changed size is a new file"
        );
        assert_eq!(WORDS.len(), 2, "the old version's entry is replaced");

        assert_eq!(WORDS.drop_entries(), 2);
        assert!(WORDS.is_empty());
        assert_eq!(first.as_str(), "a b", "a value in use stays with its user");
        WORDS.get_or_parse(&file, 0, || parse(&file)).unwrap();
        assert_eq!(PARSED.load(Ordering::SeqCst), 4, "parsed again after the drop");

        let failed = WORDS.get_or_parse(&dir.join("missing"), 0, || parse(&dir.join("missing")));
        assert!(failed.is_err(), "a file that cannot be read is the parser's to report");
        for variant in 0..(MOST_KEPT as u64 + 3) {
            WORDS.get_or_parse(&file, 100 + variant, || parse(&file)).unwrap();
        }
        assert_eq!(WORDS.len(), MOST_KEPT);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
