//! Types every Manta actor shares.
//!
//! A [`Sample`] is one episode as the trainer needs it; it is produced by a rollout
//! actor, travels to the driver (in-process or as `manta.common.Sample` protobuf), and
//! is trained on by trainer actors together with its group advantage.

pub mod advantage;
pub mod algo;
pub mod pyjson;
pub mod sample;
pub mod wire;

pub use advantage::{group_advantages, whiten_over_tokens, AdvantageOptions};
pub use algo::{AdvantageEstimator, DecayStyle, KlType, TisMode};
pub use sample::{EpisodeMetadata, PrefixCacheUse, RoutedExperts, Sample, SampleStatus};
pub use wire::WireError;
