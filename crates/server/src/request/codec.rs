//! KServe v2 tensors on the wire: JSON `data` (flat or nested, row-major) and the
//! binary tensor data extension (little-endian, BYTES as u32 length + bytes).

use std::collections::BTreeMap;

use serde::{de, ser::SerializeSeq, Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{value::RawValue, Value};
use snooze_core::{SnoozeError, TensorData};

/// Most dimensions a request may declare; ONNX itself caps tensors far below this.
pub const MAX_RANK: usize = 64;

/// Parameters are kept as raw JSON: only the few we know are ever parsed, so a
/// hostile `parameters` object costs no more than its own bytes.
pub type Parameters<'a> = BTreeMap<String, &'a RawValue>;

/// A KServe v2 inference request, borrowing from the body: tensor `data` stays raw
/// JSON until the input's name, datatype and shape have been checked against the model.
#[derive(Debug, Deserialize)]
pub struct InferRequest<'a> {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default, borrow)]
    pub parameters: Parameters<'a>,
    #[serde(borrow)]
    pub inputs: Vec<RequestInput<'a>>,
    #[serde(default, borrow)]
    pub outputs: Vec<RequestOutput<'a>>,
}

#[derive(Debug, Deserialize)]
pub struct RequestInput<'a> {
    pub name: String,
    #[serde(deserialize_with = "bounded_shape")]
    pub shape: Vec<i64>,
    pub datatype: String,
    #[serde(default, borrow)]
    pub parameters: Parameters<'a>,
    #[serde(default, borrow)]
    pub data: Option<&'a RawValue>,
}

#[derive(Debug, Deserialize)]
pub struct RequestOutput<'a> {
    pub name: String,
    #[serde(default, borrow)]
    pub parameters: Parameters<'a>,
}

/// A shape of at most [`MAX_RANK`] dimensions, refused as soon as it grows past it.
fn bounded_shape<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
    struct Shape;
    impl<'de> de::Visitor<'de> for Shape {
        type Value = Vec<i64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "an array of at most {MAX_RANK} integer dimensions")
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<i64>, A::Error> {
            let mut dims = Vec::new();
            while let Some(d) = seq.next_element::<i64>()? {
                if dims.len() == MAX_RANK {
                    return Err(de::Error::custom(format_args!("a shape has at most {MAX_RANK} dimensions")));
                }
                dims.push(d);
            }
            Ok(dims)
        }
    }
    d.deserialize_seq(Shape)
}

/// A boolean parameter, if present and boolean.
pub fn flag(p: &Parameters<'_>, key: &str) -> Option<bool> {
    p.get(key).and_then(|raw| serde_json::from_str::<bool>(raw.get()).ok())
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

/// How the response encodes each output, taken from the request so that the request
/// (and its body) can be freed before the model runs.
#[derive(Debug, Clone, Default)]
pub struct OutputEncoding {
    pub id: Option<String>,
    /// `binary_data_output` of the request.
    pub all_binary: bool,
    /// Outputs asked for, with their own `binary_data` flag.
    pub requested: Vec<(String, Option<bool>)>,
}

impl OutputEncoding {
    pub fn of(req: &InferRequest<'_>) -> OutputEncoding {
        OutputEncoding {
            id: req.id.clone(),
            all_binary: flag(&req.parameters, "binary_data_output").unwrap_or(false),
            requested: req
                .outputs
                .iter()
                .map(|o| (o.name.clone(), flag(&o.parameters, "binary_data")))
                .collect(),
        }
    }

    /// Whether an output is asked for in binary: per output, else request-wide.
    pub fn wants_binary(&self, output: &str) -> bool {
        self.requested.iter().find(|(n, _)| n == output).and_then(|(_, b)| *b).unwrap_or(self.all_binary)
    }

    pub fn output_names(&self) -> Vec<String> {
        self.requested.iter().map(|(n, _)| n.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn request(json: &str) -> InferRequest<'_> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn binary_output_selection() {
        let r = request(
            r#"{"inputs":[],"outputs":[{"name":"a","parameters":{"binary_data":true}},{"name":"b"}]}"#,
        );
        let enc = OutputEncoding::of(&r);
        assert!(enc.wants_binary("a") && !enc.wants_binary("b"));
        let r = request(r#"{"inputs":[],"parameters":{"binary_data_output":true}}"#);
        assert!(OutputEncoding::of(&r).wants_binary("anything"));
    }

    #[test]
    fn shapes_are_bounded_while_parsing() {
        let long = format!(
            r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{}]}}]}}"#,
            vec!["1"; 65].join(",")
        );
        let e = serde_json::from_str::<InferRequest>(&long).unwrap_err();
        assert!(e.to_string().contains("at most 64"), "{e}");
    }

    #[test]
    fn split_body_checks_the_header_length() {
        assert!(split_body(b"{}", Some("9")).is_err());
        assert!(split_body(b"{}", Some("x")).is_err());
        assert_eq!(split_body(b"{}ab", Some("2")).unwrap(), (&b"{}"[..], &b"ab"[..]));
    }
}
