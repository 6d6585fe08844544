//! Reading a sentence-transformers model folder without loading its weights.
//!
//! Everything a backend needs to know before it touches a tensor comes from small
//! JSON files: the encoder's hyper-parameters (`config.json`), the pipeline after the
//! encoder (`modules.json`, `1_Pooling/config.json`) and the sequence limit
//! (`sentence_bert_config.json`). Reading them here, once, lets `task`, `signature`,
//! `estimate` and `load` of either backend agree on the same folder and fail with a
//! sentence that names the file at fault.

use std::{
    fs,
    path::{Path, PathBuf},
};

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

/// What every engine needs from the encoder's `config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderConfig {
    /// `model_type` as declared (`bert`, `xlm-roberta`, ...), if it is.
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub vocab_size: usize,
    pub pad_token_id: u32,
    pub max_position_embeddings: usize,
}

#[derive(Deserialize)]
struct RawEncoderConfig {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    num_attention_heads: Option<usize>,
    vocab_size: Option<usize>,
    pad_token_id: Option<u32>,
    max_position_embeddings: Option<usize>,
}

/// The parsed configuration of a model folder.
#[derive(Debug, Clone)]
pub struct SentenceLayout {
    /// Where the transformer's own files live (`config.json`, `tokenizer.json`, weights).
    pub transformer_dir: PathBuf,
    pub encoder: EncoderConfig,
    pub pooling: Pooling,
    /// A `sentence_transformers.models.Normalize` module follows the pooling.
    pub normalize: bool,
    /// Longest input in tokens, special tokens included.
    pub max_seq_len: usize,
}

/// Whether `dir` is a sentence-embedding model folder: sentence-transformers'
/// `modules.json`, or a tokenizer next to a pooling config.
pub fn is_sentence_model(dir: &Path) -> bool {
    dir.join("modules.json").is_file()
        || (dir.join("tokenizer.json").is_file() && dir.join("1_Pooling").join("config.json").is_file())
}

/// The ONNX export of a sentence-embedding folder: `onnx/model.onnx` (the layout
/// sentence-transformers' ONNX backend and most Hub repositories ship) or `model.onnx`.
pub fn onnx_export(dir: &Path) -> Option<PathBuf> {
    if !is_sentence_model(dir) {
        return None;
    }
    [dir.join("onnx").join("model.onnx"), dir.join("model.onnx")].into_iter().find(|f| f.is_file())
}

impl SentenceLayout {
    /// Reads every configuration file of the folder at `dir`.
    pub fn read(dir: &Path) -> Result<SentenceLayout, String> {
        if !dir.is_dir() {
            return Err(format!("model folder {} does not exist or is not a folder", dir.display()));
        }
        let modules_path = dir.join("modules.json");
        let (transformer_dir, pooling, normalize) = if modules_path.exists() {
            read_modules(dir, &modules_path)?
        } else {
            let pooling_config = dir.join("1_Pooling").join("config.json");
            if pooling_config.is_file() {
                (dir.to_path_buf(), parse_pooling_config(&pooling_config)?, false)
            } else {
                tracing::info!(
                    dir = %dir.display(),
                    "no modules.json: using mean pooling without normalization"
                );
                (dir.to_path_buf(), Pooling::Mean, false)
            }
        };
        let encoder = read_encoder_config(&transformer_dir.join("config.json"))?;
        let max_seq_len = read_max_seq_len(&transformer_dir, &encoder)?;
        Ok(SentenceLayout { transformer_dir, encoder, pooling, normalize, max_seq_len })
    }

    pub fn tokenizer_path(&self) -> PathBuf {
        self.transformer_dir.join("tokenizer.json")
    }

    pub fn config_path(&self) -> PathBuf {
        self.transformer_dir.join("config.json")
    }
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
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
                    "{} lists a {} module, which SnoozeML does not support \
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
            "{} asks for '{other}' pooling, which SnoozeML does not support (supported: mean, cls, max)",
            path.display()
        )),
        several => Err(format!(
            "{} combines several pooling modes ({}), which SnoozeML does not support",
            path.display(),
            several.join(" + ")
        )),
    }
}

fn read_encoder_config(path: &Path) -> Result<EncoderConfig, String> {
    let raw: RawEncoderConfig = read_json(path)?;
    let missing = |key: &str| format!("{} has no {key}", path.display());
    let hidden_size = raw.hidden_size.ok_or_else(|| missing("hidden_size"))?;
    let num_attention_heads = raw.num_attention_heads.ok_or_else(|| missing("num_attention_heads"))?;
    if hidden_size == 0 || num_attention_heads == 0 || !hidden_size.is_multiple_of(num_attention_heads) {
        return Err(format!(
            "{}: hidden_size {hidden_size} is not a positive multiple of num_attention_heads {num_attention_heads}",
            path.display(),
        ));
    }
    Ok(EncoderConfig {
        model_type: raw.model_type,
        hidden_size,
        num_attention_heads,
        vocab_size: raw.vocab_size.ok_or_else(|| missing("vocab_size"))?,
        pad_token_id: raw.pad_token_id.unwrap_or(0),
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(512),
    })
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

/// `sentence_bert_config.json`'s `max_seq_length`, capped by the position table.
fn read_max_seq_len(transformer_dir: &Path, config: &EncoderConfig) -> Result<usize, String> {
    let path = transformer_dir.join("sentence_bert_config.json");
    let wanted = if path.exists() { read_json::<SentenceBertConfig>(&path)?.max_seq_length } else { None };
    let limit = config.max_position_embeddings;
    match wanted {
        Some(0) => Err(format!("{}: max_seq_length must be positive", path.display())),
        Some(n) => Ok(n.min(limit)),
        None => Ok(limit),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A scratch folder removed on drop.
    pub(crate) struct Scratch(pub PathBuf);

    impl Scratch {
        pub(crate) fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("snooze-text-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        pub(crate) fn write(&self, rel: &str, text: &str) -> PathBuf {
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

    pub(crate) const BERT_CONFIG: &str = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 8,
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

    pub(crate) fn st_folder(tag: &str, modules: &str, pooling: &str) -> Scratch {
        let s = Scratch::new(tag);
        s.write("config.json", BERT_CONFIG);
        s.write("modules.json", modules);
        s.write("1_Pooling/config.json", pooling);
        s
    }

    pub(crate) const MODULES: &str = r#"[
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn modules_decide_pooling_and_normalize() {
        let s = st_folder("mods", MODULES, r#"{"pooling_mode_cls_token": true}"#);
        s.write("sentence_bert_config.json", r#"{"max_seq_length": 32}"#);
        let l = SentenceLayout::read(&s.0).unwrap();
        // The 2_Normalize folder does not exist: the module entry alone means normalize.
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Cls, true, 32));
        assert_eq!((l.encoder.hidden_size, l.encoder.num_attention_heads, l.encoder.vocab_size), (8, 2, 100));

        let without_norm = r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#;
        let s = st_folder("mods2", without_norm, r#"{"pooling_mode": "max"}"#);
        s.write("sentence_bert_config.json", r#"{"max_seq_length": 1000}"#);
        let l = SentenceLayout::read(&s.0).unwrap();
        // The position table caps the sequence length.
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Max, false, 64));
    }

    #[test]
    fn no_modules_json_means_the_pooling_config_or_mean() {
        let s = Scratch::new("nomods");
        s.write("config.json", BERT_CONFIG);
        let l = SentenceLayout::read(&s.0).unwrap();
        assert_eq!((l.pooling, l.normalize, l.max_seq_len), (Pooling::Mean, false, 64));
        assert!(!is_sentence_model(&s.0));
        s.write("1_Pooling/config.json", r#"{"pooling_mode_cls_token": true}"#);
        s.write("tokenizer.json", "{}");
        assert!(is_sentence_model(&s.0));
        assert_eq!(SentenceLayout::read(&s.0).unwrap().pooling, Pooling::Cls);
    }

    #[test]
    fn the_onnx_export_is_found_where_hub_repositories_keep_it() {
        let s = st_folder("export", MODULES, r#"{"pooling_mode_mean_tokens": true}"#);
        assert_eq!(onnx_export(&s.0), None);
        s.write("model.onnx", "x");
        assert_eq!(onnx_export(&s.0), Some(s.0.join("model.onnx")));
        s.write("onnx/model.onnx", "x");
        assert_eq!(onnx_export(&s.0), Some(s.0.join("onnx").join("model.onnx")));
        // A bare model.onnx without the sentence-transformers files is a tensor model.
        let plain = Scratch::new("plain");
        plain.write("model.onnx", "x");
        assert_eq!(onnx_export(&plain.0), None);
    }

    #[test]
    fn bad_folders_name_the_file() {
        let dense = MODULES.replace("models.Normalize", "models.Dense");
        let s = st_folder("dense", &dense, r#"{"pooling_mode_mean_tokens": true}"#);
        let e = SentenceLayout::read(&s.0).unwrap_err();
        assert!(e.contains("modules.json") && e.contains("Dense"), "{e}");

        let s = st_folder("noheads", MODULES, r#"{"pooling_mode_mean_tokens": true}"#);
        s.write("config.json", &BERT_CONFIG.replace("\"num_attention_heads\": 2,", ""));
        let e = SentenceLayout::read(&s.0).unwrap_err();
        assert!(e.contains("config.json has no num_attention_heads"), "{e}");

        let s = Scratch::new("noconfig");
        s.write("modules.json", MODULES);
        let e = SentenceLayout::read(&s.0).unwrap_err();
        assert!(e.contains("1_Pooling/config.json"), "{e}");
        s.write("1_Pooling/config.json", r#"{"pooling_mode_mean_tokens": true}"#);
        let e = SentenceLayout::read(&s.0).unwrap_err();
        assert!(e.contains("cannot read") && e.contains("config.json"), "{e}");

        let e = SentenceLayout::read(Path::new("/nonexistent/model")).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
    }
}
