//! KServe v2 tensors on the wire: JSON `data` (flat or nested, row-major) and the
//! binary tensor data extension (little-endian, BYTES as u32 length + bytes).

use serde::{ser::SerializeSeq, Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};
use snooze_core::{DataType, SnoozeError, Tensor, TensorData};

#[derive(Debug, Deserialize)]
pub struct InferRequest {
    pub id: Option<String>,
    #[serde(default)]
    pub parameters: Map<String, Value>,
    pub inputs: Vec<RequestInput>,
    #[serde(default)]
    pub outputs: Vec<RequestOutput>,
}

#[derive(Debug, Deserialize)]
pub struct RequestInput {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    #[serde(default)]
    pub parameters: Map<String, Value>,
    pub data: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct RequestOutput {
    pub name: String,
    #[serde(default)]
    pub parameters: Map<String, Value>,
}

fn bad(msg: impl Into<String>) -> SnoozeError {
    SnoozeError::invalid(msg)
}

/// Splits a request body into its JSON header and the binary tail.
pub fn split_body<'a>(body: &'a [u8], header_len: Option<&str>) -> Result<(&'a [u8], &'a [u8]), SnoozeError> {
    match header_len {
        None => Ok((body, &[])),
        Some(v) => {
            let n: usize = v
                .trim()
                .parse()
                .map_err(|_| bad(format!("Inference-Header-Content-Length '{v}' is not a byte count")))?;
            if n > body.len() {
                return Err(bad(format!(
                    "Inference-Header-Content-Length is {n} but the body has only {} bytes",
                    body.len()
                )));
            }
            Ok(body.split_at(n))
        }
    }
}

/// Decodes every input; binary ones take their bytes from `binary` in input order.
pub fn decode_inputs(req: &mut InferRequest, binary: &[u8]) -> Result<Vec<Tensor>, SnoozeError> {
    let mut offset = 0usize;
    let mut tensors = Vec::with_capacity(req.inputs.len());
    for input in &mut req.inputs {
        let name = &input.name;
        let dtype = DataType::parse(&input.datatype).ok_or_else(|| {
            bad(format!("input '{name}' has unknown datatype '{}' (expected one of BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES)", input.datatype))
        })?;
        let count = Tensor::shape_elements(&input.shape)
            .ok_or_else(|| bad(format!("input '{name}' has an invalid shape {:?}", input.shape)))?;
        let data = match input.parameters.get("binary_data_size") {
            Some(size) => {
                let size = size
                    .as_u64()
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| bad(format!("input '{name}': binary_data_size must be a byte count")))?;
                let end = offset.checked_add(size).filter(|e| *e <= binary.len()).ok_or_else(|| {
                    bad(format!(
                        "input '{name}' claims {size} binary bytes but only {} remain in the body",
                        binary.len() - offset
                    ))
                })?;
                let chunk = &binary[offset..end];
                offset = end;
                from_binary(name, dtype, chunk, count)?
            }
            None => {
                let value = input.data.take().ok_or_else(|| bad(format!("input '{name}' has no data")))?;
                from_json(name, dtype, value, count)?
            }
        };
        if data.len() != count {
            return Err(bad(format!(
                "input '{name}' has {} elements but its shape {:?} needs {count}",
                data.len(),
                input.shape
            )));
        }
        tensors.push(Tensor::new(name.clone(), input.shape.clone(), data));
    }
    if offset != binary.len() {
        return Err(bad(format!("the body has {} binary bytes that no input claims", binary.len() - offset)));
    }
    Ok(tensors)
}

fn flatten(value: Value, out: &mut Vec<Value>) {
    match value {
        Value::Array(items) => items.into_iter().for_each(|v| flatten(v, out)),
        other => out.push(other),
    }
}

fn from_json(name: &str, dtype: DataType, value: Value, count: usize) -> Result<TensorData, SnoozeError> {
    let mut flat = Vec::with_capacity(count);
    flatten(value, &mut flat);
    let wrong =
        |i: usize, v: &Value| bad(format!("input '{name}' element {i}: {v} is not a valid {dtype} value"));
    macro_rules! ints {
        ($variant:ident, $t:ty) => {
            TensorData::$variant(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_i64()
                            .and_then(|x| <$t>::try_from(x).ok())
                            .or_else(|| v.as_u64().and_then(|x| <$t>::try_from(x).ok()))
                            .ok_or_else(|| wrong(i, v))
                    })
                    .collect::<Result<_, _>>()?,
            )
        };
    }
    macro_rules! floats {
        ($variant:ident, $conv:expr) => {
            TensorData::$variant(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| v.as_f64().map($conv).ok_or_else(|| wrong(i, v)))
                    .collect::<Result<_, _>>()?,
            )
        };
    }
    Ok(match dtype {
        DataType::Bool => TensorData::Bool(
            flat.iter()
                .enumerate()
                .map(|(i, v)| v.as_bool().ok_or_else(|| wrong(i, v)))
                .collect::<Result<_, _>>()?,
        ),
        DataType::Uint8 => ints!(Uint8, u8),
        DataType::Uint16 => ints!(Uint16, u16),
        DataType::Uint32 => ints!(Uint32, u32),
        DataType::Uint64 => ints!(Uint64, u64),
        DataType::Int8 => ints!(Int8, i8),
        DataType::Int16 => ints!(Int16, i16),
        DataType::Int32 => ints!(Int32, i32),
        DataType::Int64 => ints!(Int64, i64),
        DataType::Fp16 => floats!(Fp16, half::f16::from_f64),
        DataType::Fp32 => floats!(Fp32, |x| x as f32),
        DataType::Fp64 => floats!(Fp64, |x| x),
        DataType::Bytes => TensorData::Bytes(
            flat.into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.into_bytes()),
                    other => Err(wrong(i, &other)),
                })
                .collect::<Result<_, _>>()?,
        ),
    })
}

fn from_binary(name: &str, dtype: DataType, bytes: &[u8], count: usize) -> Result<TensorData, SnoozeError> {
    if let Some(size) = dtype.element_size() {
        if bytes.len() != count * size {
            return Err(bad(format!(
                "input '{name}' has {} binary bytes but {count} {dtype} elements need {}",
                bytes.len(),
                count * size
            )));
        }
    }
    macro_rules! le {
        ($variant:ident, $t:ty) => {
            TensorData::$variant(
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                    .collect(),
            )
        };
    }
    Ok(match dtype {
        DataType::Bool => TensorData::Bool(bytes.iter().map(|b| *b != 0).collect()),
        DataType::Uint8 => TensorData::Uint8(bytes.to_vec()),
        DataType::Int8 => TensorData::Int8(bytes.iter().map(|b| *b as i8).collect()),
        DataType::Uint16 => le!(Uint16, u16),
        DataType::Uint32 => le!(Uint32, u32),
        DataType::Uint64 => le!(Uint64, u64),
        DataType::Int16 => le!(Int16, i16),
        DataType::Int32 => le!(Int32, i32),
        DataType::Int64 => le!(Int64, i64),
        DataType::Fp16 => le!(Fp16, half::f16),
        DataType::Fp32 => le!(Fp32, f32),
        DataType::Fp64 => le!(Fp64, f64),
        DataType::Bytes => {
            let mut items = Vec::with_capacity(count);
            let mut rest = bytes;
            while !rest.is_empty() {
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
            TensorData::Bytes(items)
        }
    })
}

/// Appends a tensor's elements in the binary encoding.
pub fn to_binary(data: &TensorData, out: &mut Vec<u8>) {
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match data {
        TensorData::Bool(v) => out.extend(v.iter().map(|b| *b as u8)),
        TensorData::Uint8(v) => out.extend_from_slice(v),
        TensorData::Int8(v) => out.extend(v.iter().map(|b| *b as u8)),
        TensorData::Uint16(v) => le!(v),
        TensorData::Uint32(v) => le!(v),
        TensorData::Uint64(v) => le!(v),
        TensorData::Int16(v) => le!(v),
        TensorData::Int32(v) => le!(v),
        TensorData::Int64(v) => le!(v),
        TensorData::Fp16(v) => le!(v),
        TensorData::Fp32(v) => le!(v),
        TensorData::Fp64(v) => le!(v),
        TensorData::Bytes(v) => {
            for b in v {
                out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                out.extend_from_slice(b);
            }
        }
    }
}

/// Serializes `TensorData` as a flat JSON array without building `Value`s.
pub struct JsonData<'a>(pub &'a TensorData);

impl Serialize for JsonData<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            TensorData::Bool(v) => v.serialize(s),
            TensorData::Uint8(v) => v.serialize(s),
            TensorData::Uint16(v) => v.serialize(s),
            TensorData::Uint32(v) => v.serialize(s),
            TensorData::Uint64(v) => v.serialize(s),
            TensorData::Int8(v) => v.serialize(s),
            TensorData::Int16(v) => v.serialize(s),
            TensorData::Int32(v) => v.serialize(s),
            TensorData::Int64(v) => v.serialize(s),
            TensorData::Fp16(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for x in v {
                    seq.serialize_element(&x.to_f32())?;
                }
                seq.end()
            }
            TensorData::Fp32(v) => v.serialize(s),
            TensorData::Fp64(v) => v.serialize(s),
            TensorData::Bytes(v) => {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for b in v {
                    seq.serialize_element(&String::from_utf8_lossy(b))?;
                }
                seq.end()
            }
        }
    }
}

#[derive(Serialize)]
pub struct InferResponse<'a> {
    pub model_name: &'a str,
    pub model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub outputs: Vec<ResponseOutput<'a>>,
}

#[derive(Serialize)]
pub struct ResponseOutput<'a> {
    pub name: &'a str,
    pub datatype: &'static str,
    pub shape: &'a [i64],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<JsonData<'a>>,
}

/// Whether an output is asked for in binary: per output, else request-wide.
pub fn wants_binary(req: &InferRequest, output: &str) -> bool {
    let flag = |p: &Map<String, Value>, k: &str| p.get(k).and_then(Value::as_bool);
    req.outputs
        .iter()
        .find(|o| o.name == output)
        .and_then(|o| flag(&o.parameters, "binary_data"))
        .or_else(|| flag(&req.parameters, "binary_data_output"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> InferRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn json_nested_and_flat_data_decode_row_major() {
        let mut r =
            request(r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"INT32","data":[[1,2],[3,4]]}]}"#);
        let t = decode_inputs(&mut r, &[]).unwrap();
        assert_eq!(t[0].data, TensorData::Int32(vec![1, 2, 3, 4]));
        let mut r =
            request(r#"{"inputs":[{"name":"x","shape":[3],"datatype":"BYTES","data":["a","","é"]}]}"#);
        let t = decode_inputs(&mut r, &[]).unwrap();
        assert_eq!(t[0].data, TensorData::Bytes(vec![b"a".to_vec(), vec![], "é".as_bytes().to_vec()]));
    }

    #[test]
    fn errors_name_the_tensor() {
        let cases = [
            (r#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[1,2]}]}"#, "'x' has 2 elements"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[300]}]}"#, "'x' element 0"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FLOAT","data":[1]}]}"#, "unknown datatype"),
            (r#"{"inputs":[{"name":"x","shape":[-2],"datatype":"FP32","data":[1]}]}"#, "invalid shape"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"BOOL","data":["yes"]}]}"#, "'x' element 0"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32"}]}"#, "'x' has no data"),
        ];
        for (json, want) in cases {
            let e = decode_inputs(&mut request(json), &[]).unwrap_err();
            assert!(e.message.contains(want), "{json}: {}", e.message);
        }
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
            TensorData::Fp16(vec![half::f16::from_f32(1.5), half::f16::from_f32(-2.0)]),
            TensorData::Fp32(vec![1.5, -2.25]),
            TensorData::Fp64(vec![1e300, -2.0]),
            TensorData::Bytes(vec![b"ab".to_vec(), vec![0xff, 0]]),
        ];
        for data in samples {
            let mut bytes = Vec::new();
            to_binary(&data, &mut bytes);
            let dtype = data.datatype();
            let json = format!(
                r#"{{"inputs":[{{"name":"t","shape":[2],"datatype":"{dtype}","parameters":{{"binary_data_size":{}}}}}]}}"#,
                bytes.len()
            );
            let got = decode_inputs(&mut request(&json), &bytes).unwrap();
            assert_eq!(got[0].data, data, "{dtype}");
        }
    }

    #[test]
    fn binary_size_mismatches_are_rejected() {
        let json =
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        assert!(decode_inputs(&mut request(json), &[0; 4]).unwrap_err().message.contains("'x'"));
        assert!(decode_inputs(&mut request(json), &[0; 12]).unwrap_err().message.contains("no input claims"));
        let json =
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":4}}]}"#;
        assert!(decode_inputs(&mut request(json), &[0; 4]).unwrap_err().message.contains("need 8"));
        assert!(split_body(b"{}", Some("9")).is_err());
        assert!(split_body(b"{}", Some("x")).is_err());
    }

    #[test]
    fn binary_output_selection() {
        let r = request(
            r#"{"inputs":[],"outputs":[{"name":"a","parameters":{"binary_data":true}},{"name":"b"}]}"#,
        );
        assert!(wants_binary(&r, "a") && !wants_binary(&r, "b"));
        let r = request(r#"{"inputs":[],"parameters":{"binary_data_output":true}}"#);
        assert!(wants_binary(&r, "anything"));
    }
}
