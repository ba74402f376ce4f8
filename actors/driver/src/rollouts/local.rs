//! Rollout actors in the driver process (local mode).

use anyhow::Context;
use futures::future::join_all;
use manta_core::Sample;
use manta_rollout::{EpisodeRequest, GenerationSettings, RolloutMsg};
use ractor::{call, ActorRef};
use tracing::{debug, warn};

use super::{Released, RolloutBackend, Rollouts};

/// In-process rollout actors; whole groups go to one actor, round robin.
pub struct LocalRollouts {
    actors: Vec<ActorRef<RolloutMsg>>,
    /// The engines share the trainer's GPU and free their KV cache while it steps.
    colocated: bool,
}

impl Rollouts {
    /// In-process rollout actors (`colocated`: on the trainer's GPU).
    pub fn local(actors: Vec<ActorRef<RolloutMsg>>, colocated: bool) -> Self {
        Self::new(LocalRollouts { actors, colocated })
    }
}

#[async_trait::async_trait]
impl RolloutBackend for LocalRollouts {
    async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>> {
        let rollouts = &self.actors;
        let mut shares: Vec<Vec<EpisodeRequest>> = vec![Vec::new(); rollouts.len()];
        for request in requests {
            shares[request.group_index as usize % rollouts.len()].push(request);
        }
        let calls = rollouts
            .iter()
            .zip(shares)
            .filter(|(_, share)| !share.is_empty())
            .map(|(actor, share)| async move {
                call!(actor, RolloutMsg::RunEpisodes, share, generation)
            });
        let mut samples: Vec<Sample> = Vec::new();
        for result in join_all(calls).await {
            samples.extend(result.context("a rollout actor failed")?);
        }
        Ok(samples)
    }

    /// Colocated engines only. An engine that is still generating (a group carried to
    /// the next step) or cannot release keeps its memory.
    async fn release_memory(&self) -> Released {
        if !self.colocated {
            return Released::default();
        }
        let mut released = Vec::new();
        for (i, actor) in self.actors.iter().enumerate() {
            match call!(actor, RolloutMsg::ReleaseMemory) {
                Ok(Ok(true)) => released.push(i),
                Ok(Ok(false)) => debug!(engine = i, "engine busy; it keeps its KV cache this step"),
                Ok(Err(e)) => debug!(engine = i, error = %e, "engine cannot release its KV cache"),
                Err(e) => {
                    warn!(engine = i, error = %e, "rollout actor did not answer the KV release")
                }
            }
        }
        Released(released)
    }

    async fn resume_memory(&self, released: &Released) -> anyhow::Result<()> {
        for &i in &released.0 {
            call!(self.actors[i], RolloutMsg::ResumeMemory)
                .map_err(|e| {
                    anyhow::anyhow!("rollout actor {i} did not answer the KV resume: {e}")
                })?
                .with_context(|| format!("engine {i} could not reallocate its KV cache"))?;
        }
        Ok(())
    }
}
