//! Candle against sentence-transformers: the real all-MiniLM-L6-v2 must give the
//! fixture's vectors (scripts/embedding_fixture.py) for every sentence, alone and in
//! batches of mixed lengths, through both the `Embedder` and the KServe path.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, OnceLock};

use common::{cosine, fixture, max_abs_diff, model_dir, spec, Fixture};
use snooze_backend_candle::CandleBackend;
use snooze_core::{Backend, DataType, EmbedInput, InferError, LoadedModel, Tensor, TensorData};

fn model() -> &'static Arc<dyn LoadedModel> {
    static MODEL: OnceLock<Arc<dyn LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| CandleBackend::new().load(&spec(model_dir())).unwrap())
}

fn embed(texts: &[String]) -> Vec<Vec<f32>> {
    let e = model().as_embedder().unwrap();
    e.embed(&EmbedInput::Texts(texts.to_vec())).unwrap().vectors
}

/// Checks `got[k]` against the fixture's vector for sentence `which[k]`.
fn assert_matches(fx: &Fixture, which: &[usize], got: &[Vec<f32>], context: &str) {
    assert_eq!(got.len(), which.len(), "{context}: one vector per input");
    for (&i, v) in which.iter().zip(got) {
        let (cos, diff) = (cosine(v, &fx.embeddings[i]), max_abs_diff(v, &fx.embeddings[i]));
        assert!(
            cos >= 0.9999 && diff <= 1e-4,
            "{context}: sentence {i} ({:.40?}) cosine {cos:.6}, max abs diff {diff:e}",
            fx.sentences[i]
        );
    }
}

#[test]
fn every_sentence_alone_matches_sentence_transformers() {
    let fx = fixture();
    assert!(fx.sentences.len() >= 20);
    let e = model().as_embedder().unwrap();
    assert_eq!((e.dimensions(), e.max_tokens(), e.normalized()), (384, 256, true));
    for (i, s) in fx.sentences.iter().enumerate() {
        let out = e.embed(&EmbedInput::Texts(vec![s.clone()])).unwrap();
        assert_matches(&fx, &[i], &out.vectors, "alone");
        // Usage counts the tokens actually run, special tokens included, after truncation.
        assert_eq!(out.prompt_tokens(), fx.token_counts[i], "tokens of sentence {i}");
    }
}

#[test]
fn mixed_length_batches_match_sentence_transformers() {
    let fx = fixture();
    let all: Vec<usize> = (0..fx.sentences.len()).collect();
    let texts: Vec<String> = all.iter().map(|&i| fx.sentences[i].clone()).collect();
    assert_matches(&fx, &all, &embed(&texts), "one batch of all");

    // Deterministic shuffles cut into uneven groups, so each sentence meets other
    // neighbours and other padding lengths.
    for seed in [7u64, 1234] {
        let mut order = all.clone();
        let mut state = seed;
        for k in (1..order.len()).rev() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(k, (state >> 33) as usize % (k + 1));
        }
        for group in order.chunks(seed as usize % 5 + 3) {
            let texts: Vec<String> = group.iter().map(|&i| fx.sentences[i].clone()).collect();
            assert_matches(&fx, group, &embed(&texts), &format!("shuffled group (seed {seed})"));
        }
    }
}

#[test]
fn token_ids_give_the_same_vectors_as_text() {
    let fx = fixture();
    let mut tokenizer = tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    // The file itself pads every encoding to 128 tokens.
    tokenizer.with_padding(None);
    // Short sentences: the ids of the untruncated encoding are what the text path runs.
    let short: Vec<usize> = (0..fx.sentences.len()).filter(|&i| fx.token_counts[i] < 100).collect();
    let ids: Vec<Vec<u32>> = short
        .iter()
        .map(|&i| tokenizer.encode(fx.sentences[i].as_str(), true).unwrap().get_ids().to_vec())
        .collect();
    let e = model().as_embedder().unwrap();
    let by_ids = e.embed(&EmbedInput::TokenIds(ids.clone())).unwrap();
    let texts: Vec<String> = short.iter().map(|&i| fx.sentences[i].clone()).collect();
    let by_text = e.embed(&EmbedInput::Texts(texts)).unwrap();
    assert_eq!(by_ids.prompt_tokens(), by_text.prompt_tokens());
    for (a, b) in by_ids.vectors.iter().zip(&by_text.vectors) {
        assert!(max_abs_diff(a, b) <= 1e-6);
    }
    assert_matches(&fx, &short, &by_ids.vectors, "token ids");

    let err = e.embed(&EmbedInput::TokenIds(vec![vec![101, 30522, 102]])).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("30522")), "{err:?}");
    let err = e.embed(&EmbedInput::TokenIds(vec![vec![101, 102], vec![]])).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("input 1")), "{err:?}");
}

#[test]
fn long_inputs_are_truncated_to_the_limit() {
    let fx = fixture();
    let e = model().as_embedder().unwrap();
    let long = fx.sentences.iter().position(|s| s.split_whitespace().count() > 300).unwrap();
    // Anything past the limit is cut, so appending more text changes nothing.
    let longer = format!("{} and then a great many more words that the model never sees", fx.sentences[long]);
    let out = e.embed(&EmbedInput::Texts(vec![fx.sentences[long].clone(), longer])).unwrap();
    assert_eq!(out.prompt_tokens(), 2 * fx.max_seq_length);
    assert!(max_abs_diff(&out.vectors[0], &out.vectors[1]) <= 1e-6);

    // Ids past the limit are cut to the first max_tokens.
    let ids: Vec<u32> = std::iter::once(101).chain((0..600).map(|k| 2000 + k)).collect();
    let out = e.embed(&EmbedInput::TokenIds(vec![ids.clone(), ids[..256].to_vec()])).unwrap();
    assert_eq!(out.prompt_tokens(), 512);
    assert!(max_abs_diff(&out.vectors[0], &out.vectors[1]) <= 1e-6);

    let none = e.embed(&EmbedInput::Texts(vec![])).unwrap();
    assert!(none.vectors.is_empty() && none.prompt_tokens() == 0);
}

#[test]
fn kserve_path_gives_fp32_rows() {
    let fx = fixture();
    let m = model();
    let sig = m.signature();
    assert_eq!((sig.platform.as_str(), sig.outputs[0].shape.as_slice()), ("candle_bert", &[-1, 384][..]));
    let texts: Vec<Vec<u8>> = fx.sentences[..3].iter().map(|s| s.as_bytes().to_vec()).collect();
    // Any input name works when there is exactly one input.
    let out = m.infer(&[Tensor::new("sentences", vec![3], TensorData::Bytes(texts.clone()))], &[]).unwrap();
    assert_eq!((out.len(), out[0].name.as_str(), out[0].shape.as_slice()), (1, "embedding", &[3, 384][..]));
    let TensorData::Fp32(flat) = &out[0].data else { panic!("expected FP32, got {}", out[0].datatype()) };
    let rows: Vec<Vec<f32>> = flat.chunks(384).map(<[f32]>::to_vec).collect();
    assert_matches(&fx, &[0, 1, 2], &rows, "kserve");

    let bad_utf8 = Tensor::new("text", vec![2], TensorData::Bytes(vec![b"ok".to_vec(), vec![0xff, 0xfe]]));
    let err = m.infer(&[bad_utf8], &[]).unwrap_err();
    assert!(
        matches!(&err, InferError::InvalidInput(s) if s.contains("'text'") && s.contains("UTF-8")),
        "{err:?}"
    );
    let floats = Tensor::new("text", vec![1], TensorData::Fp32(vec![1.0]));
    let err = m.infer(&[floats], &[]).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(s) if s.contains("BYTES")), "{err:?}");
    let one = Tensor::new("text", vec![1], TensorData::Bytes(vec![b"hi".to_vec()]));
    let err = m.infer(&[one], &["logits".to_string()]).unwrap_err();
    assert!(matches!(&err, InferError::InvalidInput(s) if s.contains("logits")), "{err:?}");
    assert_eq!(DataType::Bytes, sig.inputs[0].datatype);
}

#[test]
fn signature_and_estimate_come_from_the_files() {
    let dir = model_dir();
    let backend = CandleBackend::new();
    assert_eq!(backend.name(), "candle");
    let sig = backend.signature(&dir).unwrap();
    assert_eq!(sig.outputs[0].shape, vec![-1, 384]);
    let est = backend.estimate(&dir, snooze_core::Weights::Prepacked);
    let weights = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    let steady = est.steady_bytes.unwrap();
    assert!(steady > weights && est.peak_bytes.unwrap() >= steady, "{est:?}");
    assert!(est.derivation.contains("MiB"), "{}", est.derivation);
}

#[test]
fn broken_folders_fail_with_a_sentence() {
    let backend = CandleBackend::new();
    let err = backend.load(&spec("/nonexistent/model".into())).err().unwrap();
    assert!(err.to_string().contains("/nonexistent/model"), "{err}");
    assert!(backend
        .estimate("/nonexistent/model".as_ref(), snooze_core::Weights::Prepacked)
        .steady_bytes
        .is_none());

    // A copy of the real folder with a second candidate weight file and no index.
    let src = model_dir();
    let dir = std::env::temp_dir().join(format!("snooze-candle-two-weights-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    for f in [
        "config.json",
        "modules.json",
        "tokenizer.json",
        "sentence_bert_config.json",
        "1_Pooling/config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    std::fs::write(dir.join("pytorch_model.bin"), b"").unwrap();
    let est = backend.estimate(&dir, snooze_core::Weights::Prepacked);
    assert!(est.steady_bytes.is_none() && est.derivation.contains("several candidate"), "{est:?}");
    let err = backend.load(&spec(dir.clone())).err().unwrap();
    assert!(err.to_string().contains("pytorch_model.bin"), "{err}");
    // Signature needs no weights.
    assert!(backend.signature(&dir).is_ok());
    std::fs::remove_file(dir.join("pytorch_model.bin")).unwrap();
    let err = backend.load(&spec(dir.clone())).err().unwrap();
    assert!(
        err.to_string().contains("model.safetensors") || err.to_string().contains(&dir.display().to_string())
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let err =
        backend.load(&snooze_core::LoadSpec { device: snooze_core::Device::Cuda(0), ..spec(src) }).err();
    if !cfg!(feature = "cuda") {
        assert!(err.unwrap().to_string().contains("cuda"));
    }
}

#[test]
fn long_texts_are_cut_before_tokenizing_and_keep_the_same_tokens() {
    use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};
    let mut tok = Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    tok.with_padding(None);
    tok.with_truncation(Some(TruncationParams {
        direction: TruncationDirection::Right,
        max_length: 256,
        strategy: TruncationStrategy::LongestFirst,
        stride: 0,
    }))
    .unwrap();
    let fx = fixture();
    let all = fx.sentences.join(" ");
    let long = all.repeat(100_000 / all.len() + 1);
    // CJK without spaces, and one very long word, test the cut where whitespace is rare.
    let cjk = "自然语言处理是人工智能的一个分支".repeat(4000);
    let word = format!("{} tail words after it", "x".repeat(50_000));
    for (what, text) in [("mixed", long.as_str()), ("cjk", cjk.as_str()), ("long word", word.as_str())] {
        let prefix = snooze_text::truncate::tokenizer_prefix(&tok, text, 256);
        let full = tok.encode(text, true).unwrap();
        let cut = tok.encode(prefix, true).unwrap();
        assert_eq!(cut.get_ids(), full.get_ids(), "{what}: the cut changed the tokens the model keeps");
        if what == "mixed" {
            assert!(prefix.len() < 8_000, "{what}: {} of {} bytes tokenized", prefix.len(), text.len());
        }
    }
    for s in &fx.sentences {
        let prefix = snooze_text::truncate::tokenizer_prefix(&tok, s, 256);
        assert_eq!(
            tok.encode(prefix, true).unwrap().get_ids(),
            tok.encode(s.as_str(), true).unwrap().get_ids()
        );
        if s.len() < 2048 {
            assert_eq!(prefix, s.as_str(), "short texts are kept whole");
        }
    }
}
