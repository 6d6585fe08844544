//! Whisper on ONNX Runtime: the two graphs `scripts/export_whisper.py` writes
//! (`encoder.onnx`, `decoder.onnx`, described by `whisper.json`) behind
//! `snooze_speech::whisper::WhisperEngine`.
//!
//! Inputs are lent to the runtime as views of the caller's buffers — the decoding loop
//! passes its KV-cache store's rows — so a decoder step copies no cache on the way in;
//! outputs are copied out (they die with the run). The `ort` crate's `Session::run`
//! takes `&mut self`, so each graph's session sits behind a mutex: the scheduler runs
//! one slice of a model at a time anyway, and a slice's runs are sequential.

use std::{
    path::Path,
    sync::{Arc, Mutex, PoisonError},
};

use ort::{
    environment::Environment,
    session::{Session, SessionInputValue, SessionOutputs},
    value::TensorRef,
};
use snooze_core::{FootprintEstimate, InferError, LoadError, LoadSpec, LoadedModel, ModelSignature, Weights};
use snooze_speech::whisper::{
    is_whisper_folder, CrossKv, DecoderInput, DecoderOutput, WhisperConfig, WhisperEngine, WhisperModel,
};

use crate::{errors, estimate, model::serving_builder, weights, OrtBackend};

/// The KServe platform name of a Whisper model served by this backend.
pub const PLATFORM: &str = "onnxruntime_whisper";

/// Whether `path` is a Whisper folder this backend serves.
pub(crate) fn is_whisper(path: &Path) -> bool {
    is_whisper_folder(path)
}

pub(crate) fn signature(path: &Path) -> Result<ModelSignature, LoadError> {
    WhisperConfig::read(path).map_err(LoadError::Failed)?;
    Ok(snooze_speech::whisper::signature(PLATFORM))
}

/// Resident bytes once loaded and run: both graphs' files by the backend's factors
/// (their weights are held once: prepacked forms replace the originals, and the token
/// lookup has its own float16 table in the file), the tokenizer's tables, and the
/// encoder's attention for one window, which a model loaded for a request runs at once
/// (the decoder's caches of a few sequences are smaller, and come after the encoder's
/// arena is handed back). The peak is the larger of the load's (the graphs optimised in
/// flight, before any run) and that. The working set of many concurrent sequences is
/// the loaded model's to declare: the scheduler holds it run by run, as far as the
/// budget can ever give it. Counted here as well (eight full-length sequences' caches,
/// on top of the load's peak), whisper-base's estimate was 1.0 GiB against ~450-550 MiB
/// measured, and a 900 MiB budget refused it as a model that could never fit.
/// Measured on tiny.en: 203 MiB resident after load for 182 MiB of files, 298-340 MiB
/// at the first run's peak (estimate 322 MiB); base: 449-553 MiB (estimate 536).
pub(crate) fn estimate(path: &Path, weights: Weights) -> FootprintEstimate {
    let config = match WhisperConfig::read(path) {
        Ok(c) => c,
        Err(e) => return FootprintEstimate::indeterminate(e),
    };
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len());
    let (Ok(encoder), Ok(decoder)) = (size(&config.encoder_path(path)), size(&config.decoder_path(path)))
    else {
        return FootprintEstimate::indeterminate(format!(
            "{} lacks {} or {}: run `make prepare`",
            path.display(),
            config.encoder,
            config.decoder
        ));
    };
    // Whisper's sessions are always prepacked (see `load`), whatever `weights` says.
    let _ = weights;
    let files = encoder + decoder;
    let scale =
        |per_mille: u64| u64::try_from(u128::from(files) * u128::from(per_mille) / 1000).unwrap_or(u64::MAX);
    let mut e = FootprintEstimate {
        steady_bytes: Some(scale(estimate::STEADY_PER_MILLE).saturating_add(estimate::FLOOR_BYTES)),
        peak_bytes: Some(scale(estimate::PEAK_PER_MILLE).saturating_add(estimate::FLOOR_BYTES)),
        derivation: format!(
            "{} + {} = {:.1} MiB; steady {:.2}x, peak {:.2}x + {:.1} MiB (prepacked)",
            config.encoder,
            config.decoder,
            files as f64 / 1048576.0,
            estimate::STEADY_PER_MILLE as f64 / 1000.0,
            estimate::PEAK_PER_MILLE as f64 / 1000.0,
            estimate::FLOOR_BYTES as f64 / 1048576.0
        ),
    };
    let tokenizer = size(&path.join("tokenizer.json")).unwrap_or(0).saturating_mul(4);
    let window = snooze_speech::whisper::encoder_run_bytes(&config);
    e.steady_bytes = e.steady_bytes.map(|b| b.saturating_add(tokenizer + window));
    e.peak_bytes = e.peak_bytes.map(|b| b.saturating_add(tokenizer)).max(e.steady_bytes);
    e.derivation += &format!(
        "; tokenizer {:.1} MiB; steady with one encoder window's attention {:.1} MiB, the peak the larger \
         of the load's and that (concurrent sequences' caches are held run by run)",
        tokenizer as f64 / 1048576.0,
        window as f64 / 1048576.0
    );
    e
}

/// The prepacked copies of both graphs (`weights.rs`) that do not exist yet, as the peak
/// their conversion holds.
pub(crate) fn preparation(path: &Path, cache_dir: &Path, library: &Path) -> Option<u64> {
    let config = WhisperConfig::read(path).ok()?;
    let missing: u64 = [config.encoder_path(path), config.decoder_path(path)]
        .iter()
        .filter(|f| weights::cached_prepacked_file(f, cache_dir, library).is_none())
        .filter_map(|f| std::fs::metadata(f).ok().map(|m| m.len()))
        .max()?;
    // One graph at a time: the larger one's conversion is the peak.
    Some(estimate::conversion_peak_of(missing))
}

/// Saves the prepacked copies of both graphs: a load then maps them instead of
/// optimising and prepacking both graphs again (measured on tiny.en: ~650 ms a load from
/// the `.onnx` files in a busy mix), and their weights are page cache, not private memory.
pub(crate) fn prepare(
    env: &Environment,
    spec: &LoadSpec,
    cache_dir: &Path,
    library: &Path,
) -> Result<(), LoadError> {
    let config = WhisperConfig::read(&spec.path).map_err(LoadError::Failed)?;
    for file in [config.encoder_path(&spec.path), config.decoder_path(&spec.path)] {
        weights::prepacked_file(env, &file, cache_dir, library)
            .map_err(|e| LoadError::Failed(format!("model '{}': {e}", spec.name)))?;
    }
    Ok(())
}

/// Loads a Whisper folder: both sessions (the crate's defaults: full graph
/// optimisation, prepacked weights, the environment's thread pool or, for a model of low
/// CPU priority, a low-priority one of their own) — from their saved
/// prepacked copies in `cache` (directory, runtime library) when they exist — then the
/// model.
pub(crate) fn load(backend: &OrtBackend, spec: &LoadSpec) -> Result<Arc<dyn LoadedModel>, LoadError> {
    let cache = backend.cache_dir.as_deref().map(|dir| (dir, backend.library.as_path()));
    let config = WhisperConfig::read(&spec.path).map_err(LoadError::Failed)?;
    let session = |file: &Path| {
        let failed = |e: &str| errors::load_error(&spec.name, file, e);
        if !file.is_file() {
            return Err(LoadError::Failed(format!(
                "cannot load model '{}': {} is missing (run `make prepare`)",
                spec.name,
                file.display()
            )));
        }
        let from = |source: &Path| {
            serving_builder(backend, spec, true)
                .map_err(|e| failed(&e))?
                .commit_from_file(source)
                .map_err(|e| failed(e.message()))
        };
        crate::sessions::prepacked_or_onnx(spec, file, cache, from)
    };
    let encoder = session(&config.encoder_path(&spec.path))?;
    let decoder = session(&config.decoder_path(&spec.path))?;
    let engine = OrtWhisper::new(&spec.name, &config, encoder, decoder, backend.release_activations);
    let model = WhisperModel::new(&spec.name, &spec.path, Box::new(engine), PLATFORM)
        .map_err(|e| LoadError::Failed(format!("cannot load model '{}': {e}", spec.name)))?;
    // Session creation reads and parses both files into buffers freed by now; glibc keeps
    // them mapped unless asked (measured: 30-70 MiB on tiny.en and base).
    snooze_core::memory::trim_heap();
    tracing::info!(
        model = %spec.name,
        layers = config.decoder_layers,
        width = config.d_model,
        multilingual = config.multilingual,
        "whisper loaded"
    );
    Ok(Arc::new(model))
}

pub(crate) struct OrtWhisper {
    name: String,
    n_mels: usize,
    layers: usize,
    heads: usize,
    head_dim: usize,
    encoder: Mutex<Session>,
    decoder: Mutex<Session>,
    /// Per layer: `cross_k_{i}`, `cross_v_{i}`; `past_k_{i}`...; `new_k_{i}`...
    names: Vec<[String; 6]>,
    /// An encoder run hands its activations (two `heads x 1500 x 1500` attention
    /// tensors per window) back when it ends; a decoder step's are small and kept.
    release: bool,
}

impl OrtWhisper {
    fn new(
        name: &str,
        config: &WhisperConfig,
        encoder: Session,
        decoder: Session,
        release: bool,
    ) -> OrtWhisper {
        let names = (0..config.decoder_layers)
            .map(|i| {
                ["cross_k", "cross_v", "past_k", "past_v", "new_k", "new_v"]
                    .map(|prefix| format!("{prefix}_{i}"))
            })
            .collect();
        OrtWhisper {
            name: name.to_owned(),
            n_mels: config.n_mels,
            layers: config.decoder_layers,
            heads: config.n_heads,
            head_dim: config.head_dim,
            encoder: Mutex::new(encoder),
            decoder: Mutex::new(decoder),
            names,
            release,
        }
    }

    /// `[batch, heads, positions, head_dim]` of a cache slice of `len` values.
    fn kv_shape(&self, batch: usize, len: usize) -> Vec<i64> {
        let positions = len / (batch * self.heads * self.head_dim).max(1);
        vec![dim(batch), dim(self.heads), dim(positions), dim(self.head_dim)]
    }

    fn failed(&self, e: &ort::Error) -> InferError {
        // Its inputs are this server's, not a request's: a shape error is a failure.
        errors::infer_error(&self.name, e.code(), e.message(), false)
    }

    fn output(&self, outputs: &SessionOutputs<'_>, name: &str) -> Result<Vec<f32>, InferError> {
        let value = outputs.get(name).ok_or_else(|| {
            InferError::Failed(format!("model '{}' returned no output '{name}'", self.name))
        })?;
        let (_, data) = value.try_extract_tensor::<f32>().map_err(|e| self.failed(&e))?;
        Ok(data.to_vec())
    }
}

fn view<'a, T>(shape: Vec<i64>, data: &'a [T]) -> ort::Result<SessionInputValue<'a>>
where
    T: ort::value::PrimitiveTensorElementType + std::fmt::Debug + Clone + 'static,
{
    Ok(TensorRef::from_array_view((shape, data))?.into())
}

fn dim(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl WhisperEngine for OrtWhisper {
    fn encode(&self, mel: &[f32], batch: usize, frames: usize) -> Result<CrossKv, InferError> {
        if mel.len() != batch * self.n_mels * frames {
            return Err(InferError::Failed(format!(
                "a mel of {} values is not {batch} x {} x {frames}",
                mel.len(),
                self.n_mels
            )));
        }
        let input =
            view(vec![dim(batch), dim(self.n_mels), dim(frames)], mel).map_err(|e| self.failed(&e))?;
        let mut session = self.encoder.lock().unwrap_or_else(PoisonError::into_inner);
        let options = crate::model::run_options(self.release).map_err(|e| self.failed(&e))?;
        let outputs = session
            .run_with_options(vec![("mel".to_owned(), input)], &options)
            .map_err(|e| self.failed(&e))?;
        let mut cross = CrossKv::default();
        for names in &self.names {
            cross.keys.push(self.output(&outputs, &names[0])?);
            cross.values.push(self.output(&outputs, &names[1])?);
        }
        Ok(cross)
    }

    fn decode(&self, input: &DecoderInput<'_>) -> Result<DecoderOutput, InferError> {
        let (b, n, p, m) = (dim(input.batch), dim(input.n_new), dim(input.n_past), dim(input.n_logits));
        let expected = input.batch * self.heads * self.head_dim;
        if input.past_keys.iter().chain(input.past_values).any(|s| s.len() != expected * input.n_past)
            || input
                .cross_keys
                .iter()
                .chain(input.cross_values)
                .any(|s| expected == 0 || s.len() % expected != 0)
        {
            return Err(InferError::Failed("a decoder step's caches do not match its batch".into()));
        }
        let layer_slices = [
            input.cross_keys.len(),
            input.cross_values.len(),
            input.past_keys.len(),
            input.past_values.len(),
        ];
        if layer_slices.iter().any(|&l| l != self.layers) {
            return Err(InferError::Failed(format!("a decoder step needs {} layers of caches", self.layers)));
        }
        let feeds = || -> ort::Result<Vec<(String, SessionInputValue<'_>)>> {
            let mut feeds = vec![
                ("tokens".to_owned(), view(vec![b, n], input.tokens)?),
                ("positions".to_owned(), view(vec![b, n], input.positions)?),
                ("attention_mask".to_owned(), view(vec![b, n, p + n], input.attention_mask)?),
                ("logit_positions".to_owned(), view(vec![b, m], input.logit_positions)?),
            ];
            for (i, names) in self.names.iter().enumerate() {
                let slices =
                    [input.cross_keys[i], input.cross_values[i], input.past_keys[i], input.past_values[i]];
                for (name, slice) in names[..4].iter().zip(slices) {
                    feeds.push((name.clone(), view(self.kv_shape(input.batch, slice.len()), slice)?));
                }
            }
            Ok(feeds)
        };
        let feeds = feeds().map_err(|e| self.failed(&e))?;
        let mut session = self.decoder.lock().unwrap_or_else(PoisonError::into_inner);
        let outputs = session.run(feeds).map_err(|e| self.failed(&e))?;
        let mut out = DecoderOutput { logits: self.output(&outputs, "logits")?, ..DecoderOutput::default() };
        for names in &self.names {
            out.new_keys.push(self.output(&outputs, &names[4])?);
            out.new_values.push(self.output(&outputs, &names[5])?);
        }
        Ok(out)
    }
}
