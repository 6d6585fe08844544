//! OpenAI-compatible `POST /v1/embeddings` and `GET /v1/models[/{model}]`, so the official SDKs
//! work unchanged. Errors take OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use std::{borrow::Cow, fmt, time::UNIX_EPOCH};

use axum::{
    body::Body,
    extract::State,
    http::{header, HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use base64::Engine;
use serde::{
    de::{self, Deserializer, SeqAccess, Visitor},
    Deserialize,
};
use serde_json::{json, value::RawValue, Value};
use snooze_core::{EmbedInput, ErrorKind, SnoozeError, Task};

use super::{
    body::read_body,
    error::{error_response, openai_body},
    kserve::priority,
    AppState,
};
use crate::request::metrics::Observation;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
}

/// An error in OpenAI's shape: the error, the request field it is about, and the model
/// (or pipeline) it names when that one is unknown, for `x-snooze-model`.
pub struct OpenAiError(SnoozeError, Option<Cow<'static, str>>, Option<String>);

/// The names of a multipart form's fields (or a JSON body's members) seen so far. One
/// given twice is refused: which of the two should count is a guess either way. OpenAI's
/// list fields (`...[]`) repeat by design. A set: a body may hold many members.
pub(super) struct SeenFields {
    names: std::collections::HashSet<String>,
    what: &'static str,
}

impl Default for SeenFields {
    fn default() -> Self {
        SeenFields { names: Default::default(), what: "form field" }
    }
}

impl SeenFields {
    /// For a JSON object's members.
    pub(super) fn members() -> Self {
        SeenFields { what: "member", ..Default::default() }
    }

    pub(super) fn once(&mut self, name: &str) -> Result<(), OpenAiError> {
        if name.ends_with("[]") {
            return Ok(());
        }
        if !self.names.insert(name.to_string()) {
            let msg = format!("the {} '{name}' is given more than once: send it once", self.what);
            return Err(OpenAiError::about(name.to_string(), SnoozeError::invalid(msg)));
        }
        Ok(())
    }
}

impl OpenAiError {
    /// `e`, naming the request field `param` it is about.
    pub fn about(param: impl Into<Cow<'static, str>>, e: SnoozeError) -> OpenAiError {
        OpenAiError(e, Some(param.into()).filter(|p| !p.is_empty()), None)
    }

    /// Names the model the request asked for in the answer's `x-snooze-model`, as every
    /// answer about a model does (KServe's 404 for an unknown one included): for a
    /// model or pipeline the server does not know, which no handler can name.
    pub fn naming(mut self, model: &str) -> OpenAiError {
        self.2 = Some(model.to_owned());
        self
    }

    pub fn error(&self) -> &SnoozeError {
        &self.0
    }
}

impl From<SnoozeError> for OpenAiError {
    fn from(e: SnoozeError) -> Self {
        OpenAiError(e, None, None)
    }
}

fn invalid(param: &'static str, msg: impl Into<String>) -> OpenAiError {
    OpenAiError::about(param, SnoozeError::invalid(msg))
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let OpenAiError(e, param, model) = self;
        let mut response = error_response(&e, openai_body(&e, param.as_deref()));
        if let Some(value) = model.and_then(|m| HeaderValue::from_str(&m).ok()) {
            response.headers_mut().insert(MODEL_HEADER, value);
        }
        response
    }
}

#[derive(Deserialize)]
struct EmbeddingsRequest<'a> {
    /// Required here or in the `x-snooze-model` header (which a proxy can hash on).
    #[serde(default)]
    model: Option<String>,
    #[serde(borrow)]
    input: &'a RawValue,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

/// `str | [str] | [int] | [[int]]` → what the embedder takes, parsed straight into
/// typed vectors with every limit applied while parsing: the number of inputs, the
/// characters of a text and the tokens of a token list (`max_input_chars` for both).
pub fn parse_input(raw: &RawValue, max_inputs: usize, max_chars: usize) -> Result<EmbedInput, OpenAiError> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let input = InputVisitor { max_inputs, max_chars }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| {
            // serde_json appends a position; the sentence before it is what a user needs.
            let text = e.to_string();
            let text = text.split(" at line ").next().unwrap_or(&text).to_string();
            invalid("input", text)
        })?;
    if input.is_empty() {
        return Err(invalid("input", "input must not be empty"));
    }
    Ok(input)
}

struct InputVisitor {
    max_inputs: usize,
    max_chars: usize,
}

impl InputVisitor {
    fn deserialize<'de, D: Deserializer<'de>>(self, d: D) -> Result<EmbedInput, D::Error> {
        d.deserialize_any(self)
    }

    fn text<E: de::Error>(&self, i: usize, s: String) -> Result<String, E> {
        // Bytes bound the characters: count only what could be too long.
        if s.len() > self.max_chars {
            let n = s.chars().count();
            if n > self.max_chars {
                return Err(E::custom(format_args!(
                    "input {i} has {n} characters, more than max_input_chars ({})",
                    self.max_chars
                )));
            }
        }
        Ok(s)
    }
}

/// One element of an input array, before the array's kind is known.
enum Item {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

/// A token-id list, bounded while it is parsed.
struct TokenList {
    max: usize,
}

impl<'de> Visitor<'de> for TokenList {
    type Value = Vec<u32>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        let mut ids = Vec::new();
        while let Some(id) = seq.next_element::<Token>()? {
            if ids.len() == self.max {
                return Err(de::Error::custom(format_args!(
                    "a token-id list is longer than max_input_chars ({})",
                    self.max
                )));
            }
            ids.push(id.0);
        }
        Ok(ids)
    }
}

/// A token id: an integer that fits u32.
struct Token(u32);

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Token, D::Error> {
        let v = i64::deserialize(d).map_err(|_| de::Error::custom("token ids must be integers >= 0"))?;
        u32::try_from(v).map(Token).map_err(|_| {
            de::Error::custom(format_args!("token id {v} is not an integer >= 0 that fits 32 bits"))
        })
    }
}

/// Decides what an array element is from its first character.
struct ItemSeed {
    max_tokens: usize,
}

impl<'de> de::DeserializeSeed<'de> for ItemSeed {
    type Value = Item;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Item, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed {
    type Value = Item;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id or an array of token ids")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
        Ok(Item::Text(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Item, E> {
        Ok(Item::Text(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        u32::try_from(v)
            .map(Item::Token)
            .map_err(|_| E::custom(format_args!("token id {v} does not fit 32 bits")))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
        u32::try_from(v).map(Item::Token).map_err(|_| E::custom("token ids must be integers >= 0"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
        TokenList { max: self.max_tokens }.visit_seq(seq).map(Item::Tokens)
    }
}

impl<'de> Visitor<'de> for InputVisitor {
    type Value = EmbedInput;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, an array of token ids or an array of token-id arrays")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<EmbedInput, E> {
        self.visit_string(v.to_string())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<EmbedInput, E> {
        Ok(EmbedInput::Texts(vec![self.text(0, v)?]))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EmbedInput, A::Error> {
        let seed = || ItemSeed { max_tokens: self.max_chars };
        let Some(first) = seq.next_element_seed(seed())? else {
            return Ok(EmbedInput::Texts(Vec::new()));
        };
        let too_many = || {
            de::Error::custom(format_args!(
                "more than the {} inputs allowed in one request (max_embedding_inputs)",
                self.max_inputs
            ))
        };
        let mismatch = |i: usize, holds: &str| {
            de::Error::custom(format_args!("input {i} is not like input 0: the array holds {holds}"))
        };
        match first {
            Item::Text(t) => {
                let mut texts = vec![self.text(0, t)?];
                while let Some(item) = seq.next_element_seed(seed())? {
                    let i = texts.len();
                    if i == self.max_inputs {
                        return Err(too_many());
                    }
                    match item {
                        Item::Text(t) => texts.push(self.text(i, t)?),
                        _ => return Err(mismatch(i, "strings")),
                    }
                }
                Ok(EmbedInput::Texts(texts))
            }
            Item::Token(t) => {
                let mut ids = vec![t];
                while let Some(id) = seq.next_element::<Token>()? {
                    if ids.len() == self.max_chars {
                        return Err(de::Error::custom(format_args!(
                            "a token-id list is longer than max_input_chars ({})",
                            self.max_chars
                        )));
                    }
                    ids.push(id.0);
                }
                Ok(EmbedInput::TokenIds(vec![ids]))
            }
            Item::Tokens(first) => {
                let mut lists = vec![first];
                while let Some(item) = seq.next_element_seed(seed())? {
                    let i = lists.len();
                    if i == self.max_inputs {
                        return Err(too_many());
                    }
                    match item {
                        Item::Tokens(ids) => lists.push(ids),
                        _ => return Err(mismatch(i, "token-id arrays")),
                    }
                }
                if let Some(i) = lists.iter().position(Vec::is_empty) {
                    return Err(de::Error::custom(format_args!("input {i} is an empty token-id array")));
                }
                Ok(EmbedInput::TokenIds(lists))
            }
        }
    }
}

/// The header that names a request's model, for a proxy to route by; every answer
/// about a model carries it too (the 404 for one the server does not know included).
pub const MODEL_HEADER: &str = "x-snooze-model";

async fn embeddings(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let mut seen = Observation::start("openai", None);
    let result = embed_once(&state, headers, body, &mut seen.model).await;
    let model = seen.model.clone();
    seen.finish(result.as_ref().map(drop).map_err(|e| &e.0));
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    if let Some(value) = model.and_then(|m| HeaderValue::from_str(&m).ok()) {
        response.headers_mut().insert(MODEL_HEADER, value);
    }
    response
}

/// The model a request names: its body's `model`, else the `x-snooze-model` header;
/// when both are given they must agree.
pub(super) fn requested_model(body: Option<String>, headers: &HeaderMap) -> Result<String, OpenAiError> {
    let header = match headers.get(MODEL_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| invalid("model", format!("the {MODEL_HEADER} header is not visible ASCII")))?
                .to_owned(),
        ),
    };
    if body.as_deref().or(header.as_deref()).is_some_and(|m| m.trim().is_empty()) {
        return Err(invalid("model", "`model` is empty: name a configured model"));
    }
    match (body, header) {
        (Some(b), Some(h)) if b != h => Err(invalid(
            "model",
            format!("the body names model '{b}' but the {MODEL_HEADER} header names '{h}'"),
        )),
        (Some(m), _) | (None, Some(m)) => Ok(m),
        (None, None) => {
            Err(invalid("model", format!("no model: set `model` in the body or the {MODEL_HEADER} header")))
        }
    }
}

/// The member of an embeddings body that does not parse as its type (`"dimensions": "64"`),
/// for the error's `param`; `input` when none of the others is at fault.
fn field_at_fault(body: &[u8]) -> &'static str {
    fn parses<'a, T: Deserialize<'a>>(raw: Option<&&'a RawValue>) -> bool {
        raw.is_none_or(|r| serde_json::from_str::<T>(r.get()).is_ok())
    }
    let Ok(fields) = serde_json::from_slice::<std::collections::HashMap<&str, &RawValue>>(body) else {
        return "input";
    };
    if !parses::<Option<String>>(fields.get("model")) {
        "model"
    } else if !parses::<Option<String>>(fields.get("encoding_format")) {
        "encoding_format"
    } else if !parses::<Option<i64>>(fields.get("dimensions")) {
        "dimensions"
    } else if !parses::<Option<String>>(fields.get("user")) {
        "user"
    } else {
        "input"
    }
}

/// One embeddings request; `model` is set once the request names a configured model.
async fn embed_once(
    state: &AppState,
    headers: HeaderMap,
    body: Body,
    model_seen: &mut Option<String>,
) -> Result<Response, OpenAiError> {
    let state = state.clone();
    state.admit()?;
    let mut charge = state.request_memory.charge();
    let body = read_body(&state, &headers, body, state.settings.max_request_size, &mut charge).await?;
    let req: EmbeddingsRequest = serde_json::from_slice(&body).map_err(|e| {
        // The body is read as JSON whatever its Content-Type (`curl -d` says it is a
        // form); a multipart upload is not JSON at all, and the parser's words would not
        // say so.
        let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if content_type.starts_with("multipart/") {
            invalid("input", format!("the body is {content_type}: send the embeddings request as JSON"))
        } else {
            invalid(field_at_fault(&body), format!("the body is not a valid embeddings request: {e}"))
        }
    })?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(invalid(
                "encoding_format",
                format!("encoding_format '{other}' is not \"float\" or \"base64\""),
            ))
        }
    };
    let name = requested_model(req.model, &headers)?;
    let info = state.manager.info(&name).map_err(|e| OpenAiError::about("model", e).naming(&name))?;
    *model_seen = Some(name.clone());
    if info.task != Task::Embedding {
        return Err(invalid("model", format!("model '{name}' is not a text-embedding model")));
    }
    let input = parse_input(req.input, state.settings.max_embedding_inputs, state.settings.max_input_chars)?;
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d >= 1 => Some(usize::try_from(d).unwrap_or(usize::MAX)),
        Some(d) => return Err(invalid("dimensions", format!("dimensions must be at least 1, got {d}"))),
    };
    // The vector width is in the signature: a `dimensions` no vector can have is refused
    // before any work.
    let width = info.signature().ok().and_then(|s| s.outputs.first()?.shape.get(1).copied());
    if let (Some(d), Some(w)) = (dimensions, width.filter(|w| *w > 0)) {
        if d as i64 > w {
            return Err(invalid("dimensions", format!("dimensions {d} is more than the model's {w}")));
        }
    }
    let model = name;
    drop(body);
    let priority = priority(&headers, None)?;
    // What the model refuses (a token id outside its vocabulary) is in the input.
    let (mut result, normalized) =
        state.manager.embed(&model, priority, input).await.map_err(|e| match e.kind {
            ErrorKind::InvalidInput => OpenAiError::about("input", e),
            _ => e.into(),
        })?;
    if let Some(d) = dimensions {
        let have = result.vectors.first().map_or(usize::MAX, Vec::len);
        if d > have {
            return Err(invalid("dimensions", format!("dimensions {d} is more than the model's {have}")));
        }
        if !normalized {
            return Err(invalid(
                "dimensions",
                "this model's vectors are not normalized, so they cannot be shortened with dimensions",
            ));
        }
        for v in &mut result.vectors {
            v.truncate(d);
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= norm);
        }
    }
    let data: Vec<Value> = result
        .vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens(), "total_tokens": result.prompt_tokens()},
    }))
    .into_response())
}

/// A model as OpenAI's API describes one; `created` is when the server started.
fn model_object(state: &AppState, name: &str) -> Value {
    let created = state.started.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    json!({"id": name, "object": "model", "created": created, "owned_by": "snoozeml"})
}

async fn models(State(state): State<AppState>) -> Response {
    let data: Vec<Value> = state.manager.models().iter().map(|m| model_object(&state, &m.name)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{model}`: what the SDKs' `models.retrieve` asks; 404 for a model the
/// server does not know.
async fn model(
    State(state): State<AppState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match state.manager.info(&name) {
        Ok(_) => Json(model_object(&state, &name)).into_response(),
        Err(e) => OpenAiError::about("model", e).naming(&name).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_forms() {
        let p = |v: &str| {
            let raw: Box<RawValue> = serde_json::from_str(v).unwrap();
            parse_input(&raw, 4, 10).map_err(|e| e.0.message)
        };
        assert_eq!(p(r#""hi""#).unwrap(), EmbedInput::Texts(vec!["hi".into()]));
        assert_eq!(p(r#"["a", "b"]"#).unwrap(), EmbedInput::Texts(vec!["a".into(), "b".into()]));
        assert_eq!(p("[1, 2]").unwrap(), EmbedInput::TokenIds(vec![vec![1, 2]]));
        assert_eq!(p("[[1], [2, 3]]").unwrap(), EmbedInput::TokenIds(vec![vec![1], vec![2, 3]]));
        assert!(p("[]").unwrap_err().contains("empty"));
        assert!(p(r#"["a", 1]"#).unwrap_err().contains("input 1"));
        assert!(p(r#"["a","a","a","a","a"]"#).unwrap_err().contains("more than the 4 inputs"));
        assert!(p(&format!("{:?}", "x".repeat(11))).unwrap_err().contains("max_input_chars"));
        assert!(p("[-1]").unwrap_err().contains("token ids"));
        assert!(p(r#"{"a": 1}"#).unwrap_err().contains("a string"));
        assert!(p("[[1], []]").unwrap_err().contains("input 1 is an empty"));
        assert!(p("[1,2,3,4,5,6,7,8,9,10,11]").unwrap_err().contains("longer than max_input_chars"));
        assert!(p("[4294967296]").unwrap_err().contains("32 bits"));
        assert!(p("[1.5]").unwrap_err().contains("a string, a token id"), "{:?}", p("[1.5]"));
    }
}
