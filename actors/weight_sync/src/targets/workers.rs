//! Engines on worker daemons: the trainer's weights go to every live node as bounded
//! gRPC chunks (no shared disk), staged there before the engines pause.

use std::sync::Arc;

use anyhow::Context;
use manta_engine::PauseMode;
use manta_hosting::rollout::pool::PauseMode as WirePause;
use manta_hosting::weights;
use manta_hosting::RemotePool;
use manta_proto::weight_sync::EngineDigest;

use crate::sync::{EngineTargets, Published, TrainerWeights};

/// The pool's engines, on its live nodes.
pub struct WorkerEngines(Arc<RemotePool>);

impl WorkerEngines {
    pub fn new(pool: Arc<RemotePool>) -> Self {
        Self(pool)
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
        let set = Arc::new(
            trainer
                .weight_set()
                .await
                .context("reading the trainer's weights")?,
        );
        let chunk = weights::chunk_bytes()?;
        let pause = match pause {
            PauseMode::Abort => WirePause::Abort,
            _ => WirePause::Drain,
        };
        let synced = self
            .0
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
        for (node, digests) in self.0.engine_digests().await {
            for d in digests? {
                found.push((node.clone(), d));
            }
        }
        Ok(found)
    }

    fn verify_rejoins(&self) {
        self.0.verify_rejoins();
    }
}
