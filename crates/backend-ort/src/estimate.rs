//! What a model will cost in RAM, from its files alone.
//!
//! The admission guard needs a figure *before* the load, so it is derived from the
//! bytes on disk: the `.onnx` file plus every external-data file it names, times a
//! factor, plus a floor. The factors come from measuring ONNX Runtime 1.32 on the
//! CPU provider, RSS over an already warm runtime (`cargo test -p
//! snooze-backend-ort --test footprint -- --ignored --nocapture` re-measures):
//!
//! | model (file bytes)         | steady RSS   | load peak   |
//! |----------------------------|--------------|-------------|
//! | mlp-10m (10.0 MiB)         | 9-24 MiB     | 9-24 MiB    |
//! | mlp-100m (100.2 MiB)       | 89-104 MiB   | 145-154 MiB |
//! | mlp-400m (400.8 MiB ext.)  | 400-402 MiB  | 600 MiB     |
//!
//! Weights end up resident once; while the session is created about half of them
//! again is in flight. Small models scatter by glibc heap state, which the floor
//! absorbs. Activations of large batches come on top (they live in the session's
//! arena) and are what the learned footprint is for.

use std::path::Path;

use snooze_core::{FootprintEstimate, Weights};

use crate::{onnx_file::ModelFile, resolve_model_file};

/// Resident bytes once loaded, per byte of model files, in thousandths.
pub const STEADY_PER_MILLE: u64 = 1_050;
/// Bytes at the worst moment of the load, per byte of model files, in thousandths.
pub const PEAK_PER_MILLE: u64 = 1_550;
/// Per-session fixed cost and heap scatter (small models measured up to 14 MiB above their weights).
pub const FLOOR_BYTES: u64 = 20 << 20;
/// `compact` / `mapped`: one copy (private or mapped) of the ORT-format file, about the
/// size of the weights.
pub const LEAN_STEADY_PER_MILLE: u64 = 1_020;
pub const LEAN_PEAK_PER_MILLE: u64 = 1_100;

/// The one-time conversion to the ORT format (a session without prepacking that
/// serialises the model again) or to a prepacked copy, per byte of model files:
/// measured 2.6x (+259 MiB) for the 100 MiB MLP from its `.onnx`.
pub const CONVERSION_PEAK_PER_MILLE: u64 = 2_700;
/// The same from weights the runtime maps (the mapped copy, or external data): measured
/// 1.6x (+160 MiB, the mapped weights included) for the 100 MiB MLP, 1.5x for the
/// 400 MiB one with external data.
pub const MAPPED_CONVERSION_PEAK_PER_MILLE: u64 = 1_700;

/// The peak of the one-time conversion of the model at `path` (ORT format or prepacked
/// copy), from its files; `mapped`: converted from its mapped copy.
pub(crate) fn conversion_peak(path: &Path, mapped: bool) -> Option<u64> {
    let (_, model, external) = file_bytes(path).ok()?;
    let per_mille =
        if mapped || external > 0 { MAPPED_CONVERSION_PEAK_PER_MILLE } else { CONVERSION_PEAK_PER_MILLE };
    Some(scale(model.saturating_add(external), per_mille).saturating_add(FLOOR_BYTES))
}

/// The peak of converting a graph of `bytes` from the `.onnx`.
pub fn conversion_peak_of(bytes: u64) -> u64 {
    scale(bytes, CONVERSION_PEAK_PER_MILLE).saturating_add(FLOOR_BYTES)
}

/// An embedding model also holds its tokenizer's tables (about 4x `tokenizer.json`)
/// and one micro-batch pass's activations in the runtime's arena.
pub(crate) fn add_embedding(e: &mut FootprintEstimate, path: &Path) {
    let Ok(layout) = snooze_text::SentenceLayout::read(path) else { return };
    let tokenizer = std::fs::metadata(layout.tokenizer_path()).map_or(0, |m| m.len()).saturating_mul(4);
    let working = crate::embed::working_bytes(layout.encoder.hidden_size);
    let extra = tokenizer.saturating_add(working);
    e.steady_bytes = e.steady_bytes.map(|b| b.saturating_add(extra));
    e.peak_bytes = e.peak_bytes.map(|b| b.saturating_add(extra));
    e.derivation += &format!(
        "; tokenizer {} and one pass of {} tokens {}",
        mib(tokenizer),
        crate::embed::TOKENS_PER_PASS,
        mib(working)
    );
}

pub(crate) fn estimate(path: &Path, weights: Weights) -> FootprintEstimate {
    let (steady_per_mille, peak_per_mille) = match weights {
        Weights::Compact | Weights::Mapped => (LEAN_STEADY_PER_MILLE, LEAN_PEAK_PER_MILLE),
        Weights::Prepacked | Weights::Auto => (STEADY_PER_MILLE, PEAK_PER_MILLE),
    };
    match file_bytes(path) {
        Ok((name, model, external)) => {
            let total = model.saturating_add(external);
            let steady = scale(total, steady_per_mille).saturating_add(FLOOR_BYTES);
            let peak = scale(total, peak_per_mille).saturating_add(FLOOR_BYTES);
            FootprintEstimate {
                steady_bytes: Some(steady),
                peak_bytes: Some(peak),
                derivation: format!(
                    "{name} {} + external data {} = {}; weights = {}: steady = {}x + {}; peak = {}x + {} \
                     (factors measured on ONNX Runtime 1.32, CPU)",
                    mib(model),
                    mib(external),
                    mib(total),
                    weights.as_str(),
                    ratio(steady_per_mille),
                    mib(FLOOR_BYTES),
                    ratio(peak_per_mille),
                    mib(FLOOR_BYTES),
                ),
            }
        }
        Err(why) => FootprintEstimate::indeterminate(why),
    }
}

/// The model file's name, its size and that of its external-data files (each counted once).
fn file_bytes(path: &Path) -> Result<(String, u64, u64), String> {
    let file = resolve_model_file(path)?;
    let model = std::fs::metadata(&file).map_err(|e| format!("cannot size {}: {e}", file.display()))?.len();
    let parsed = ModelFile::read(&file)
        .map_err(|e| format!("cannot read {} as an ONNX model: {e}", file.display()))?;
    let mut external = 0u64;
    for (data, location) in parsed.external_files(&file).zip(&parsed.external_locations) {
        let len = std::fs::metadata(&data)
            .map_err(|e| format!("cannot size external data '{location}' named by {}: {e}", file.display()))?
            .len();
        external = external.saturating_add(len);
    }
    let name = file.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    Ok((name, model, external))
}

fn scale(bytes: u64, per_mille: u64) -> u64 {
    u64::try_from(u128::from(bytes) * u128::from(per_mille) / 1000).unwrap_or(u64::MAX)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn ratio(per_mille: u64) -> String {
    format!("{:.2}", per_mille as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn scaling_is_exact_and_saturates() {
        assert_eq!(scale(1000, 1_050), 1050);
        assert_eq!(scale(u64::MAX, 2_000), u64::MAX);
        assert_eq!(mib(3 << 20), "3.0 MiB");
        assert_eq!(ratio(1_050), "1.05");
    }

    #[test]
    fn unreadable_paths_are_indeterminate() {
        let e = estimate(Path::new("/nonexistent/model.onnx"), Weights::Prepacked);
        assert_eq!(e.steady_bytes, None);
        assert!(e.derivation.contains("/nonexistent"), "{}", e.derivation);
    }
}
