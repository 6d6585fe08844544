//! ModelInferRequest inputs to tensors and tensors to a ModelInferResponse: typed
//! `contents` checked element by element against their datatype (after their length was
//! checked against the shape), `raw_input_contents` through the shared binary decoder;
//! outputs always raw, as Triton sends them.

use std::collections::HashSet;

use snooze_core::{DataType, ModelInfo, SnoozeError, Tensor, TensorData};

use super::proto::{
    model_infer_request::InferInputTensor, model_infer_response::InferOutputTensor, InferTensorContents,
    ModelInferResponse,
};
use crate::request::{codec, decode, inference, AppState, VERSION};

/// Typed `contents` of one input, checked element by element against its datatype
/// (its length was checked against the shape before anything was converted).
fn typed(name: &str, datatype: DataType, c: InferTensorContents) -> Result<TensorData, SnoozeError> {
    fn narrow<S: Copy, T: TryFrom<S>>(name: &str, v: Vec<S>, dt: DataType) -> Result<Vec<T>, SnoozeError> {
        v.into_iter()
            .enumerate()
            .map(|(i, x)| {
                T::try_from(x).map_err(|_| {
                    SnoozeError::invalid(format!("input '{name}' element {i} is out of range for {dt}"))
                })
            })
            .collect()
    }
    Ok(match datatype {
        DataType::Bool => TensorData::Bool(c.bool_contents),
        DataType::Int8 => TensorData::Int8(narrow(name, c.int_contents, datatype)?),
        DataType::Int16 => TensorData::Int16(narrow(name, c.int_contents, datatype)?),
        DataType::Int32 => TensorData::Int32(c.int_contents),
        DataType::Int64 => TensorData::Int64(c.int64_contents),
        DataType::Uint8 => TensorData::Uint8(narrow(name, c.uint_contents, datatype)?),
        DataType::Uint16 => TensorData::Uint16(narrow(name, c.uint_contents, datatype)?),
        DataType::Uint32 => TensorData::Uint32(c.uint_contents),
        DataType::Uint64 => TensorData::Uint64(c.uint64_contents),
        DataType::Fp32 => TensorData::Fp32(c.fp32_contents),
        DataType::Fp64 => TensorData::Fp64(c.fp64_contents),
        DataType::Bytes => TensorData::Bytes(c.bytes_contents),
        DataType::Fp16 => {
            return Err(SnoozeError::invalid(format!(
                "input '{name}': FP16 has no typed contents in the protocol; send it in raw_input_contents"
            )))
        }
    })
}

/// How many elements the typed contents hold for `datatype`, and whether another
/// field holds any (a client that filled the wrong one).
fn typed_len(datatype: DataType, c: &InferTensorContents) -> (usize, usize) {
    let lens = [
        c.bool_contents.len(),
        c.int_contents.len(),
        c.int64_contents.len(),
        c.uint_contents.len(),
        c.uint64_contents.len(),
        c.fp32_contents.len(),
        c.fp64_contents.len(),
        c.bytes_contents.len(),
    ];
    let field = match datatype {
        DataType::Bool => 0,
        DataType::Int8 | DataType::Int16 | DataType::Int32 => 1,
        DataType::Int64 => 2,
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => 3,
        DataType::Uint64 => 4,
        DataType::Fp32 => 5,
        DataType::Fp64 => 6,
        DataType::Bytes => 7,
        DataType::Fp16 => return (0, lens.iter().sum()),
    };
    (lens[field], lens.iter().sum::<usize>() - lens[field])
}

/// Decodes a `ModelInferRequest`'s inputs: headers first (names, datatypes, shapes
/// against the model), then data: raw bytes in the binary layout, or typed contents
/// whose length must match the shape before anything is converted.
pub(super) fn decode_inputs(
    state: &AppState,
    info: &ModelInfo,
    inputs: Vec<InferInputTensor>,
    raw: Vec<Vec<u8>>,
) -> Result<Vec<Tensor>, SnoozeError> {
    let sig = info.signature();
    let sig = sig.as_ref().ok();
    let model = info.name.as_str();
    if !raw.is_empty() && raw.len() != inputs.len() {
        return Err(SnoozeError::invalid(format!(
            "raw_input_contents has {} entries for {} inputs (one per input, or none)",
            raw.len(),
            inputs.len()
        )));
    }
    let mut seen = HashSet::new();
    let mut headers = Vec::with_capacity(inputs.len());
    for input in &inputs {
        let (dt, count) =
            decode::check_header(&input.name, &input.datatype, &input.shape, sig, model, &mut seen)?;
        inference::check_text_count(state, info, &input.name, count)?;
        headers.push((dt, count));
    }
    decode::check_complete(sig, &seen)?;
    if !raw.is_empty() {
        if let Some(i) = inputs.iter().position(|i| i.contents.is_some()) {
            return Err(SnoozeError::invalid(format!(
                "input '{}' has contents while the request has raw_input_contents (use one or the other)",
                inputs[i].name
            )));
        }
        let plans = inputs
            .iter()
            .zip(&headers)
            .zip(&raw)
            .map(|((input, (dt, count)), bytes)| {
                decode::plan_raw(&input.name, *dt, &input.shape, *count, bytes)
            })
            .collect::<Result<Vec<_>, _>>()?;
        return decode::decode(plans, &[]);
    }
    inputs
        .into_iter()
        .zip(headers)
        .map(|(input, (dt, count))| {
            let name = input.name;
            let contents = input.contents.unwrap_or_default();
            let (len, others) = typed_len(dt, &contents);
            if others > 0 {
                return Err(SnoozeError::invalid(format!(
                    "input '{name}' ({dt}) has values in a contents field of another datatype"
                )));
            }
            if len != count {
                return Err(SnoozeError::invalid(format!(
                    "input '{name}' has {len} elements but its shape {:?} needs {count}",
                    input.shape
                )));
            }
            let data = typed(&name, dt, contents)?;
            Ok(Tensor::new(name, input.shape, data))
        })
        .collect()
}

/// Outputs are always sent in `raw_output_contents` (as Triton does): the binary
/// layout, which every client reads, at no conversion cost.
pub(super) fn encode_outputs(name: &str, id: String, outputs: Vec<Tensor>) -> ModelInferResponse {
    let mut raw = Vec::with_capacity(outputs.len());
    let tensors = outputs
        .into_iter()
        .map(|t| {
            let mut bytes = Vec::new();
            codec::to_binary(&t.data, &mut bytes);
            raw.push(bytes);
            InferOutputTensor {
                datatype: t.datatype().as_str().to_string(),
                name: t.name,
                shape: t.shape,
                parameters: Default::default(),
                contents: None,
            }
        })
        .collect();
    ModelInferResponse {
        model_name: name.to_string(),
        model_version: VERSION.to_string(),
        id,
        parameters: Default::default(),
        outputs: tensors,
        raw_output_contents: raw,
    }
}
