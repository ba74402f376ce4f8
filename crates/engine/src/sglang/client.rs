//! SGLang's `/generate` and weight-update JSON (REFERENCE.md §3): what Manta sends and
//! how answers map to [`GenerateOutput`].

use serde_json::{json, Value};

use super::super::{FinishReason, GenerateOutput, GenerateRequest, MatchedStop};

/// The `/generate` body: token ids in, token ids and log-probs out, stop tokens kept.
pub fn generate_body(request: &GenerateRequest, rid: &str) -> Value {
    let p = &request.params;
    let mut params = json!({
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "stop_token_ids": p.stop_token_ids,
        "ignore_eos": p.ignore_eos,
        "no_stop_trim": true,
        "skip_special_tokens": false,
    });
    if !p.stop.is_empty() {
        params["stop"] = json!(p.stop);
    }
    if let Some(seed) = p.seed {
        params["sampling_seed"] = json!(seed);
    }
    json!({
        "input_ids": request.input_ids,
        "sampling_params": params,
        "return_logprob": true,
        "rid": rid,
    })
}

/// Reads a `/generate` answer; `current_version` stands in for a non-numeric
/// `weight_version` (SGLang starts at "default").
pub fn parse_generate(body: &Value, current_version: u64) -> Result<GenerateOutput, String> {
    let output_ids: Vec<u32> = body
        .get("output_ids")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .ok_or("no output_ids (is the server returning token ids?)")?;
    let meta = body.get("meta_info").ok_or("no meta_info")?;
    let finish = meta.get("finish_reason").unwrap_or(&Value::Null);
    let (finish_reason, matched_stop) = match finish.get("type").and_then(Value::as_str) {
        Some("stop") => (
            FinishReason::Stop,
            match finish.get("matched") {
                Some(Value::Number(n)) => n.as_u64().map(|t| MatchedStop::Token(t as u32)),
                Some(Value::String(s)) => Some(MatchedStop::Text(s.clone())),
                _ => None,
            },
        ),
        Some("length") => (FinishReason::Length, None),
        Some("abort") => (FinishReason::Abort, None),
        other => return Err(format!("unknown finish_reason {other:?}: {finish}")),
    };
    let logprobs: Vec<f32> = match meta.get("output_token_logprobs").and_then(Value::as_array) {
        Some(rows) => rows
            .iter()
            .map(|r| r.get(0).and_then(Value::as_f64).unwrap_or(0.0) as f32)
            .collect(),
        None => return Err("no meta_info.output_token_logprobs (return_logprob)".into()),
    };
    if logprobs.len() != output_ids.len() {
        return Err(format!(
            "{} output ids but {} log-probs",
            output_ids.len(),
            logprobs.len()
        ));
    }
    let weight_version = match meta.get("weight_version") {
        Some(Value::String(s)) => s.parse().unwrap_or(current_version),
        Some(Value::Number(n)) => n.as_u64().unwrap_or(current_version),
        _ => current_version,
    };
    let count = |k: &str| meta.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    Ok(GenerateOutput {
        output_ids,
        logprobs,
        finish: finish_reason,
        matched_stop,
        weight_version,
        prompt_tokens: count("prompt_tokens"),
        cached_tokens: count("cached_tokens"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_map_to_status() {
        let body = |finish: Value| {
            json!({"output_ids": [5, 2], "meta_info": {"finish_reason": finish,
                "output_token_logprobs": [[-0.5, 5, null], [-0.25, 2, null]],
                "weight_version": "default", "prompt_tokens": 3}})
        };
        let out = parse_generate(&body(json!({"type": "stop", "matched": 2})), 7).unwrap();
        assert_eq!(out.finish, FinishReason::Stop);
        assert_eq!(out.matched_stop, Some(MatchedStop::Token(2)));
        assert_eq!(out.logprobs, vec![-0.5, -0.25]);
        assert_eq!(out.weight_version, 7);
        let out = parse_generate(&body(json!({"type": "length", "length": 2})), 0).unwrap();
        assert_eq!(out.finish, FinishReason::Length);
        let out = parse_generate(&body(json!({"type": "abort", "message": "x"})), 0).unwrap();
        assert_eq!(out.finish, FinishReason::Abort);
        assert!(parse_generate(&body(json!({"type": "odd"})), 0).is_err());
    }
}
