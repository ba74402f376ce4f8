//! Manta's configuration files and how they combine with command-line flags.
//!
//! - `cluster.toml` ([`ClusterConfig`]): where actors run (local mode or worker
//!   daemons), engine kind, and defaults for the training flags.
//! - `train_config.yaml` ([`TrainConfig`]): the OpenReward cookbook's file, accepted
//!   unchanged — environments, secrets, system prompt template, thinking.
//! - [`TrainSettings`]: the resolved hyperparameters: flag > a `--train-settings` file's
//!   `[train]` > cluster.toml `[train]` > the cookbook's defaults, each with its source
//!   ([`resolved_settings`]).
//!
//! Every error names the file, the key and the offending value.

mod checks;
mod cluster;
mod error;
mod eval;
mod settings;
mod sources;
mod train;
mod train_file;
mod trainer_ranks;

pub use cluster::{
    ClusterConfig, ClusterMode, ClusterTls, EngineKind, NodeConfig, RolloutSection,
    TrainerFailurePolicy, TrainerSection, WorkerWeights,
};
pub use error::ConfigError;
pub use eval::{eval_datasets, EvalDataset, EvalSettings, LEGACY_EVAL_NAME};
pub use settings::{
    dynamic_sampling_filter_name, AlgoSettings, LayerRecompute, SamplingSettings, TrainOverrides,
    TrainSettings, DYNAMIC_SAMPLING_FILTERS, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,
};
pub use sources::{
    render as render_settings, resolved_settings, Layer, ResolvedSetting, SettingSource,
};
pub use train::{
    format_system_prompt, EnvironmentConfig, RewardReduction, TrainConfig, DEFAULT_SYSTEM_PROMPT,
};
pub use trainer_ranks::TrainerRankPlace;
