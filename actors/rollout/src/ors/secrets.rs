//! The `X-Secrets` header: base64 of `{"KEY": {"value": ..., "allowed_domains": [...]}}`.

use std::collections::BTreeMap;

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
    Some(base64(Value::Object(payload).to_string().as_bytes()))
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
    }

    #[test]
    fn header_lists_values_and_known_domains() {
        assert_eq!(secrets_header(&BTreeMap::new()), None);
        let secrets = BTreeMap::from([
            ("OPENAI_API_KEY".to_string(), "sk".to_string()),
            ("MY_KEY".to_string(), "v".to_string()),
        ]);
        let header = secrets_header(&secrets).expect("header");
        // A 42-byte (whole base64 groups) prefix of the JSON encodes to a prefix of the header.
        let prefix = br#"{"MY_KEY":{"value":"v"},"OPENAI_API_KEY":{"#;
        assert_eq!(prefix.len() % 3, 0);
        assert!(header.starts_with(&base64(prefix)), "{header}");
    }
}
