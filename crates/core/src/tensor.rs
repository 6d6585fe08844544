//! Tensors as they cross the boundary between a transport and a backend.
//!
//! The element types are the KServe v2 datatypes; each holds its elements in a
//! typed, row-major `Vec` so a backend can hand them to its runtime without
//! reinterpreting bytes, and a transport can encode them as JSON or as the binary
//! tensor data extension (little-endian) without knowing the backend.

use std::fmt;

use half::f16;

/// A KServe v2 datatype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
}

impl DataType {
    pub const ALL: [DataType; 13] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    /// The wire name (`"FP32"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    pub fn parse(s: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.as_str() == s)
    }

    /// Bytes per element in the binary encoding; `None` for BYTES (length-prefixed).
    pub fn element_size(self) -> Option<usize> {
        Some(match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 => 2,
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
            DataType::Bytes => return None,
        })
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Elements of a tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    Bool(Vec<bool>),
    Uint8(Vec<u8>),
    Uint16(Vec<u16>),
    Uint32(Vec<u32>),
    Uint64(Vec<u64>),
    Int8(Vec<i8>),
    Int16(Vec<i16>),
    Int32(Vec<i32>),
    Int64(Vec<i64>),
    Fp16(Vec<f16>),
    Fp32(Vec<f32>),
    Fp64(Vec<f64>),
    Bytes(Vec<Vec<u8>>),
}

/// Applies `$body` to the typed vector inside a `TensorData`, whatever its type.
#[macro_export]
macro_rules! with_tensor_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::TensorData::Bool($v) => $body,
            $crate::TensorData::Uint8($v) => $body,
            $crate::TensorData::Uint16($v) => $body,
            $crate::TensorData::Uint32($v) => $body,
            $crate::TensorData::Uint64($v) => $body,
            $crate::TensorData::Int8($v) => $body,
            $crate::TensorData::Int16($v) => $body,
            $crate::TensorData::Int32($v) => $body,
            $crate::TensorData::Int64($v) => $body,
            $crate::TensorData::Fp16($v) => $body,
            $crate::TensorData::Fp32($v) => $body,
            $crate::TensorData::Fp64($v) => $body,
            $crate::TensorData::Bytes($v) => $body,
        }
    };
}

impl TensorData {
    pub fn datatype(&self) -> DataType {
        match self {
            TensorData::Bool(_) => DataType::Bool,
            TensorData::Uint8(_) => DataType::Uint8,
            TensorData::Uint16(_) => DataType::Uint16,
            TensorData::Uint32(_) => DataType::Uint32,
            TensorData::Uint64(_) => DataType::Uint64,
            TensorData::Int8(_) => DataType::Int8,
            TensorData::Int16(_) => DataType::Int16,
            TensorData::Int32(_) => DataType::Int32,
            TensorData::Int64(_) => DataType::Int64,
            TensorData::Fp16(_) => DataType::Fp16,
            TensorData::Fp32(_) => DataType::Fp32,
            TensorData::Fp64(_) => DataType::Fp64,
            TensorData::Bytes(_) => DataType::Bytes,
        }
    }

    pub fn len(&self) -> usize {
        with_tensor_data!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes held, for request-size accounting.
    pub fn byte_size(&self) -> usize {
        match self {
            TensorData::Bytes(v) => v.iter().map(|b| b.len() + 4).sum(),
            other => other.len() * other.datatype().element_size().unwrap_or(1),
        }
    }
}

impl TensorData {
    /// Elements `start..end` (row-major), same type.
    pub fn slice(&self, start: usize, end: usize) -> TensorData {
        macro_rules! cut {
            ($($variant:ident),*) => {
                match self { $(TensorData::$variant(v) => TensorData::$variant(v[start..end].to_vec()),)* }
            };
        }
        cut!(Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Fp16, Fp32, Fp64, Bytes)
    }

    /// Appends `other`'s elements; `false` (and nothing appended) if the types differ.
    pub fn append(&mut self, other: TensorData) -> bool {
        macro_rules! join {
            ($($variant:ident),*) => {
                match (self, other) {
                    $((TensorData::$variant(a), TensorData::$variant(b)) => { a.extend(b); true })*
                    _ => false,
                }
            };
        }
        join!(Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Fp16, Fp32, Fp64, Bytes)
    }
}

/// Splits a batch in halves along the first dimension: every input must have the same
/// batch size `n >= 2`. `None` when the request cannot be split.
pub fn split_batch(inputs: &[Tensor]) -> Option<(Vec<Tensor>, Vec<Tensor>)> {
    let n = *inputs.first()?.shape.first()?;
    if n < 2 || inputs.iter().any(|t| t.shape.first() != Some(&n)) {
        return None;
    }
    let (n, half) = (n as usize, (n / 2) as usize);
    let mut left = Vec::with_capacity(inputs.len());
    let mut right = Vec::with_capacity(inputs.len());
    for t in inputs {
        let row = t.data.len() / n;
        let mut shape = t.shape.clone();
        shape[0] = half as i64;
        left.push(Tensor::new(t.name.clone(), shape.clone(), t.data.slice(0, half * row)));
        shape[0] = (n - half) as i64;
        right.push(Tensor::new(t.name.clone(), shape, t.data.slice(half * row, n * row)));
    }
    Some((left, right))
}

/// Joins the outputs of two halves along the first dimension.
pub fn concat_batch(left: Vec<Tensor>, right: Vec<Tensor>) -> Option<Vec<Tensor>> {
    if left.len() != right.len() {
        return None;
    }
    left.into_iter()
        .zip(right)
        .map(|(mut a, b)| {
            let same_rest =
                a.name == b.name && a.shape.len() == b.shape.len() && a.shape[1..] == b.shape[1..];
            if a.shape.is_empty() || !same_rest || !a.data.append(b.data) {
                return None;
            }
            a.shape[0] += b.shape[0];
            Some(a)
        })
        .collect()
}

/// A named tensor with its shape (every dimension known).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub data: TensorData,
}

impl Tensor {
    pub fn new(name: impl Into<String>, shape: Vec<i64>, data: TensorData) -> Tensor {
        Tensor { name: name.into(), shape, data }
    }

    pub fn datatype(&self) -> DataType {
        self.data.datatype()
    }

    /// Number of elements the shape describes, or `None` for a negative dimension / overflow.
    pub fn shape_elements(shape: &[i64]) -> Option<usize> {
        shape.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
    }
}

/// What a model takes or gives, as declared by the model (`-1` = any size).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// Checks a request tensor against this spec; the error names the tensor.
    pub fn check(&self, t: &Tensor) -> Result<(), String> {
        self.check_header(&t.name, t.datatype(), &t.shape)
    }

    /// Checks a declared datatype and shape, before any data is decoded.
    pub fn check_header(&self, name: &str, datatype: DataType, shape: &[i64]) -> Result<(), String> {
        if datatype != self.datatype {
            return Err(format!(
                "input '{name}' has datatype {datatype} but the model expects {}",
                self.datatype
            ));
        }
        let shape_ok = self.shape.len() == shape.len()
            && self.shape.iter().zip(shape).all(|(&want, &have)| want < 0 || want == have);
        if !shape_ok {
            return Err(format!(
                "input '{name}' has shape {shape:?} but the model expects {:?} (-1 = any size)",
                self.shape
            ));
        }
        Ok(())
    }
}

/// A model's declared interface (KServe model metadata).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ModelSignature {
    pub platform: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatype_names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(DataType::parse(d.as_str()), Some(d));
        }
        assert_eq!(DataType::parse("FLOAT"), None);
    }

    #[test]
    fn spec_check_names_the_tensor() {
        let spec = TensorSpec { name: "x".into(), datatype: DataType::Fp32, shape: vec![-1, 4] };
        let ok = Tensor::new("x", vec![2, 4], TensorData::Fp32(vec![0.0; 8]));
        assert!(spec.check(&ok).is_ok());
        assert!(spec.check(&ok).is_ok());
        let bad_shape = Tensor::new("x", vec![2, 3], TensorData::Fp32(vec![0.0; 6]));
        assert!(spec.check(&bad_shape).unwrap_err().contains("'x'"));
        let bad_type = Tensor::new("x", vec![2, 4], TensorData::Int32(vec![0; 8]));
        assert!(spec.check(&bad_type).unwrap_err().contains("FP32"));
    }

    #[test]
    fn split_and_concat_batches() {
        let x = Tensor::new("x", vec![3, 2], TensorData::Fp32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let b =
            Tensor::new("b", vec![3], TensorData::Bytes(vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]));
        let (l, r) = split_batch(&[x.clone(), b.clone()]).unwrap();
        assert_eq!(l[0].shape, [1, 2]);
        assert_eq!(r[0].data, TensorData::Fp32(vec![3.0, 4.0, 5.0, 6.0]));
        assert_eq!(r[1].data, TensorData::Bytes(vec![b"b".to_vec(), b"c".to_vec()]));
        assert_eq!(concat_batch(l, r).unwrap(), vec![x.clone(), b]);
        let one = Tensor::new("x", vec![1, 2], TensorData::Fp32(vec![1.0, 2.0]));
        assert!(split_batch(std::slice::from_ref(&one)).is_none(), "a batch of one cannot be split");
        assert!(split_batch(&[x, one]).is_none(), "different batch sizes");
    }

    #[test]
    fn shape_elements_rejects_negative_and_overflow() {
        assert_eq!(Tensor::shape_elements(&[2, 3]), Some(6));
        assert_eq!(Tensor::shape_elements(&[]), Some(1));
        assert_eq!(Tensor::shape_elements(&[-1, 3]), None);
        assert_eq!(Tensor::shape_elements(&[i64::MAX, 4]), None);
    }
}
