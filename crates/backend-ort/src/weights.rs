//! Where a model's weights live, per `weights` profile, and the ORT-format cache the
//! lean profiles are built on.
//!
//! Measured on ONNX Runtime 1.32 with the 100 MiB demo MLP (see `bench/README.md`):
//! creating a session from the `.onnx` file copies every initializer into
//! runtime-owned buffers and, by default, prepacks MatMul weights (about 350 ms). A
//! model in the ORT format, handed over as bytes with
//! `session.use_ort_model_bytes_directly` + `session.use_ort_model_bytes_for_initializers`,
//! is used in place: initializers point into the bytes, nothing is parsed or copied.
//! ONNX Runtime can also save an optimised model whose initializers — prepacked ones
//! included (`session.save_external_prepacked_constant_initializers`) — sit page-aligned
//! in an external data file, which it maps on load: the prepacked weights are then page
//! cache too, and loading skips prepacking (measured: ~115 ms instead of ~300 ms, no
//! private memory for the weights, runs as fast as ONNX Runtime's default). So:
//! - `prepacked`: that mapped, prepacked copy (`<name>.prepacked/`); without a cache
//!   directory, the `.onnx` as ONNX Runtime loads it by default;
//! - `compact`: the cached ORT file read into one private buffer, used in place, no
//!   prepacking — about 1.0x the weights, a 100 MiB model in ~55 ms;
//! - `mapped`: the cached ORT file mapped copy-on-write, used in place, no prepacking —
//!   no private copy at all, the pages are the page cache's, and a reload is ~1 ms.
//!
//! Until its copy is made, a `compact` or `mapped` model loads its *mapped copy*
//! (`<name>.mapped/`, see `external`): the `.onnx` with its weights moved into a
//! page-aligned data file that ONNX Runtime maps, made by the first load in ~40 ms
//! without the runtime or private memory, loaded in ~4 ms, run as the ORT-format copy
//! runs. A model that cannot have one loads the `.onnx` without prepacking (~150 ms for
//! 100 MiB instead of ~300). The one-time conversions start from the mapped copy, but
//! for a prepacked copy of a model whose mapped copy stores weights as panels (see
//! `panels`): that one starts from the `.onnx`.
//!
//! The cache (`state_dir/ort-cache/`) is keyed by the model files' fingerprint, the
//! runtime library and the copies' form (`FORM_LINE`); the user's files are never
//! touched. A conversion that fails is an error naming the file and the reason.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Mutex,
};

use ort::{
    environment::Environment,
    session::{builder::GraphOptimizationLevel, Session},
};

use crate::{
    external,
    onnx_file::ModelFile,
    owners::{sweep, tmp_path},
};

/// What the copies hold, as their `.source` notes it: this changes when a copy made
/// before would be of no use (form 2: the mapped and ORT-format copies had MatMuls turned
/// around; form 3: their big MatMul weights are stored as panels instead, see `panels`;
/// form 4: those MatMuls are `ai.snooze.PanelMatMul`, which reads the panels in place).
/// Entries of an earlier form (noted without it, or with
/// another) are removed when a process next writes to the cache, and made again, under
/// other names (the form is part of their names' hash), as the models need them.
const FORM_LINE: &str = "form 4";

/// The bytes a `compact` or `mapped` model is served from: they must outlive its sessions.
pub(crate) enum ModelBytes {
    Owned(Box<[u8]>),
    /// Copy-on-write: a write by the runtime (none is expected) would get a private page
    /// instead of a fault.
    Mapped(memmap2::MmapMut),
}

impl ModelBytes {
    pub(crate) fn read(path: &Path) -> Result<ModelBytes, String> {
        std::fs::read(path)
            .map(|v| ModelBytes::Owned(v.into_boxed_slice()))
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
    }

    pub(crate) fn map(path: &Path) -> Result<ModelBytes, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // SAFETY: the cache file is written once, renamed into place and never modified;
        // the mapping is private, so even a writer could not change what we read.
        let map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }
            .map_err(|e| format!("cannot map {}: {e}", path.display()))?;
        Ok(ModelBytes::Mapped(map))
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            ModelBytes::Owned(b) => b,
            ModelBytes::Mapped(m) => m,
        }
    }

    /// Bytes that become resident as runs touch them (mapped only).
    pub(crate) fn mapped_len(&self) -> u64 {
        match self {
            ModelBytes::Owned(_) => 0,
            ModelBytes::Mapped(m) => m.len() as u64,
        }
    }
}

/// The prepacked copy of `onnx` (`model.onnx` + its mapped data) in `cache_dir`, saved
/// now if it is not there yet.
pub(crate) fn prepacked_file(
    env: &Environment,
    onnx: &Path,
    cache_dir: &Path,
    runtime: &Path,
) -> Result<PathBuf, String> {
    let dir = cache_dir.join(format!("{}.prepacked", cache_stem(onnx, runtime)));
    let model = dir.join("model.onnx");
    if model.is_file() {
        return Ok(model);
    }
    open_cache(cache_dir)?;
    let tmp = tmp_path(&dir);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let started = std::time::Instant::now();
    let source = conversion_source(onnx, cache_dir, runtime, true);
    if let Err(e) = save_prepacked(env, &source, &tmp.join("model.onnx")) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(format!("cannot save a prepacked copy of {}: {e}", onnx.display()));
    }
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process sharing the cache (a `snooze prepare` beside the server, a
        // second replica on one volume) saved the same copy first: the first rename wins.
        if model.is_file() {
            return Ok(model);
        }
        return Err(format!("cannot move the prepacked copy to {}: {e}", dir.display()));
    }
    remember_source(onnx, cache_dir, runtime);
    log_made("saved a prepacked copy", onnx, &dir, started);
    Ok(model)
}

fn save_prepacked(env: &Environment, onnx: &Path, to: &Path) -> ort::Result<()> {
    let builder = Session::builder(env)?
        .with_optimization_level(GraphOptimizationLevel::Level2)?
        .with_config_entry("session.optimized_model_external_initializers_file_name", "model.data")?
        .with_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")?
        .with_config_entry("session.save_external_prepacked_constant_initializers", "1")?;
    save_optimized(builder, onnx, to)
}

/// Creates a throwaway session that writes the optimised model to `to`, then gives its
/// memory back: it held a whole session that no footprint accounts for, and until the
/// heap is trimmed the probe sees it as taken (the next admission would evict for it).
fn save_optimized(builder: ort::session::builder::SessionBuilder, onnx: &Path, to: &Path) -> ort::Result<()> {
    drop(builder.with_optimized_model_path(to)?.commit_from_file(onnx)?);
    snooze_core::memory::trim_heap();
    Ok(())
}

/// The mapped copy of `onnx` in `cache_dir` (see `external`), made now if it is not
/// there yet; `Ok(None)` if the model cannot have one.
pub(crate) fn mapped_copy(onnx: &Path, cache_dir: &Path, runtime: &Path) -> Result<Option<PathBuf>, String> {
    let dir = mapped_copy_dir(onnx, cache_dir, runtime);
    if let Some(made) = external::cached(&dir) {
        return Ok(Some(made));
    }
    open_cache(cache_dir)?;
    let started = std::time::Instant::now();
    let made = external::copy(onnx, &dir)?;
    if made.is_some() {
        remember_source(onnx, cache_dir, runtime);
        log_made("made a mapped copy", onnx, &dir, started);
    }
    Ok(made)
}

/// The mapped copy of `onnx` in `cache_dir`, if one was made.
pub(crate) fn cached_mapped_copy(onnx: &Path, cache_dir: &Path, runtime: &Path) -> Option<PathBuf> {
    external::cached(&mapped_copy_dir(onnx, cache_dir, runtime))
}

/// Removes the mapped copy of `onnx` (one the runtime would not load).
pub(crate) fn discard_mapped_copy(onnx: &Path, cache_dir: &Path, runtime: &Path) {
    let _ = std::fs::remove_dir_all(mapped_copy_dir(onnx, cache_dir, runtime));
}

fn mapped_copy_dir(onnx: &Path, cache_dir: &Path, runtime: &Path) -> PathBuf {
    cache_dir.join(format!("{}.mapped", cache_stem(onnx, runtime)))
}

/// What a conversion reads: the mapped copy (made now: it takes tens of milliseconds and
/// no private memory), from which ONNX Runtime converts with a smaller peak (+160 MiB
/// instead of +260 MiB for the 100 MiB MLP) and sooner; the `.onnx` if there is none, or
/// if the copy's weights are stored as panels and the conversion is to the prepacked copy
/// (see `panels`: prepacked, the original layout is the faster one).
fn conversion_source(onnx: &Path, cache_dir: &Path, runtime: &Path, prepacking: bool) -> PathBuf {
    match mapped_copy(onnx, cache_dir, runtime) {
        Ok(Some(copy)) if prepacking && external::has_panels(&copy) => onnx.to_path_buf(),
        Ok(Some(copy)) => copy,
        Ok(None) => onnx.to_path_buf(),
        Err(e) => {
            tracing::warn!(model = %onnx.display(), error = %e, "converting from the .onnx: no mapped copy");
            onnx.to_path_buf()
        }
    }
}

/// Removes the prepacked copy of `onnx` (one the runtime would not load).
pub(crate) fn discard_prepacked_copy(onnx: &Path, cache_dir: &Path, runtime: &Path) {
    let _ = std::fs::remove_dir_all(cache_dir.join(format!("{}.prepacked", cache_stem(onnx, runtime))));
}

/// The prepacked copy of `onnx` in `cache_dir`, if one was saved.
pub(crate) fn cached_prepacked_file(onnx: &Path, cache_dir: &Path, runtime: &Path) -> Option<PathBuf> {
    Some(cache_dir.join(format!("{}.prepacked", cache_stem(onnx, runtime))).join("model.onnx"))
        .filter(|p| p.is_file())
}

/// The ORT-format copy of `onnx` in `cache_dir`, if one was made.
pub(crate) fn cached_ort_file(onnx: &Path, cache_dir: &Path, runtime: &Path) -> Option<PathBuf> {
    Some(cache_dir.join(cache_name(onnx, runtime))).filter(|p| p.is_file())
}

/// The ORT-format copy of `onnx` in `cache_dir`, converted now if it is not there yet.
pub(crate) fn ort_format_file(
    env: &Environment,
    onnx: &Path,
    cache_dir: &Path,
    runtime: &Path,
) -> Result<PathBuf, String> {
    let target = cache_dir.join(cache_name(onnx, runtime));
    if target.is_file() {
        return Ok(target);
    }
    open_cache(cache_dir)?;
    let tmp = tmp_path(&target);
    let started = std::time::Instant::now();
    let converted = convert(env, &conversion_source(onnx, cache_dir, runtime, false), &tmp);
    if let Err(e) = converted {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot convert {} to the ORT format: {e}", onnx.display()));
    }
    std::fs::rename(&tmp, &target)
        .map_err(|e| format!("cannot move the converted model to {}: {e}", target.display()))?;
    remember_source(onnx, cache_dir, runtime);
    log_made("converted to the ORT format", onnx, &target, started);
    Ok(target)
}

/// Saves the model as ONNX Runtime optimises it at the extended level (portable across
/// CPUs: no layout transforms for one instruction set), in the ORT format.
fn convert(env: &Environment, onnx: &Path, to: &Path) -> ort::Result<()> {
    let builder = Session::builder(env)?
        .with_operators(crate::panel_op::domain()?)?
        .with_optimization_level(GraphOptimizationLevel::Level2)?
        .with_prepacking(false)?
        .with_config_entry("session.save_model_format", "ORT")?;
    save_optimized(builder, onnx, to)
}

/// Creates `cache_dir` if need be, removes the copies of replaced model versions (a new
/// version's first copy is made just after) and, the first time this process writes to
/// it, sweeps what stopped processes left.
fn open_cache(cache_dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(cache_dir).map_err(|e| format!("cannot create {}: {e}", cache_dir.display()))?;
    collect_replaced(cache_dir);
    static SWEPT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut swept = SWEPT.lock().unwrap_or_else(|p| p.into_inner());
    if !swept.iter().any(|d| d == cache_dir) {
        swept.push(cache_dir.to_path_buf());
        // This process's proof of life for its own entries, before it writes any.
        crate::owners::hold_lock(cache_dir);
        sweep(cache_dir);
    }
    Ok(())
}

/// Notes, beside `onnx`'s cache entries, the file version they are made from:
/// `<stem>.source` holds its path and fingerprint (see `collect_replaced`). The path as
/// the config names it, made absolute but its links not followed: the fingerprint counts
/// the file's name, so the target of `models/ocr-det/model.onnx ->
/// PP-OCRv6_det_small.onnx` (how `make prepare` links the OCR models) has another, and
/// every sweep took the copies for a replaced version's (remade at each load, never
/// prepacked for long). A link pointed at a new file is a new version, as it should be.
fn remember_source(onnx: &Path, cache_dir: &Path, runtime: &Path) {
    let fingerprint = model_fingerprint(onnx);
    let target = cache_dir.join(format!("{}.source", stem_of(onnx, &fingerprint, runtime)));
    if target.is_file() {
        return;
    }
    let Ok(path) = std::path::absolute(onnx) else { return };
    let Some(path) = path.to_str().filter(|p| !p.contains('\n')) else { return };
    let tmp = tmp_path(&target);
    let written = std::fs::write(&tmp, format!("{path}\n{fingerprint}\n{FORM_LINE}\n"))
        .and_then(|()| std::fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::debug!(entry = %target.display(), error = %e, "cannot note which file a cache entry is made from");
    }
}

/// Removes the entries (ORT format, mapped and prepacked copies) of every model file version
/// that was replaced: its `.source` names a file that is still there with another
/// fingerprint (size, modification time, sampled bytes), so no process can ask for these copies again
/// — every lookup hashes the file as it is now. An update of a model would otherwise leave
/// up to 4x its size on disk for good. Entries whose file is gone stay (another process
/// may see it where this one does not: a mount of its own), as do entries of other
/// runtimes and those made before sources were noted.
fn collect_replaced(cache_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(cache_dir) else { return };
    for entry in entries.flatten() {
        let source = entry.path();
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".source")) else { continue };
        let Ok(text) = std::fs::read_to_string(&source) else { continue };
        let mut lines = text.lines();
        let (Some(file), Some(fingerprint)) = (lines.next(), lines.next()) else { continue };
        let file = Path::new(file);
        // Entries of an earlier form are of no use to this version, whatever their file.
        let current_form = lines.next() == Some(FORM_LINE);
        if current_form && (!file.is_file() || model_fingerprint(file) == fingerprint) {
            continue;
        }
        let mut removed = Vec::new();
        for suffix in [".ort", ".mapped", ".prepacked"] {
            let path = cache_dir.join(format!("{stem}{suffix}"));
            let done = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else if path.is_file() {
                std::fs::remove_file(&path)
            } else {
                continue;
            };
            match done {
                Ok(()) => removed.push(suffix),
                // The source stays: the next sweep tries again (a read-only state dir
                // fails at every load: said once).
                Err(e) => {
                    if first_time(&path.to_string_lossy()) {
                        tracing::warn!(entry = %path.display(), error = %e, "cannot remove a replaced model's cache entry (said once)");
                    } else {
                        tracing::debug!(entry = %path.display(), error = %e, "cannot remove a replaced model's cache entry");
                    }
                    return;
                }
            }
        }
        let _ = std::fs::remove_file(&source);
        if current_form {
            tracing::info!(model = %file.display(), entries = ?removed, stem, "removed the cached copies of a replaced version of the model");
        } else {
            tracing::info!(model = %file.display(), entries = ?removed, stem, "removed cached copies of an earlier form (made again as needed)");
        }
    }
}

/// Whether `key` is seen for the first time in this process: a failure that repeats at
/// every load (a read-only state dir) is a warning once, then a debug line.
pub(crate) fn first_time(key: &str) -> bool {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.iter().any(|k| k == key) {
        return false;
    }
    seen.push(key.to_string());
    true
}

/// One line per cache entry made: `what` of `onnx`, now at `cache`.
fn log_made(what: &str, onnx: &Path, cache: &Path, started: std::time::Instant) {
    tracing::info!(
        model = %onnx.display(),
        cache = %cache.display(),
        duration_ms = started.elapsed().as_millis() as u64,
        "{what} (once per file version)"
    );
}

fn cache_name(onnx: &Path, runtime: &Path) -> String {
    format!("{}.ort", cache_stem(onnx, runtime))
}

/// `<stem>-<hash>`: the hash covers the files' fingerprint (size, modification time and sampled bytes
/// of the model and its external data), its path and the runtime library.
fn cache_stem(onnx: &Path, runtime: &Path) -> String {
    stem_of(onnx, &model_fingerprint(onnx), runtime)
}

/// The fingerprint of `onnx` and of every external-data file it names, so that a new
/// version of the weights alone (the `.onnx` untouched) is a new model too: its copies
/// hold the old weights. A model without external data has its file's fingerprint alone,
/// as before external data was counted, so the copies already made stay valid. Reading
/// the names walks the graph's headers in a mapping, not the weights.
pub(crate) fn model_fingerprint(onnx: &Path) -> String {
    let mut print = snooze_core::learned::fingerprint(onnx);
    let Ok(model) = ModelFile::read(onnx) else { return print };
    for data in model.external_files(onnx) {
        print.push('+');
        print.push_str(&snooze_core::learned::fingerprint(&data));
    }
    print
}

/// [`cache_stem`] of `onnx` as it was when its fingerprint was `fingerprint`. Keyed by
/// the path as configured (absolute, links not followed), as its `.source` notes it: two
/// links to one file have a copy each, so pointing one elsewhere removes only its own.
fn stem_of(onnx: &Path, fingerprint: &str, runtime: &Path) -> String {
    let mut h = DefaultHasher::new();
    FORM_LINE.hash(&mut h);
    fingerprint.hash(&mut h);
    std::path::absolute(onnx).unwrap_or_else(|_| onnx.to_path_buf()).hash(&mut h);
    runtime.hash(&mut h);
    let stem = onnx
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .unwrap_or("model")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
        .collect::<String>();
    format!("{stem}-{:016x}", h.finish())
}

#[cfg(test)]
mod tests;
