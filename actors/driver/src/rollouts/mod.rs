//! The rollout actors as the step loop sees them: one handle, [`Rollouts`], whatever
//! their placement. Each placement implements [`RolloutBackend`] — in-process actors
//! ([`local`]), actors on worker daemons ([`remote`]), or saved rollouts read back
//! ([`saved`], `--load-debug-rollout-data`) — so the step loop and the group queue
//! (crate::sampling) have one code path.

pub mod local;
pub mod remote;
pub mod saved;

use std::sync::Arc;

use manta_core::Sample;
use manta_rollout::{EpisodeRequest, GenerationSettings};

/// What the step loop asks of rollout actors, wherever they live.
#[async_trait::async_trait]
pub trait RolloutBackend: Send + Sync {
    /// Runs every request and returns one sample per request (whole groups per rollout
    /// actor, by `group_index`; the samples of one group stay in request order).
    async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>>;

    /// Engines that share the trainer's GPU free their KV cache for the training step
    /// (SGLang's release of memory occupation); returns the engines that did, for
    /// [`RolloutBackend::resume_memory`]. None by default.
    async fn release_memory(&self) -> Released {
        Released::default()
    }

    /// Allocates again the KV caches that [`RolloutBackend::release_memory`] freed.
    async fn resume_memory(&self, _released: &Released) -> anyhow::Result<()> {
        Ok(())
    }

    /// Worker nodes answering heartbeats (`None`: the actors are not on workers).
    fn live_nodes(&self) -> Option<usize> {
        None
    }
}

/// The engines (by the backend's own index) that freed their KV cache for a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released(pub Vec<usize>);

impl Released {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A handle to the run's rollout actors. Cheap to clone, so each group can run as its
/// own task (crate::sampling).
#[derive(Clone)]
pub struct Rollouts(Arc<dyn RolloutBackend>);

impl Rollouts {
    pub fn new(backend: impl RolloutBackend + 'static) -> Self {
        Self(Arc::new(backend))
    }

    pub async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>> {
        // Counted for `driver status` while they run (also when the call is dropped).
        let in_flight = InFlight::new(requests.len());
        let samples = self.0.run_episodes(requests, generation).await;
        drop(in_flight);
        samples
    }

    pub async fn release_memory(&self) -> Released {
        self.0.release_memory().await
    }

    pub async fn resume_memory(&self, released: &Released) -> anyhow::Result<()> {
        self.0.resume_memory(released).await
    }

    pub fn live_nodes(&self) -> Option<usize> {
        self.0.live_nodes()
    }
}

/// Episodes counted as in flight (crate::status) for as long as it lives.
struct InFlight(i64);

impl InFlight {
    fn new(n: usize) -> Self {
        crate::status::episodes_in_flight(n as i64);
        Self(n as i64)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        crate::status::episodes_in_flight(-self.0);
    }
}
