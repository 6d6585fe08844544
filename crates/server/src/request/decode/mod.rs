//! Decoding KServe v2 inputs, bounded by what was sent.
//!
//! Two steps. [`plan_inputs`] reads only each input's header — name, datatype,
//! shape, where its data is — and checks it against the model's metadata and against
//! what the body can hold, with checked arithmetic throughout. Only then does
//! [`decode`] turn data into tensors, reserving at most what the bytes at hand can
//! back (never the element count a client declared) and counting elements as it goes,
//! so `"shape":[1099511627776,256],"data":[]` costs nothing and a ragged nested array
//! is a 400 naming the tensor.

use std::collections::HashSet;

use serde_json::value::RawValue;
use snooze_core::{DataType, ModelSignature, SnoozeError, Tensor};

use super::codec::InferRequest;

mod binary;
mod json;
#[cfg(test)]
mod tests;

use binary::from_binary;
use json::from_json;

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
                        "input '{name}' declares {count} elements (shape {:?}) but its JSON data is {} characters long, too short to hold them",
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
