//! Reading a sentence-transformers model folder for Candle, without loading its weights.
//!
//! The pipeline around the encoder (pooling, normalization, sequence limit, tokenizer)
//! is read by `snooze_text`; this adds what Candle's BERT needs: the full BERT config
//! and which safetensors files to map. Reading them once lets `signature`, `estimate`
//! and `load` agree on the same folder and fail with a sentence naming the file at fault.

use std::{
    fs,
    path::{Path, PathBuf},
};

use candle_transformers::models::bert;
use serde::Deserialize;
use snooze_text::SentenceLayout;

/// The parsed configuration of a model folder.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    pub sentence: SentenceLayout,
    pub config: bert::Config,
}

impl ModelLayout {
    /// Reads every configuration file of the folder at `dir`.
    pub fn read(dir: &Path) -> Result<ModelLayout, String> {
        let sentence = SentenceLayout::read(dir)?;
        let config = read_bert_config(&sentence.config_path())?;
        Ok(ModelLayout { sentence, config })
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not valid: {e}", path.display()))
}

fn read_bert_config(path: &Path) -> Result<bert::Config, String> {
    let value: serde_json::Value = read_json(path)?;
    // Other encoders (RoBERTa, DistilBERT...) would parse or half-parse as BERT and
    // then compute wrong vectors; refuse them by name instead.
    match value.get("model_type").and_then(|t| t.as_str()) {
        Some("bert") | None => {}
        Some(other) => {
            return Err(format!(
                "{} declares model_type '{other}'; the candle backend runs BERT models only",
                path.display()
            ))
        }
    }
    let config: bert::Config =
        serde_json::from_value(value).map_err(|e| format!("{} is not a BERT config: {e}", path.display()))?;
    if config.hidden_size == 0
        || config.num_attention_heads == 0
        || !config.hidden_size.is_multiple_of(config.num_attention_heads)
    {
        return Err(format!(
            "{}: hidden_size {} is not a positive multiple of num_attention_heads {}",
            path.display(),
            config.hidden_size,
            config.num_attention_heads
        ));
    }
    Ok(config)
}

#[derive(Deserialize)]
struct SafetensorsIndex {
    weight_map: std::collections::BTreeMap<String, String>,
}

const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files to map: the shards an index lists, else the folder's one
/// `.safetensors` file. Several candidates and no index to choose is an error, not a
/// guess: loading the wrong file would serve wrong vectors.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.exists() {
        let index: SafetensorsIndex = read_json(&index_path)?;
        let mut files: Vec<PathBuf> = index.weight_map.values().map(|f| dir.join(f)).collect();
        files.sort();
        files.dedup();
        if files.is_empty() {
            return Err(format!("{} lists no weight files", index_path.display()));
        }
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(format!("{} lists {}, which is missing", index_path.display(), missing.display()));
        }
        return Ok(files);
    }
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut safetensors = Vec::new();
    let mut others = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => safetensors.push(path),
            Some("bin" | "pt" | "pth" | "ckpt" | "h5" | "msgpack") => others.push(path),
            _ => {}
        }
    }
    safetensors.sort();
    others.sort();
    let names = |v: &[PathBuf]| {
        v.iter().filter_map(|p| p.file_name()?.to_str().map(str::to_owned)).collect::<Vec<_>>().join(", ")
    };
    match (safetensors.len(), others.len()) {
        (1, 0) => Ok(safetensors),
        (0, 0) => Err(format!("{} holds no model.safetensors", dir.display())),
        (0, _) => Err(format!(
            "{} holds no safetensors weights (found {}); the candle backend reads safetensors only",
            dir.display(),
            names(&others)
        )),
        _ => Err(format!(
            "{} holds several candidate weight files ({}) and no {INDEX_FILE} to choose among them; \
             keep only the safetensors weights to serve",
            dir.display(),
            names(&[safetensors, others].concat())
        )),
    }
}

/// Bytes the tensors of a safetensors file take once converted to f32, from its header.
pub fn f32_bytes(path: &Path) -> Result<u64, String> {
    use std::io::Read;
    let bad = |why: &str| format!("{} is not a safetensors file: {why}", path.display());
    let mut file = fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| bad(&e.to_string()))?;
    let len = u64::from_le_bytes(len);
    // The format caps its header at 100 MB; a bigger length means a corrupt file.
    if len > 100_000_000 {
        return Err(bad("header length out of range"));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| bad(&e.to_string()))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(&e.to_string()))?;
    let mut total = 0u64;
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let shape =
            info.get("shape").and_then(|s| s.as_array()).ok_or_else(|| bad("tensor without shape"))?;
        let elements = shape.iter().try_fold(1u64, |acc, d| d.as_u64().and_then(|d| acc.checked_mul(d)));
        let elements = elements.ok_or_else(|| bad("bad tensor shape"))?;
        total = total.saturating_add(elements.saturating_mul(4));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A scratch folder removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("snooze-candle-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn write(&self, rel: &str, text: &str) -> PathBuf {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn other_encoders_are_refused_by_name() {
        let s = Scratch::new("roberta");
        s.write(
            "config.json",
            r#"{"model_type": "roberta", "vocab_size": 100, "hidden_size": 8, "num_attention_heads": 2}"#,
        );
        let e = ModelLayout::read(&s.0).unwrap_err();
        assert!(e.contains("config.json") && e.contains("roberta"), "{e}");
    }

    #[test]
    fn weight_files_choose_or_refuse() {
        let s = Scratch::new("weights");
        assert!(weight_files(&s.0).unwrap_err().contains("no model.safetensors"));
        s.write("pytorch_model.bin", "x");
        assert!(weight_files(&s.0).unwrap_err().contains("safetensors only"));
        s.write("model.safetensors", "x");
        let e = weight_files(&s.0).unwrap_err();
        assert!(e.contains("several candidate") && e.contains("pytorch_model.bin"), "{e}");
        fs::remove_file(s.0.join("pytorch_model.bin")).unwrap();
        assert_eq!(weight_files(&s.0).unwrap(), vec![s.0.join("model.safetensors")]);
        s.write("other.safetensors", "x");
        assert!(weight_files(&s.0).unwrap_err().contains("several candidate"));
        // An index is the rule that chooses.
        s.write(
            INDEX_FILE,
            r#"{"metadata": {}, "weight_map": {"a": "model-00002.safetensors", "b": "model-00001.safetensors",
                "c": "model-00001.safetensors"}}"#,
        );
        assert!(weight_files(&s.0).unwrap_err().contains("missing"));
        s.write("model-00001.safetensors", "x");
        s.write("model-00002.safetensors", "x");
        let files = weight_files(&s.0).unwrap();
        assert_eq!(files, vec![s.0.join("model-00001.safetensors"), s.0.join("model-00002.safetensors")]);
    }

    #[test]
    fn f32_bytes_reads_the_header() {
        let s = Scratch::new("header");
        let header = r#"{"__metadata__": {"format": "pt"}, "a": {"dtype": "F16", "shape": [2, 3],
            "data_offsets": [0, 12]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0u8; 28]);
        let path = s.0.join("model.safetensors");
        fs::write(&path, bytes).unwrap();
        assert_eq!(f32_bytes(&path), Ok((6 + 4) * 4));
        let junk = s.write("junk.safetensors", "garbage that is no header");
        assert!(f32_bytes(&junk).unwrap_err().contains("not a safetensors file"));
    }
}
