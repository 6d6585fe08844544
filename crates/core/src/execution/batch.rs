//! Requests merged into one run and split back: tensors stacked along the first
//! dimension (micro-batches of at most `max_rows` rows), texts of several embedding
//! requests embedded together, outputs cut back per request.

use crate::{
    backend::{EmbedInput, Embeddings, InferError, LoadedModel},
    tensor::Tensor,
};

use super::{batch_rows, Output, Payload};

/// Merges the requests' inputs along the first dimension, runs them in micro-batches
/// of at most `max_rows` rows, and splits the outputs back per request. A lone
/// request that fits runs on its own tensors, without a copy.
pub(super) fn run_tensors(
    model: &dyn LoadedModel,
    requests: &[&[Tensor]],
    outputs: &[String],
    max_rows: usize,
) -> Result<Vec<Vec<Tensor>>, InferError> {
    let rows: Vec<usize> = requests.iter().map(|r| batch_rows(r).unwrap_or(1)).collect();
    let total: usize = rows.iter().sum();
    if requests.len() == 1 && (total <= max_rows || batch_rows(requests[0]).is_none()) {
        return Ok(vec![model.infer(requests[0], outputs)?]);
    }
    let merged = if requests.len() == 1 { requests[0].to_vec() } else { concat_rows(requests)? };
    let mut joined: Option<Vec<Tensor>> = None;
    let mut start = 0;
    while start < total || (total == 0 && joined.is_none()) {
        let end = (start + max_rows).min(total);
        let part: Vec<Tensor> = merged.iter().map(|t| slice_rows(t, total, start, end)).collect();
        let out = model.infer(&part, outputs)?;
        joined = Some(match joined {
            None => out,
            Some(acc) => append_rows(acc, out)?,
        });
        if total == 0 {
            break;
        }
        start = end;
    }
    split_rows(joined.unwrap_or_default(), &rows)
}

/// Rows `start..end` of a tensor whose first dimension is `total`.
fn slice_rows(t: &Tensor, total: usize, start: usize, end: usize) -> Tensor {
    let row = t.data.len().checked_div(total).unwrap_or(0);
    let mut shape = t.shape.clone();
    if let Some(first) = shape.first_mut() {
        *first = (end - start) as i64;
    }
    Tensor::new(t.name.clone(), shape, t.data.slice(start * row, end * row))
}

/// Every request's inputs, joined along the first dimension, by input name.
fn concat_rows(requests: &[&[Tensor]]) -> Result<Vec<Tensor>, InferError> {
    let mismatch = || InferError::Failed("the requests of a batch have different inputs".into());
    let first = requests.first().ok_or_else(mismatch)?;
    first
        .iter()
        .map(|t| {
            let mut joined = Tensor::new(t.name.clone(), t.shape.clone(), t.data.clone());
            for other in &requests[1..] {
                let o = other.iter().find(|o| o.name == t.name).ok_or_else(mismatch)?;
                if !joined.data.append(o.data.clone()) || o.shape.get(1..) != t.shape.get(1..) {
                    return Err(mismatch());
                }
                joined.shape[0] += o.shape[0];
            }
            Ok(joined)
        })
        .collect()
}

/// Joins the outputs of two consecutive micro-batches.
fn append_rows(acc: Vec<Tensor>, next: Vec<Tensor>) -> Result<Vec<Tensor>, InferError> {
    crate::tensor::concat_batch(acc, next)
        .ok_or_else(|| InferError::Failed("the outputs of the micro-batches cannot be joined".into()))
}

/// Cuts every output along its first dimension into one part per request.
fn split_rows(outputs: Vec<Tensor>, rows: &[usize]) -> Result<Vec<Vec<Tensor>>, InferError> {
    let total: usize = rows.iter().sum();
    let mut per: Vec<Vec<Tensor>> = rows.iter().map(|_| Vec::with_capacity(outputs.len())).collect();
    for t in outputs {
        if t.shape.first().copied() != Some(total as i64) {
            return Err(InferError::Failed(format!(
                "output '{}' has shape {:?}, not {total} rows: it cannot be split per request",
                t.name, t.shape
            )));
        }
        let mut start = 0;
        for (i, &n) in rows.iter().enumerate() {
            per[i].push(slice_rows(&t, total, start, start + n));
            start += n;
        }
    }
    Ok(per)
}

/// Texts (or token lists) of every request in one call (or several of `max_rows`),
/// vectors split back per request.
pub(super) fn run_embed(
    model: &dyn LoadedModel,
    payloads: &[&Payload],
    max_rows: usize,
) -> Result<Vec<Output>, InferError> {
    let embedder = model
        .as_embedder()
        .ok_or_else(|| InferError::InvalidInput("this model does not produce embeddings".into()))?;
    let inputs: Vec<&EmbedInput> = payloads
        .iter()
        .map(|p| match p {
            Payload::Embed(i) => Ok(i),
            _ => Err(InferError::Failed("a batch mixes embeddings and other requests".into())),
        })
        .collect::<Result<_, _>>()?;
    let merged = merge_embed_inputs(&inputs)?;
    let mut vectors = Vec::with_capacity(merged.len());
    let mut tokens = Vec::with_capacity(merged.len());
    for part in chunk_embed_input(&merged, max_rows) {
        let out = embedder.embed(&part)?;
        vectors.extend(out.vectors);
        tokens.extend(out.tokens);
    }
    let normalized = embedder.normalized();
    let mut vectors = vectors.into_iter();
    let mut tokens = tokens.into_iter();
    Ok(inputs
        .iter()
        .map(|i| {
            let v: Vec<Vec<f32>> = vectors.by_ref().take(i.len()).collect();
            let t: Vec<usize> = tokens.by_ref().take(i.len()).collect();
            Output::Embeddings { embeddings: Embeddings::new(v, t), normalized }
        })
        .collect())
}

fn merge_embed_inputs(inputs: &[&EmbedInput]) -> Result<EmbedInput, InferError> {
    if let [one] = inputs {
        return Ok((*one).clone());
    }
    let mut texts = Vec::new();
    let mut ids = Vec::new();
    for i in inputs {
        match i {
            EmbedInput::Texts(t) => texts.extend(t.iter().cloned()),
            EmbedInput::TokenIds(t) => ids.extend(t.iter().cloned()),
        }
    }
    match (texts.is_empty(), ids.is_empty()) {
        (_, true) => Ok(EmbedInput::Texts(texts)),
        (true, false) => Ok(EmbedInput::TokenIds(ids)),
        (false, false) => Err(InferError::Failed("a batch mixes texts and token ids".into())),
    }
}

fn chunk_embed_input(input: &EmbedInput, max_rows: usize) -> Vec<EmbedInput> {
    if input.len() <= max_rows {
        return vec![input.clone()];
    }
    match input {
        EmbedInput::Texts(t) => t.chunks(max_rows).map(|c| EmbedInput::Texts(c.to_vec())).collect(),
        EmbedInput::TokenIds(t) => t.chunks(max_rows).map(|c| EmbedInput::TokenIds(c.to_vec())).collect(),
    }
}
