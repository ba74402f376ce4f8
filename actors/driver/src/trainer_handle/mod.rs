//! The trainer as the step loop sees it: one handle, [`TrainerHandle`], with the same
//! calls whether the trainer is an actor in this process ([`local`]), a group of
//! data-parallel rank actors in this process ([`data_parallel`]) or one hosted by a
//! worker daemon ([`remote`]); each placement implements [`TrainerBackend`].

pub mod data_parallel;
pub mod local;
pub mod rank_checkpoints;
pub mod remote;
mod weight_parts;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use manta_hosting::weights::WeightSet;
use manta_hosting::TrainerCallError;
use manta_trainer::{NamedTensors, TrainBatch};

/// What the step loop asks of the trainer, wherever it lives.
#[async_trait::async_trait]
pub trait TrainerBackend: Send + Sync {
    async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError>;

    async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError>;

    /// Restores weights, optimizer and step; returns the checkpoint's step.
    async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError>;

    /// The current weights as bytes, for engines in other processes.
    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError>;

    /// The current weights as tensors, when the trainer is in this process (a broadcast
    /// to workers is rooted here).
    async fn tensors(&self) -> Result<Option<NamedTensors>, TrainerCallError> {
        Ok(None)
    }

    /// The whole weights, gathered: under ZeRO-3 a collective every rank of the group
    /// must be asked at once. Only ranks in this process are built for it (ZeRO-3 is
    /// refused in remote mode before anything starts).
    async fn gather_weights(&self) -> Result<NamedTensors, TrainerCallError> {
        Err(TrainerCallError::Failed {
            addr: self
                .worker_addr()
                .unwrap_or("the driver process")
                .to_string(),
            message: "gathering ZeRO-3 weights is built for ranks in the driver only".into(),
        })
    }

    /// Starts handing this trainer's weights to `visitor` a shard group at a time
    /// (`TrainerMsg::VisitWeights`); the task ends once every group was visited. `None`:
    /// not a trainer in this process (the visitor runs on the rank's own thread).
    fn visit_weights(
        &self,
        _visitor: manta_trainer::WeightVisitor,
    ) -> Option<tokio::task::JoinHandle<Result<(), TrainerCallError>>> {
        None
    }

    /// The groups [`TrainerBackend::visit_weights`] hands out, by name, shape and kind
    /// (`TrainerMsg::WeightGroups`; no collective). `None`: not a trainer in this process.
    async fn weight_groups(
        &self,
    ) -> Result<Option<manta_trainer::WeightGroupShapes>, TrainerCallError> {
        Ok(None)
    }

    /// The weights a shard group at a time (ZeRO-3 ranks: see
    /// [`manta_weight_sync::TrainerWeights::weight_parts`]); `None`: read them whole.
    async fn weight_parts(
        &self,
    ) -> Result<Option<manta_weight_sync::TrainerParts>, TrainerCallError> {
        Ok(None)
    }

    /// The worker hosting the trainer (`None`: this process), for weight-sync routing.
    fn worker_addr(&self) -> Option<&str> {
        None
    }

    /// Re-creates a lost trainer with its initial weights (the caller restores a
    /// checkpoint after). Only a trainer on a worker can be lost and re-created.
    async fn restart(&self, _timeout: Duration) -> anyhow::Result<()> {
        anyhow::bail!("only a trainer on a worker can be restarted")
    }

    /// Stops the trainer (its actors in this process, or the one it placed on a worker).
    async fn shutdown(&self) {}
}

/// A handle to the run's trainer. Cheap to clone.
#[derive(Clone)]
pub struct TrainerHandle(Arc<dyn TrainerBackend>);

impl TrainerHandle {
    pub fn new(backend: impl TrainerBackend + 'static) -> Self {
        Self(Arc::new(backend))
    }

    pub async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        self.0.train_step(step, batch).await
    }

    pub async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        self.0.save_checkpoint(dir, step).await
    }

    /// Restores weights, optimizer and step; returns the checkpoint's step.
    pub async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        self.0.load_checkpoint(dir).await
    }

    /// The current weights as bytes, for engines in other processes: exported
    /// in-process, or streamed off the trainer's worker in chunks.
    pub async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        self.0.weight_set().await
    }

    /// The worker hosting the trainer (`None`: this process).
    pub fn worker_addr(&self) -> Option<&str> {
        self.0.worker_addr()
    }

    /// See [`TrainerBackend::restart`].
    pub async fn restart(&self, timeout: Duration) -> anyhow::Result<()> {
        self.0.restart(timeout).await
    }

    /// See [`TrainerBackend::shutdown`].
    pub async fn shutdown(&self) {
        self.0.shutdown().await
    }
}

#[async_trait::async_trait]
impl manta_weight_sync::TrainerWeights for TrainerHandle {
    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        TrainerHandle::weight_set(self).await
    }

    fn worker_addr(&self) -> Option<&str> {
        TrainerHandle::worker_addr(self)
    }

    async fn tensors(&self) -> Result<Option<NamedTensors>, TrainerCallError> {
        self.0.tensors().await
    }

    async fn weight_parts(
        &self,
    ) -> Result<Option<manta_weight_sync::TrainerParts>, TrainerCallError> {
        self.0.weight_parts().await
    }
}
