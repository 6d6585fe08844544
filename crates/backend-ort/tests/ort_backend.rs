//! The backend against the real ONNX Runtime and the models `make prepare` generates.

#![allow(clippy::unwrap_used)]

mod common;

use std::{path::Path, time::Instant};

use common::{backend, cpu, max_abs_diff, model};
use half::f16;
use snooze_backend_ort::OrtBackend;
use snooze_core::{
    Backend, DataType, Device, InferError, LoadError, LoadSpec, LoadedModel, Tensor, TensorData, TensorSpec,
};

fn spec(name: &str, datatype: DataType, shape: &[i64]) -> TensorSpec {
    TensorSpec { name: name.to_owned(), datatype, shape: shape.to_vec() }
}

#[test]
fn signature_of_an_inline_weights_model() {
    let sig = backend().signature(&model("mlp-100m-1")).unwrap();
    assert_eq!(sig.platform, "onnxruntime_onnx");
    // W1, B1, W2, B2 are initializers, not inputs.
    assert_eq!(sig.inputs, vec![spec("x", DataType::Fp32, &[-1, 256])]);
    assert_eq!(sig.outputs, vec![spec("y", DataType::Fp32, &[-1, 256])]);
}

#[test]
fn signature_of_an_external_data_model_is_instant() {
    let started = Instant::now();
    let sig = backend().signature(&model("mlp-400m/model.onnx")).unwrap();
    assert_eq!(sig.inputs, vec![spec("x", DataType::Fp32, &[-1, 256])]);
    assert_eq!(sig.outputs, vec![spec("y", DataType::Fp32, &[-1, 256])]);
    // Generous: the point is that the weights are skipped, not read.
    assert!(started.elapsed().as_secs() < 2, "took {:?}", started.elapsed());
}

#[test]
fn signature_of_every_datatype() {
    let sig = backend().signature(&model("test/identity-all-types")).unwrap();
    assert_eq!(sig.inputs.len(), DataType::ALL.len());
    for dt in DataType::ALL {
        let t = dt.as_str().to_lowercase();
        assert!(sig.inputs.contains(&spec(&format!("in_{t}"), dt, &[-1, 3])), "in_{t}: {:?}", sig.inputs);
        assert!(sig.outputs.contains(&spec(&format!("out_{t}"), dt, &[-1, 3])), "out_{t}");
    }
}

#[test]
fn a_corrupt_file_is_a_failure_naming_the_path() {
    let path = model("test/corrupt/model.onnx");
    let b = backend();
    let Err(LoadError::Failed(msg)) = b.signature(&path) else { panic!("corrupt signature should fail") };
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    let Err(LoadError::Failed(msg)) = b.load(&cpu("corrupt", path.clone())) else {
        panic!("corrupt load should fail")
    };
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    let estimate = b.estimate(&path, snooze_core::Weights::Prepacked);
    assert_eq!(estimate.steady_bytes, None, "{}", estimate.derivation);
}

#[test]
fn missing_models_and_other_devices_are_refused() {
    let b = backend();
    let Err(LoadError::Failed(msg)) = b.load(&cpu("ghost", "/nonexistent/model".into())) else {
        panic!("missing model should fail")
    };
    assert!(msg.contains("'ghost'") && msg.contains("/nonexistent/model"), "{msg}");
    let gpu = LoadSpec { device: Device::Cuda(0), ..cpu("m", model("mlp-10m")) };
    let Err(LoadError::Failed(msg)) = b.load(&gpu) else { panic!("cuda should be refused") };
    assert!(msg.contains("cuda:0"), "{msg}");
}

#[test]
fn a_missing_library_is_an_error_not_a_panic() {
    let err = OrtBackend::new(Some(Path::new("/nonexistent/libonnxruntime.so.1"))).unwrap_err();
    assert!(err.contains("/nonexistent/libonnxruntime.so.1") && err.contains("make prepare"), "{err}");
    // The runtime stays usable for everyone else.
    backend();
}

#[test]
fn estimate_counts_external_data() {
    let e = backend().estimate(&model("mlp-400m"), snooze_core::Weights::Prepacked);
    let steady = e.steady_bytes.expect("400m is sizeable");
    let peak = e.peak_bytes.expect("peak");
    // More than the 420,250,624 bytes of model.onnx.data: the external data is counted.
    assert!(steady > 420_250_624, "{steady}: {}", e.derivation);
    assert!(peak >= steady);
    assert!(e.derivation.contains("external data 400.8 MiB"), "{}", e.derivation);

    let inline = backend().estimate(&model("mlp-100m-1"), snooze_core::Weights::Prepacked);
    assert!(inline.derivation.contains("external data 0.0 MiB"), "{}", inline.derivation);
    assert!(inline.steady_bytes.unwrap() > 100 << 20);
}

fn reference(name: &str) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let text = std::fs::read_to_string(model(name).join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    };
    let shape = json["shape"].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect();
    (floats(&json["input"]["x"]), shape, floats(&json["output"]["y"]))
}

#[test]
fn mlp_10m_matches_its_reference() {
    let (x, shape, want) = reference("mlp-10m");
    let m = backend().load(&cpu("mlp-10m", model("mlp-10m"))).unwrap();
    let out = m.infer(&[Tensor::new("x", shape.clone(), TensorData::Fp32(x))], &[]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].name, "y");
    assert_eq!(out[0].shape, shape);
    let TensorData::Fp32(got) = &out[0].data else { panic!("y should be FP32") };
    let max_diff = max_abs_diff(got, &want);
    assert!(max_diff <= 1e-4, "max abs diff {max_diff}");
}

/// One [2, 3] tensor of every datatype, as the identity model's inputs.
fn all_types() -> Vec<Tensor> {
    let ints = [0i64, 1, 2, 3, 4, 5];
    DataType::ALL
        .into_iter()
        .map(|dt| {
            let data = match dt {
                DataType::Bool => TensorData::Bool(vec![true, false, true, false, false, true]),
                DataType::Uint8 => TensorData::Uint8(ints.iter().map(|&i| i as u8 + 250).collect()),
                DataType::Uint16 => TensorData::Uint16(ints.iter().map(|&i| i as u16 + 65530).collect()),
                DataType::Uint32 => TensorData::Uint32(ints.iter().map(|&i| u32::MAX - i as u32).collect()),
                DataType::Uint64 => TensorData::Uint64(ints.iter().map(|&i| u64::MAX - i as u64).collect()),
                DataType::Int8 => TensorData::Int8(ints.iter().map(|&i| -128 + i as i8).collect()),
                DataType::Int16 => TensorData::Int16(ints.iter().map(|&i| -(i as i16) * 1000).collect()),
                DataType::Int32 => TensorData::Int32(ints.iter().map(|&i| i32::MIN + i as i32).collect()),
                DataType::Int64 => TensorData::Int64(ints.iter().map(|&i| i64::MIN + i).collect()),
                DataType::Fp16 => {
                    TensorData::Fp16(ints.iter().map(|&i| f16::from_f32(i as f32 * 0.5)).collect())
                }
                DataType::Fp32 => TensorData::Fp32(ints.iter().map(|&i| i as f32 / 3.0).collect()),
                DataType::Fp64 => TensorData::Fp64(ints.iter().map(|&i| i as f64 / 7.0).collect()),
                DataType::Bytes => TensorData::Bytes(
                    ["a", "bc", "", "déjà", "x", "yz"].iter().map(|s| s.as_bytes().to_vec()).collect(),
                ),
            };
            Tensor::new(format!("in_{}", dt.as_str().to_lowercase()), vec![2, 3], data)
        })
        .collect()
}

fn identity() -> std::sync::Arc<dyn LoadedModel> {
    backend().load(&cpu("identity", model("test/identity-all-types"))).unwrap()
}

#[test]
fn identity_round_trips_every_datatype() {
    let m = identity();
    let inputs = all_types();
    let out = m.infer(&inputs, &[]).unwrap();
    let order: Vec<&str> = m.signature().outputs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(out.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), order, "signature order");
    for t in &inputs {
        let want = t.name.replacen("in_", "out_", 1);
        let got = out.iter().find(|o| o.name == want).unwrap();
        assert_eq!(got.shape, t.shape, "{want}");
        assert_eq!(got.data, t.data, "{want}");
    }
}

#[test]
fn requested_outputs_come_back_alone_and_in_order() {
    let m = identity();
    let wanted = ["out_int8".to_owned(), "out_bytes".to_owned(), "out_bool".to_owned()];
    let out = m.infer(&all_types(), &wanted).unwrap();
    assert_eq!(out.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), wanted);
    assert_eq!(out[2].data, TensorData::Bool(vec![true, false, true, false, false, true]));
}

fn invalid(result: Result<Vec<Tensor>, InferError>) -> String {
    match result {
        Err(InferError::InvalidInput(m)) => m,
        other => panic!("expected InvalidInput, got {other:?}"),
    }
}

#[test]
fn bad_requests_are_invalid_input_naming_the_tensor() {
    let m = identity();

    let mut unknown = all_types();
    unknown.push(Tensor::new("in_nope", vec![1], TensorData::Fp32(vec![0.0])));
    assert!(invalid(m.infer(&unknown, &[])).contains("'in_nope'"));

    let mut missing = all_types();
    missing.retain(|t| t.name != "in_fp64");
    assert!(invalid(m.infer(&missing, &[])).contains("'in_fp64' is missing"));

    assert!(invalid(m.infer(&all_types(), &["out_nope".to_owned()])).contains("'out_nope'"));

    let mut wrong_type = all_types();
    wrong_type[0].data = TensorData::Uint8(vec![0; 6]);
    assert!(invalid(m.infer(&wrong_type, &[])).contains("'in_bool'"));

    let mut wrong_count = all_types();
    wrong_count[1].shape = vec![3, 3];
    let msg = invalid(m.infer(&wrong_count, &[]));
    assert!(msg.contains("'in_uint8'") && msg.contains("carries 6 values"), "{msg}");

    let mut not_utf8 = all_types();
    let bytes = not_utf8.iter_mut().find(|t| t.name == "in_bytes").unwrap();
    bytes.data = TensorData::Bytes(vec![vec![0xff]; 6]);
    assert!(invalid(m.infer(&not_utf8, &[])).contains("'in_bytes'"));

    // The model stays usable after refusals.
    assert_eq!(m.infer(&all_types(), &[]).unwrap().len(), DataType::ALL.len());
}

/// A model named by its `.onnx` file is another version when only the external data
/// it names changes (same size, same time: a retrain copied with `cp -p`); before, the
/// server kept its old signature, footprint and cached copies until a restart.
#[test]
fn the_fingerprint_of_an_onnx_file_counts_its_external_data() {
    let dir = std::env::temp_dir().join(format!("snooze-ort-fingerprint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let onnx = dir.join("model.onnx");
    std::fs::copy(model("mlp-400m/model.onnx"), &onnx).unwrap();
    let data = dir.join("model.onnx.data");
    let when = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
    let write = |bytes: &[u8]| {
        std::fs::write(&data, bytes).unwrap();
        std::fs::File::options().write(true).open(&data).unwrap().set_modified(when).unwrap();
    };
    write(b"weights, version 1");
    let b = backend();
    let v1 = b.fingerprint(&onnx);
    assert_eq!(b.fingerprint(&onnx), v1, "the same files, the same version");
    write(b"weights, version 2");
    assert_ne!(b.fingerprint(&onnx), v1, "new external data, the graph untouched");
    // A folder, or a file with its weights inline, is fingerprinted as the core does it.
    assert_eq!(b.fingerprint(&dir), snooze_core::learned::fingerprint(&dir));
    let inline = model("mlp-10m/model.onnx");
    assert_eq!(b.fingerprint(&inline), snooze_core::learned::fingerprint(&inline));
    let _ = std::fs::remove_dir_all(&dir);
}
