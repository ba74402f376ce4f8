//! The optimizer a trainer rank steps, whichever its data-parallel setting.

use std::path::Path;

use manta_model::NamedTensors;
use tch::Kind;

use super::super::{Collective, CollectiveError};
use super::optimizer::ZeroAdamW;
use crate::optimizer::{AdamW, AdamWConfig};

/// A trainer rank's optimizer: the whole AdamW (one rank: exactly the single-GPU path)
/// or this rank's ZeRO-2 shard.
pub enum RankOptimizer {
    Whole(AdamW),
    Sharded(Box<ZeroAdamW>),
}

impl RankOptimizer {
    pub fn config(&self) -> AdamWConfig {
        match self {
            Self::Whole(o) => o.config,
            Self::Sharded(o) => o.config,
        }
    }

    pub fn set_lr(&mut self, lr: f64) {
        match self {
            Self::Whole(o) => o.config.lr = lr,
            Self::Sharded(o) => o.config.lr = lr,
        }
    }

    pub fn step_count(&self) -> u64 {
        match self {
            Self::Whole(o) => o.step_count(),
            Self::Sharded(o) => o.step_count(),
        }
    }

    /// This rank's sharded optimizer (ZeRO-2 or ZeRO-3).
    pub fn sharded(&self) -> Option<&ZeroAdamW> {
        match self {
            Self::Whole(_) => None,
            Self::Sharded(o) => Some(o),
        }
    }

    /// This rank's optimizer when the parameters are sharded too (ZeRO-3).
    pub fn zero3(&self) -> Option<&ZeroAdamW> {
        match self {
            Self::Sharded(o) if o.stage3 => Some(o),
            _ => None,
        }
    }

    /// [`RankOptimizer::zero3`], mutable.
    pub fn zero3_mut(&mut self) -> Option<&mut ZeroAdamW> {
        match self {
            Self::Sharded(o) if o.stage3 => Some(o),
            _ => None,
        }
    }

    /// The data-parallel group, when sharded.
    pub fn collective(&self) -> Option<&dyn Collective> {
        match self {
            Self::Whole(_) => None,
            Self::Sharded(o) => Some(o.collective()),
        }
    }

    pub fn has_master_weights(&self) -> bool {
        match self {
            Self::Whole(o) => o.has_master_weights(),
            Self::Sharded(o) => o.kind != Kind::Float,
        }
    }

    pub fn master_weights(&self) -> Result<NamedTensors, CollectiveError> {
        match self {
            Self::Whole(o) => Ok(o.master_weights()),
            Self::Sharded(o) => o.master_weights(),
        }
    }

    /// Clips the (global) gradient norm; returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, CollectiveError> {
        match self {
            Self::Whole(o) => Ok(o.clip_grad_norm(max_norm)),
            Self::Sharded(o) => o.clip_grad_norm(max_norm),
        }
    }

    pub fn step(&mut self) -> Result<(), CollectiveError> {
        match self {
            Self::Whole(o) => {
                o.step();
                Ok(())
            }
            Self::Sharded(o) => o.step(),
        }
    }

    pub fn zero_grad(&mut self) {
        match self {
            Self::Whole(o) => o.zero_grad(),
            Self::Sharded(o) => o.zero_grad(),
        }
    }

    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        match self {
            Self::Whole(o) => o.save(dir),
            Self::Sharded(o) => o.save(dir),
        }
    }

    pub fn load(&mut self, dir: &Path, step: u64) -> Result<(), String> {
        match self {
            Self::Whole(o) => o.load(dir, step),
            Self::Sharded(o) => o.load(dir, step),
        }
    }
}
