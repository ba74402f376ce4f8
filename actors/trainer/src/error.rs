//! The trainer's one error type, below every module that can fail a step, so that the
//! parallel strategies and the trainer name it without naming each other.

use std::path::PathBuf;

use manta_model::{ModelError, RecomputeError};

use crate::data_parallel::CollectiveError;
use crate::memory_plan::DoesNotFit;

/// Why building, stepping, saving or loading a trainer failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid training batch: {0}")]
    Batch(String),
    #[error("trainer configuration: {0}")]
    Config(String),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error(transparent)]
    Recompute(#[from] RecomputeError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    DoesNotFit(#[from] DoesNotFit),
}
