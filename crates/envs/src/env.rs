//! The environment interface the server hosts, and the ORS wire types it answers with.
//!
//! Field names follow the `openreward` SDK's pydantic models, so the JSON on the wire is the
//! same whether a client talks to this server or to `openreward.environments.Server`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One dataset split (`GET /{env}/splits`); `kind` is `train`, `validation` or `test`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: SplitKind,
}

/// The split types the ORS protocol knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitKind {
    Train,
    Validation,
    Test,
}

impl Split {
    /// A split whose type is inferred from its name the way the SDK does
    /// (`train`/`validation`/`test`, anything else is `validation`).
    pub fn named(name: &str) -> Self {
        let kind = match name {
            "train" => SplitKind::Train,
            "test" => SplitKind::Test,
            _ => SplitKind::Validation,
        };
        Self {
            name: name.to_string(),
            kind,
        }
    }
}

/// One tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON schema of the tool's input object; `null` for a tool without arguments.
    pub input_schema: Option<Value>,
}

/// The environment's terminal tool: hidden from `tools`, it receives a plain assistant
/// message as `{arg: text}` (or `{}` when `arg` is `None`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TerminalTool {
    pub name: String,
    pub arg: Option<String>,
    #[serde(default)]
    pub description: String,
}

/// `GET /{env}/tools` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolsListing {
    pub tools: Vec<ToolSpec>,
    pub terminal_tool: Option<TerminalTool>,
}

/// A content block of a prompt or a tool result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Block {
    Text {
        text: String,
    },
    Image {
        data: String,
        #[serde(rename = "mimeType")]
        mime_type: String,
    },
}

impl Block {
    /// A text block.
    pub fn text(text: impl Into<String>) -> Self {
        Block::Text { text: text.into() }
    }
}

/// The result of a tool that ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolOutput {
    pub blocks: Vec<Block>,
    pub metadata: Option<Value>,
    pub reward: Option<f64>,
    pub finished: bool,
}

/// Why a tool call was refused without running (the SDK's `RunToolError.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    NotFound,
    NameCollision,
    InputValidation,
    EpisodeFinished,
}

/// `{"ok":true,"output":…}` or `{"ok":false,"error":…,"reason":…}`: the body of a `/call` result.
#[derive(Debug, Clone, PartialEq)]
pub enum RunToolOutput {
    Ok(ToolOutput),
    Rejected {
        error: String,
        reason: Option<RejectReason>,
    },
}

impl RunToolOutput {
    /// A refused call with a reason.
    pub fn rejected(reason: RejectReason, error: impl Into<String>) -> Self {
        RunToolOutput::Rejected {
            error: error.into(),
            reason: Some(reason),
        }
    }

    /// The wire JSON (`ok` discriminates the two shapes).
    pub fn to_json(&self) -> Value {
        match self {
            RunToolOutput::Ok(output) => serde_json::json!({ "ok": true, "output": output }),
            RunToolOutput::Rejected { error, reason } => {
                serde_json::json!({ "ok": false, "error": error, "reason": reason })
            }
        }
    }
}

/// Errors an environment reports for task listing and episode creation; the server maps
/// them to the HTTP status the SDK server uses.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("Invalid split {0:?}")]
    UnknownSplit(String),
    #[error("Invalid index {index} for split {split:?} ({len} tasks)")]
    IndexOutOfRange { split: String, index: u64, len: u64 },
    /// The environment cannot enumerate tasks; clients use `num_tasks` + `task` instead.
    #[error("list_tasks is not supported for this environment. Use the index-based API (num_tasks + get_task) instead.")]
    ListingNotSupported,
    #[error("invalid task spec: {0}")]
    InvalidTask(String),
}

/// Secrets a client sent in `X-Secrets`, by key.
pub type Secrets = BTreeMap<String, String>;

/// An environment class: lists its splits, tasks and tools, and starts episodes.
pub trait Environment: Send + Sync {
    /// The variant name used in URL paths: lower case, unique within a server.
    fn name(&self) -> &str;
    /// Dataset splits, in the order `/splits` lists them.
    fn splits(&self) -> Vec<Split>;
    /// Number of tasks in `split`.
    fn num_tasks(&self, split: &str) -> Result<u64, EnvError>;
    /// The task spec at `index` of `split`.
    fn task(&self, split: &str, index: u64) -> Result<Value, EnvError>;
    /// All task specs of `split`; the default enumerates `task(i)`.
    fn tasks(&self, split: &str) -> Result<Vec<Value>, EnvError> {
        (0..self.num_tasks(split)?)
            .map(|i| self.task(split, i))
            .collect()
    }
    /// Tools shared by every task.
    fn tools(&self) -> ToolsListing;
    /// A fresh episode for `task_spec`.
    fn new_episode(
        &self,
        task_spec: &Value,
        secrets: &Secrets,
    ) -> Result<Box<dyn Episode>, EnvError>;
}

/// One live episode (a session's environment instance).
pub trait Episode: Send {
    /// The task prompt.
    fn prompt(&self) -> Vec<Block>;
    /// Tools of this task when they differ from the environment's (`/task_tools`).
    fn tools(&self) -> Option<ToolsListing> {
        None
    }
    /// Runs tool `name` on `input`. A panic here is reported to the client as an SSE
    /// `error` event, like an exception raised by a Python tool.
    fn call(&mut self, name: &str, input: &Value) -> RunToolOutput;
}
