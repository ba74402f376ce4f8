//! ORS wire types as the client reads them (lenient: unknown fields are ignored).

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// A dataset split: `name` and its `type` (`train`, `validation` or `test`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
}

/// Task specs of a split, with the environment (variant) name to open sessions with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskList {
    pub tasks: Vec<Value>,
    pub env_name: String,
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON schema of the input object; `None` for a tool without arguments.
    #[serde(default)]
    pub input_schema: Option<Value>,
}

/// The terminal tool: hidden from `tools`; a plain assistant message is sent to it as
/// `{arg: text}` (or `{}` when `arg` is `None`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TerminalTool {
    pub name: String,
    #[serde(default)]
    pub arg: Option<String>,
    #[serde(default)]
    pub description: String,
}

/// Tools of an environment or session. Servers older than the terminal-tool field omit it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolsListing {
    pub tools: Vec<ToolSpec>,
    #[serde(default)]
    pub terminal_tool: Option<TerminalTool>,
}

/// A content block of a prompt or tool result. Block types this client does not know
/// are kept as raw JSON rather than failing the episode.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    Text { text: String },
    Image { data: String, mime_type: String },
    Other(Value),
}

impl<'de> Deserialize<'de> for Block {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        Ok(match v.get("type").and_then(Value::as_str) {
            Some("text") => match field("text") {
                Some(text) => Block::Text { text },
                None => return Err(serde::de::Error::custom("text block without `text`")),
            },
            Some("image") => match (field("data"), field("mimeType")) {
                (Some(data), Some(mime_type)) => Block::Image { data, mime_type },
                _ => {
                    return Err(serde::de::Error::custom(
                        "image block needs `data` and `mimeType`",
                    ))
                }
            },
            _ => Block::Other(v),
        })
    }
}

/// The outcome of a `/call`: the tool ran (`Ok`), or the server refused it (`Rejected`,
/// e.g. reason `not_found`, `input_validation`, `episode_finished`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolResult {
    Ok {
        blocks: Vec<Block>,
        reward: Option<f64>,
        finished: bool,
        metadata: Option<Value>,
    },
    Rejected {
        error: String,
        reason: Option<String>,
    },
}

#[derive(Deserialize)]
struct WireOutput {
    blocks: Vec<Block>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    reward: Option<f64>,
    #[serde(default)]
    finished: bool,
}

#[derive(Deserialize)]
struct WireResult {
    ok: bool,
    #[serde(default)]
    output: Option<WireOutput>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

impl ToolResult {
    /// Parses a `RunToolOutput` JSON document.
    pub(crate) fn from_json(text: &str) -> Result<Self, String> {
        let wire: WireResult = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if wire.ok {
            let out = wire
                .output
                .ok_or_else(|| "`ok: true` result without `output`".to_string())?;
            Ok(ToolResult::Ok {
                blocks: out.blocks,
                reward: out.reward,
                finished: out.finished,
                metadata: out.metadata.filter(|m| !m.is_null()),
            })
        } else {
            Ok(ToolResult::Rejected {
                error: wire.error.unwrap_or_default(),
                reason: wire.reason,
            })
        }
    }
}
