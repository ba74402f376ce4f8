//! Client for the Open Reward Standard (ORS) HTTP+SSE protocol.
//!
//! Speaks to openreward.ai, to the `openreward` SDK's `Server`, and to Manta's built-in
//! server (`manta-envs`) alike: environment listing calls ([`OrsClient`]) and per-episode
//! sessions ([`OrsSession`]) with keep-alive pings, resumable tool calls and retries.

mod client;
mod error;
mod retry;
mod secrets;
mod session;
mod sse;
mod types;

#[cfg(test)]
mod tests;

pub use client::{OrsClient, OrsClientOptions};
pub use error::OrsError;
pub use retry::RetryPolicy;
pub use session::OrsSession;
pub use types::{Block, SplitInfo, TaskList, TerminalTool, ToolResult, ToolSpec, ToolsListing};
