//! Parsing the model's tool call out of a turn's text (Hermes/Qwen format):
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

use serde_json::{Map, Value};

pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// A parsed call: one per turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// What the turn's text holds.
#[derive(Debug, Clone, PartialEq)]
pub enum ParsedTurn {
    /// No `<tool_call>` tag: a plain message.
    NoToolCall,
    Call(ToolCall),
    /// A tag is there but its content is not a valid call; the reason is shown to the model.
    Malformed(String),
}

/// Takes the text from the first `<tool_call>` to the next `</tool_call>` (or the end of
/// the text, if generation stopped before closing it) and reads it as JSON with a string
/// `name` and an object `arguments` (missing = `{}`). The cookbook's rules, except that a
/// malformed call is reported instead of crashing the episode.
pub fn parse_tool_call(text: &str) -> ParsedTurn {
    let Some(start) = text.find(TOOL_CALL_OPEN) else {
        return ParsedTurn::NoToolCall;
    };
    let rest = &text[start + TOOL_CALL_OPEN.len()..];
    let body = match rest.find(TOOL_CALL_CLOSE) {
        Some(end) => &rest[..end],
        None => rest,
    }
    .trim();
    if body.is_empty() {
        return ParsedTurn::Malformed("the tool call is empty".into());
    }
    let value: Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => return ParsedTurn::Malformed(format!("the tool call is not valid JSON ({e})")),
    };
    let Value::Object(mut obj) = value else {
        return ParsedTurn::Malformed(
            "the tool call must be a JSON object with \"name\" and \"arguments\"".into(),
        );
    };
    let name = match obj.remove("name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s,
        Some(other) => {
            return ParsedTurn::Malformed(format!(
                "\"name\" must be a non-empty string, got {other}"
            ));
        }
        None => return ParsedTurn::Malformed("the tool call has no \"name\"".into()),
    };
    let arguments = match obj.remove("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        // Some models emit the arguments as a JSON string; accept it when it holds an object.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(m)) => m,
            _ => {
                return ParsedTurn::Malformed(format!(
                    "\"arguments\" must be a JSON object, got the string {s:?}"
                ))
            }
        },
        Some(other) => {
            return ParsedTurn::Malformed(format!(
                "\"arguments\" must be a JSON object, got {other}"
            ));
        }
    };
    ParsedTurn::Call(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> ParsedTurn {
        ParsedTurn::Call(ToolCall {
            name: name.into(),
            arguments: args.as_object().unwrap().clone(),
        })
    }

    #[test]
    fn well_formed_calls() {
        let t = "thinking...\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": 3}}\n</tool_call>";
        assert_eq!(parse_tool_call(t), call("add", json!({"amount": 3})));
        // Missing arguments default to {}; an unclosed call still parses to the end.
        assert_eq!(
            parse_tool_call("<tool_call>{\"name\": \"submit\"}"),
            call("submit", json!({}))
        );
        // Only the first call counts.
        let two = "<tool_call>{\"name\":\"a\"}</tool_call><tool_call>{\"name\":\"b\"}</tool_call>";
        assert_eq!(parse_tool_call(two), call("a", json!({})));
        // Arguments given as a JSON string holding an object.
        assert_eq!(
            parse_tool_call(
                "<tool_call>{\"name\":\"a\",\"arguments\":\"{\\\"x\\\":1}\"}</tool_call>"
            ),
            call("a", json!({"x": 1}))
        );
    }

    #[test]
    fn plain_text_has_no_call() {
        assert_eq!(parse_tool_call("The answer is 7."), ParsedTurn::NoToolCall);
    }

    #[test]
    fn malformed_calls_say_why() {
        let cases = [
            (
                "<tool_call>{\"name\": \"add\", \"arguments\": {</tool_call>",
                "not valid JSON",
            ),
            ("<tool_call>[1,2]</tool_call>", "must be a JSON object"),
            ("<tool_call>{\"arguments\": {}}</tool_call>", "no \"name\""),
            (
                "<tool_call>{\"name\": 5}</tool_call>",
                "\"name\" must be a non-empty string",
            ),
            (
                "<tool_call>{\"name\": \"a\", \"arguments\": [1]}</tool_call>",
                "\"arguments\" must be a JSON object",
            ),
            (
                "<tool_call>{\"name\": \"a\", \"arguments\": \"oops\"}</tool_call>",
                "got the string",
            ),
            ("<tool_call>  </tool_call>", "empty"),
        ];
        for (text, want) in cases {
            match parse_tool_call(text) {
                ParsedTurn::Malformed(reason) => assert!(reason.contains(want), "{text}: {reason}"),
                other => panic!("{text}: expected Malformed, got {other:?}"),
            }
        }
    }
}
