//! The `X-Secrets` header: base64 of `{"KEY": {"value": ..., "allowed_domains": [...]}}`.

use std::collections::BTreeMap;

use base64::prelude::{Engine as _, BASE64_STANDARD};
use serde_json::{json, Map, Value};

/// Hosts a well-known secret may be sent to (the hosted proxy filters egress by them).
fn known_domains(key: &str) -> Option<&'static [&'static str]> {
    Some(match key.to_ascii_uppercase().as_str() {
        "OPENAI_API_KEY" => &["api.openai.com"],
        "ANTHROPIC_API_KEY" => &["api.anthropic.com"],
        "GEMINI_API_KEY" | "GOOGLE_API_KEY" => &["generativelanguage.googleapis.com"],
        "OPENROUTER_API_KEY" => &["openrouter.ai"],
        "TAVILY_API_KEY" => &["api.tavily.com"],
        "HF_TOKEN" | "HUGGING_FACE_HUB_TOKEN" => {
            &["huggingface.co", "api-inference.huggingface.co"]
        }
        _ => return None,
    })
}

/// The header value for `secrets`, or `None` when there are none.
pub(crate) fn secrets_header(secrets: &BTreeMap<String, String>) -> Option<String> {
    if secrets.is_empty() {
        return None;
    }
    let mut payload = Map::new();
    for (key, value) in secrets {
        let mut entry = json!({ "value": value });
        if let Some(domains) = known_domains(key) {
            entry["allowed_domains"] = json!(domains);
        }
        payload.insert(key.clone(), entry);
    }
    Some(BASE64_STANDARD.encode(Value::Object(payload).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lists_values_and_known_domains() {
        assert_eq!(secrets_header(&BTreeMap::new()), None);
        let secrets = BTreeMap::from([
            ("OPENAI_API_KEY".to_string(), "sk".to_string()),
            ("MY_KEY".to_string(), "v".to_string()),
        ]);
        let header = secrets_header(&secrets).expect("header");
        let decoded: Value =
            serde_json::from_slice(&BASE64_STANDARD.decode(&header).unwrap()).unwrap();
        assert_eq!(decoded["MY_KEY"], json!({"value": "v"}));
        assert_eq!(decoded["OPENAI_API_KEY"]["value"], "sk");
        assert_eq!(
            decoded["OPENAI_API_KEY"]["allowed_domains"],
            json!(["api.openai.com"])
        );
    }
}
