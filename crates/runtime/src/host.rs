//! What a worker daemon hosts, without knowing which actors they are: each actor kind
//! (`ActorKind` in cluster.proto) is served by an [`ActorHost`] registered on the
//! daemon, which turns a `SpawnActor` request into a [`HostedActor`]. The daemon keeps
//! the registry, leases and supervision; the host keeps what is specific to its actors
//! (their config format, their typed handle, what must happen when they stop).

use std::any::Any;
use std::sync::Arc;

use futures::future::BoxFuture;
use ractor::ActorCell;
use tonic::Status;

/// One `SpawnActor` request, as a host sees it.
#[derive(Debug, Clone)]
pub struct SpawnRequest {
    /// The actor's name on this worker (unique here; the daemon checked).
    pub name: String,
    /// GPUs the driver placed the actor on (empty: CPU).
    pub gpus: Vec<u32>,
    /// The actor's arguments, in the host's own JSON format.
    pub config_json: String,
    /// GPUs this worker offers.
    pub offered_gpus: Vec<u32>,
}

/// Builds and tears down the actors of one kind on a worker.
#[tonic::async_trait]
pub trait ActorHost: Send + Sync + 'static {
    /// Starts the actor `request` describes. Runs on the worker's actor runtime; the
    /// returned status is the `SpawnActor` call's answer.
    async fn spawn(&self, request: SpawnRequest) -> Result<HostedActor, Status>;

    /// Releases what the host keeps beside its actors (e.g. a server they share); runs
    /// when the daemon stops, after every actor was stopped.
    async fn shutdown(&self) {}
}

/// A started actor as the daemon keeps it: its cell (stopped and supervised by the
/// daemon), a typed handle for the services that call it, and work to finish after it
/// stops.
pub struct HostedActor {
    pub(crate) cell: ActorCell,
    pub(crate) handle: Arc<dyn Any + Send + Sync>,
    pub(crate) on_stop: Option<BoxFuture<'static, ()>>,
}

impl HostedActor {
    /// `handle` is what services get back from [`crate::WorkerDaemon::hosted`] (for
    /// example the actor's typed `ActorRef`).
    pub fn new(cell: ActorCell, handle: impl Any + Send + Sync) -> Self {
        Self {
            cell,
            handle: Arc::new(handle),
            on_stop: None,
        }
    }

    /// Runs `finish` once the actor was stopped (by the driver, a lapsed lease, the
    /// daemon's shutdown, or after it ended on its own).
    pub fn on_stop(
        mut self,
        finish: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Self {
        self.on_stop = Some(Box::pin(finish));
        self
    }
}
