//! Manta's configuration files and how they combine with command-line flags.
//!
//! - `cluster.toml` ([`ClusterConfig`]): where actors run (local mode or worker
//!   daemons), engine kind, and defaults for the training flags.
//! - `train_config.yaml` ([`TrainConfig`]): the OpenReward cookbook's file, accepted
//!   unchanged — environments, secrets, system prompt template, thinking.
//! - [`TrainSettings`]: the resolved hyperparameters: flag > cluster.toml `[train]` >
//!   the cookbook's defaults.
//!
//! Every error names the file, the key and the offending value.

mod cluster;
mod error;
mod settings;
mod train;
mod trainer_ranks;

pub use cluster::{
    ClusterConfig, ClusterMode, ClusterTls, EngineKind, NodeConfig, RolloutSection,
    TrainerFailurePolicy, TrainerSection, WorkerWeights,
};
pub use error::ConfigError;
pub use settings::{
    dynamic_sampling_filter_name, AlgoSettings, LayerRecompute, SamplingSettings, TrainOverrides,
    TrainSettings, DYNAMIC_SAMPLING_FILTERS, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,
};
pub use train::{
    format_system_prompt, EnvironmentConfig, RewardReduction, TrainConfig, DEFAULT_SYSTEM_PROMPT,
};
pub use trainer_ranks::TrainerRankPlace;
