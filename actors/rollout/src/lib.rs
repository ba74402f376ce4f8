//! The rollout actor: generates episodes on an engine (`manta_engine`) against ORS
//! environments.
//!
//! - [`ors`]: the Open Reward Standard client (HTTP + SSE).
//! - [`chat`]: chat-template pieces for token-level accounting.
//! - [`tool_call`]: parsing the model's tool calls.
//! - [`episode`]: one episode, start to reward.
//! - [`actor`]: `RolloutActor`, many episodes in flight.
//! - [`upload`]: trajectory upload to OpenReward, in the background.

pub mod actor;
pub mod balance;
pub mod chat;
pub mod episode;
pub mod ors;
pub mod tool_call;
pub mod upload;

pub use actor::{IncomingWeights, RolloutActor, RolloutArgs, RolloutMsg};
pub use episode::{EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings, TaskRef};
pub use upload::{UploadConfig, UploadStats, Uploader};
