//! Weight sync: everything that moves the trainer's weights into the engines, in one
//! crate the driver calls once.
//!
//! - [`sync`]: [`WeightSync`], the one call of the step loop, the same in local and
//!   remote mode, over an [`EngineTargets`] ([`targets`]: engines in this process, or on
//!   worker daemons over gRPC); verification bit for bit.
//! - [`route`]: which mechanism placement calls for per trainer/engine pair (in-process
//!   copy, NCCL broadcast, CUDA IPC, gRPC) and whether this build can run it.
//! - [`actor`]: the `WeightSyncActor` feeding the engines of this process (copies, or
//!   one NCCL broadcast group: [`broadcast`]).
//!
//! The wire side lives with the actors it serves: the worker's weights service
//! (manta-hosting) and the SGLang engine's `/update_weights_from_distributed` feed
//! (manta-engine).

pub mod actor;
pub mod broadcast;
pub mod route;
pub mod sync;
pub mod targets;

pub use actor::{
    SyncOptions, SyncReport, WeightSyncActor, WeightSyncArgs, WeightSyncError, WeightSyncMsg,
    WeightSyncState,
};
pub use broadcast::BroadcastRoot;
pub use sync::{
    trainer_endpoint, EngineTargets, Published, SyncOutcome, TrainerParts, TrainerWeights,
    WeightSync, VERIFY_ENV,
};
