//! Property tests of every request decoder (KServe JSON, the binary extension, BYTES,
//! OpenAI inputs), and the corpus of the nastiest requests seen, replayed at the
//! decoder: random and adversarial headers, shapes, sizes and bodies never panic,
//! never allocate more than a small multiple of the body, and either decode or give a
//! 400 that names the tensor.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    path::Path,
};

use proptest::prelude::*;
use serde_json::{json, value::RawValue, Value};
use snooze_core::{DataType, ErrorKind, ModelSignature, SnoozeError, Tensor, TensorData, TensorSpec};
use snooze_server::{
    request::{
        codec::{split_body, InferRequest},
        decode::{decode, plan_inputs},
    },
    rest::openai::parse_input,
};

/// Counts the bytes this thread has allocated and not freed, and their peak.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters move.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // While a block moves, old and new exist at once.
            track(new_size as isize);
            track(-(layout.size() as isize));
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result and the most it held at once beyond what was live before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get) - start;
    (out, peak.max(0) as usize)
}

/// "A small multiple of the body": the worst case is BYTES, 24 bytes of `Vec` header
/// per 3-byte `"",` element; 64 KiB covers fixed costs (messages, small tables).
fn allowed(body_len: usize) -> usize {
    16 * body_len + (64 << 10)
}

fn spec(name: &str, datatype: DataType, shape: &[i64]) -> TensorSpec {
    TensorSpec { name: name.into(), datatype, shape: shape.to_vec() }
}

/// The demo models the hostile suite sends these requests to.
fn signature(model: &str) -> ModelSignature {
    match model {
        "mlp-10m" => ModelSignature {
            platform: "onnxruntime_onnx".into(),
            inputs: vec![spec("x", DataType::Fp32, &[-1, 256])],
            outputs: vec![spec("y", DataType::Fp32, &[-1, 256])],
        },
        // One BYTES input of rows of three: every request below that sends only
        // `in_bytes` is complete for it, so its data reaches the decoder.
        "bytes" => ModelSignature {
            platform: "onnxruntime_onnx".into(),
            inputs: vec![spec("in_bytes", DataType::Bytes, &[-1, 3])],
            outputs: Vec::new(),
        },
        "minilm" => ModelSignature {
            platform: "candle_bert".into(),
            inputs: vec![spec("text", DataType::Bytes, &[-1])],
            outputs: vec![spec("embedding", DataType::Fp32, &[-1, 384])],
        },
        _ => ModelSignature {
            platform: "onnxruntime_onnx".into(),
            inputs: DataType::ALL
                .iter()
                .map(|d| spec(&format!("in_{}", d.as_str().to_lowercase()), *d, &[-1, 3]))
                .collect(),
            outputs: Vec::new(),
        },
    }
}

/// The whole KServe decode path, as the handler runs it.
fn decode_kserve(
    body: &[u8],
    header_len: Option<&str>,
    sig: Option<&ModelSignature>,
) -> Result<Vec<Tensor>, SnoozeError> {
    let (json_part, binary) = split_body(body, header_len)?;
    let req: InferRequest =
        serde_json::from_slice(json_part).map_err(|e| SnoozeError::invalid(format!("not a request: {e}")))?;
    let plans = plan_inputs(&req, binary.len(), sig, "m")?;
    decode(plans, binary)
}

/// Decodes or refuses with a 400; an error about an input names it.
fn check_kserve(
    body: &[u8],
    header_len: Option<&str>,
    sig: Option<&ModelSignature>,
) -> Result<(), TestCaseError> {
    let (result, peak) = peak_of(|| decode_kserve(body, header_len, sig));
    prop_assert!(peak <= allowed(body.len()), "held {peak} bytes decoding a {}-byte body", body.len());
    if let Err(e) = result {
        prop_assert_eq!(e.kind, ErrorKind::InvalidInput, "{}", e.message);
        let about_an_input = e.message.contains("element") || e.message.contains("shape");
        prop_assert!(
            !about_an_input || e.message.contains("input '"),
            "does not name the tensor: {}",
            e.message
        );
    }
    Ok(())
}

/// JSON values as clients send them, well-formed or not for the datatype.
fn element() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
        "[a-z\\u{e9}\\u{4e2d}]{0,6}".prop_map(Value::from),
        Just(Value::Null),
    ]
}

/// Flat, nested, ragged and odd data.
fn data() -> impl Strategy<Value = Value> {
    element().prop_recursive(4, 64, 8, |inner| prop::collection::vec(inner, 0..8).prop_map(Value::from))
}

/// Shapes near every edge: empty, zero, negative, huge, overflowing products.
fn shape() -> impl Strategy<Value = Vec<i64>> {
    let dim = prop_oneof![
        0i64..5,
        Just(-1i64),
        Just(256i64),
        Just(1 << 40),
        Just(1 << 62),
        Just(i64::MAX),
        any::<i64>(),
    ];
    prop::collection::vec(dim, 0..5)
}

fn datatype() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(DataType::ALL.to_vec()).prop_map(|d| d.as_str().to_string()),
        Just("FLOAT".to_string()),
        "[A-Z0-9]{0,6}",
    ]
}

fn input() -> impl Strategy<Value = Value> {
    (prop::sample::select(vec!["x", "y", "in_fp32", "in_bytes", ""]), shape(), datatype(), data()).prop_map(
        |(name, shape, dt, data)| json!({"name": name, "shape": shape, "datatype": dt, "data": data}),
    )
}

/// A binary-extension input: a size claim (honest or not) and random bytes.
fn binary_request() -> impl Strategy<Value = (Vec<u8>, String)> {
    (
        prop::sample::select(DataType::ALL.to_vec()),
        shape(),
        prop_oneof![0u64..64, Just(u64::MAX), Just(1 << 33), any::<u64>()],
        prop::collection::vec(any::<u8>(), 0..96),
    )
        .prop_map(|(dt, shape, size, tail)| {
            let name = format!("in_{}", dt.as_str().to_lowercase());
            let header = json!({"inputs": [{"name": name, "shape": shape, "datatype": dt.as_str(),
                                 "parameters": {"binary_data_size": size}}]})
            .to_string();
            let len = header.len().to_string();
            let mut body = header.into_bytes();
            body.extend_from_slice(&tail);
            (body, len)
        })
}

/// The elements of a `[rows, 3]` BYTES input: 1..5 rows of random strings.
fn bytes_elements() -> impl Strategy<Value = Vec<Vec<u8>>> {
    (1usize..5)
        .prop_flat_map(|rows| prop::collection::vec(prop::collection::vec(any::<u8>(), 0..8), rows * 3))
}

/// The binary layout: a little-endian u32 length before each element.
fn length_prefixed(elements: &[Vec<u8>]) -> Vec<u8> {
    let mut tail = Vec::new();
    for e in elements {
        tail.extend_from_slice(&u32::try_from(e.len()).expect("a short element").to_le_bytes());
        tail.extend_from_slice(e);
    }
    tail
}

/// A request whose one input `in_bytes` declares `rows` rows of three and honestly
/// states the size of its binary `tail` (only the prefixes inside it may lie); the body
/// and its JSON header's length.
fn bytes_request(rows: usize, tail: &[u8]) -> (Vec<u8>, String) {
    let header = json!({"inputs": [{"name": "in_bytes", "shape": [rows, 3], "datatype": "BYTES",
                         "parameters": {"binary_data_size": tail.len()}}]})
    .to_string();
    let len = header.len().to_string();
    let mut body = header.into_bytes();
    body.extend_from_slice(tail);
    (body, len)
}

/// How a BYTES body lies about its elements; each lie must be refused.
#[derive(Debug, Clone)]
enum Lie {
    /// One element's prefix claims more bytes than the whole rest of the body holds
    /// (`over` past the end, or a huge count).
    Overclaim { at: prop::sample::Index, over: u32 },
    /// The body ends `cut` bytes early (taken modulo the last element with its prefix).
    Truncated { cut: usize },
    /// One element more than the shape declares.
    ExtraElement,
    /// One element fewer than the shape declares.
    MissingElement,
}

fn lie() -> impl Strategy<Value = Lie> {
    prop_oneof![
        (any::<prop::sample::Index>(), prop_oneof![1u32..64, Just(u32::MAX), Just(1 << 31)])
            .prop_map(|(at, over)| Lie::Overclaim { at, over }),
        (1usize..16).prop_map(|cut| Lie::Truncated { cut }),
        Just(Lie::ExtraElement),
        Just(Lie::MissingElement),
    ]
}

/// The honest binary tail of `elements`, made to tell `lie`.
fn lying_tail(elements: &[Vec<u8>], lie: &Lie) -> Vec<u8> {
    match lie {
        Lie::Overclaim { at, over } => {
            let at = at.index(elements.len());
            let mut tail = length_prefixed(elements);
            let prefix = length_prefixed(&elements[..at]).len();
            let rest = u32::try_from(tail.len() - prefix - 4).expect("a short body");
            let claim = if *over < 64 { rest + over } else { *over };
            tail[prefix..prefix + 4].copy_from_slice(&claim.to_le_bytes());
            tail
        }
        Lie::Truncated { cut } => {
            let mut tail = length_prefixed(elements);
            let last = elements.last().map_or(0, Vec::len) + 4;
            tail.truncate(tail.len() - (1 + (cut - 1) % last));
            tail
        }
        Lie::ExtraElement => {
            let mut more = elements.to_vec();
            more.push(b"extra".to_vec());
            length_prefixed(&more)
        }
        Lie::MissingElement => length_prefixed(&elements[..elements.len() - 1]),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn kserve_json_requests_decode_or_are_refused_with_a_bounded_cost(
        inputs in prop::collection::vec(input(), 0..4),
        with_model in any::<bool>(),
    ) {
        let body = json!({"inputs": inputs}).to_string();
        let sig = signature("identity-all-types");
        check_kserve(body.as_bytes(), None, with_model.then_some(&sig))?;
    }

    #[test]
    fn binary_extension_requests_decode_or_are_refused((body, len) in binary_request(), with_model in any::<bool>()) {
        let sig = signature("identity-all-types");
        check_kserve(&body, Some(&len), with_model.then_some(&sig))?;
    }

    #[test]
    fn honest_bytes_length_prefixes_decode_to_their_elements(elements in bytes_elements()) {
        let (body, len) = bytes_request(elements.len() / 3, &length_prefixed(&elements));
        let decoded = decode_kserve(&body, Some(&len), Some(&signature("bytes")));
        let tensors = decoded.map_err(|e| TestCaseError::fail(format!("an honest body was refused: {}", e.message)))?;
        prop_assert_eq!(tensors.len(), 1);
        prop_assert_eq!(&tensors[0].data, &TensorData::Bytes(elements));
    }

    #[test]
    fn lying_bytes_length_prefixes_are_refused(elements in bytes_elements(), lie in lie()) {
        let (body, len) = bytes_request(elements.len() / 3, &lying_tail(&elements, &lie));
        check_kserve(&body, Some(&len), Some(&signature("bytes")))?;
        match decode_kserve(&body, Some(&len), Some(&signature("bytes"))) {
            Ok(tensors) => prop_assert!(false, "{:?} was decoded: {:?}", lie, tensors[0].data),
            Err(e) => prop_assert!(e.message.contains("input 'in_bytes'"), "{:?}: {}", lie, e.message),
        }
    }

    #[test]
    fn arbitrary_bytes_and_header_lengths_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..256),
        header_len in prop::option::of("[0-9 x-]{0,6}"),
    ) {
        check_kserve(&body, header_len.as_deref(), None)?;
    }

    #[test]
    fn declared_counts_cost_nothing_until_data_backs_them(rows in (1i64 << 20)..(1i64 << 62), cols in 1i64..1024) {
        let body = json!({"inputs": [{"name": "x", "shape": [rows, cols], "datatype": "FP64", "data": [1.0, 2.0]}]}).to_string();
        check_kserve(body.as_bytes(), None, None)?;
        let sig = signature("mlp-10m");
        let body = json!({"inputs": [{"name": "x", "shape": [rows, 256], "datatype": "FP32", "data": []}]}).to_string();
        check_kserve(body.as_bytes(), None, Some(&sig))?;
    }

    #[test]
    fn openai_inputs_parse_or_are_refused_with_a_bounded_cost(input in data(), max_inputs in 1usize..8, max_chars in 1usize..16) {
        let text = input.to_string();
        let raw: Box<RawValue> = serde_json::from_str(&text).expect("a JSON value");
        let (result, peak) = peak_of(|| parse_input(&raw, max_inputs, max_chars).map(|_| ()));
        prop_assert!(peak <= allowed(text.len()), "held {peak} bytes parsing {} bytes", text.len());
        if let Err(e) = result {
            prop_assert_eq!(e.error().kind, ErrorKind::InvalidInput);
        }
    }
}

/// Big versions of the worst shapes: the bound must hold far from proptest's small sizes.
#[test]
fn large_bodies_stay_within_the_bound() {
    let many = |item: &str, n: usize| format!("[{}]", vec![item; n].join(","));
    let cases = [
        ("BYTES", many("\"\"", 200_000), 200_000),
        ("FP64", many("0", 300_000), 300_000),
        ("BOOL", many("true", 100_000), 100_000),
        ("FP32", many("[0]", 100_000), 100_000),
    ];
    for (dt, data, n) in cases {
        let body =
            format!(r#"{{"inputs":[{{"name":"t","shape":[{n},1],"datatype":"{dt}","data":{data}}}]}}"#);
        let (result, peak) = peak_of(|| decode_kserve(body.as_bytes(), None, None));
        assert!(result.is_ok(), "{dt}: {:?}", result.err());
        assert!(peak <= allowed(body.len()), "{dt}: held {peak} bytes for a {}-byte body", body.len());
    }
    // Whitespace makes the data long but holds one element: the shape's count must
    // not size the buffer.
    let n = 300_000;
    let body = format!(
        r#"{{"inputs":[{{"name":"t","shape":[{n}],"datatype":"BYTES","data":[""{}]}}]}}"#,
        " ".repeat(n)
    );
    let (result, peak) = peak_of(|| decode_kserve(body.as_bytes(), None, None));
    assert!(result.unwrap_err().message.contains("has 1 elements"));
    assert!(peak <= allowed(body.len()), "padded BYTES: held {peak} bytes for a {}-byte body", body.len());
    let tokens = many("7", 400_000);
    let raw: Box<RawValue> = serde_json::from_str(&format!("[{tokens}]")).expect("json");
    let (result, peak) = peak_of(|| parse_input(&raw, 1, 1 << 20).map(|_| ()));
    assert!(result.is_ok());
    assert!(peak <= allowed(tokens.len()), "token ids: held {peak} bytes for {} bytes", tokens.len());
}

/// The corpus (`tests/corpus/*.json`) replayed at the decoder: each case is refused
/// with the expected sentence, cheaply.
#[test]
fn the_corpus_of_nasty_requests_is_refused() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let path = entry.expect("entry").path();
        let case: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?").to_string();
        let body = case["body"].as_str().expect("body");
        let contains = case["contains"].as_str();
        let (message, peak, len) = match case["endpoint"].as_str() {
            Some("kserve") => {
                let binary = hex(case["binary_hex"].as_str().unwrap_or(""));
                let mut all = body.as_bytes().to_vec();
                all.extend_from_slice(&binary);
                let header_len = (!binary.is_empty()).then(|| body.len().to_string());
                let sig = signature(case["model"].as_str().unwrap_or(""));
                let (result, peak) = peak_of(|| decode_kserve(&all, header_len.as_deref(), Some(&sig)));
                let e = result.expect_err(&name);
                assert_eq!(e.kind, ErrorKind::InvalidInput, "{name}: {}", e.message);
                (e.message, peak, all.len())
            }
            _ => {
                let (result, peak) = peak_of(|| {
                    let req: Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
                    let raw: Box<RawValue> =
                        serde_json::from_str(&req["input"].to_string()).map_err(|e| e.to_string())?;
                    parse_input(&raw, 256, 100_000).map(|_| ()).map_err(|e| e.error().message.clone())
                });
                (result.expect_err(&name), peak, body.len())
            }
        };
        if let Some(want) = contains {
            assert!(message.contains(want), "{name}: '{message}' lacks '{want}'");
        }
        assert!(peak <= allowed(len), "{name}: held {peak} bytes");
        seen += 1;
    }
    assert!(seen >= 20, "the corpus has {seen} cases");
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}
