//! Manta's built-in Open Reward Standard (ORS) environment server.
//!
//! Local mode needs an environment without network access or an API key, so this crate
//! serves environments over the same HTTP+SSE protocol as the `openreward` SDK's `Server`
//! (routes, JSON bodies, SSE events and status codes), and ships two small environments:
//! `digits` (single turn, terminal answer) and `counter` (multi-turn tools, step rewards).
//!
//! ```no_run
//! # async fn demo() -> Result<(), manta_envs::EnvServerError> {
//! let server = manta_envs::serve("127.0.0.1:0".parse().unwrap(), manta_envs::builtin_environments()).await?;
//! println!("ORS server at {}", server.base_url());
//! server.shutdown().await;
//! # Ok(()) }
//! ```

mod builtin;
mod env;
mod server;

pub use builtin::{builtin_environments, digits_reward, Counter, Digits};
pub use env::{
    Block, EnvError, Environment, Episode, RejectReason, RunToolOutput, Secrets, Split, SplitKind,
    TerminalTool, ToolOutput, ToolSpec, ToolsListing,
};
pub use server::{serve, EnvServer, EnvServerError, ServerHandle};
