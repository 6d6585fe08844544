//! An embedding model on KServe v2: one BYTES input of texts, one FP32 output of vectors.

use snooze_core::{
    DataType, EmbedInput, Embedder, InferError, ModelSignature, Tensor, TensorData, TensorSpec,
};

/// The output tensor's name, for KServe and for the signature.
pub const OUTPUT_NAME: &str = "embedding";

/// The KServe signature: texts in, one vector per text out.
pub fn signature(platform: &str, hidden_size: usize) -> ModelSignature {
    let hidden = i64::try_from(hidden_size).unwrap_or(i64::MAX);
    ModelSignature {
        platform: platform.into(),
        inputs: vec![TensorSpec { name: "text".into(), datatype: DataType::Bytes, shape: vec![-1] }],
        outputs: vec![TensorSpec {
            name: OUTPUT_NAME.into(),
            datatype: DataType::Fp32,
            shape: vec![-1, hidden],
        }],
    }
}

/// A KServe request to an embedding model: its texts in, their vectors out.
pub fn infer(model: &dyn Embedder, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
    let embeddings = model.embed(&EmbedInput::Texts(texts(inputs, outputs)?))?;
    Ok(vec![output(embeddings.vectors, model.dimensions())])
}

/// The texts of a KServe request: its one BYTES input (named `text` when there are several).
pub fn texts(inputs: &[Tensor], outputs: &[String]) -> Result<Vec<String>, InferError> {
    if let Some(unknown) = outputs.iter().find(|o| o.as_str() != OUTPUT_NAME) {
        return Err(InferError::InvalidInput(format!(
            "unknown output '{unknown}'; this model has one output, '{OUTPUT_NAME}'"
        )));
    }
    let input = match inputs.len() {
        1 => inputs.first(),
        _ => inputs.iter().find(|t| t.name == "text"),
    };
    let input = input.ok_or_else(|| {
        InferError::InvalidInput(
            "expected one BYTES input of texts (named 'text' when there are several)".into(),
        )
    })?;
    let name = &input.name;
    let TensorData::Bytes(items) = &input.data else {
        return Err(InferError::InvalidInput(format!(
            "input '{name}' has datatype {} but the model expects BYTES (UTF-8 texts)",
            input.data.datatype()
        )));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            String::from_utf8(bytes.clone()).map_err(|_| {
                InferError::InvalidInput(format!("input '{name}' element {i} is not valid UTF-8 text"))
            })
        })
        .collect()
}

/// The output tensor holding `vectors` (`[rows, dims]`).
pub fn output(vectors: Vec<Vec<f32>>, dims: usize) -> Tensor {
    let rows = vectors.len();
    let data: Vec<f32> = vectors.into_iter().flatten().collect();
    let shape = vec![i64::try_from(rows).unwrap_or(i64::MAX), i64::try_from(dims).unwrap_or(i64::MAX)];
    Tensor::new(OUTPUT_NAME, shape, TensorData::Fp32(data))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn signature_has_text_in_and_embedding_out() {
        let s = signature("onnx_sentence_embedding", 384);
        assert_eq!((s.inputs[0].name.as_str(), s.inputs[0].datatype), ("text", DataType::Bytes));
        assert_eq!(s.outputs[0].shape, vec![-1, 384]);
    }

    #[test]
    fn texts_are_checked() {
        let t = |name: &str, data| Tensor::new(name, vec![1], data);
        let ok = texts(&[t("text", TensorData::Bytes(vec![b"hi".to_vec()]))], &[]).unwrap();
        assert_eq!(ok, vec!["hi".to_string()]);
        let e = texts(&[t("x", TensorData::Fp32(vec![1.0]))], &[]).unwrap_err();
        assert!(e.to_string().contains("BYTES"), "{e}");
        let e = texts(&[t("x", TensorData::Bytes(vec![vec![0xff]]))], &[]).unwrap_err();
        assert!(e.to_string().contains("element 0 is not valid UTF-8"), "{e}");
        let e = texts(&[t("text", TensorData::Bytes(vec![]))], &["y".into()]).unwrap_err();
        assert!(e.to_string().contains("unknown output 'y'"), "{e}");
    }
}
