//! Placement as data: cluster.toml and the run's settings in, the actors the step loop
//! drives out. One call, [`place`], whatever the layout — the trainer alone over saved
//! rollouts (`--load-debug-rollout-data`), everything in this process (local mode, the
//! simplest placement), or actors on worker daemons (remote mode) — and one
//! [`Teardown::run`], so `run::train` has a single path from placement to shutdown.

use std::collections::BTreeMap;
use std::sync::Arc;

use manta_config::{ClusterConfig, ClusterMode, TrainConfig, TrainSettings};
use manta_hosting::RemotePool;
use manta_rollout::ors::OrsClient;

use crate::local::LocalWorker;
use crate::run::TrainerRecovery;
use crate::step::StepActors;
use crate::trainer_handle::TrainerHandle;

/// What a placement started.
pub struct Placed {
    /// What each step talks to.
    pub actors: StepActors,
    /// One client per environment, for listing tasks (none over saved rollouts).
    pub env_clients: BTreeMap<String, OrsClient>,
    /// What to do when a remote trainer is lost.
    pub recovery: TrainerRecovery,
    /// Stops what the placement started, after the run.
    pub teardown: Teardown,
}

/// The actors, servers and worker connections a placement stops at the end.
pub enum Teardown {
    /// The trainer alone (saved rollouts).
    Trainer(TrainerHandle),
    /// This process's worker: trainer, engines, environment server, uploader.
    Local(LocalWorker),
    /// A trainer (here or on a worker), this process's worker (task listing) and the
    /// rollout pool on the workers.
    Remote {
        trainer: TrainerHandle,
        worker: LocalWorker,
        pool: Arc<RemotePool>,
    },
}

impl Teardown {
    pub async fn run(self) {
        match self {
            Teardown::Trainer(trainer) => trainer.shutdown().await,
            Teardown::Local(worker) => worker.shutdown().await,
            Teardown::Remote {
                trainer,
                worker,
                pool,
            } => {
                trainer.shutdown().await;
                worker.shutdown().await;
                if let Ok(pool) = Arc::try_unwrap(pool) {
                    pool.shutdown().await;
                }
            }
        }
    }
}

/// Starts the actors `cluster` places for this run. Remote mode makes the paths in
/// `settings` absolute (workers read and write them).
pub async fn place(
    cluster: &ClusterConfig,
    train: &TrainConfig,
    settings: &mut TrainSettings,
) -> anyhow::Result<Placed> {
    // Debug data needs no engine or environment, local or remote: the trainer runs here.
    if let Some(template) = settings.load_debug_rollout_data.clone() {
        // Data-parallel ranks are a local-mode setting (remote ranks are not built yet).
        let ranks = match cluster.mode {
            ClusterMode::Local => cluster.trainer.data_parallel_world(),
            ClusterMode::Remote => 1,
        };
        return crate::local::place_saved(template, settings, ranks).await;
    }
    match cluster.mode {
        ClusterMode::Local => crate::local::place(cluster, train, settings).await,
        ClusterMode::Remote => crate::remote::place(cluster, train, settings).await,
    }
}
