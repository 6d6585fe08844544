//! Sentence embeddings on ONNX Runtime against sentence-transformers: the MiniLM
//! export `make prepare` builds (scripts/export_minilm_onnx.py) must give the
//! fixture's vectors (scripts/embedding_fixture.py) — fp32 at cosine >= 0.9999 for
//! every sentence, int8 at >= 0.99 — alone, in mixed batches and on the KServe path.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    path::PathBuf,
    sync::{Arc, OnceLock},
};

use common::{backend, cpu, max_abs_diff, model};
use snooze_core::{Backend, DataType, EmbedInput, InferError, LoadedModel, Task, Tensor, TensorData};

#[derive(serde::Deserialize)]
struct Fixture {
    sentences: Vec<String>,
    embeddings: Vec<Vec<f32>>,
    token_counts: Vec<usize>,
    max_seq_length: usize,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minilm_embeddings.json");
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    })
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn fp32() -> &'static Arc<dyn LoadedModel> {
    static MODEL: OnceLock<Arc<dyn LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| backend().load(&cpu("minilm-onnx", model("minilm-onnx"))).unwrap())
}

fn int8() -> &'static Arc<dyn LoadedModel> {
    static MODEL: OnceLock<Arc<dyn LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| backend().load(&cpu("minilm-onnx-int8", model("minilm-onnx-int8"))).unwrap())
}

/// The lower of two (cosine, sentence) pairs; a NaN cosine wins, so `>=` checks fail on it.
fn lower(a: (f64, usize), b: (f64, usize)) -> (f64, usize) {
    if a.0.is_nan() || a.0 <= b.0 {
        a
    } else {
        b
    }
}

/// The lowest cosine to the fixture over `which` (NaN if any is NaN), checking one vector
/// per input.
fn min_cosine(got: &[Vec<f32>], which: &[usize]) -> (f64, usize) {
    assert!(!which.is_empty(), "no vector to compare");
    assert_eq!(got.len(), which.len(), "one vector per input");
    which.iter().zip(got).map(|(&i, v)| (cosine(v, &fixture().embeddings[i]), i)).reduce(lower).unwrap()
}

fn embed(m: &Arc<dyn LoadedModel>, which: &[usize]) -> Vec<Vec<f32>> {
    let texts = which.iter().map(|&i| fixture().sentences[i].clone()).collect();
    m.as_embedder().unwrap().embed(&EmbedInput::Texts(texts)).unwrap().vectors
}

#[test]
fn fp32_export_matches_sentence_transformers_alone_and_in_batches() {
    let fx = fixture();
    let e = fp32().as_embedder().expect("an embedding model");
    assert_eq!((e.dimensions(), e.max_tokens(), e.normalized()), (384, fx.max_seq_length, true));
    let mut worst = (f64::INFINITY, 0);
    for (i, s) in fx.sentences.iter().enumerate() {
        let out = e.embed(&EmbedInput::Texts(vec![s.clone()])).unwrap();
        assert_eq!(out.prompt_tokens(), fx.token_counts[i], "tokens of sentence {i}");
        worst = lower(worst, min_cosine(&out.vectors, &[i]));
    }
    println!("fp32 export, alone: min cosine {:.7} (sentence {})", worst.0, worst.1);
    assert!(worst.0 >= 0.9999, "sentence {}: cosine {:.7} < 0.9999", worst.1, worst.0);

    // One batch of all (mixed lengths, long ones truncated), and uneven groups.
    let all: Vec<usize> = (0..fx.sentences.len()).rev().collect();
    let (c, i) = min_cosine(&embed(fp32(), &all), &all);
    println!("fp32 export, one batch of {}: min cosine {c:.7} (sentence {i})", all.len());
    assert!(c >= 0.9999, "batched: sentence {i} cosine {c:.7}");
    for group in all.chunks(4) {
        let (c, i) = min_cosine(&embed(fp32(), group), group);
        assert!(c >= 0.9999, "group {group:?}: sentence {i} cosine {c:.7}");
    }
}

#[test]
fn int8_export_stays_close_to_sentence_transformers() {
    let fx = fixture();
    let all: Vec<usize> = (0..fx.sentences.len()).collect();
    let vectors = embed(int8(), &all);
    let (c, i) = min_cosine(&vectors, &all);
    let mean = all.iter().map(|&k| cosine(&vectors[k], &fx.embeddings[k])).sum::<f64>() / all.len() as f64;
    println!("int8 export: min cosine {c:.5} (sentence {i}), mean {mean:.5}");
    assert!(c >= 0.99, "sentence {i}: cosine {c:.5} < 0.99");
    // Quantization changes the vectors: this is not the fp32 model served twice.
    let exact = embed(fp32(), &all);
    assert!(vectors.iter().zip(&exact).any(|(a, b)| a != b));
}

#[test]
fn token_ids_and_truncation_behave_as_on_candle() {
    let e = fp32().as_embedder().unwrap();
    // Ids past the limit are cut to the first max_tokens.
    let ids: Vec<u32> = std::iter::once(101).chain((0..600).map(|k| 2000 + k)).collect();
    let out = e.embed(&EmbedInput::TokenIds(vec![ids.clone(), ids[..256].to_vec()])).unwrap();
    assert_eq!(out.prompt_tokens(), 512);
    let diff = max_abs_diff(&out.vectors[0], &out.vectors[1]);
    assert!(diff <= 1e-5, "{diff}");
    let err = e.embed(&EmbedInput::TokenIds(vec![vec![101, 999_999]])).unwrap_err();
    assert!(
        matches!(&err, InferError::InvalidInput(s) if s.contains("999999") && s.contains("vocabulary")),
        "{err:?}"
    );
    let err = e.embed(&EmbedInput::TokenIds(vec![vec![101], vec![]])).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(s) if s.contains("input 1 has no tokens")), "{err:?}");
    assert!(e.embed(&EmbedInput::Texts(vec![])).unwrap().vectors.is_empty());
}

#[test]
fn kserve_bytes_in_fp32_rows_out() {
    let m = fp32();
    let sig = m.signature();
    assert_eq!(sig.inputs[0].datatype, DataType::Bytes);
    assert_eq!(
        (sig.outputs[0].name.as_str(), sig.outputs[0].shape.as_slice()),
        ("embedding", &[-1, 384][..])
    );
    let texts: Vec<Vec<u8>> = fixture().sentences[..3].iter().map(|s| s.as_bytes().to_vec()).collect();
    let out = m.infer(&[Tensor::new("text", vec![3], TensorData::Bytes(texts))], &[]).unwrap();
    assert_eq!(out[0].shape, vec![3, 384]);
    let TensorData::Fp32(flat) = &out[0].data else { panic!("expected FP32") };
    let rows: Vec<Vec<f32>> = flat.chunks(384).map(<[f32]>::to_vec).collect();
    assert!(min_cosine(&rows, &[0, 1, 2]).0 >= 0.9999);
    let err = m.infer(&[Tensor::new("text", vec![1], TensorData::Fp32(vec![1.0]))], &[]).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(s) if s.contains("BYTES")), "{err:?}");
}

#[test]
fn the_task_and_signature_come_from_the_folder() {
    let b = backend();
    let dir = model("minilm-onnx");
    assert_eq!(b.task(&dir), Task::Embedding);
    assert_eq!(b.task(&model("mlp-10m")), Task::Tensor);
    let sig = b.signature(&dir).unwrap();
    assert_eq!(sig.platform, snooze_backend_ort::embed::PLATFORM);
    assert_eq!(sig.outputs[0].shape, vec![-1, 384]);
    let est = b.estimate(&dir, snooze_core::Weights::Prepacked);
    let file = std::fs::metadata(dir.join("onnx/model.onnx")).unwrap().len();
    assert!(est.steady_bytes.unwrap() > file && est.derivation.contains("tokenizer"), "{est:?}");
}

#[test]
fn only_the_dynamically_quantized_export_answers_by_the_batch() {
    let b = backend();
    assert!(
        b.batch_dependent(&model("minilm-onnx-int8")),
        "int8's DynamicQuantizeLinear scales by the batch"
    );
    // Each int8 vector moves when another text shares its run: why it runs requests apart.
    let alone = embed(int8(), &[0]);
    let beside = embed(int8(), &[0, 1]);
    let moved = alone[0].iter().zip(&beside[0]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(moved > 1e-4, "int8's first vector moved by {moved} only");
    for rows_apart in ["minilm-onnx", "mlp-10m", "whisper-tiny-en"] {
        assert!(!b.batch_dependent(&model(rows_apart)), "{rows_apart}");
    }
}

#[test]
fn an_export_that_is_no_text_encoder_is_refused_before_any_session() {
    // A sentence-transformers folder whose onnx/model.onnx is the MLP (input x).
    let src = model("minilm-onnx");
    let dir = std::env::temp_dir().join(format!("snooze-ort-not-an-encoder-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::create_dir_all(dir.join("onnx")).unwrap();
    for f in [
        "config.json",
        "modules.json",
        "tokenizer.json",
        "sentence_bert_config.json",
        "1_Pooling/config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(model("mlp-10m").join("model.onnx"), dir.join("onnx/model.onnx")).unwrap();
    let b = backend();
    assert_eq!(b.task(&dir), Task::Embedding);
    let err = b.load(&cpu("broken", dir.clone())).err().unwrap().to_string();
    assert!(err.contains("not a text encoder export") && err.contains("'x'"), "{err}");
    let err = b.signature(&dir).unwrap_err().to_string();
    assert!(err.contains("not a text encoder export"), "{err}");
    // A tokenizer that does not parse is named.
    std::fs::copy(src.join("onnx/model.onnx"), dir.join("onnx/model.onnx")).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{broken").unwrap();
    let err = b.load(&cpu("broken", dir.clone())).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
