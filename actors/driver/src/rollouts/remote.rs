//! Rollout actors on worker daemons (remote mode), through the pool that places them,
//! heartbeats their nodes and re-queues a lost node's episodes.

use std::sync::Arc;

use manta_core::Sample;
use manta_hosting::RemotePool;
use manta_rollout::{EpisodeRequest, GenerationSettings};

use super::{RolloutBackend, Rollouts};

impl Rollouts {
    /// The pool's rollout actors.
    pub fn remote(pool: Arc<RemotePool>) -> Self {
        Self::new(RemoteRollouts(pool))
    }
}

/// Rollout actors on workers. Engines there keep their KV cache (no colocation across
/// processes yet), so memory release is the default no-op.
struct RemoteRollouts(Arc<RemotePool>);

#[async_trait::async_trait]
impl RolloutBackend for RemoteRollouts {
    async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>> {
        Ok(self.0.run_episodes(requests, generation).await?)
    }

    fn live_nodes(&self) -> Option<usize> {
        Some(self.0.live_nodes())
    }
}
