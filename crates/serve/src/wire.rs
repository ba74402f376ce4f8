//! The JSON of SGLang's native HTTP API (`/generate` and the control routes), parsed into
//! engine requests and built from engine outputs.
//!
//! Parsing checks everything before anything runs, so a batch is accepted or refused
//! whole, and every refusal names the field (`sampling_params[1].temperature: ...`).

use manta_engine::{FinishReason, GenerateOutput, GenerateRequest, MatchedStop, SamplingParams};
use manta_tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A request the server refuses; the message names the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

fn bad<T>(message: impl Into<String>) -> Result<T, BadRequest> {
    Err(BadRequest(message.into()))
}

/// What parsing a `/generate` body needs from the server.
pub struct ParseContext<'a> {
    /// `None` when the server runs without a tokenizer (`text` and stop strings refused).
    pub tokenizer: Option<&'a Tokenizer>,
    /// The model's vocabulary (config.json `vocab_size`): ids at or above it are refused.
    pub vocab_size: usize,
    /// Longest prompt + output; bounds `max_new_tokens: null`.
    pub context_length: usize,
}

/// One generation of a `/generate` call (a batch has several).
#[derive(Debug, Clone)]
pub struct Item {
    pub request: GenerateRequest,
    pub return_logprob: bool,
    /// Third element of each `output_token_logprobs` entry: the token's text instead of null.
    pub return_text_in_logprobs: bool,
    pub skip_special_tokens: bool,
    /// Keep the matched stop string or token in `text` (output ids always keep it).
    pub no_stop_trim: bool,
}

/// A parsed `/generate` body.
#[derive(Debug, Clone)]
pub struct ParsedGenerate {
    /// The input was a list of prompts: the answer is a list too (even of one).
    pub batch: bool,
    pub items: Vec<Item>,
    pub stream: bool,
}

/// The top level of a `/generate` body; polymorphic fields stay JSON until checked.
#[derive(Debug, Deserialize)]
struct GenerateBody {
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    input_ids: Option<Value>,
    #[serde(default)]
    sampling_params: Option<Value>,
    #[serde(default)]
    return_logprob: Option<Value>,
    #[serde(default)]
    rid: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    return_text_in_logprobs: Option<bool>,
    /// Rollout routing replay: `meta_info.routed_experts` in the answer.
    #[serde(default)]
    return_routed_experts: Option<bool>,
    #[serde(default)]
    top_logprobs_num: Option<Value>,
    #[serde(default)]
    token_ids_logprob: Option<Value>,
    /// Prompt log-probs are not computed; SGLang clients that send 0 (the cookbook does)
    /// read only the output log-probs.
    #[serde(default)]
    #[allow(dead_code)]
    logprob_start_len: Option<Value>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

/// Top-level keys SGLang accepts that change the result in ways this engine cannot
/// honour: refused when set, rather than silently ignored.
const UNSUPPORTED_TOP_LEVEL: [&str; 9] = [
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "lora_id",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
];

/// SGLang's `sampling_params`. Absent keys take SGLang's defaults; keys that would change
/// sampling in ways the native engine lacks are refused unless they hold their neutral value.
#[derive(Debug, Deserialize)]
struct SamplingParamsWire {
    /// `null` means "until the context is full", as in SGLang.
    #[serde(default = "default_max_new_tokens")]
    max_new_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    sampling_seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Option<Vec<i64>>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    skip_special_tokens: Option<bool>,
    #[serde(default)]
    no_stop_trim: Option<bool>,
    /// vLLM/OpenAI spelling the cookbook sends; read as `no_stop_trim`.
    #[serde(default)]
    include_stop_str_in_output: Option<bool>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    min_new_tokens: Option<i64>,
    #[serde(default)]
    json_schema: Option<Value>,
    #[serde(default)]
    regex: Option<Value>,
    #[serde(default)]
    ebnf: Option<Value>,
    #[serde(default)]
    structural_tag: Option<Value>,
    #[serde(default)]
    logit_bias: Option<Value>,
    /// Everything else (`spaces_between_special_tokens`, `custom_params`,
    /// `stream_interval`, ...) has no effect here and is accepted.
    #[serde(flatten)]
    #[allow(dead_code)]
    other: Map<String, Value>,
}

fn default_max_new_tokens() -> Option<i64> {
    Some(128)
}

/// Sampling settings of one item, before the prompt length is known.
struct ItemParams {
    params: SamplingParams,
    /// `max_new_tokens: null`: fill the context.
    until_context: bool,
    skip_special_tokens: bool,
    no_stop_trim: bool,
}

/// Parses and checks a `/generate` body. `new_rid` names requests that bring no `rid`.
pub fn parse_generate(
    body: &[u8],
    ctx: &ParseContext<'_>,
    mut new_rid: impl FnMut() -> String,
) -> Result<ParsedGenerate, BadRequest> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| BadRequest(format!("request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return bad(format!(
            "request body must be a JSON object, got {}",
            kind_of(&value)
        ));
    }
    let body: GenerateBody = typed(value, "")?;
    for key in UNSUPPORTED_TOP_LEVEL {
        if let Some(v) = body.other.get(key) {
            if !is_unset(v) {
                return bad(format!("{key}: not supported by the native engine"));
            }
        }
    }
    if let Some(v) = &body.top_logprobs_num {
        if !is_unset(v) && v.as_i64() != Some(0) {
            return bad("top_logprobs_num: top log-probs are not supported by the native engine (only output_token_logprobs)");
        }
    }
    if let Some(v) = &body.token_ids_logprob {
        if !is_unset(v) {
            return bad("token_ids_logprob: not supported by the native engine");
        }
    }

    // Prompts: exactly one of text / input_ids.
    let text = body.text.filter(|v| !v.is_null());
    let input_ids = body.input_ids.filter(|v| !v.is_null());
    let (batch, prompts): (bool, Vec<Vec<u32>>) = match (text, input_ids) {
        (Some(_), Some(_)) => return bad("give either text or input_ids, not both"),
        (None, None) => return bad("input_ids: missing (give input_ids or text)"),
        (None, Some(ids)) => parse_input_ids(&ids, ctx.vocab_size)?,
        (Some(text), None) => parse_text(&text, ctx.tokenizer)?,
    };
    let n = prompts.len();

    let sampling = per_item(body.sampling_params, n, "sampling_params", |v, field| {
        parse_sampling(v, field, ctx.tokenizer.is_some())
    })?;
    let return_logprob = per_item(
        body.return_logprob,
        n,
        "return_logprob",
        |v, field| match v {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(other) => bad(format!(
                "{field}: expected true or false, got {}",
                kind_of(&other)
            )),
        },
    )?;
    let rids: Vec<String> = match body.rid.filter(|v| !v.is_null()) {
        None => (0..n).map(|_| new_rid()).collect(),
        Some(Value::String(s)) if !batch => vec![s],
        Some(Value::String(_)) => {
            return bad("rid: a batch needs a list of rids, one per input");
        }
        Some(Value::Array(list)) if batch => {
            if list.len() != n {
                return bad(format!("rid: {} rids for {n} inputs", list.len()));
            }
            list.into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s),
                    other => bad(format!(
                        "rid[{i}]: expected a string, got {}",
                        kind_of(&other)
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        Some(other) => {
            return bad(format!(
                "rid: expected {}, got {}",
                if batch {
                    "a list of strings"
                } else {
                    "a string"
                },
                kind_of(&other)
            ))
        }
    };
    let stream = body.stream.unwrap_or(false);
    if stream && batch {
        return bad("stream: streaming a batch is not supported; send one prompt per request");
    }

    let items = prompts
        .into_iter()
        .zip(sampling)
        .zip(return_logprob)
        .zip(rids)
        .enumerate()
        .map(|(i, (((input_ids, sp), return_logprob), rid))| {
            let mut params = sp.params;
            if sp.until_context {
                params.max_new_tokens = ctx.context_length.saturating_sub(input_ids.len());
            }
            if input_ids.len() >= ctx.context_length {
                let field = if batch { format!("input_ids[{i}]") } else { "input_ids".into() };
                return bad(format!(
                    "{field}: {} tokens do not fit the context length {} (the prompt must leave room for one output token)",
                    input_ids.len(),
                    ctx.context_length
                ));
            }
            Ok(Item {
                request: GenerateRequest {
                    input_ids,
                    params,
                    rid: Some(rid),
                    return_routed_experts: body.return_routed_experts.unwrap_or(false),
                },
                return_logprob,
                return_text_in_logprobs: body.return_text_in_logprobs.unwrap_or(false),
                skip_special_tokens: sp.skip_special_tokens,
                no_stop_trim: sp.no_stop_trim,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ParsedGenerate {
        batch,
        items,
        stream,
    })
}

/// Deserializes with the failing key's path in the message (`sampling_params.top_k: ...`).
fn typed<T: serde::de::DeserializeOwned>(value: Value, prefix: &str) -> Result<T, BadRequest> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = match (prefix.is_empty(), path == ".") {
            (true, true) => "request".to_string(),
            (true, false) => path,
            (false, true) => prefix.to_string(),
            (false, false) => format!("{prefix}.{path}"),
        };
        BadRequest(format!("{field}: {}", e.into_inner()))
    })
}

/// JSON null, or an empty list/object: the caller did not ask for the feature.
fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A value given once for all prompts, or as a list with one per prompt.
fn per_item<T>(
    value: Option<Value>,
    n: usize,
    field: &str,
    mut parse: impl FnMut(Option<Value>, &str) -> Result<T, BadRequest>,
) -> Result<Vec<T>, BadRequest> {
    match value {
        Some(Value::Array(list)) => {
            if list.len() != n {
                return bad(format!("{field}: {} entries for {n} inputs", list.len()));
            }
            list.into_iter()
                .enumerate()
                .map(|(i, v)| parse(Some(v), &format!("{field}[{i}]")))
                .collect()
        }
        other => (0..n).map(|_| parse(other.clone(), field)).collect(),
    }
}

fn parse_input_ids(v: &Value, vocab: usize) -> Result<(bool, Vec<Vec<u32>>), BadRequest> {
    let Value::Array(list) = v else {
        return bad(format!(
            "input_ids: expected a list of token ids or a list of such lists, got {}",
            kind_of(v)
        ));
    };
    if list.is_empty() {
        return bad("input_ids: empty (give at least one token id)");
    }
    if list[0].is_array() {
        let prompts = list
            .iter()
            .enumerate()
            .map(|(i, one)| token_list(one, &format!("input_ids[{i}]"), vocab))
            .collect::<Result<_, _>>()?;
        Ok((true, prompts))
    } else {
        Ok((false, vec![token_list(v, "input_ids", vocab)?]))
    }
}

fn token_list(v: &Value, field: &str, vocab: usize) -> Result<Vec<u32>, BadRequest> {
    let Value::Array(list) = v else {
        return bad(format!(
            "{field}: expected a list of token ids, got {}",
            kind_of(v)
        ));
    };
    if list.is_empty() {
        return bad(format!("{field}: empty (give at least one token id)"));
    }
    list.iter()
        .enumerate()
        .map(|(j, t)| {
            let id = t
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    BadRequest(format!(
                        "{field}[{j}]: {t} is not a token id (a non-negative integer)"
                    ))
                })?;
            if id as usize >= vocab {
                return bad(format!(
                    "{field}[{j}]: token id {id} is outside the vocabulary (vocab_size {vocab})"
                ));
            }
            Ok(id)
        })
        .collect()
}

fn parse_text(
    v: &Value,
    tokenizer: Option<&Tokenizer>,
) -> Result<(bool, Vec<Vec<u32>>), BadRequest> {
    let Some(tok) = tokenizer else {
        return bad("text: this server has no tokenizer (the model directory has no tokenizer.json, or --skip-tokenizer-init): send input_ids");
    };
    let encode = |s: &str, field: &str| -> Result<Vec<u32>, BadRequest> {
        let ids = tok
            .encode(s)
            .map_err(|e| BadRequest(format!("{field}: cannot be tokenized: {e}")))?;
        if ids.is_empty() {
            return bad(format!("{field}: empty (the text has no tokens)"));
        }
        Ok(ids)
    };
    match v {
        Value::String(s) => Ok((false, vec![encode(s, "text")?])),
        Value::Array(list) => {
            if list.is_empty() {
                return bad("text: empty list");
            }
            let prompts = list
                .iter()
                .enumerate()
                .map(|(i, one)| match one {
                    Value::String(s) => encode(s, &format!("text[{i}]")),
                    other => bad(format!(
                        "text[{i}]: expected a string, got {}",
                        kind_of(other)
                    )),
                })
                .collect::<Result<_, _>>()?;
            Ok((true, prompts))
        }
        other => bad(format!(
            "text: expected a string or a list of strings, got {}",
            kind_of(other)
        )),
    }
}

fn parse_sampling(
    v: Option<Value>,
    field: &str,
    has_tokenizer: bool,
) -> Result<ItemParams, BadRequest> {
    let v = match v {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(v @ Value::Object(_)) => v,
        Some(other) => {
            return bad(format!(
                "{field}: expected an object, got {}",
                kind_of(&other)
            ))
        }
    };
    let w: SamplingParamsWire = typed(v, field)?;
    let unsupported = |key: &str, value: String, neutral: &str| {
        bad::<()>(format!(
            "{field}.{key}: {value} is not supported by the native engine (only {neutral})"
        ))
    };
    if let Some(n) = w.n {
        if n != 1 {
            return bad(format!(
                "{field}.n: {n} is not supported (only n = 1); send the prompt n times, or as a batch"
            ));
        }
    }
    for (key, value, neutral) in [
        ("frequency_penalty", w.frequency_penalty, 0.0),
        ("presence_penalty", w.presence_penalty, 0.0),
        ("repetition_penalty", w.repetition_penalty, 1.0),
    ] {
        if let Some(x) = value {
            if x != neutral {
                unsupported(key, x.to_string(), &neutral.to_string())?;
            }
        }
    }
    if let Some(m) = w.min_new_tokens {
        if m != 0 {
            unsupported("min_new_tokens", m.to_string(), "0")?;
        }
    }
    for (key, value) in [
        ("json_schema", &w.json_schema),
        ("regex", &w.regex),
        ("ebnf", &w.ebnf),
        ("structural_tag", &w.structural_tag),
        ("logit_bias", &w.logit_bias),
    ] {
        if let Some(v) = value {
            if !is_unset(v) {
                return bad(format!(
                    "{field}.{key}: constrained or biased decoding is not supported by the native engine"
                ));
            }
        }
    }

    let until_context = w.max_new_tokens.is_none();
    let max_new_tokens = match w.max_new_tokens {
        None => 0,
        Some(m) => usize::try_from(m)
            .map_err(|_| BadRequest(format!("{field}.max_new_tokens: {m} must be at least 0")))?,
    };
    let stop: Vec<String> = match w.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(list)) => list
            .into_iter()
            .enumerate()
            .map(|(i, s)| match s {
                Value::String(s) => Ok(s),
                other => bad(format!(
                    "{field}.stop[{i}]: expected a string, got {}",
                    kind_of(&other)
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return bad(format!(
                "{field}.stop: expected a string or a list of strings, got {}",
                kind_of(&other)
            ))
        }
    };
    if !stop.is_empty() && !has_tokenizer {
        return bad(format!(
            "{field}.stop: stop strings need a tokenizer, and this server has none: use stop_token_ids"
        ));
    }
    let stop_token_ids = w
        .stop_token_ids
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            u32::try_from(t).map_err(|_| {
                BadRequest(format!(
                    "{field}.stop_token_ids[{i}]: {t} is not a token id"
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    let defaults = SamplingParams::default();
    let params = SamplingParams {
        max_new_tokens,
        temperature: w.temperature.unwrap_or(defaults.temperature),
        top_p: w.top_p.unwrap_or(defaults.top_p),
        top_k: w.top_k.unwrap_or(defaults.top_k),
        min_p: w.min_p.unwrap_or(defaults.min_p),
        seed: w.sampling_seed,
        stop_token_ids,
        stop,
        ignore_eos: w.ignore_eos.unwrap_or(false),
    };
    // The engine's checks name `sampling_params.<key>`; keep the caller's index if any.
    params.validate().map_err(|e| {
        let message = e.to_string();
        let message = message
            .strip_prefix("bad generate request: ")
            .unwrap_or(&message);
        BadRequest(message.replacen("sampling_params", field, 1))
    })?;
    Ok(ItemParams {
        params,
        until_context,
        skip_special_tokens: w.skip_special_tokens.unwrap_or(true),
        no_stop_trim: w.no_stop_trim.unwrap_or(false)
            || w.include_stop_str_in_output.unwrap_or(false),
    })
}

/// `meta_info.finish_reason`: `matched` is the stop token id or stop string (null for
/// length and abort, where SGLang adds `length` and `message`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FinishReasonWire {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub matched: Option<MatchedWire>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub length: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(untagged)]
pub enum MatchedWire {
    Token(u32),
    Text(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct MetaInfo {
    pub id: String,
    pub finish_reason: FinishReasonWire,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// A string, as in SGLang (whose versions are free-form); here the engine's counter.
    pub weight_version: String,
    /// Seconds from the request's arrival to its answer.
    pub e2e_latency: f64,
    /// `[logprob, token_id, text-or-null]` per output token, stop token included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<(f32, u32, Option<String>)>>,
    /// With `return_routed_experts`: base64 of int32 [prompt + output − 1, sparse
    /// layers, k], SGLang's form (SGLang versions that write every layer agree on
    /// models whose layers are all sparse, as Qwen3-30B-A3B's are).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
}

/// One `/generate` answer. `text` is absent when the server has no tokenizer, as SGLang
/// with `--skip-tokenizer-init`.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateResponse {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub output_ids: Vec<u32>,
    pub meta_info: MetaInfo,
}

/// Builds the answer of one item. `output_ids` always ends with the stop token that ended
/// generation; `text` follows SGLang: decoded with `skip_special_tokens`, and unless
/// `no_stop_trim` without the matched stop token and cut before the matched stop string.
pub fn generate_response(
    item: &Item,
    out: GenerateOutput,
    tokenizer: Option<&Tokenizer>,
    e2e_latency: f64,
) -> GenerateResponse {
    let finish_reason = match (&out.finish, &out.matched_stop) {
        (FinishReason::Stop, m) => FinishReasonWire {
            kind: "stop",
            matched: m.as_ref().map(|m| match m {
                MatchedStop::Token(t) => MatchedWire::Token(*t),
                MatchedStop::Text(s) => MatchedWire::Text(s.clone()),
            }),
            length: None,
            message: None,
        },
        (FinishReason::Length, _) => FinishReasonWire {
            kind: "length",
            matched: None,
            length: Some(out.output_ids.len()),
            message: None,
        },
        (FinishReason::Abort, _) => FinishReasonWire {
            kind: "abort",
            matched: None,
            length: None,
            message: Some("aborted".into()),
        },
    };
    let text = tokenizer.map(|tok| {
        let mut ids: &[u32] = &out.output_ids;
        if !item.no_stop_trim && matches!(out.matched_stop, Some(MatchedStop::Token(_))) {
            ids = &ids[..ids.len().saturating_sub(1)];
        }
        let mut text = decode_known(tok, ids, item.skip_special_tokens);
        if !item.no_stop_trim {
            if let Some(MatchedStop::Text(s)) = &out.matched_stop {
                if let Some(pos) = text.find(s.as_str()) {
                    text.truncate(pos);
                }
            }
        }
        text
    });
    let output_token_logprobs = item.return_logprob.then(|| {
        out.output_ids
            .iter()
            .zip(&out.logprobs)
            .map(|(&id, &lp)| {
                let piece = match (item.return_text_in_logprobs, tokenizer) {
                    (true, Some(tok)) => Some(decode_known(tok, &[id], false)),
                    _ => None,
                };
                (lp, id, piece)
            })
            .collect()
    });
    GenerateResponse {
        text,
        meta_info: MetaInfo {
            id: item.request.rid.clone().unwrap_or_default(),
            finish_reason,
            prompt_tokens: out.prompt_tokens,
            completion_tokens: out.output_ids.len(),
            cached_tokens: out.cached_tokens,
            weight_version: out.weight_version.to_string(),
            e2e_latency,
            output_token_logprobs,
            routed_experts: out.routed_experts.as_ref().map(encode_routed_experts),
        },
        output_ids: out.output_ids,
    }
}

/// SGLang's wire form of routed experts: base64 of little-endian int32, row-major.
fn encode_routed_experts(r: &manta_engine::RoutedExperts) -> String {
    use base64::Engine as _;
    let bytes: Vec<u8> = r.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes the ids the tokenizer knows: models pad their embedding rows past the
/// tokenizer's vocabulary, and a sampled padding id has no text.
fn decode_known(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> String {
    let known: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| (id as usize) < tok.vocab_size())
        .collect();
    tok.decode(&known, skip_special_tokens).unwrap_or_default()
}

/// `POST /pause_generation` body (optional; SGLang's default mode is abort).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseBody {
    #[serde(default = "default_pause_mode")]
    pub mode: String,
}

fn default_pause_mode() -> String {
    "abort".into()
}

/// `POST /abort_request` body.
#[derive(Debug, Deserialize)]
pub struct AbortBody {
    #[serde(default)]
    pub rid: Option<String>,
    #[serde(default)]
    pub abort_all: bool,
}

/// `POST /update_weights_from_disk` body.
#[derive(Debug, Deserialize)]
pub struct UpdateFromDiskBody {
    pub model_path: String,
    #[serde(default)]
    pub load_format: Option<String>,
    #[serde(default)]
    pub weight_version: Option<String>,
    /// Abort running requests first instead of waiting for them.
    #[serde(default)]
    pub abort_all_requests: bool,
}

/// Parses a control route's JSON body; an empty body reads as `{}`.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, BadRequest> {
    let value: Value = if body.iter().all(|b| b.is_ascii_whitespace()) {
        Value::Object(Map::new())
    } else {
        serde_json::from_slice(body)
            .map_err(|e| BadRequest(format!("request body is not valid JSON: {e}")))?
    };
    if !value.is_object() {
        return bad(format!(
            "request body must be a JSON object, got {}",
            kind_of(&value)
        ));
    }
    typed(value, "")
}

#[cfg(test)]
mod tests;
