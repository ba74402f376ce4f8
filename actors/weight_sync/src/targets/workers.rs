//! Engines on worker daemons: the trainer's weights go to every live node as bounded
//! gRPC chunks (no shared disk), staged there before the engines pause; or, with
//! `cluster.worker_weights` "nccl" or "store", by one broadcast to every engine through
//! a weight-update group rooted where the trainer is — in this process, or on the
//! trainer's worker, which sends its parameters itself ([`RemotePool::publish_broadcast`]).
//! A broadcast that fails falls back to chunks for that version, with a warning naming
//! the cause; the bytes are read off the trainer only then.

use std::sync::Arc;

use anyhow::Context;
use manta_engine::PauseMode;
use manta_hosting::rollout::pool::{GroupRoot, PauseMode as WirePause, RootAt};
use manta_hosting::weights;
use manta_hosting::RemotePool;
use manta_proto::weight_sync::EngineDigest;
use tracing::warn;

use crate::sync::{EngineTargets, Published, TrainerWeights};

/// The pool's engines, on its live nodes.
pub struct WorkerEngines {
    pool: Arc<RemotePool>,
    /// Rank 0 of the broadcast to the workers (`None`: gRPC chunks).
    broadcast: Option<GroupRoot>,
}

impl WorkerEngines {
    pub fn new(pool: Arc<RemotePool>) -> Self {
        Self {
            pool,
            broadcast: None,
        }
    }

    /// Weights go by broadcast from a group rooted where `root` says.
    pub fn broadcasting(mut self, root: GroupRoot) -> Self {
        self.broadcast = Some(root);
        self
    }

    /// One broadcast of the trainer's weights: its tensors from this process, or its
    /// parameters from its worker. `Ok(None)`: the root is this process but the trainer
    /// is not.
    async fn publish_by_broadcast(
        &self,
        root: &GroupRoot,
        trainer: &dyn TrainerWeights,
        version: u64,
        pause: WirePause,
        want_digests: bool,
    ) -> anyhow::Result<Option<Published>> {
        let (tensors, sent) = match &root.at {
            RootAt::Trainer { .. } => (None, None),
            RootAt::Here { .. } => {
                let Some(tensors) = trainer
                    .tensors()
                    .await
                    .context("reading the trainer's weights")?
                else {
                    return Ok(None);
                };
                let sent = if want_digests {
                    let copy: manta_engine::NamedTensors = tensors
                        .iter()
                        .map(|(n, t)| (n.clone(), t.to_device(tch::Device::Cpu)))
                        .collect();
                    Some(
                        tokio::task::spawn_blocking(move || weights::digest_tensors(&copy))
                            .await??,
                    )
                } else {
                    None
                };
                (Some(tensors), sent)
            }
        };
        let (synced, digests) = self
            .pool
            .publish_broadcast(
                root,
                tensors,
                version,
                pause,
                want_digests && sent.is_none(),
            )
            .await?;
        Ok(Some(Published {
            pause_to_resume_s: synced.pause_to_resume_s,
            engines: synced.engines,
            sent: sent.or(digests),
        }))
    }
}

#[async_trait::async_trait]
impl EngineTargets for WorkerEngines {
    async fn publish(
        &self,
        trainer: &dyn TrainerWeights,
        version: u64,
        pause: PauseMode,
        want_digests: bool,
    ) -> anyhow::Result<Published> {
        let chunk = weights::chunk_bytes()?;
        let pause = match pause {
            PauseMode::Abort => WirePause::Abort,
            _ => WirePause::Drain,
        };
        if let Some(root) = &self.broadcast {
            match self
                .publish_by_broadcast(root, trainer, version, pause, want_digests)
                .await
            {
                Ok(Some(published)) => return Ok(published),
                Ok(None) => {}
                Err(e) => warn!(
                    version,
                    rank0 = %root.describe(),
                    error = %format!("{e:#}"),
                    "weights by broadcast failed; sending this version as gRPC chunks"
                ),
            }
        }
        // Read only now: with the trainer on a worker this streams its weights here.
        let set = Arc::new(
            trainer
                .weight_set()
                .await
                .context("reading the trainer's weights")?,
        );
        let synced = self
            .pool
            .publish_weights(set.clone(), version, chunk, pause)
            .await
            .with_context(|| format!("sending weights version {version} to the workers"))?;
        Ok(Published {
            pause_to_resume_s: synced.pause_to_resume_s,
            engines: synced.engines,
            sent: want_digests.then(|| set.digests()),
        })
    }

    async fn engine_digests(&self) -> anyhow::Result<Vec<(String, EngineDigest)>> {
        let mut found = Vec::new();
        for (node, digests) in self.pool.engine_digests().await {
            for d in digests? {
                found.push((node.clone(), d));
            }
        }
        Ok(found)
    }

    fn verify_rejoins(&self) {
        self.pool.verify_rejoins();
    }
}
