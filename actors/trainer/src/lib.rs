//! The trainer actor: one GRPO step per rollout over the samples it is given.
//!
//! - [`loss`]: the clipped policy-gradient loss and its aggregation (REFERENCE.md §4).
//! - [`batch`]: splitting a batch into micro-batches under a token budget.
//! - [`optimizer`]: AdamW whose state can be checkpointed.
//! - [`data_parallel`]: ranks over a `Collective` (threads or NCCL) with ZeRO-2 or ZeRO-3.
//! - [`schedule`]: the learning-rate schedule (warmup, decay).
//! - [`trainer`]: the model, optimizer and step, free of actor plumbing.
//! - [`actor`]: the `TrainerActor` message interface.
//! - [`export`]: a checkpoint (one trainer or ZeRO shards) as a Hugging Face model directory.
//! - [`profile`]: where a step's time goes, per phase (`MANTA_TRAINER_PROFILE`).
//! - `torch_trace`: a Kineto trace of one step, every kernel in it (`MANTA_TORCH_PROFILE`).

pub mod actor;
pub mod batch;
mod context_parallel;
pub mod data_parallel;
mod error;
pub mod export;
pub mod loss;
pub mod memory_plan;
pub mod optimizer;
pub mod profile;
pub mod schedule;
mod torch_trace;
pub mod trainer;

pub use actor::{
    RankGroupKind, TrainerActor, TrainerArgs, TrainerMsg, TrainerRankActor, TrainerRankArgs,
    WeightGroupShapes, WeightVisitor,
};
pub use manta_model::{Recompute, RecomputeMethod};
pub use trainer::{AlgoOptions, NamedTensors, TrainBatch, Trainer, TrainerError, TrainerOptions};
