//! The trainer as the step loop sees it: the same calls whether it is an actor in this
//! process or one hosted by a worker daemon.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use manta_cluster::weights::WeightSet;
use manta_cluster::{RemoteTrainer, TrainerCallError};
use manta_trainer::{NamedTensors, TrainBatch, TrainerMsg};
use ractor::{call, ActorRef};

/// Where the in-process trainer's errors say they come from.
const IN_PROCESS: &str = "the driver process";

/// A trainer, local or remote.
#[derive(Clone)]
pub enum TrainerHandle {
    Local(ActorRef<TrainerMsg>),
    Remote(Arc<RemoteTrainer>),
}

fn failed(message: impl ToString) -> TrainerCallError {
    TrainerCallError::Failed {
        addr: IN_PROCESS.into(),
        message: message.to_string(),
    }
}

impl TrainerHandle {
    pub async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        match self {
            TrainerHandle::Local(actor) => call!(actor, TrainerMsg::TrainStep, batch)
                .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
                .map_err(|e| failed(format!("training step {step} failed: {e}"))),
            TrainerHandle::Remote(t) => t.train_step(step, &batch).await,
        }
    }

    pub async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        match self {
            TrainerHandle::Local(actor) => {
                call!(actor, TrainerMsg::SaveCheckpoint, dir.to_path_buf(), step)
                    .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
                    .map_err(failed)
            }
            TrainerHandle::Remote(t) => t.save_checkpoint(dir, step).await,
        }
    }

    /// Restores weights, optimizer and step; returns the checkpoint's step.
    pub async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        match self {
            TrainerHandle::Local(actor) => {
                call!(actor, TrainerMsg::LoadCheckpoint, dir.to_path_buf())
                    .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
                    .map_err(failed)
            }
            TrainerHandle::Remote(t) => t.load_checkpoint(dir).await,
        }
    }

    /// The current weights as bytes, for engines in other processes: exported
    /// in-process, or streamed off the trainer's worker in chunks.
    pub async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        match self {
            TrainerHandle::Local(actor) => {
                let weights: NamedTensors = call!(actor, TrainerMsg::ExportWeights)
                    .map_err(|e| failed(format!("the trainer did not answer: {e}")))?;
                tokio::task::spawn_blocking(move || WeightSet::from_tensors(&weights))
                    .await
                    .map_err(failed)?
                    .map_err(failed)
            }
            TrainerHandle::Remote(t) => t.pull_weights().await,
        }
    }

    /// The in-process actor (local weight sync moves tensors straight out of it).
    pub fn local_actor(&self) -> Option<&ActorRef<TrainerMsg>> {
        match self {
            TrainerHandle::Local(actor) => Some(actor),
            TrainerHandle::Remote(_) => None,
        }
    }

    /// The remote trainer, which can be re-created when its node is lost.
    pub fn remote(&self) -> Option<&RemoteTrainer> {
        match self {
            TrainerHandle::Remote(t) => Some(t),
            TrainerHandle::Local(_) => None,
        }
    }
}
