//! JSON text exactly as Python's `json.dumps` writes it by default (`", "` and `": "`
//! separators, non-ASCII escaped as `\uXXXX`), so hashes and prompts match the
//! cookbook's byte for byte.

use serde_json::Value;

/// `json.dumps(value)`: object keys in the order the value holds them.
pub fn dumps(value: &Value) -> String {
    let mut out = String::new();
    write_value(value, false, &mut out);
    out
}

/// `json.dumps(value, sort_keys=True)`.
pub fn dumps_sorted(value: &Value) -> String {
    let mut out = String::new();
    write_value(value, true, &mut out);
    out
}

fn write_value(value: &Value, sort: bool, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(item, sort, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_string(k, out);
                out.push_str(": ");
                write_value(v, sort, out);
            }
            out.push('}');
        }
        Value::String(s) => write_string(s, out),
        Value::Number(n) => match n.as_f64() {
            // Python prints floats with a fractional part ("1.0"); serde_json keeps "1.0" too.
            Some(f) if n.is_f64() && f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 => {
                out.push_str(&format!("{f:.1}"))
            }
            _ => out.push_str(&n.to_string()),
        },
        other => out.push_str(&other.to_string()),
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_defaults() {
        // python3 -c 'import json;print(json.dumps({"b":[1,2.0,None,True],"a":"é\n😀"},sort_keys=True))'
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.0, null, true], "a": "é\n😀"}"#).unwrap();
        assert_eq!(
            dumps_sorted(&v),
            r#"{"a": "\u00e9\n\ud83d\ude00", "b": [1, 2.0, null, true]}"#
        );
        let _ = json!(null);
    }
}
