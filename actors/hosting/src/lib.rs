//! Manta's actors on worker daemons, over the generic runtime (manta_runtime): one
//! folder per actor, each with what a worker runs for it and what the driver calls.
//!
//! - [`worker`]: plugs rollout and trainer actors and their services into a
//!   `manta_runtime::WorkerDaemon` ([`serve`], [`spawn_control_plane`]).
//! - [`rollout`]: spawn config, actor host + `Rollout` service, calls, the driver's
//!   [`RemotePool`] across nodes (heartbeats, failover, rejoin).
//! - [`trainer`]: spawn config, actor host + `Trainer` service, calls, the driver's
//!   [`RemoteTrainer`] (heartbeat, restart).
//! - [`weights`]: weights as bounded, checksummed gRPC chunks; the `WeightSync`
//!   service and its calls.

pub mod rollout;
pub mod trainer;
pub mod weights;
pub mod worker;

pub use rollout::client::RolloutCalls;
pub use rollout::pool::{NodeSpec, PoolOptions, PoolSync, RemotePool};
pub use rollout::spawn::{
    OpenRewardAccess, RolloutSpawnConfig, SglangSpawn, ShippedTrainConfig, UploadTarget,
};
pub use trainer::client::TrainerCalls;
pub use trainer::remote::{RemoteTrainer, TrainerCallError};
pub use trainer::spawn::TrainerSpawnConfig;
pub use weights::WeightSyncCalls;
pub use worker::{serve, serve_with_tls, spawn_control_plane};
