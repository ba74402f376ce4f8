//! JSON text exactly as Python's `json.dumps` writes it: `", "` / `": "` separators,
//! `ensure_ascii` escapes (surrogate pairs above the BMP), Python's float repr (`1e-05`,
//! `1e+16`, `Infinity`), integers kept as integers and keys in the order the value holds
//! them unless sorted.
//!
//! The cookbook hashes tasks with `json.dumps(spec, sort_keys=True)` and writes
//! tasks.jsonl with `json.dumps`; transformers' chat templates render `tojson` with it.
//! Tokens and hashes depend on those bytes, so every Manta writer of such text uses this
//! module. Limit: integers beyond the u64/i64 range arrive as floats from serde_json
//! and are written as floats.

use serde_json::{Map, Value};

/// The `json.dumps` arguments that chat templates pass.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(unit)`: one item per line, each level indented by `unit`.
    pub indent: Option<String>,
    /// Between items; Python's default is `", "` on one line and `","` when indenting.
    pub item_separator: String,
    /// Between a key and its value.
    pub key_separator: String,
    /// Sort object keys (Python `sort_keys=True`); otherwise keys keep their order.
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python's defaults for the given indent (`separators=None`).
    pub fn python_defaults(ensure_ascii: bool, indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        Self {
            ensure_ascii,
            indent,
            item_separator: item_separator.to_owned(),
            key_separator: ": ".to_owned(),
            sort_keys: false,
        }
    }
}

/// Serialises `value` like `json.dumps(value, **options)`.
pub fn dumps(value: &Value, options: &DumpOptions) -> String {
    let mut out = String::new();
    write_value(&mut out, value, options, 0);
    out
}

/// `json.dumps(value)` with Python's defaults.
pub fn dumps_default(value: &Value) -> String {
    dumps(value, &DumpOptions::python_defaults(true, None))
}

/// `json.dumps(value, sort_keys=True)` with Python's other defaults.
pub fn dumps_sorted(value: &Value) -> String {
    let options = DumpOptions {
        sort_keys: true,
        ..DumpOptions::python_defaults(true, None)
    };
    dumps(value, &options)
}

fn write_value(out: &mut String, value: &Value, options: &DumpOptions, level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(number) => match (number.as_i64(), number.as_u64(), number.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (None, Some(u), _) => out.push_str(&u.to_string()),
            (None, None, Some(f)) => out.push_str(&python_float_repr(f)),
            // Arbitrary-precision numbers are not enabled; fall back to serde_json's text.
            (None, None, None) => out.push_str(&number.to_string()),
        },
        Value::String(s) => write_string(out, s, options.ensure_ascii),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                newline_indent(out, options, level + 1);
                write_value(out, item, options, level + 1);
            }
            newline_indent(out, options, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (key, item)) in ordered_entries(map, options.sort_keys)
                .into_iter()
                .enumerate()
            {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                newline_indent(out, options, level + 1);
                write_string(out, key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                write_value(out, item, options, level + 1);
            }
            newline_indent(out, options, level);
            out.push('}');
        }
    }
}

fn ordered_entries(map: &Map<String, Value>, sort_keys: bool) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = map.iter().collect();
    if sort_keys {
        entries.sort_by(|a, b| a.0.cmp(b.0));
    }
    entries
}

fn newline_indent(out: &mut String, options: &DumpOptions, level: usize) {
    if let Some(unit) = &options.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(unit);
        }
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
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
            c if (c as u32) < 0x20 => push_u_escape(out, c as u32),
            // With ensure_ascii Python escapes everything outside printable ASCII (DEL included).
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    push_u_escape(out, u32::from(*unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_u_escape(out: &mut String, unit: u32) {
    out.push_str(&format!("\\u{unit:04x}"));
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents in [-4, 16),
/// otherwise scientific with a signed exponent of at least two digits (`1e+16`, `1.5e-05`).
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` gives the shortest digits that round-trip, e.g. "-1.5e-5" or "0e0".
    let scientific = format!("{f:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let body = if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let int_len = usize::try_from(exponent).unwrap_or(0) + 1;
            let mut int_part = digits.clone();
            while int_part.len() < int_len {
                int_part.push('0');
            }
            let frac = int_part.split_off(int_len);
            let frac = if frac.is_empty() {
                "0".to_owned()
            } else {
                frac
            };
            format!("{int_part}.{frac}")
        } else {
            let zeros = "0".repeat(usize::try_from(-exponent - 1).unwrap_or(0));
            format!("0.{zeros}{digits}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() {
            first.to_owned()
        } else {
            format!("{first}.{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{exp_sign}{:02}", exponent.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_match_python_repr() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.5, "0.5"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-2.5e100, "-2.5e+100"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
        ];
        for (value, expected) in cases {
            assert_eq!(python_float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn dumps_matches_python_layout() {
        let value = json!({"b": [1, 2.0, {}], "a": "é\n\"<>&", "c": []});
        let one_line = DumpOptions::python_defaults(false, None);
        assert_eq!(
            dumps(&value, &one_line),
            r#"{"b": [1, 2.0, {}], "a": "é\n\"<>&", "c": []}"#
        );
        let ascii_indented = DumpOptions {
            sort_keys: true,
            ..DumpOptions::python_defaults(true, Some("  ".to_owned()))
        };
        assert_eq!(
            dumps(&value, &ascii_indented),
            "{\n  \"a\": \"\\u00e9\\n\\\"<>&\",\n  \"b\": [\n    1,\n    2.0,\n    {}\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(
            dumps(
                &json!("😀\u{1f}"),
                &DumpOptions::python_defaults(true, None)
            ),
            r#""\ud83d\ude00\u001f""#
        );
    }

    #[test]
    fn default_dumps_escape_and_keep_numbers_as_python() {
        // python3 -c 'import json;print(json.dumps({"b":[1,2.0,None,True,1e-05,1e16],"a":"é\n😀"},sort_keys=True))'
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.0, null, true, 1e-05, 1e16], "a": "é\n😀"}"#)
                .unwrap();
        assert_eq!(
            dumps_sorted(&v),
            r#"{"a": "\u00e9\n\ud83d\ude00", "b": [1, 2.0, null, true, 1e-05, 1e+16]}"#
        );
        // Unsorted: the value's own key order (serde_json's preserve_order).
        assert_eq!(
            dumps_default(&v),
            r#"{"b": [1, 2.0, null, true, 1e-05, 1e+16], "a": "\u00e9\n\ud83d\ude00"}"#
        );
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(f64::INFINITY), "Infinity");
        assert_eq!(python_float_repr(-1e-7), "-1e-07");
        assert_eq!(
            dumps_default(&serde_json::json!(u64::MAX)),
            u64::MAX.to_string()
        );
    }
}
