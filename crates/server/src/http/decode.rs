//! Decoding KServe v2 inputs, bounded by what was sent.
//!
//! Two steps. [`plan_inputs`] reads only each input's header — name, datatype,
//! shape, where its data is — and checks it against the model's metadata and against
//! what the body can hold, with checked arithmetic throughout. Only then does
//! [`decode`] turn data into tensors, reserving at most what the bytes at hand can
//! back (never the element count a client declared) and counting elements as it goes,
//! so `"shape":[1099511627776,256],"data":[]` costs nothing and a ragged nested array
//! is a 400 naming the tensor.

use std::{collections::HashSet, fmt};

use half::f16;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde_json::value::RawValue;
use snooze_core::{DataType, ModelSignature, SnoozeError, Tensor, TensorData};

use super::codec::InferRequest;

/// Where an input's elements are.
#[derive(Debug, Clone, Copy)]
enum Source<'r> {
    Json(&'r RawValue),
    /// `size` bytes at `offset` of the binary tail.
    Binary {
        offset: usize,
        size: usize,
    },
    /// Bytes of their own (gRPC's `raw_input_contents`), in the binary layout.
    Raw(&'r [u8]),
}

/// One input whose header has been checked; its data is not decoded yet.
#[derive(Debug)]
pub struct InputPlan<'r> {
    pub name: &'r str,
    pub datatype: DataType,
    pub shape: &'r [i64],
    /// Elements the shape declares.
    pub count: usize,
    source: Source<'r>,
}

fn bad(msg: impl Into<String>) -> SnoozeError {
    SnoozeError::invalid(msg)
}

/// Checks every input's header against `sig` (when the model's files could be read)
/// and against the body; nothing is decoded yet.
pub fn plan_inputs<'r>(
    req: &'r InferRequest<'r>,
    binary_len: usize,
    sig: Option<&ModelSignature>,
    model: &str,
) -> Result<Vec<InputPlan<'r>>, SnoozeError> {
    let mut plans = Vec::with_capacity(req.inputs.len().min(sig.map_or(usize::MAX, |s| s.inputs.len() + 1)));
    let mut seen = HashSet::new();
    let mut offset = 0usize;
    for input in &req.inputs {
        let name = input.name.as_str();
        let (datatype, count) = check_header(name, &input.datatype, &input.shape, sig, model, &mut seen)?;
        let source = match (input.parameters.get("binary_data_size"), input.data) {
            (Some(_), Some(_)) => {
                return Err(bad(format!("input '{name}' has both data and binary_data_size")));
            }
            (Some(size), None) => {
                let size: usize = serde_json::from_str::<u64>(size.get())
                    .ok()
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| bad(format!("input '{name}': binary_data_size must be a byte count")))?;
                let end = offset.checked_add(size).filter(|e| *e <= binary_len).ok_or_else(|| {
                    bad(format!(
                        "input '{name}' claims {size} binary bytes but only {} remain in the body",
                        binary_len - offset
                    ))
                })?;
                check_binary_size(name, datatype, count, size)?;
                let source = Source::Binary { offset, size };
                offset = end;
                source
            }
            (None, Some(raw)) => {
                // Every element takes at least one byte of JSON.
                if count > raw.get().len() {
                    return Err(bad(format!(
                        "input '{name}' declares {count} elements (shape {:?}) but its data has only {} bytes",
                        input.shape,
                        raw.get().len()
                    )));
                }
                Source::Json(raw)
            }
            (None, None) => return Err(bad(format!("input '{name}' has no data"))),
        };
        plans.push(InputPlan { name, datatype, shape: &input.shape, count, source });
    }
    if offset != binary_len {
        return Err(bad(format!("the body has {} binary bytes that no input claims", binary_len - offset)));
    }
    check_complete(sig, &seen)?;
    Ok(plans)
}

/// Checks one input's name, datatype and shape against the model's metadata (when its
/// files could be read) and against the inputs `seen` before it, with checked
/// arithmetic: every protocol's first step, before any data is looked at. Returns the
/// datatype and the element count the shape declares.
pub fn check_header<'r>(
    name: &'r str,
    datatype: &str,
    shape: &[i64],
    sig: Option<&ModelSignature>,
    model: &str,
    seen: &mut HashSet<&'r str>,
) -> Result<(DataType, usize), SnoozeError> {
    let dt = DataType::parse(datatype).ok_or_else(|| {
        bad(format!(
            "input '{name}' has unknown datatype '{datatype}' (expected one of BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES)"
        ))
    })?;
    let count = Tensor::shape_elements(shape)
        .ok_or_else(|| bad(format!("input '{name}' has an invalid shape {shape:?}")))?;
    if let Some(size) = dt.element_size() {
        count.checked_mul(size).filter(|b| isize::try_from(*b).is_ok()).ok_or_else(|| {
            bad(format!("input '{name}': shape {shape:?} is larger than any tensor can be"))
        })?;
    }
    if !seen.insert(name) {
        return Err(bad(format!("input '{name}' is given twice")));
    }
    if let Some(sig) = sig {
        let spec = sig.inputs.iter().find(|s| s.name == name).ok_or_else(|| {
            bad(format!("model '{model}' has no input '{name}' (inputs: {})", names(&sig.inputs)))
        })?;
        spec.check_header(name, dt, shape).map_err(bad)?;
    }
    Ok((dt, count))
}

/// After every input's header: none the model needs is missing.
pub fn check_complete(sig: Option<&ModelSignature>, seen: &HashSet<&str>) -> Result<(), SnoozeError> {
    match sig.and_then(|s| s.inputs.iter().find(|s| !seen.contains(s.name.as_str()))) {
        Some(missing) => Err(bad(format!("input '{}' is missing", missing.name))),
        None => Ok(()),
    }
}

/// An input whose data is `bytes` in the binary layout (little-endian; BYTES with a
/// 4-byte length before each element), checked against its header.
pub fn plan_raw<'r>(
    name: &'r str,
    datatype: DataType,
    shape: &'r [i64],
    count: usize,
    bytes: &'r [u8],
) -> Result<InputPlan<'r>, SnoozeError> {
    check_binary_size(name, datatype, count, bytes.len())?;
    Ok(InputPlan { name, datatype, shape, count, source: Source::Raw(bytes) })
}

fn names(specs: &[snooze_core::TensorSpec]) -> String {
    specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// The binary size an input claims must be what its shape needs (BYTES: at least a
/// 4-byte length per element).
fn check_binary_size(name: &str, datatype: DataType, count: usize, size: usize) -> Result<(), SnoozeError> {
    match datatype.element_size() {
        Some(each) => {
            let need = count.saturating_mul(each);
            if size != need {
                return Err(bad(format!(
                    "input '{name}' has {size} binary bytes but {count} {datatype} elements need {need}"
                )));
            }
        }
        None => {
            if count.saturating_mul(4) > size {
                return Err(bad(format!(
                    "input '{name}' has {size} binary bytes, too few for {count} BYTES elements (4-byte length each)"
                )));
            }
        }
    }
    Ok(())
}

/// Decodes the planned inputs; `binary` is the body's binary tail.
pub fn decode(plans: Vec<InputPlan<'_>>, binary: &[u8]) -> Result<Vec<Tensor>, SnoozeError> {
    plans
        .into_iter()
        .map(|p| {
            let data = match p.source {
                Source::Json(raw) => from_json(&p, raw)?,
                Source::Binary { offset, size } => from_binary(&p, &binary[offset..offset + size])?,
                Source::Raw(bytes) => from_binary(&p, bytes)?,
            };
            if data.len() != p.count {
                return Err(bad(format!(
                    "input '{}' has {} elements but its shape {:?} needs {}",
                    p.name,
                    data.len(),
                    p.shape,
                    p.count
                )));
            }
            Ok(Tensor::new(p.name, p.shape.to_vec(), data))
        })
        .collect()
}

fn from_binary(p: &InputPlan<'_>, bytes: &[u8]) -> Result<TensorData, SnoozeError> {
    macro_rules! le {
        ($variant:ident, $t:ty) => {
            TensorData::$variant(
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
            )
        };
    }
    Ok(match p.datatype {
        DataType::Bool => TensorData::Bool(bytes.iter().map(|b| *b != 0).collect()),
        DataType::Uint8 => TensorData::Uint8(bytes.to_vec()),
        DataType::Int8 => TensorData::Int8(bytes.iter().map(|b| *b as i8).collect()),
        DataType::Uint16 => le!(Uint16, u16),
        DataType::Uint32 => le!(Uint32, u32),
        DataType::Uint64 => le!(Uint64, u64),
        DataType::Int16 => le!(Int16, i16),
        DataType::Int32 => le!(Int32, i32),
        DataType::Int64 => le!(Int64, i64),
        DataType::Fp16 => le!(Fp16, f16),
        DataType::Fp32 => le!(Fp32, f32),
        DataType::Fp64 => le!(Fp64, f64),
        DataType::Bytes => TensorData::Bytes(length_prefixed(p, bytes)?),
    })
}

/// BYTES in the binary extension: a little-endian u32 length before each element.
fn length_prefixed(p: &InputPlan<'_>, bytes: &[u8]) -> Result<Vec<Vec<u8>>, SnoozeError> {
    let name = p.name;
    let mut items = Vec::with_capacity(p.count.min(bytes.len() / 4));
    let mut rest = bytes;
    while !rest.is_empty() {
        if items.len() == p.count {
            return Err(bad(format!(
                "input '{name}' has more than the {} BYTES elements its shape {:?} declares",
                p.count, p.shape
            )));
        }
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad(format!("input '{name}': truncated BYTES length prefix")))?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > tail.len() {
            return Err(bad(format!(
                "input '{name}': a BYTES element claims {len} bytes, {} remain",
                tail.len()
            )));
        }
        items.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    Ok(items)
}

/// What one element of a datatype may be written as in JSON.
trait Element: Sized {
    /// The fewest bytes of JSON an element takes with its separator: bounds how much
    /// room the bytes at hand can back.
    const MIN_JSON_BYTES: usize = 2;
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
}

impl Element for bool {
    fn from_bool(v: bool) -> Option<Self> {
        Some(v)
    }
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_u64(v: u64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    )*};
}
int_element!(u8, u16, u32, u64, i8, i16, i32, i64);

macro_rules! float_element {
    ($($t:ty => $from:expr),*) => {$(
        impl Element for $t {
            fn from_i64(v: i64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_u64(v: u64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_f64(v: f64) -> Option<Self> {
                Some($from(v))
            }
        }
    )*};
}
float_element!(f32 => |x: f64| x as f32, f64 => |x: f64| x, f16 => f16::from_f64);

impl Element for Vec<u8> {
    const MIN_JSON_BYTES: usize = 3; // "",
    fn from_str(v: &str) -> Option<Self> {
        Some(v.as_bytes().to_vec())
    }
}

fn from_json(p: &InputPlan<'_>, raw: &RawValue) -> Result<TensorData, SnoozeError> {
    Ok(match p.datatype {
        DataType::Bool => TensorData::Bool(json_elements(p, raw)?),
        DataType::Uint8 => TensorData::Uint8(json_elements(p, raw)?),
        DataType::Uint16 => TensorData::Uint16(json_elements(p, raw)?),
        DataType::Uint32 => TensorData::Uint32(json_elements(p, raw)?),
        DataType::Uint64 => TensorData::Uint64(json_elements(p, raw)?),
        DataType::Int8 => TensorData::Int8(json_elements(p, raw)?),
        DataType::Int16 => TensorData::Int16(json_elements(p, raw)?),
        DataType::Int32 => TensorData::Int32(json_elements(p, raw)?),
        DataType::Int64 => TensorData::Int64(json_elements(p, raw)?),
        DataType::Fp16 => TensorData::Fp16(json_elements(p, raw)?),
        DataType::Fp32 => TensorData::Fp32(json_elements(p, raw)?),
        DataType::Fp64 => TensorData::Fp64(json_elements(p, raw)?),
        DataType::Bytes => TensorData::Bytes(json_elements(p, raw)?),
    })
}

/// Elements of `raw` (a value, a flat array, or arrays nested exactly as the shape),
/// row-major, streamed into a vector no larger than the JSON can back.
fn json_elements<T: Element>(p: &InputPlan<'_>, raw: &RawValue) -> Result<Vec<T>, SnoozeError> {
    let text = raw.get();
    let mut st = Nesting {
        out: Vec::with_capacity(p.count.min(text.len() / T::MIN_JSON_BYTES + 1)),
        expected: p.count,
        datatype: p.datatype,
        dims: Vec::new(),
        leaf_depth: None,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    Level { st: &mut st, depth: 0 }
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| bad(format!("input '{}': {e}", p.name)))?;
    let shape = p.shape;
    match st.leaf_depth {
        // Nested: the arrays must be the shape, dimension by dimension.
        Some(depth) if depth > 1 => {
            let nested: Vec<usize> = st.dims.iter().take(depth).map(|d| d.unwrap_or(0)).collect();
            let same = nested.len() == shape.len() && nested.iter().zip(shape).all(|(&n, &s)| n as i64 == s);
            if !same {
                return Err(bad(format!(
                    "input '{}' is nested as {nested:?} but its shape is {shape:?}",
                    p.name
                )));
            }
        }
        Some(0) if p.count != 1 => {
            return Err(bad(format!(
                "input '{}' has one value but its shape {shape:?} needs {}",
                p.name, p.count
            )));
        }
        _ => {}
    }
    Ok(st.out)
}

/// What the visitor has seen so far.
struct Nesting<T> {
    out: Vec<T>,
    expected: usize,
    datatype: DataType,
    /// Length of the arrays at each depth (all arrays at a depth must agree).
    dims: Vec<Option<usize>>,
    /// The depth values were found at (all values must be at one depth).
    leaf_depth: Option<usize>,
}

impl<T: Element> Nesting<T> {
    fn value<E: de::Error>(&mut self, depth: usize, v: Option<T>, shown: impl fmt::Display) -> Result<(), E> {
        let arrays_here = self.dims.get(depth).is_some_and(Option::is_some);
        match self.leaf_depth {
            _ if arrays_here => return Err(E::custom("ragged data: arrays and values mixed at one level")),
            Some(d) if d != depth => {
                return Err(E::custom("ragged data: values at different nesting depths"))
            }
            _ => self.leaf_depth = Some(depth),
        }
        if self.out.len() == self.expected {
            return Err(E::custom(format_args!(
                "more than the {} elements its shape declares",
                self.expected
            )));
        }
        let v = v.ok_or_else(|| {
            E::custom(format_args!(
                "element {}: {shown} is not a valid {} value",
                self.out.len(),
                self.datatype
            ))
        })?;
        self.out.push(v);
        Ok(())
    }

    fn array_closed<E: de::Error>(&mut self, depth: usize, len: usize) -> Result<(), E> {
        if self.leaf_depth.is_some_and(|d| d <= depth) {
            return Err(E::custom("ragged data: arrays and values mixed at one level"));
        }
        if self.dims.len() <= depth {
            self.dims.resize(depth + 1, None);
        }
        match self.dims[depth] {
            Some(first) if first != len => Err(E::custom(format_args!(
                "ragged data: an array at depth {depth} has {len} items where another has {first}"
            ))),
            _ => {
                self.dims[depth] = Some(len);
                Ok(())
            }
        }
    }
}

/// The value at one depth of the nesting.
struct Level<'s, T> {
    st: &'s mut Nesting<T>,
    depth: usize,
}

impl<'de, T: Element> DeserializeSeed<'de> for Level<'_, T> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Element> Visitor<'de> for Level<'_, T> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} values, flat or nested in arrays", self.st.datatype)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut len = 0usize;
        while seq.next_element_seed(Level { st: &mut *self.st, depth: self.depth + 1 })?.is_some() {
            len += 1;
        }
        self.st.array_closed(self.depth, len)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.st.value(self.depth, T::from_bool(v), v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.st.value(self.depth, T::from_i64(v), v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.st.value(self.depth, T::from_u64(v), v)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.st.value(self.depth, T::from_f64(v), v)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let shown = Quoted(v);
        self.st.value(self.depth, T::from_str(v), shown)
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.st.value(self.depth, None, "null")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.st.value(self.depth, None, "an object")
    }
}

/// A string shown in an error, cut so a huge one does not flood the message.
struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let cut: String = self.0.chars().take(40).collect();
        let more = if cut.len() < self.0.len() { "..." } else { "" };
        write!(f, "{:?}{more}", cut)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use snooze_core::TensorSpec;

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
        let t =
            run(r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[[1,2],[3,4]]}]}"#, &[])
                .unwrap();
        assert_eq!(t[0].data, TensorData::Int32(vec![1, 2, 3, 4]));
        let t = run(r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[1,2,3,4]}]}"#, &[])
            .unwrap();
        assert_eq!(t[0].data, TensorData::Int32(vec![1, 2, 3, 4]));
        let t = run(r#"{"inputs":[{"name":"x","shape":[3],"datatype":"BYTES","data":["a","","é"]}]}"#, &[])
            .unwrap();
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
        assert!(e.contains("'x'") && e.contains("only 2 bytes"), "{e}");
        let e =
            err(r#"{"inputs":[{"name":"x","datatype":"FP64","shape":[4611686018427387904,2],"data":[]}]}"#);
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
        let e =
            check(r#"{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":["not","a","float"]}]}"#);
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
}
