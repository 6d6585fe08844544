//! Header checks, binary and JSON decoding, bounded by what was sent.

#![allow(clippy::unwrap_used)]

use half::f16;
use snooze_core::{TensorData, TensorSpec};

use super::*;

fn sig() -> ModelSignature {
    let spec = |name: &str, datatype, shape: Vec<i64>| TensorSpec { name: name.into(), datatype, shape };
    ModelSignature {
        platform: "test".into(),
        inputs: vec![spec("x", DataType::Fp32, vec![-1, 2])],
        outputs: vec![spec("y", DataType::Fp32, vec![-1, 2])],
    }
}

/// Decodes a JSON request without a model signature.
fn run(json: &str, binary: &[u8]) -> Result<Vec<Tensor>, SnoozeError> {
    let req: InferRequest = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    decode(plan_inputs(&req, binary.len(), None, "m")?, binary)
}

fn err(json: &str) -> String {
    run(json, &[]).unwrap_err().message
}

#[test]
fn nested_and_flat_data_decode_row_major() {
    let t = run(r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[[1,2],[3,4]]}]}"#, &[])
        .unwrap();
    assert_eq!(t[0].data, TensorData::Int32(vec![1, 2, 3, 4]));
    let t =
        run(r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[1,2,3,4]}]}"#, &[]).unwrap();
    assert_eq!(t[0].data, TensorData::Int32(vec![1, 2, 3, 4]));
    let t =
        run(r#"{"inputs":[{"name":"x","shape":[3],"datatype":"BYTES","data":["a","","é"]}]}"#, &[]).unwrap();
    assert_eq!(t[0].data, TensorData::Bytes(vec![b"a".to_vec(), vec![], "é".as_bytes().to_vec()]));
    let t = run(r#"{"inputs":[{"name":"x","shape":[],"datatype":"FP64","data":2.5}]}"#, &[]).unwrap();
    assert_eq!(t[0].data, TensorData::Fp64(vec![2.5]));
    let t = run(r#"{"inputs":[{"name":"x","shape":[0,3],"datatype":"FP32","data":[]}]}"#, &[]).unwrap();
    assert!(t[0].data.is_empty());
}

#[test]
fn errors_name_the_tensor() {
    let cases = [
        (r#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[1,2]}]}"#, "'x' has 2 elements"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[300]}]}"#, "'x': element 0"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FLOAT","data":[1]}]}"#, "unknown datatype"),
        (r#"{"inputs":[{"name":"x","shape":[-2],"datatype":"FP32","data":[1]}]}"#, "invalid shape"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"BOOL","data":["yes"]}]}"#, "'x': element 0"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32"}]}"#, "'x' has no data"),
        (r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2,3]}]}"#, "more than the 2"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[null]}]}"#, "null is not"),
        (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[{}]}]}"#, "an object"),
        (
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]},{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]}]}"#,
            "given twice",
        ),
    ];
    for (json, want) in cases {
        let e = err(json);
        assert!(e.contains(want), "{json}: {e}");
    }
}

#[test]
fn ragged_and_misnested_data_is_refused() {
    let cases = [
        (r#"[[1,2],[3]]"#, "[3]", "ragged"),
        (r#"[[1,2],3]"#, "[3]", "ragged"),
        (r#"[1,[2,3]]"#, "[3]", "ragged"),
        (r#"[[1],[2],[3]]"#, "[3]", "nested as [3, 1]"),
        (r#"[[1,2,3],[4,5,6]]"#, "[3,2]", "nested as [2, 3]"),
        (r#"12345"#, "[2]", "one value"),
    ];
    for (data, shape, want) in cases {
        let json =
            format!(r#"{{"inputs":[{{"name":"t","shape":{shape},"datatype":"INT64","data":{data}}}]}}"#);
        let e = err(&json);
        assert!(e.contains("'t'") && e.contains(want), "{data}: {e}");
    }
}

#[test]
fn declared_sizes_the_body_cannot_back_cost_nothing() {
    // The issue's request: a terabyte-row shape with empty data is refused before any decoding.
    let e = err(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1099511627776,256],"data":[]}]}"#);
    assert!(e.contains("'x'") && e.contains("is 2 characters long, too short"), "{e}");
    let e = err(r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[4611686018427387904,2],"data":[]}]}"#);
    assert!(e.contains("'x'"), "{e}");
    let e = err(
        r#"{"inputs":[{"name":"x","datatype":"BYTES","shape":[4611686018427387904],"parameters":{"binary_data_size":4}}]}"#,
    );
    assert!(e.contains("'x'"), "{e}");
}

#[test]
fn headers_are_checked_against_the_model_before_the_data() {
    let s = sig();
    let check = |json: &str| {
        let req: InferRequest = serde_json::from_str(json).unwrap();
        plan_inputs(&req, 0, Some(&s), "m").map(|_| ()).unwrap_err().message
    };
    // Bad data after a bad header: the header is what is reported.
    let e = check(r#"{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":["not","a","float"]}]}"#);
    assert!(e.contains("shape [1, 3]"), "{e}");
    let e = check(r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"INT32","data":[1,2]}]}"#);
    assert!(e.contains("datatype INT32"), "{e}");
    let e = check(r#"{"inputs":[{"name":"z","shape":[1,2],"datatype":"FP32","data":[1,2]}]}"#);
    assert!(e.contains("no input 'z'"), "{e}");
    let e = check(r#"{"inputs":[]}"#);
    assert!(e.contains("'x' is missing"), "{e}");
}

#[test]
fn binary_round_trips_every_type() {
    let samples = vec![
        TensorData::Bool(vec![true, false]),
        TensorData::Uint8(vec![1, 255]),
        TensorData::Uint16(vec![1, 65535]),
        TensorData::Uint32(vec![1, u32::MAX]),
        TensorData::Uint64(vec![1, u64::MAX]),
        TensorData::Int8(vec![-1, 127]),
        TensorData::Int16(vec![-1, 300]),
        TensorData::Int32(vec![-1, 70000]),
        TensorData::Int64(vec![-1, i64::MIN]),
        TensorData::Fp16(vec![f16::from_f32(1.5), f16::from_f32(-2.0)]),
        TensorData::Fp32(vec![1.5, -2.25]),
        TensorData::Fp64(vec![1e300, -2.0]),
        TensorData::Bytes(vec![b"ab".to_vec(), vec![0xff, 0]]),
    ];
    for data in samples {
        let mut bytes = Vec::new();
        super::super::codec::to_binary(&data, &mut bytes);
        let dtype = data.datatype();
        let json = format!(
            r#"{{"inputs":[{{"name":"t","shape":[2],"datatype":"{dtype}","parameters":{{"binary_data_size":{}}}}}]}}"#,
            bytes.len()
        );
        assert_eq!(run(&json, &bytes).unwrap()[0].data, data, "{dtype}");
    }
}

#[test]
fn binary_size_mismatches_are_rejected() {
    let json =
        r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
    assert!(run(json, &[0; 4]).unwrap_err().message.contains("'x'"));
    assert!(run(json, &[0; 12]).unwrap_err().message.contains("no input claims"));
    let json =
        r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":4}}]}"#;
    assert!(run(json, &[0; 4]).unwrap_err().message.contains("need 8"));
    let json =
        r#"{"inputs":[{"name":"x","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":8}}]}"#;
    let two = [1, 0, 0, 0, b'a', 0, 0, 0];
    assert!(run(json, &two).unwrap_err().message.contains("more than the 1"));
    let claims_too_much = [9, 0, 0, 0, b'a', b'b', b'c', b'd'];
    assert!(run(json, &claims_too_much).unwrap_err().message.contains("claims 9 bytes"));
}
