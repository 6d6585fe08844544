//! What the vision tests share: the repository root, rapidocr's reference answers
//! (`tests/fixtures/ocr_reference.json`) and the three PP-OCR models loaded once on ONNX
//! Runtime, with the recogniser's alphabet.

#![allow(dead_code, clippy::unwrap_used)]

use std::{
    path::PathBuf,
    sync::{Arc, OnceLock},
};

use serde_json::Value;
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Device, LoadSpec, LoadedModel};
use snooze_vision::CtcDecoder;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn reference() -> &'static Value {
    static REF: OnceLock<Value> = OnceLock::new();
    REF.get_or_init(|| {
        let text = std::fs::read_to_string(root().join("tests/fixtures/ocr_reference.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    })
}

pub struct Models {
    pub det: Arc<dyn LoadedModel>,
    pub cls: Arc<dyn LoadedModel>,
    pub rec: Arc<dyn LoadedModel>,
    pub decoder: Arc<CtcDecoder>,
}

pub fn models() -> &'static Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS.get_or_init(|| {
        let backend = OrtBackend::new(None).unwrap_or_else(|e| panic!("these tests need ONNX Runtime: {e}"));
        let load = |name: &str| {
            let path = root().join("models").join(name);
            assert!(path.exists(), "{} is missing: run `make prepare`", path.display());
            let spec = LoadSpec {
                name: name.to_owned(),
                path,
                device: Device::Cpu,
                intra_op_threads: 1,
                instances: 1,
                weights: snooze_core::Weights::Prepacked,
                low_cpu_priority: false,
            };
            backend.load(&spec).unwrap()
        };
        let keys = std::fs::read_to_string(root().join("models/ocr-rec/keys.txt")).unwrap();
        Models {
            det: load("ocr-det"),
            cls: load("ocr-cls"),
            rec: load("ocr-rec"),
            decoder: Arc::new(CtcDecoder::from_keys(&keys)),
        }
    })
}
