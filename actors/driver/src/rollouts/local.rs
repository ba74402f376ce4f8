//! Rollout actors in the driver process (local mode).

use anyhow::Context;
use futures::future::join_all;
use manta_core::Sample;
use manta_rollout::balance::LoadBalancer;
use manta_rollout::{EpisodeRequest, GenerationSettings, RolloutMsg};
use ractor::{call, ActorRef};
use tracing::{debug, warn};

use super::{Released, RolloutBackend, Rollouts};

/// In-process rollout actors; each group goes whole to the actor with the fewest
/// episodes in flight (manta_rollout::balance).
pub struct LocalRollouts {
    actors: Vec<ActorRef<RolloutMsg>>,
    balancer: LoadBalancer,
    /// The engines share the trainer's GPU and free their KV cache while it steps.
    colocated: bool,
}

impl Rollouts {
    /// In-process rollout actors (`colocated`: on the trainer's GPU).
    pub fn local(actors: Vec<ActorRef<RolloutMsg>>, colocated: bool) -> Self {
        let balancer = LoadBalancer::new(actors.len());
        Self::new(LocalRollouts {
            actors,
            balancer,
            colocated,
        })
    }
}

#[async_trait::async_trait]
impl RolloutBackend for LocalRollouts {
    async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>> {
        // Requests come in whole groups (the sampler sends one call per group).
        let mut groups: Vec<(u32, Vec<EpisodeRequest>)> = Vec::new();
        for request in requests {
            match groups.iter_mut().find(|(g, _)| *g == request.group_index) {
                Some((_, share)) => share.push(request),
                None => groups.push((request.group_index, vec![request])),
            }
        }
        let mut calls = Vec::with_capacity(groups.len());
        for (group, share) in groups {
            let assignment = self
                .balancer
                .assign(group, share.len())
                .context("no rollout actor to run episodes on")?;
            let actor = &self.actors[assignment.engine()];
            calls.push(async move {
                // Counted against the actor until it answers.
                let _assignment = assignment;
                call!(actor, RolloutMsg::RunEpisodes, share, generation)
            });
        }
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
