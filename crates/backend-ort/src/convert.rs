//! Moving tensors between SnoozeML's typed vectors and ONNX Runtime values.
//!
//! Inputs are lent to the runtime as views of the request's own buffers
//! (`TensorRef::from_array_view`), so a request's data is not copied on the way in
//! and stays with the caller for an out-of-memory retry; outputs are copied out of the
//! runtime's buffers because they die with the run.

use std::fmt::Debug;

use ort::{
    session::SessionInputValue,
    value::{DynValue, PrimitiveTensorElementType, TensorElementType, ValueType},
};
use snooze_core::{InferError, Tensor, TensorData};

/// Turns a request tensor into a named session input that borrows its data.
pub(crate) fn to_input<'t>(
    model: &str,
    t: &'t Tensor,
) -> Result<(String, SessionInputValue<'t>), InferError> {
    let Tensor { name, shape, data } = t;
    let value: ort::Result<SessionInputValue<'t>> = match data {
        TensorData::Bool(v) => view(shape, v),
        TensorData::Uint8(v) => view(shape, v),
        TensorData::Uint16(v) => view(shape, v),
        TensorData::Uint32(v) => view(shape, v),
        TensorData::Uint64(v) => view(shape, v),
        TensorData::Int8(v) => view(shape, v),
        TensorData::Int16(v) => view(shape, v),
        TensorData::Int32(v) => view(shape, v),
        TensorData::Int64(v) => view(shape, v),
        TensorData::Fp16(v) => view(shape, v),
        TensorData::Fp32(v) => view(shape, v),
        TensorData::Fp64(v) => view(shape, v),
        TensorData::Bytes(v) => {
            // Strings are copied: ONNX Runtime keeps its own string objects.
            let strings = utf8_strings(name, v)?;
            ort::value::Tensor::from_string_array((shape.clone(), strings.as_slice()))
                .map(|t| t.into_dyn().into())
        }
    };
    let value = value.map_err(|e| {
        crate::errors::infer_error(model, e.code(), &format!("input '{name}': {}", e.message()), true)
    })?;
    Ok((name.clone(), value))
}

fn view<'t, T>(shape: &[i64], data: &'t [T]) -> ort::Result<SessionInputValue<'t>>
where
    T: PrimitiveTensorElementType + Debug + Clone + 'static,
{
    Ok(ort::value::TensorRef::from_array_view((shape.to_vec(), data))?.into())
}

/// ONNX Runtime strings are NUL-terminated UTF-8 on the way in, while KServe BYTES
/// are arbitrary: refuse what cannot pass rather than mangle it.
fn utf8_strings(name: &str, elements: &[Vec<u8>]) -> Result<Vec<String>, InferError> {
    elements
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            if bytes.contains(&0) {
                return Err(InferError::InvalidInput(format!(
                    "element {i} of input '{name}' contains a NUL byte, which ONNX Runtime strings cannot hold"
                )));
            }
            String::from_utf8(bytes.clone()).map_err(|_| {
                InferError::InvalidInput(format!(
                    "element {i} of input '{name}' is not valid UTF-8; the onnx backend passes BYTES as \
                     ONNX Runtime strings, which must be UTF-8"
                ))
            })
        })
        .collect()
}

/// Copies one output out of the runtime.
pub(crate) fn to_tensor(name: &str, value: &DynValue) -> Result<Tensor, String> {
    let ty = match value.dtype() {
        ValueType::Tensor { ty, .. } => *ty,
        other => return Err(format!("output '{name}' is a {other:?}, not a tensor")),
    };
    let (shape, data) = match ty {
        TensorElementType::Bool => copy(value, TensorData::Bool),
        TensorElementType::Uint8 => copy(value, TensorData::Uint8),
        TensorElementType::Uint16 => copy(value, TensorData::Uint16),
        TensorElementType::Uint32 => copy(value, TensorData::Uint32),
        TensorElementType::Uint64 => copy(value, TensorData::Uint64),
        TensorElementType::Int8 => copy(value, TensorData::Int8),
        TensorElementType::Int16 => copy(value, TensorData::Int16),
        TensorElementType::Int32 => copy(value, TensorData::Int32),
        TensorElementType::Int64 => copy(value, TensorData::Int64),
        TensorElementType::Float16 => copy(value, TensorData::Fp16),
        TensorElementType::Float32 => copy(value, TensorData::Fp32),
        TensorElementType::Float64 => copy(value, TensorData::Fp64),
        TensorElementType::String => value.try_extract_strings().map(|(shape, strings)| {
            (shape.to_vec(), TensorData::Bytes(strings.into_iter().map(String::into_bytes).collect()))
        }),
        other => {
            return Err(format!("output '{name}' has element type {other:?}, which KServe cannot carry"))
        }
    }
    .map_err(|e| format!("cannot read output '{name}': {}", e.message()))?;
    Ok(Tensor::new(name, shape, data))
}

fn copy<T>(value: &DynValue, wrap: fn(Vec<T>) -> TensorData) -> ort::Result<(Vec<i64>, TensorData)>
where
    T: PrimitiveTensorElementType + Clone,
{
    let (shape, data) = value.try_extract_tensor::<T>()?;
    Ok((shape.to_vec(), wrap(data.to_vec())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bytes_must_be_utf8_without_nul() {
        let ok = utf8_strings("s", &[b"a".to_vec(), "déjà".as_bytes().to_vec(), vec![]]).unwrap();
        assert_eq!(ok, vec!["a", "déjà", ""]);
        let err = utf8_strings("s", &[b"a".to_vec(), vec![0xff, 0xfe]]).unwrap_err();
        assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("element 1 of input 's'")), "{err}");
        let err = utf8_strings("s", &[b"a\0b".to_vec()]).unwrap_err();
        assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("NUL")), "{err}");
    }
}
