//! Engines in the driver process: the in-process weight-sync actor hands the
//! trainer's tensors to each engine, which copies them into its own parameters.

use crate::actor::{SyncOptions, WeightSyncMsg};
use anyhow::Context;
use manta_engine::PauseMode;
use manta_hosting::weights;
use manta_proto::weight_sync::EngineDigest;
use manta_rollout::RolloutMsg;
use ractor::{call, ActorRef};

use crate::sync::{EngineTargets, Published, TrainerWeights};

/// The driver's engines and the weight-sync actor that feeds them.
pub struct InProcessEngines {
    actor: ActorRef<WeightSyncMsg>,
    engines: Vec<ActorRef<RolloutMsg>>,
}

impl InProcessEngines {
    pub fn new(actor: ActorRef<WeightSyncMsg>, engines: Vec<ActorRef<RolloutMsg>>) -> Self {
        Self { actor, engines }
    }
}

#[async_trait::async_trait]
impl EngineTargets for InProcessEngines {
    /// The weight-sync actor reads the (in-process) trainer itself; no bytes pass here.
    async fn publish(
        &self,
        _trainer: &dyn TrainerWeights,
        version: u64,
        pause: PauseMode,
        _want_digests: bool,
    ) -> anyhow::Result<Published> {
        let opts = SyncOptions {
            pause,
            allow_rewind: true,
        };
        let report = call!(self.actor, WeightSyncMsg::SyncWith, version, opts)
            .context("the weight-sync actor did not answer")?
            .context("in-process weight sync")?;
        Ok(Published {
            pause_to_resume_s: report.pause_to_resume_s,
            engines: self.engines.len(),
            sent: None,
        })
    }

    async fn refresh_lagging(&self) -> anyhow::Result<Vec<String>> {
        let fed = call!(self.actor, WeightSyncMsg::Refresh)
            .context("the weight-sync actor did not answer")?
            .context("re-sending weights to a restarted engine")?;
        Ok(fed.into_iter().map(|i| format!("rollout-{i}")).collect())
    }

    async fn engine_digests(&self) -> anyhow::Result<Vec<(String, EngineDigest)>> {
        let mut found = Vec::new();
        for (i, engine) in self.engines.iter().enumerate() {
            let tensors = call!(engine, RolloutMsg::ReadWeights)
                .context("a rollout actor did not answer")?
                .context("reading an engine's weights")?;
            let v = call!(engine, RolloutMsg::WeightVersion)
                .context("a rollout actor did not answer")?;
            let digests =
                tokio::task::spawn_blocking(move || weights::digest_tensors(&tensors)).await??;
            found.push((
                "driver".into(),
                EngineDigest {
                    actor: format!("rollout-{i}"),
                    version: v,
                    tensors: digests,
                },
            ));
        }
        Ok(found)
    }
}
