//! The trainer on a worker daemon, with its heartbeat and restart
//! (manta_hosting::RemoteTrainer).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use manta_hosting::weights::WeightSet;
use manta_hosting::{RemoteTrainer, TrainerCallError};
use manta_trainer::TrainBatch;

use super::{TrainerBackend, TrainerHandle};

impl TrainerHandle {
    /// A trainer placed on a worker.
    pub fn remote(trainer: Arc<RemoteTrainer>) -> Self {
        Self::new(OnWorker(trainer))
    }
}

/// A trainer on a worker (also each rank of a data-parallel group on workers).
pub(super) struct OnWorker(pub(super) Arc<RemoteTrainer>);

#[async_trait::async_trait]
impl TrainerBackend for OnWorker {
    async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        self.0.train_step(step, &batch).await
    }

    async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        self.0.save_checkpoint(dir, step).await
    }

    async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        self.0.load_checkpoint(dir).await
    }

    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        self.0.pull_weights().await
    }

    fn worker_addr(&self) -> Option<&str> {
        Some(self.0.addr())
    }

    async fn restart(&self, timeout: Duration) -> anyhow::Result<()> {
        Ok(self.0.restart(timeout).await?)
    }

    async fn shutdown(&self) {
        self.0.shutdown().await
    }
}
