//! A trainer hosted by a worker daemon, called like the in-process one, with its own
//! heartbeat so that a lost node is noticed even while a long step is in flight.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use manta_runtime::{RuntimeError, WorkerClient};
use manta_trainer::TrainBatch;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::client::TrainerCalls;
use super::rank_group::RankSpawn;
use super::spawn::TrainerSpawnConfig;
use crate::weights::{WeightSet, WeightSyncCalls};

/// Why a trainer call did not give a result. The driver restarts a `Lost` trainer (or
/// stops, as configured); a `Failed` call is a bug or bad input and stops the run.
#[derive(Debug, thiserror::Error)]
pub enum TrainerCallError {
    #[error("the trainer on worker {addr} was lost: {reason}")]
    Lost { addr: String, reason: String },
    #[error("trainer on {addr}: {message}")]
    Failed { addr: String, message: String },
}

/// Where the trainer lives and how to reach it again.
pub struct RemoteTrainer {
    client: WorkerClient,
    name: String,
    /// What the trainer is re-created from; a data-parallel rank's place in its group
    /// is replaced when the group is opened again ([`RemoteTrainer::respawn`]).
    spawn: std::sync::Mutex<TrainerSpawnConfig>,
    gpus: Vec<u32>,
    spawn_timeout: Duration,
    live: watch::Sender<bool>,
    heartbeat: JoinHandle<()>,
    /// Counts calls that may change the trainer's weights (steps, checkpoint loads,
    /// re-creation), held for writing while one runs: a broadcast rooted at the trainer
    /// outside a sync checks that nothing changed them since the version it re-sends.
    weights: tokio::sync::RwLock<u64>,
    /// Bumped each time the trainer is re-created: a weight-update group rooted at the
    /// trainer before died with it.
    incarnation: std::sync::atomic::AtomicU64,
}

impl RemoteTrainer {
    /// Checks that the node answers, offers `gpus` and has the model at `model_dir`
    /// (before anything is started).
    pub async fn check(
        client: &WorkerClient,
        gpus: &[u32],
        model_dir: &Path,
    ) -> Result<(), RuntimeError> {
        let res = client
            .describe(Duration::from_secs(5))
            .await
            .map_err(|e| RuntimeError::Placement(format!("trainer node: {e}")))?;
        if let Some(g) = gpus.iter().find(|g| !res.gpus.contains(g)) {
            return Err(RuntimeError::Placement(format!(
                "the trainer should use GPU {g} of node {}, but the worker reports GPUs {:?}",
                client.addr(),
                res.gpus
            )));
        }
        client
            .check_model(model_dir, &["config.json"], Duration::from_secs(5))
            .await
    }

    /// Spawns trainer `name` on the worker and starts heartbeating it.
    pub async fn start(
        client: WorkerClient,
        name: &str,
        spawn: TrainerSpawnConfig,
        gpus: Vec<u32>,
        spawn_timeout: Duration,
        heartbeat_interval: Duration,
        dead_after: Duration,
    ) -> Result<Self, RuntimeError> {
        client
            .spawn_trainer(name, &spawn, &gpus, spawn_timeout)
            .await?;
        info!(node = client.addr(), trainer = name, "trainer placed");
        let (live, _) = watch::channel(true);
        let heartbeat = tokio::spawn(heartbeat_loop(
            client.clone(),
            live.clone(),
            heartbeat_interval,
            dead_after,
        ));
        Ok(Self {
            client,
            name: name.to_string(),
            spawn: std::sync::Mutex::new(spawn),
            gpus,
            spawn_timeout,
            live,
            heartbeat,
            weights: tokio::sync::RwLock::new(0),
            incarnation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn addr(&self) -> &str {
        self.client.addr()
    }

    /// The worker's client and the trainer's name there.
    pub fn placed(&self) -> (WorkerClient, String) {
        (self.client.clone(), self.name.clone())
    }

    /// Runs `call` unless the node is, or is declared, dead first.
    async fn guarded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, RuntimeError>>,
    ) -> Result<T, TrainerCallError> {
        let mut live = self.live.subscribe();
        tokio::select! {
            result = call => result.map_err(|e| self.classify(e)),
            _ = live.wait_for(|l| !*l) => Err(TrainerCallError::Lost {
                addr: self.addr().to_string(),
                reason: "no heartbeat answer (node declared dead)".into(),
            }),
        }
    }

    /// A gRPC failure is a lost trainer unless the trainer itself answered with an error.
    fn classify(&self, e: RuntimeError) -> TrainerCallError {
        let addr = self.addr().to_string();
        match &e {
            RuntimeError::Rpc { status, .. }
                if matches!(
                    status.code(),
                    tonic::Code::Internal
                        | tonic::Code::InvalidArgument
                        | tonic::Code::FailedPrecondition
                ) =>
            {
                TrainerCallError::Failed {
                    addr,
                    message: status.message().to_string(),
                }
            }
            _ => TrainerCallError::Lost {
                addr,
                reason: e.to_string(),
            },
        }
    }

    pub async fn train_step(
        &self,
        step: u64,
        batch: &TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        let mut generation = self.weights.write().await;
        *generation += 1;
        self.guarded(self.client.train_step(&self.name, step, batch))
            .await
    }

    pub async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        self.guarded(
            self.client
                .save_checkpoint(&self.name, &dir.to_string_lossy(), step),
        )
        .await
    }

    pub async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        let mut generation = self.weights.write().await;
        *generation += 1;
        self.guarded(
            self.client
                .load_checkpoint(&self.name, &dir.to_string_lossy()),
        )
        .await
    }

    /// The trainer's current weights, streamed off its worker in chunks.
    pub async fn pull_weights(&self) -> Result<WeightSet, TrainerCallError> {
        self.guarded(self.client.pull_weights(&self.name)).await
    }

    /// How many calls that may change the weights have started (waits for one running).
    pub async fn weights_generation(&self) -> u64 {
        *self.weights.read().await
    }

    /// Keeps the weights as they are while the guard lives (`None`: a call that may
    /// change them is running).
    pub fn hold_weights(&self) -> Option<tokio::sync::RwLockReadGuard<'_, u64>> {
        self.weights.try_read().ok()
    }

    /// Waits (up to `timeout`) for the node to answer, then re-creates the trainer from
    /// its spawn config (initial weights); the caller restores a checkpoint after.
    pub async fn restart(&self, timeout: Duration) -> Result<(), RuntimeError> {
        self.wait_for_node(timeout).await?;
        self.respawn(None).await
    }

    /// Waits (up to `timeout`) until the trainer's worker answers: a lost worker has to
    /// come back before anything can be placed on it again.
    pub async fn wait_for_node(&self, timeout: Duration) -> Result<(), RuntimeError> {
        let started = Instant::now();
        loop {
            match self.client.describe(Duration::from_secs(2)).await {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() >= timeout => {
                    return Err(RuntimeError::Node {
                        addr: self.addr().to_string(),
                        message: format!(
                            "the trainer's node did not come back within {timeout:?}: {e}"
                        ),
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Stops the trainer on its worker, if the worker still hosts it. For a rank of a
    /// data-parallel group this ends its collective waits (its worker aborts them), so
    /// surviving ranks are free before the group is opened again; an unreachable worker
    /// is only logged, since it hosts nothing that could wait.
    pub async fn stop_hosted(&self) {
        if let Err(e) = self.client.stop_actor(&self.name).await {
            info!(node = self.addr(), trainer = %self.name, error = %e, "no trainer to stop");
        }
    }

    /// Re-creates the trainer on its (answering) worker from its spawn config, with
    /// `rank` as its new place when its data-parallel group was opened again (the old
    /// group's NCCL id or store is gone). A copy still hosted there is stopped first.
    pub async fn respawn(&self, rank: Option<RankSpawn>) -> Result<(), RuntimeError> {
        let mut generation = self.weights.write().await;
        *generation += 1;
        // A worker that survived (a hung call, a lost connection) may still host it.
        self.stop_hosted().await;
        let spawn = {
            let mut spawn = self.spawn.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(rank) = rank {
                spawn.rank = Some(rank);
            }
            spawn.clone()
        };
        self.client
            .spawn_trainer(&self.name, &spawn, &self.gpus, self.spawn_timeout)
            .await?;
        self.incarnation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.live.send_replace(true);
        info!(node = self.addr(), trainer = %self.name, "trainer re-created");
        Ok(())
    }

    /// How many times the trainer was re-created ([`RemoteTrainer::restart`]).
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops the heartbeat and the trainer (the worker keeps running).
    pub async fn shutdown(&self) {
        self.heartbeat.abort();
        let _ = self.client.stop_actor(&self.name).await;
    }
}

impl Drop for RemoteTrainer {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// Marks the node dead after `dead_after` without an answer. Only reachability is
/// tracked: bringing the trainer back is the driver's decision ([`RemoteTrainer::restart`]).
async fn heartbeat_loop(
    client: WorkerClient,
    live: watch::Sender<bool>,
    interval: Duration,
    dead_after: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_ok = Instant::now();
    let mut sequence = 0;
    loop {
        ticker.tick().await;
        sequence += 1;
        match client
            .heartbeat(
                sequence,
                manta_runtime::client::heartbeat_limit(last_ok, interval, dead_after),
            )
            .await
        {
            Ok(_) => last_ok = Instant::now(),
            Err(e) => {
                if *live.borrow() && last_ok.elapsed() >= dead_after {
                    live.send_replace(false);
                    warn!(node = client.addr(), error = %e, "trainer node dead: no heartbeat for {dead_after:?}");
                }
            }
        }
    }
}
