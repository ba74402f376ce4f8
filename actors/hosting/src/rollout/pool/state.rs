//! The pool's shared state: its nodes, the weights last published, the broadcast group,
//! and how a failed weight sync is judged.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use manta_rollout::balance::LoadBalancer;
use manta_runtime::{RuntimeError, WorkerClient};
use tokio::sync::watch;
use tracing::warn;

use crate::rollout::rank0::{GroupRoot, Rank0};
use crate::rollout::spawn::RolloutSpawnConfig;
use crate::weights::WeightSet;
use manta_proto::weight_sync::PauseMode;

/// Heartbeat and failover timing.
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions {
    pub heartbeat_interval: Duration,
    /// A node whose last answered heartbeat is older than this is dead.
    pub dead_after: Duration,
    /// How long a batch waits for any node to be live before giving up.
    pub no_live_node_timeout: Duration,
    /// A worker that gets no heartbeat from this pool for this long stops its actors.
    pub lease_timeout: Duration,
}

/// What one publication of weights did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolSync {
    /// Nodes whose engines took the version.
    pub nodes: usize,
    /// Engines that took it.
    pub engines: usize,
    /// Longest pause-to-resume of an engine, seconds.
    pub pause_to_resume_s: f64,
}

pub(super) struct Node {
    pub(super) client: WorkerClient,
    pub(super) actors: Vec<String>,
    pub(super) live: watch::Sender<bool>,
    /// Bumped whenever the node's actors were spawned again: a weight-update group
    /// made before holds none of them.
    pub(super) incarnation: AtomicU64,
    /// Rejoined while broadcasts are in use: goes live when the next broadcast reached it.
    pub(super) awaiting_weights: AtomicBool,
}

pub(super) struct Shared {
    pub(super) nodes: Vec<Node>,
    pub(super) spawn: RolloutSpawnConfig,
    /// The weights every engine should run, kept for nodes that rejoin.
    pub(super) weights: Mutex<Option<Published>>,
    /// Held while weights are published or a rejoining node is synced, so a node
    /// never goes live between a publication's start and its list of live nodes.
    pub(super) publish: tokio::sync::Mutex<()>,
    /// Check a rejoined node's engines against the published weights, bit for bit.
    pub(super) verify_rejoins: std::sync::atomic::AtomicBool,
    /// Weights go by broadcast (rejoining nodes wait for the next one).
    pub(super) broadcasting: AtomicBool,
    /// The weight-update group of the last broadcast and who was in it.
    pub(super) group: tokio::sync::Mutex<Option<PoolGroup>>,
    /// The last broadcast rooted at the trainer's worker, for a rejoin broadcast.
    pub(super) last_root: Mutex<Option<RootBroadcast>>,
    pub(super) opts: PoolOptions,
    /// Episodes in flight per rollout actor (indices into `slots`): a group goes to
    /// the least-loaded actor of a live node.
    pub(super) balancer: LoadBalancer,
    /// (node, actor) of each balancer index.
    pub(super) slots: Vec<(usize, usize)>,
}

/// The current weights as last published: a rejoining node gets exactly these.
#[derive(Clone)]
pub(super) struct Published {
    pub(super) set: Arc<WeightSet>,
    pub(super) version: u64,
    pub(super) chunk_bytes: usize,
    pub(super) pause: PauseMode,
}

/// A weight-update group's rank 0 and its members: (node, incarnation) each, and the
/// incarnation of rank 0's trainer (0 when rank 0 is this process).
pub(super) struct PoolGroup {
    pub(super) rank0: Rank0,
    pub(super) members: Vec<(usize, u64)>,
    pub(super) root_incarnation: u64,
}

/// A version last broadcast from the trainer's worker, and the trainer's weights
/// generation then ([`crate::RemoteTrainer::weights_generation`]).
#[derive(Clone)]
pub(super) struct RootBroadcast {
    pub(super) root: GroupRoot,
    pub(super) version: u64,
    pub(super) pause: PauseMode,
    pub(super) generation: u64,
}

/// Whether a node or rank 0 refused the weights (wrong shapes, bad request): an error
/// for the caller, never a lost node.
pub(super) fn refused(e: &RuntimeError) -> bool {
    matches!(e, RuntimeError::Rpc { status, .. } if matches!(
        status.code(),
        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
    ))
}

/// A node that could not take `version`: refused weights are an error for the caller;
/// anything else marks the node dead (it gets the weights when it rejoins).
pub(super) fn node_failed(node: &Node, e: RuntimeError, version: u64) -> Result<(), RuntimeError> {
    if refused(&e) {
        return Err(e);
    }
    warn!(node = node.client.addr(), version, error = %e, "weight sync failed; marking the node dead");
    node.live.send_replace(false);
    Ok(())
}
