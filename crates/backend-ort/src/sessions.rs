//! Sessions for a model file in the form its `weights` setting asks for: the cached
//! prepacked copy, the cached ORT-format file (in memory or mapped), the mapped copy or
//! the `.onnx` itself. A cached copy the runtime refuses (cut short by a full disk,
//! damaged on a shared volume) is never the model's end: it is removed, the `.onnx`
//! loads instead, and the copy is made again later (at the next start or by
//! `snooze prepare`).

use std::path::{Path, PathBuf};

use snooze_core::{LoadError, LoadSpec, Weights};

use crate::{
    errors, external,
    model::{serving_builder, Runner},
    weights::{self, ModelBytes},
    OrtBackend,
};

impl OrtBackend {
    /// What an unconverted `compact` or `mapped` model loads: its mapped copy, made now if
    /// need be, with the bytes of its data file; else the `.onnx`.
    fn interim_source(&self, name: &str, file: &Path) -> (PathBuf, u64) {
        let Some(dir) = self.cache_dir.as_deref() else { return (file.to_path_buf(), 0) };
        match weights::mapped_copy(file, dir, &self.library) {
            Ok(Some(copy)) => {
                let data = copy.with_file_name(external::DATA_FILE);
                (copy, std::fs::metadata(data).map_or(0, |m| m.len()))
            }
            Ok(None) => (file.to_path_buf(), 0),
            Err(e) => {
                if weights::first_time(&format!("no mapped copy: {}", file.display())) {
                    tracing::warn!(model = %name, error = %e, "loading the .onnx: no mapped copy (said once)");
                } else {
                    tracing::debug!(model = %name, error = %e, "loading the .onnx: no mapped copy");
                }
                (file.to_path_buf(), 0)
            }
        }
    }

    /// Creates `n` sessions for `file` held as `weights`; with them, what in-place sessions
    /// borrow and the bytes of data files the runtime maps.
    pub(crate) fn sessions(
        &self,
        spec: &LoadSpec,
        file: &Path,
    ) -> Result<(Vec<Runner>, Option<ModelBytes>, u64), LoadError> {
        let failed = |e: &str| errors::load_error(&spec.name, file, e);
        let n = spec.instances.max(1);
        // Threads come from the environment's global pool (see `ThreadPool`), or a
        // low-priority pool of the session's own (see `threads`).
        let builder = |prepack: bool| serving_builder(self, spec, prepack).map_err(|e| failed(&e));
        // An error names the file that failed: a cached copy, or the `.onnx`.
        let from_file = |from: &Path, prepack: bool| {
            (0..n)
                .map(|_| {
                    builder(prepack)?
                        .commit_from_file(from)
                        .map(Runner::Own)
                        .map_err(|e| errors::load_error(&spec.name, from, e.message()))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let dir = self.cache_dir.as_deref();
        match spec.weights {
            Weights::Prepacked | Weights::Auto => {
                // The saved prepacked copy (mapped by the runtime), else the `.onnx` as
                // ONNX Runtime loads it by default.
                let cache = dir.map(|d| (d, self.library.as_path()));
                prepacked_or_onnx(spec, file, cache, |from| from_file(from, true)).map(|made| (made, None, 0))
            }
            Weights::Compact | Weights::Mapped => {
                if let Some(ort_file) = self.cached_ort_format(file) {
                    match self.in_place(spec, &ort_file, n) {
                        Ok(made) => return Ok(made),
                        Err(LoadError::Failed(e)) => {
                            refused(spec, &ort_file, &e);
                            let _ = std::fs::remove_file(&ort_file);
                        }
                        Err(e) => return Err(e),
                    }
                }
                // Not converted yet (a background preparation will): the mapped copy,
                // made now if need be, else the .onnx. Without prepacking, as the
                // converted form runs: the load is the part a waiting request sees. On
                // the 100 MiB MLP: the .onnx loads in 145-171 ms with 100 MiB of private
                // memory (227-413 ms prepacked); the mapped copy is made in ~40 ms and
                // loads in ~4 ms with none, its weights page cache.
                let (source, mapped) = self.interim_source(&spec.name, file);
                tracing::debug!(model = %spec.name, weights = spec.weights.as_str(), source = %source.display(), "not converted yet");
                match from_file(&source, false) {
                    Ok(made) => Ok((made, None, mapped)),
                    // The runtime refused the copy (it takes whatever it takes from
                    // the .onnx): the .onnx, whose error is the one to report.
                    Err(LoadError::Failed(e)) if source != file => {
                        refused(spec, &source, &e);
                        if let Some(dir) = dir {
                            weights::discard_mapped_copy(file, dir, &self.library);
                        }
                        Ok((from_file(file, false)?, None, 0))
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// `n` sessions reading the ORT-format file in place (held in memory, or mapped for
    /// `mapped`), with the bytes they borrow.
    fn in_place(
        &self,
        spec: &LoadSpec,
        ort_file: &Path,
        n: usize,
    ) -> Result<(Vec<Runner>, Option<ModelBytes>, u64), LoadError> {
        let failed = |e: &str| errors::load_error(&spec.name, ort_file, e);
        let bytes = if spec.weights == Weights::Mapped {
            ModelBytes::map(ort_file)
        } else {
            ModelBytes::read(ort_file)
        }
        .map_err(|e| LoadError::Failed(format!("model '{}': {e}", spec.name)))?;
        // SAFETY: the slice points into `bytes` (heap or mapping: it does not move
        // when `bytes` does); the model returned keeps `bytes` until every session
        // made from it is dropped.
        let slice: &'static [u8] = unsafe { std::mem::transmute::<&[u8], &'static [u8]>(bytes.as_slice()) };
        // The zero-copy keys are set once on a builder used for one session:
        // `commit_from_memory_directly` resets them after its commit, which ONNX
        // Runtime reports as two warnings on every load.
        let sessions = (0..n)
            .map(|_| {
                let mut b = serving_builder(self, spec, false).map_err(|e| failed(&e))?;
                for key in
                    ["session.use_ort_model_bytes_directly", "session.use_ort_model_bytes_for_initializers"]
                {
                    b = b.with_config_entry(key, "1").map_err(|e| failed(e.message()))?;
                }
                b.commit_from_memory(slice).map(Runner::InPlace).map_err(|e| failed(e.message()))
            })
            .collect::<Result<_, _>>()?;
        Ok((sessions, Some(bytes), 0))
    }
}

/// `make` from `onnx`'s saved prepacked copy in the cache (folder, runtime library) when
/// there is one, else from the `.onnx`; a copy the runtime refuses is removed and the
/// `.onnx` loads.
pub(crate) fn prepacked_or_onnx<T>(
    spec: &LoadSpec,
    onnx: &Path,
    cache: Option<(&Path, &Path)>,
    make: impl Fn(&Path) -> Result<T, LoadError>,
) -> Result<T, LoadError> {
    let Some((dir, library)) = cache else { return make(onnx) };
    let Some(copy) = weights::cached_prepacked_file(onnx, dir, library) else { return make(onnx) };
    match make(&copy) {
        Err(LoadError::Failed(e)) => {
            refused(spec, &copy, &e);
            weights::discard_prepacked_copy(onnx, dir, library);
            make(onnx)
        }
        made => made,
    }
}

/// Logs a cached copy the runtime would not load (it is removed and the `.onnx` loads).
fn refused(spec: &LoadSpec, copy: &Path, error: &str) {
    tracing::warn!(
        model = %spec.name,
        copy = %copy.display(),
        error = %error,
        "a cached copy did not load: removed; loading the .onnx (the copy is made again at the next start or by `snooze prepare`)"
    );
}
