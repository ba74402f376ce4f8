//! Placement as data: what a placement started — the actors the step loop drives, the
//! environment clients, the trainer-recovery policy, and the teardown that stops them —
//! whatever the layout: the trainer alone over saved rollouts (`--load-debug-rollout-data`,
//! `local::place_saved`), everything in this process (local mode, `local::place`), or
//! actors on worker daemons (remote mode, `remote::place`). `run::train` picks the
//! placement and has a single path from there to shutdown.

use std::collections::BTreeMap;
use std::sync::Arc;

use manta_config::TrainerFailurePolicy;
use manta_hosting::RemotePool;
use manta_rollout::ors::OrsClient;

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

/// What the driver does when a remote trainer is lost (cluster.toml `[trainer]`).
#[derive(Debug, Clone, Copy)]
pub struct TrainerRecovery {
    pub policy: TrainerFailurePolicy,
    pub restart_timeout: std::time::Duration,
}

impl Default for TrainerRecovery {
    fn default() -> Self {
        Self {
            policy: TrainerFailurePolicy::Stop,
            restart_timeout: std::time::Duration::from_secs(120),
        }
    }
}

/// Something a placement started that must be stopped when the run ends.
#[async_trait::async_trait]
pub trait Stoppable: Send {
    async fn stop(self: Box<Self>);
}

/// The actors, servers and worker connections a placement stops at the end, in the
/// order they were added.
#[derive(Default)]
pub struct Teardown(Vec<Box<dyn Stoppable>>);

impl Teardown {
    /// Stops `part` after what was added before it.
    pub fn then(mut self, part: impl Stoppable + 'static) -> Self {
        self.0.push(Box::new(part));
        self
    }

    pub async fn run(self) {
        for part in self.0 {
            part.stop().await;
        }
    }
}

#[async_trait::async_trait]
impl Stoppable for TrainerHandle {
    async fn stop(self: Box<Self>) {
        self.shutdown().await;
    }
}

/// The rollout pool stops once the last handle to it is this one.
#[async_trait::async_trait]
impl Stoppable for Arc<RemotePool> {
    async fn stop(self: Box<Self>) {
        if let Ok(pool) = Arc::try_unwrap(*self) {
            pool.shutdown().await;
        }
    }
}
