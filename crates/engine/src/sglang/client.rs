//! SGLang's `/generate` and weight-update JSON (REFERENCE.md §3): what Manta sends and
//! how answers map to [`GenerateOutput`].

use serde_json::{json, Value};

use base64::Engine as _;

use super::super::{FinishReason, GenerateOutput, GenerateRequest, MatchedStop, RoutedExperts};

/// The layout of a mixture-of-experts model's routed-expert rows: SGLang writes
/// `num_layers` entries per token (dense layers' unused) or, in some versions, the
/// sparse layers' only; Manta keeps the sparse ones.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingShape {
    pub num_layers: usize,
    /// The sparse layers' indices, in order.
    pub sparse: Vec<usize>,
    pub top_k: usize,
}

impl RoutingShape {
    /// The shape of the model in `model_dir`; `None` for a dense model or an unreadable config.
    pub fn of_model(model_dir: &std::path::Path) -> Option<Self> {
        let cfg = manta_model::ModelConfig::from_file(&model_dir.join("config.json")).ok()?;
        let moe = cfg.moe()?;
        Some(Self {
            num_layers: cfg.num_hidden_layers as usize,
            sparse: moe
                .sparse_layers(cfg.num_hidden_layers)
                .into_iter()
                .map(|l| l as usize)
                .collect(),
            top_k: moe.top_k as usize,
        })
    }
}

/// Decodes `meta_info.routed_experts` (base64 of little-endian int32 [rows, layers, k])
/// into the sparse layers' rows.
pub fn decode_routed_experts(
    text: &str,
    rows: usize,
    shape: &RoutingShape,
) -> Result<RoutedExperts, String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("meta_info.routed_experts is not base64: {e}"))?;
    let values: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let k = shape.top_k;
    let sparse = shape.sparse.len();
    let ids = if bytes.len() == 4 * rows * shape.num_layers * k {
        values
            .chunks_exact(shape.num_layers * k)
            .flat_map(|row| {
                shape
                    .sparse
                    .iter()
                    .flat_map(move |&l| row[l * k..(l + 1) * k].to_vec())
            })
            .collect()
    } else if bytes.len() == 4 * rows * sparse * k {
        values
    } else {
        return Err(format!(
            "meta_info.routed_experts holds {} bytes; {rows} tokens x {} (or {sparse} sparse) \
             layers x top-{k} int32 expected",
            bytes.len(),
            shape.num_layers
        ));
    };
    Ok(RoutedExperts {
        layers: sparse as u32,
        top_k: k as u32,
        ids,
    })
}

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
    let mut body = json!({
        "input_ids": request.input_ids,
        "sampling_params": params,
        "return_logprob": true,
        "rid": rid,
    });
    if request.return_routed_experts {
        body["return_routed_experts"] = json!(true);
    }
    body
}

/// Reads a `/generate` answer; `current_version` stands in for a non-numeric
/// `weight_version` (SGLang starts at "default").
/// `routing`: the request asked for routed experts of a model of this shape, over
/// `prompt_len` prompt tokens.
pub fn parse_generate(
    body: &Value,
    current_version: u64,
    routing: Option<(&RoutingShape, usize)>,
) -> Result<GenerateOutput, String> {
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
    let routed_experts = match routing {
        None => None,
        Some((shape, prompt_len)) => {
            let text = meta.get("routed_experts").and_then(Value::as_str).ok_or(
                "no meta_info.routed_experts (start SGLang with --enable-return-routed-experts)",
            )?;
            let rows = (prompt_len + output_ids.len()).saturating_sub(1);
            Some(decode_routed_experts(text, rows, shape)?)
        }
    };
    Ok(GenerateOutput {
        output_ids,
        logprobs,
        finish: finish_reason,
        matched_stop,
        weight_version,
        prompt_tokens: count("prompt_tokens"),
        cached_tokens: count("cached_tokens"),
        routed_experts,
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
        let out = parse_generate(&body(json!({"type": "stop", "matched": 2})), 7, None).unwrap();
        assert_eq!(out.finish, FinishReason::Stop);
        assert_eq!(out.matched_stop, Some(MatchedStop::Token(2)));
        assert_eq!(out.logprobs, vec![-0.5, -0.25]);
        assert_eq!(out.weight_version, 7);
        let out = parse_generate(&body(json!({"type": "length", "length": 2})), 0, None).unwrap();
        assert_eq!(out.finish, FinishReason::Length);
        let out = parse_generate(&body(json!({"type": "abort", "message": "x"})), 0, None).unwrap();
        assert_eq!(out.finish, FinishReason::Abort);
        assert!(parse_generate(&body(json!({"type": "odd"})), 0, None).is_err());
    }

    #[test]
    fn routed_experts_decode_from_all_layers_or_the_sparse_ones() {
        // 2 layers, layer 1 sparse, top-2; 3 rows.
        let shape = RoutingShape {
            num_layers: 2,
            sparse: vec![1],
            top_k: 2,
        };
        let encode = |v: &[i32]| {
            base64::engine::general_purpose::STANDARD
                .encode(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
        };
        let all = [0, 0, 4, 1, 0, 0, 2, 3, 0, 0, 5, 0];
        let got = decode_routed_experts(&encode(&all), 3, &shape).unwrap();
        assert_eq!(got.ids, vec![4, 1, 2, 3, 5, 0]);
        assert_eq!((got.layers, got.top_k), (1, 2));
        let sparse = decode_routed_experts(&encode(&[4, 1, 2, 3, 5, 0]), 3, &shape).unwrap();
        assert_eq!(sparse, got);
        let err = decode_routed_experts(&encode(&[1, 2, 3]), 3, &shape).unwrap_err();
        assert!(err.contains("12 bytes"), "{err}");
        let body = json!({"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, 5, null], [-0.25, 2, null]],
            "routed_experts": encode(&all)}});
        let out = parse_generate(&body, 0, Some((&shape, 2))).unwrap();
        assert_eq!(out.routed_experts, Some(got));
    }
}
