//! Reading a sentence-transformers model folder without loading its weights.
//!
//! Everything the backend needs to know before it touches a tensor comes from small
//! JSON files: the BERT hyper-parameters (`config.json`), the pipeline after the
//! encoder (`modules.json`, `1_Pooling/config.json`), the sequence limit
//! (`sentence_bert_config.json`) and which weight files to map. Reading them here,
//! once, lets `signature`, `estimate` and `load` agree on the same folder and fail
//! with a sentence that names the file at fault.

use std::{
    fs,
    path::{Path, PathBuf},
};

use candle_transformers::models::bert;
use serde::Deserialize;

/// How token vectors become one sentence vector (sentence-transformers' `Pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Average over the real (unpadded) tokens.
    Mean,
    /// The first token's vector (`[CLS]`).
    Cls,
    /// Element-wise maximum over the real tokens.
    Max,
}

/// The parsed configuration of a model folder.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    /// Where the transformer's own files live (`config.json`, `tokenizer.json`, weights).
    pub transformer_dir: PathBuf,
    pub config: bert::Config,
    pub pooling: Pooling,
    /// A `sentence_transformers.models.Normalize` module follows the pooling.
    pub normalize: bool,
    /// Longest input in tokens, special tokens included.
    pub max_seq_len: usize,
}

impl ModelLayout {
    /// Reads every configuration file of the folder at `dir`.
    pub fn read(dir: &Path) -> Result<ModelLayout, String> {
        if !dir.is_dir() {
            return Err(format!("model folder {} does not exist or is not a folder", dir.display()));
        }
        let modules_path = dir.join("modules.json");
        let (transformer_dir, pooling, normalize) = if modules_path.exists() {
            read_modules(dir, &modules_path)?
        } else {
            tracing::info!(
                dir = %dir.display(),
                "no modules.json: using mean pooling without normalization"
            );
            (dir.to_path_buf(), Pooling::Mean, false)
        };
        let config = read_bert_config(&transformer_dir.join("config.json"))?;
        let max_seq_len = read_max_seq_len(&transformer_dir, &config)?;
        Ok(ModelLayout { transformer_dir, config, pooling, normalize, max_seq_len })
    }

    pub fn tokenizer_path(&self) -> PathBuf {
        self.transformer_dir.join("tokenizer.json")
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not valid: {e}", path.display()))
}

#[derive(Deserialize)]
struct ModuleEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

/// Returns (transformer folder, pooling, normalize) from `modules.json`.
fn read_modules(dir: &Path, modules_path: &Path) -> Result<(PathBuf, Pooling, bool), String> {
    let modules: Vec<ModuleEntry> = read_json(modules_path)?;
    let mut transformer_dir = None;
    let mut pooling = None;
    let mut normalize = false;
    for m in &modules {
        // Module classes moved between packages across sentence-transformers versions;
        // the class name is what identifies the operation.
        match m.kind.rsplit('.').next().unwrap_or_default() {
            "Transformer" => transformer_dir = Some(dir.join(&m.path)),
            "Pooling" => {
                let config = dir.join(&m.path).join("config.json");
                pooling = Some(parse_pooling_config(&config)?);
            }
            "Normalize" => normalize = true,
            _ => {
                return Err(format!(
                    "{} lists a {} module, which the candle backend does not support \
                     (supported: Transformer, Pooling, Normalize)",
                    modules_path.display(),
                    m.kind
                ))
            }
        }
    }
    let transformer_dir =
        transformer_dir.ok_or_else(|| format!("{} lists no Transformer module", modules_path.display()))?;
    let pooling = pooling.ok_or_else(|| format!("{} lists no Pooling module", modules_path.display()))?;
    Ok((transformer_dir, pooling, normalize))
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PoolingConfig {
    pooling_mode_cls_token: bool,
    pooling_mode_mean_tokens: bool,
    pooling_mode_max_tokens: bool,
    pooling_mode_mean_sqrt_len_tokens: bool,
    pooling_mode_weightedmean_tokens: bool,
    pooling_mode_lasttoken: bool,
    /// The single-string form `Pooling(pooling_mode="mean")` accepts.
    pooling_mode: Option<String>,
}

/// Parses a sentence-transformers `Pooling` config; exactly one supported mode must be on.
pub fn parse_pooling_config(path: &Path) -> Result<Pooling, String> {
    let c: PoolingConfig = read_json(path)?;
    let on: Vec<&str> = if let Some(mode) = &c.pooling_mode {
        vec![mode.as_str()]
    } else {
        [
            (c.pooling_mode_cls_token, "cls"),
            (c.pooling_mode_mean_tokens, "mean"),
            (c.pooling_mode_max_tokens, "max"),
            (c.pooling_mode_mean_sqrt_len_tokens, "mean_sqrt_len_tokens"),
            (c.pooling_mode_weightedmean_tokens, "weightedmean"),
            (c.pooling_mode_lasttoken, "lasttoken"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect()
    };
    match on.as_slice() {
        ["mean"] => Ok(Pooling::Mean),
        ["cls"] => Ok(Pooling::Cls),
        ["max"] => Ok(Pooling::Max),
        [] => Err(format!("{} turns on no pooling mode", path.display())),
        [other] => Err(format!(
            "{} asks for '{other}' pooling, which the candle backend does not support \
             (supported: mean, cls, max)",
            path.display()
        )),
        several => Err(format!(
            "{} combines several pooling modes ({}), which the candle backend does not support",
            path.display(),
            several.join(" + ")
        )),
    }
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
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

/// `sentence_bert_config.json`'s `max_seq_length`, capped by the position table.
fn read_max_seq_len(transformer_dir: &Path, config: &bert::Config) -> Result<usize, String> {
    let path = transformer_dir.join("sentence_bert_config.json");
    let wanted = if path.exists() { read_json::<SentenceBertConfig>(&path)?.max_seq_length } else { None };
    let limit = config.max_position_embeddings;
    match wanted {
        Some(0) => Err(format!("{}: max_seq_length must be positive", path.display())),
        Some(n) => Ok(n.min(limit)),
        None => Ok(limit),
    }
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

    const BERT_CONFIG: &str = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "max_position_embeddings": 64,
        "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}"#;

    fn pooling(json: &str) -> Result<Pooling, String> {
        let s = Scratch::new(&format!("pool{}", json.len()));
        parse_pooling_config(&s.write("config.json", json))
    }

    #[test]
    fn pooling_modes_parse() {
        assert_eq!(pooling(r#"{"pooling_mode_mean_tokens": true}"#), Ok(Pooling::Mean));
        assert_eq!(
            pooling(r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#),
            Ok(Pooling::Cls)
        );
        assert_eq!(
            pooling(r#"{"pooling_mode_max_tokens": true, "word_embedding_dimension": 8}"#),
            Ok(Pooling::Max)
        );
        assert_eq!(pooling(r#"{"pooling_mode": "cls"}"#), Ok(Pooling::Cls));
    }

    #[test]
    fn unsupported_pooling_is_refused_with_the_file_name() {
        let none = pooling(r#"{"pooling_mode_mean_tokens": false}"#).unwrap_err();
        assert!(none.contains("config.json") && none.contains("no pooling"), "{none}");
        let sqrt = pooling(r#"{"pooling_mode_mean_sqrt_len_tokens": true}"#).unwrap_err();
        assert!(sqrt.contains("mean_sqrt_len_tokens"), "{sqrt}");
        let both =
            pooling(r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#).unwrap_err();
        assert!(both.contains("cls + mean"), "{both}");
        let broken = pooling("{not json").unwrap_err();
        assert!(broken.contains("config.json is not valid"), "{broken}");
    }

    fn st_folder(tag: &str, modules: &str, pooling: &str) -> Scratch {
        let s = Scratch::new(tag);
        s.write("config.json", BERT_CONFIG);
        s.write("modules.json", modules);
        s.write("1_Pooling/config.json", pooling);
        s
    }

    const MODULES: &str = r#"[
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn modules_decide_pooling_and_normalize() {
        let s = st_folder("mods", MODULES, r#"{"pooling_mode_cls_token": true}"#);
        s.write("sentence_bert_config.json", r#"{"max_seq_length": 32}"#);
        let l = ModelLayout::read(&s.0).unwrap();
        // The 2_Normalize folder does not exist: the module entry alone means normalize.
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Cls, true, 32));

        let without_norm = r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#;
        let s = st_folder("mods2", without_norm, r#"{"pooling_mode": "max"}"#);
        s.write("sentence_bert_config.json", r#"{"max_seq_length": 1000}"#);
        let l = ModelLayout::read(&s.0).unwrap();
        // The position table caps the sequence length.
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Max, false, 64));
    }

    #[test]
    fn no_modules_json_means_mean_pooling_unnormalized() {
        let s = Scratch::new("nomods");
        s.write("config.json", BERT_CONFIG);
        let l = ModelLayout::read(&s.0).unwrap();
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Mean, false, 64));
    }

    #[test]
    fn bad_folders_name_the_file() {
        let dense = MODULES.replace("models.Normalize", "models.Dense");
        let s = st_folder("dense", &dense, r#"{"pooling_mode_mean_tokens": true}"#);
        let e = ModelLayout::read(&s.0).unwrap_err();
        assert!(e.contains("modules.json") && e.contains("Dense"), "{e}");

        let s = st_folder("roberta", MODULES, r#"{"pooling_mode_mean_tokens": true}"#);
        s.write("config.json", &BERT_CONFIG.replace("\"bert\"", "\"roberta\""));
        let e = ModelLayout::read(&s.0).unwrap_err();
        assert!(e.contains("config.json") && e.contains("roberta"), "{e}");

        let s = Scratch::new("noconfig");
        s.write("modules.json", MODULES);
        let e = ModelLayout::read(&s.0).unwrap_err();
        assert!(e.contains("1_Pooling/config.json"), "{e}");
        s.write("1_Pooling/config.json", r#"{"pooling_mode_mean_tokens": true}"#);
        let e = ModelLayout::read(&s.0).unwrap_err();
        assert!(e.contains("cannot read") && e.contains("config.json"), "{e}");

        let e = ModelLayout::read(Path::new("/nonexistent/model")).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
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
