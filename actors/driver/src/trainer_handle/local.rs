//! The trainer as an actor in the driver process.

use std::collections::BTreeMap;
use std::path::Path;

use manta_hosting::weights::WeightSet;
use manta_hosting::TrainerCallError;
use manta_trainer::{NamedTensors, TrainBatch, TrainerMsg};
use ractor::{call, ActorRef};

use super::{TrainerBackend, TrainerHandle};

/// Where the in-process trainer's errors say they come from.
const IN_PROCESS: &str = "the driver process";

fn failed(message: impl ToString) -> TrainerCallError {
    TrainerCallError::Failed {
        addr: IN_PROCESS.into(),
        message: message.to_string(),
    }
}

impl TrainerHandle {
    /// The in-process trainer actor.
    pub fn local(actor: ActorRef<TrainerMsg>) -> Self {
        Self::new(LocalTrainer(actor))
    }
}

/// One trainer actor in this process (also each rank of a local data-parallel group).
pub(super) struct LocalTrainer(pub(super) ActorRef<TrainerMsg>);

#[async_trait::async_trait]
impl TrainerBackend for LocalTrainer {
    /// The whole weights, gathered (a ZeRO-3 rank: every rank of its group must be
    /// asked at once).
    async fn gather_weights(&self) -> Result<NamedTensors, TrainerCallError> {
        call!(self.0, TrainerMsg::GatherWeights)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
            .map_err(|e| failed(format!("gathering the weights: {e}")))
    }

    async fn weight_groups(
        &self,
    ) -> Result<Option<manta_trainer::WeightGroupShapes>, TrainerCallError> {
        call!(self.0, TrainerMsg::WeightGroups)
            .map(Some)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))
    }

    fn visit_weights(
        &self,
        visitor: manta_trainer::WeightVisitor,
    ) -> Option<tokio::task::JoinHandle<Result<(), TrainerCallError>>> {
        let actor = self.0.clone();
        Some(tokio::spawn(async move {
            call!(actor, TrainerMsg::VisitWeights, visitor)
                .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
                .map_err(|e| failed(format!("reading the weights: {e}")))
        }))
    }

    async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        call!(self.0, TrainerMsg::TrainStep, batch)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
            .map_err(|e| failed(format!("training step {step} failed: {e}")))
    }

    async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        call!(self.0, TrainerMsg::SaveCheckpoint, dir.to_path_buf(), step)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
            .map_err(failed)
    }

    async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        call!(self.0, TrainerMsg::LoadCheckpoint, dir.to_path_buf())
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))?
            .map_err(failed)
    }

    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        let weights: NamedTensors = call!(self.0, TrainerMsg::ExportWeights)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))?;
        tokio::task::spawn_blocking(move || WeightSet::from_tensors(&weights))
            .await
            .map_err(failed)?
            .map_err(failed)
    }

    async fn tensors(&self) -> Result<Option<NamedTensors>, TrainerCallError> {
        call!(self.0, TrainerMsg::ExportWeights)
            .map(Some)
            .map_err(|e| failed(format!("the trainer did not answer: {e}")))
    }

    async fn shutdown(&self) {
        self.0.stop(None);
    }
}
