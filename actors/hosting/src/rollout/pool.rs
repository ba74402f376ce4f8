//! Remote rollout actors across worker nodes: placement, heartbeats, failover of a
//! dead node's episodes to a live one (de-duplicated by sample id), and rejoin.
//!
//! Weights reach the nodes as gRPC chunks ([`RemotePool::publish_weights`]) or by one
//! broadcast over a weight-update group whose rank 0 is this process or the trainer's
//! worker ([`RemotePool::publish_broadcast`], [`super::rank0`]): the group is made again
//! whenever its members change (a node died, rejoined or re-spawned an actor), and once
//! broadcasts are in use a rejoining node waits, not live, until a broadcast gives it the
//! weights: the next sync's, or — rank 0 on the trainer's worker, no other node live, the
//! trainer's weights untouched since the last sync — one made for it at once, so a run
//! whose only rollout node returns does not wait for a sync that needs that node first.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use manta_core::Sample;
use manta_rollout::balance::{Assignment, LoadBalancer};
use manta_rollout::{EpisodeRequest, GenerationSettings};
use manta_runtime::{ClientTls, Lease, RuntimeError, WorkerClient};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use manta_proto::weight_sync as wpb;
use manta_trainer::NamedTensors;

use super::client::RolloutCalls;
use super::rank0::{wire_backend, Rank0};
pub use super::rank0::{GroupRoot, RootAt};
use super::spawn::RolloutSpawnConfig;
use crate::weights::{WeightSet, WeightSyncCalls};
pub use manta_proto::weight_sync::PauseMode;

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

/// A node as the cluster file describes it.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub address: String,
    /// GPUs the node must offer (empty: CPU only).
    pub gpus: Vec<u32>,
}

struct Node {
    client: WorkerClient,
    actors: Vec<String>,
    live: watch::Sender<bool>,
    /// Bumped whenever the node's actors were spawned again: a weight-update group
    /// made before holds none of them.
    incarnation: AtomicU64,
    /// Rejoined while broadcasts are in use: goes live when the next broadcast reached it.
    awaiting_weights: AtomicBool,
}

struct Shared {
    nodes: Vec<Node>,
    spawn: RolloutSpawnConfig,
    /// The weights every engine should run, kept for nodes that rejoin.
    weights: Mutex<Option<Published>>,
    /// Held while weights are published or a rejoining node is synced, so a node
    /// never goes live between a publication's start and its list of live nodes.
    publish: tokio::sync::Mutex<()>,
    /// Check a rejoined node's engines against the published weights, bit for bit.
    verify_rejoins: std::sync::atomic::AtomicBool,
    /// Weights go by broadcast (rejoining nodes wait for the next one).
    broadcasting: AtomicBool,
    /// The weight-update group of the last broadcast and who was in it.
    group: tokio::sync::Mutex<Option<PoolGroup>>,
    /// The last broadcast rooted at the trainer's worker, for a rejoin broadcast.
    last_root: Mutex<Option<RootBroadcast>>,
    opts: PoolOptions,
    /// Episodes in flight per rollout actor (indices into `slots`): a group goes to
    /// the least-loaded actor of a live node.
    balancer: LoadBalancer,
    /// (node, actor) of each balancer index.
    slots: Vec<(usize, usize)>,
}

/// The current weights as last published: a rejoining node gets exactly these.
#[derive(Clone)]
struct Published {
    set: Arc<WeightSet>,
    version: u64,
    chunk_bytes: usize,
    pause: PauseMode,
}

/// A weight-update group's rank 0 and its members: (node, incarnation) each, and the
/// incarnation of rank 0's trainer (0 when rank 0 is this process).
struct PoolGroup {
    rank0: Rank0,
    members: Vec<(usize, u64)>,
    root_incarnation: u64,
}

/// A version last broadcast from the trainer's worker, and the trainer's weights
/// generation then ([`crate::RemoteTrainer::weights_generation`]).
#[derive(Clone)]
struct RootBroadcast {
    root: GroupRoot,
    version: u64,
    pause: PauseMode,
    generation: u64,
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

/// Rollout actors on worker daemons, used through the same batch call as local ones.
pub struct RemotePool {
    shared: Arc<Shared>,
    heartbeats: Vec<JoinHandle<()>>,
}

impl RemotePool {
    /// Checks every node (reachable, token accepted, GPUs present) before starting
    /// anything, then spawns `engines_per_node` rollout actors on each.
    pub async fn start(
        nodes: &[NodeSpec],
        token: &str,
        spawn: RolloutSpawnConfig,
        engines_per_node: usize,
        opts: PoolOptions,
    ) -> Result<Self, RuntimeError> {
        Self::start_with_tls(nodes, token, None, spawn, engines_per_node, opts).await
    }

    /// [`RemotePool::start`], reaching the nodes over TLS when `tls` is given.
    pub async fn start_with_tls(
        nodes: &[NodeSpec],
        token: &str,
        tls: Option<&ClientTls>,
        spawn: RolloutSpawnConfig,
        engines_per_node: usize,
        opts: PoolOptions,
    ) -> Result<Self, RuntimeError> {
        if nodes.is_empty() || engines_per_node == 0 {
            return Err(RuntimeError::Placement(
                "no node or no rollout engine to place".into(),
            ));
        }
        let lease = Lease::new(opts.lease_timeout);
        let mut clients = Vec::new();
        for spec in nodes {
            let client = WorkerClient::connect(&spec.address, token, tls)?.with_lease(lease);
            let res = client
                .describe(Duration::from_secs(5))
                .await
                .map_err(|e| RuntimeError::Placement(e.to_string()))?;
            if let Some(g) = spec.gpus.iter().find(|g| !res.gpus.contains(g)) {
                return Err(RuntimeError::Placement(format!(
                    "node {} should offer GPU {g}, but the worker reports GPUs {:?}",
                    spec.address, res.gpus
                )));
            }
            client
                .check_model(
                    &spawn.model_dir,
                    &["config.json", "tokenizer.json"],
                    Duration::from_secs(5),
                )
                .await?;
            clients.push(client);
        }
        let mut built = Vec::new();
        // Nodes already placed keep their lease while the others load their models.
        let mut keep_alive = Vec::new();
        for (i, client) in clients.into_iter().enumerate() {
            let actors: Vec<String> = (0..engines_per_node)
                .map(|k| format!("rollout-{i}-{k}"))
                .collect();
            for name in &actors {
                if let Err(e) = client.spawn_rollout(name, &spawn).await {
                    keep_alive.iter().for_each(JoinHandle::abort);
                    return Err(e);
                }
            }
            keep_alive.push(tokio::spawn(renew_lease(
                client.clone(),
                opts.heartbeat_interval,
            )));
            let (live, _) = watch::channel(true);
            built.push(Node {
                client,
                actors,
                live,
                incarnation: AtomicU64::new(0),
                awaiting_weights: AtomicBool::new(false),
            });
        }
        let slots: Vec<(usize, usize)> = built
            .iter()
            .enumerate()
            .flat_map(|(n, node)| (0..node.actors.len()).map(move |a| (n, a)))
            .collect();
        let shared = Arc::new(Shared {
            balancer: LoadBalancer::new(slots.len()),
            slots,
            nodes: built,
            spawn,
            weights: Mutex::new(None),
            publish: tokio::sync::Mutex::new(()),
            verify_rejoins: std::sync::atomic::AtomicBool::new(false),
            broadcasting: AtomicBool::new(false),
            group: tokio::sync::Mutex::new(None),
            last_root: Mutex::new(None),
            opts,
        });
        let heartbeats = (0..shared.nodes.len())
            .map(|i| tokio::spawn(heartbeat_loop(shared.clone(), i)))
            .collect();
        keep_alive.iter().for_each(JoinHandle::abort);
        Ok(Self { shared, heartbeats })
    }

    /// Each node's client and the actors placed on it.
    pub fn placed(&self) -> Vec<(WorkerClient, Vec<String>)> {
        self.shared
            .nodes
            .iter()
            .map(|n| (n.client.clone(), n.actors.clone()))
            .collect()
    }

    /// Stops heartbeats (and with them rejoins that would re-spawn actors), for a
    /// shutdown that stops the actors from outside.
    pub fn stop_heartbeats(&self) {
        for h in &self.heartbeats {
            h.abort();
        }
    }

    /// Nodes answering heartbeats now.
    pub fn live_nodes(&self) -> usize {
        self.shared
            .nodes
            .iter()
            .filter(|n| *n.live.borrow())
            .count()
    }

    /// Sends `set` as `version` to every live node over gRPC (bounded chunks, no shared
    /// disk), then has each apply it (pause, copy, bump version, resume). A node that
    /// fails is marked dead, so it gets these weights again when it rejoins; weights
    /// that a node refuses (wrong shapes, a broken stream) are an error.
    pub async fn publish_weights(
        &self,
        set: Arc<WeightSet>,
        version: u64,
        chunk_bytes: usize,
        pause: PauseMode,
    ) -> Result<PoolSync, RuntimeError> {
        let _publishing = self.shared.publish.lock().await;
        let published = Published {
            set,
            version,
            chunk_bytes,
            pause,
        };
        if let Ok(mut w) = self.shared.weights.lock() {
            *w = Some(published.clone());
        }
        let live: Vec<&Node> = self
            .shared
            .nodes
            .iter()
            .filter(|n| *n.live.borrow())
            .collect();
        // Every node receives before any pauses: the pause covers the copy alone.
        let pushed = join_all(live.iter().map(|node| {
            node.client
                .push_weights(published.set.clone(), version, published.chunk_bytes)
        }))
        .await;
        let mut staged = Vec::new();
        for (node, result) in live.into_iter().zip(pushed) {
            match result {
                Ok(_) => staged.push(node),
                Err(e) => node_failed(node, e, version)?,
            }
        }
        let applied = join_all(
            staged
                .iter()
                .map(|node| node.client.apply_weights(version, pause)),
        )
        .await;
        let mut sync = PoolSync {
            nodes: 0,
            engines: 0,
            pause_to_resume_s: 0.0,
        };
        for (node, result) in staged.into_iter().zip(applied) {
            match result {
                Ok(reply) => {
                    sync.nodes += 1;
                    sync.engines += reply.engines as usize;
                    sync.pause_to_resume_s = sync.pause_to_resume_s.max(reply.pause_to_resume_s);
                }
                Err(e) => node_failed(node, e, version)?,
            }
        }
        if sync.nodes == 0 {
            return Err(RuntimeError::Placement(format!(
                "no live node took weights version {version}"
            )));
        }
        Ok(sync)
    }

    /// Sends the trainer's weights as `version` to every engine of the live nodes, and of
    /// nodes waiting to go live, by one broadcast: each node is told over gRPC which group
    /// to join at which ranks (`ReceiveBroadcast`) while rank 0 broadcasts — this process
    /// sending `tensors` (on `root`'s device), or the trainer's worker sending its
    /// trainer's parameters (`tensors` is `None`; with `want_digests` their digests come
    /// back). The group is kept while its members stay the same and made again when they
    /// change. A node that fails is marked dead (refused weights are an error); the group
    /// is then aborted on every side and dropped, and the version is not applied — but
    /// with rank 0 on the trainer's worker and no node live after it, the version is kept
    /// for the node that returns (`Ok`, no node synced).
    pub async fn publish_broadcast(
        &self,
        root: &GroupRoot,
        tensors: Option<NamedTensors>,
        version: u64,
        pause: PauseMode,
        want_digests: bool,
    ) -> Result<(PoolSync, Option<Vec<wpb::TensorDigest>>), RuntimeError> {
        let _publishing = self.shared.publish.lock().await;
        self.shared.broadcasting.store(true, Ordering::SeqCst);
        // Bytes published before are not current any more: rejoins wait for a broadcast.
        if let Ok(mut w) = self.shared.weights.lock() {
            *w = None;
        }
        let generation = match &root.at {
            RootAt::Trainer { trainer, .. } => Some(trainer.weights_generation().await),
            RootAt::Here { .. } => None,
        };
        let sent =
            broadcast_locked(&self.shared, root, tensors, version, pause, want_digests).await;
        // No node live now (the only rollout node died before or during the broadcast):
        // with rank 0 on the trainer's worker the version is not lost — the node that
        // returns gets it from there — so the sync has reached every live engine.
        let none_live = !self.shared.nodes.iter().any(|n| *n.live.borrow());
        let sent = match sent {
            Err(e) if generation.is_some() && none_live && !refused(&e) => {
                warn!(
                    version,
                    error = %e,
                    "weights version {version} reached no node (none is live); a node that returns gets it from the trainer's worker"
                );
                Ok((
                    PoolSync {
                        nodes: 0,
                        engines: 0,
                        pause_to_resume_s: 0.0,
                    },
                    None,
                ))
            }
            sent => sent,
        };
        if let Ok(mut last) = self.shared.last_root.lock() {
            *last = match (&sent, generation) {
                (Ok(_), Some(generation)) => Some(RootBroadcast {
                    root: root.clone(),
                    version,
                    pause,
                    generation,
                }),
                _ => None,
            };
        }
        sent
    }

    /// The name of the weight-update group the last broadcast used (`None`: none kept).
    pub async fn group_name(&self) -> Option<String> {
        self.shared
            .group
            .lock()
            .await
            .as_ref()
            .map(|g| g.rank0.group_name().to_string())
    }

    /// Whether a rejoined node waits for the next broadcast to go live.
    pub fn awaiting_weights(&self) -> bool {
        self.shared
            .nodes
            .iter()
            .any(|n| n.awaiting_weights.load(Ordering::SeqCst))
    }

    /// From now on, a rejoined node's engines are read back after their sync and must
    /// hold the published weights bit for bit (else the rejoin fails and is retried).
    pub fn verify_rejoins(&self) {
        self.shared.verify_rejoins.store(true, Ordering::Relaxed);
    }

    /// What every live node's engines hold now (verification), by node address.
    pub async fn engine_digests(
        &self,
    ) -> Vec<(
        String,
        Result<Vec<manta_proto::weight_sync::EngineDigest>, RuntimeError>,
    )> {
        let live: Vec<&Node> = self
            .shared
            .nodes
            .iter()
            .filter(|n| *n.live.borrow())
            .collect();
        let digests = join_all(live.iter().map(|n| n.client.engine_digests())).await;
        live.iter()
            .map(|n| n.client.addr().to_string())
            .zip(digests)
            .collect()
    }

    /// Runs `requests` on live nodes (whole groups per call) and returns one sample per
    /// request, in request order. Episodes of a node that dies are re-sent elsewhere;
    /// a sample id seen twice keeps its first sample.
    pub async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        settings: GenerationSettings,
    ) -> Result<Vec<Sample>, RuntimeError> {
        let order: Vec<u64> = requests.iter().map(|r| r.sample_id).collect();
        let mut groups: BTreeMap<u32, Vec<EpisodeRequest>> = BTreeMap::new();
        for r in requests {
            groups.entry(r.group_index).or_default().push(r);
        }
        let mut done: BTreeMap<u64, Sample> = BTreeMap::new();
        // Shares that failed, by node: one warning per node and call (a dead node fails
        // every share it held at once), then one line with the totals. A step may run
        // several calls at once (one per batch of groups in flight).
        let mut failed: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        let mut running = FuturesUnordered::new();
        for (group, share) in groups {
            let (node, actor, load) = self.pick(None, group, share.len()).await?;
            running.push(run_share(
                self.shared.clone(),
                node,
                actor,
                share,
                settings,
                load,
                None,
            ));
        }
        while let Some((node, share, samples, result)) = running.next().await {
            for s in samples {
                done.entry(s.id).or_insert(s);
            }
            if let Err(e) = result {
                let missing: Vec<EpisodeRequest> = share
                    .into_iter()
                    .filter(|r| !done.contains_key(&r.sample_id))
                    .collect();
                let (shares, episodes) = failed.entry(node).or_default();
                if *shares == 0 {
                    warn!(
                        node = self.shared.nodes[node].client.addr(),
                        error = %e,
                        "a rollout share failed; re-queueing its episodes on another node \
                         (the node's other failed shares of this batch are counted, not logged)"
                    );
                } else {
                    debug!(node = self.shared.nodes[node].client.addr(), error = %e, "rollout share failed");
                }
                *shares += 1;
                *episodes += missing.len();
                if !missing.is_empty() {
                    let group = missing[0].group_index;
                    let (other, actor, load) = self.pick(Some(node), group, missing.len()).await?;
                    // Back to the node that just failed (no other is live, and it is not
                    // declared dead yet): wait a heartbeat first, instead of failing
                    // again at once in a tight loop until the heartbeats decide.
                    let wait = (other == node).then_some(self.shared.opts.heartbeat_interval);
                    running.push(run_share(
                        self.shared.clone(),
                        other,
                        actor,
                        missing,
                        settings,
                        load,
                        wait,
                    ));
                }
            }
        }
        for (node, (shares, episodes)) in failed {
            warn!(
                node = self.shared.nodes[node].client.addr(),
                shares,
                episodes,
                "node lost work: {shares} rollout shares of this batch failed there and their \
                 {episodes} unfinished episodes ran again elsewhere"
            );
        }
        order
            .iter()
            .map(|id| {
                done.remove(id).ok_or_else(|| {
                    RuntimeError::Placement(format!("sample {id} came back from no node"))
                })
            })
            .collect()
    }

    /// The actor of a live node (preferring nodes other than `avoid`) with the fewest
    /// episodes in flight, counted against it for `episodes` until the returned
    /// [`Assignment`] drops; waits for a node to come back when none is live.
    async fn pick(
        &self,
        avoid: Option<usize>,
        group: u32,
        episodes: usize,
    ) -> Result<(usize, String, Assignment), RuntimeError> {
        let started = Instant::now();
        let shared = &self.shared;
        loop {
            let live = |node: usize| *shared.nodes[node].live.borrow();
            let other_live = (0..shared.nodes.len()).any(|n| live(n) && Some(n) != avoid);
            let allowed = |slot: usize| {
                let node = shared.slots[slot].0;
                live(node) && (!other_live || Some(node) != avoid)
            };
            if let Some(load) = shared.balancer.assign_among(group, episodes, allowed) {
                let (node, actor) = shared.slots[load.engine()];
                return Ok((node, shared.nodes[node].actors[actor].clone(), load));
            }
            if started.elapsed() > self.shared.opts.no_live_node_timeout {
                return Err(RuntimeError::Placement(format!(
                    "no worker node has been live for {:?}",
                    self.shared.opts.no_live_node_timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the heartbeats and the remote actors (workers keep running).
    pub async fn shutdown(self) {
        for h in &self.heartbeats {
            h.abort();
        }
        for node in &self.shared.nodes {
            for a in &node.actors {
                let _ = node.client.stop_actor(a).await;
            }
        }
    }
}

/// Streams one share from `actor` of `node`; ends early with an error when the stream
/// breaks or the node is declared dead. Returns what arrived either way. `_load` counts
/// the share's episodes against the actor until it ends; `wait` delays the start (a
/// share sent back to the node it just failed on).
async fn run_share(
    shared: Arc<Shared>,
    node: usize,
    actor: String,
    share: Vec<EpisodeRequest>,
    settings: GenerationSettings,
    _load: Assignment,
    wait: Option<Duration>,
) -> (
    usize,
    Vec<EpisodeRequest>,
    Vec<Sample>,
    Result<(), RuntimeError>,
) {
    let n = &shared.nodes[node];
    let mut live = n.live.subscribe();
    let mut samples = Vec::new();
    let result = async {
        if let Some(wait) = wait {
            // Cut short if the heartbeats declare the node dead meanwhile.
            let _ = tokio::time::timeout(wait, live.wait_for(|l| !*l)).await;
        }
        let mut stream = n.client.run_episodes(&actor, &share, settings).await?;
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(p)) => samples.push(Sample::try_from(p)?),
                    Ok(None) => return Ok(()),
                    Err(status) => return Err(n.client.stream_error(status)),
                },
                changed = live.wait_for(|l| !*l) => {
                    let _ = changed;
                    return Err(RuntimeError::Node {
                        addr: n.client.addr().to_string(),
                        message: "declared dead (missed heartbeats)".into(),
                    });
                }
            }
        }
    }
    .await;
    (node, share, samples, result)
}

/// Heartbeats `client` (renewing its lease) until aborted; answers are not checked.
async fn renew_lease(client: WorkerClient, interval: Duration) {
    let mut sequence = 0;
    loop {
        tokio::time::sleep(interval).await;
        sequence += 1;
        let _ = client.heartbeat(sequence, interval).await;
    }
}

/// How often a node waiting for broadcast weights asks for a rejoin broadcast again.
const REJOIN_RETRY: Duration = Duration::from_secs(1);

/// Heartbeats one node; marks it dead after `dead_after` without an answer, and on
/// its return re-spawns missing actors and reloads the current weights.
async fn heartbeat_loop(shared: Arc<Shared>, index: usize) {
    let node = &shared.nodes[index];
    let addr = node.client.addr().to_string();
    let mut ticker = tokio::time::interval(shared.opts.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_ok = Instant::now();
    let mut last_try = Instant::now();
    let mut sequence = 0;
    loop {
        ticker.tick().await;
        sequence += 1;
        match node
            .client
            .heartbeat(
                sequence,
                manta_runtime::client::heartbeat_limit(
                    last_ok,
                    shared.opts.heartbeat_interval,
                    shared.opts.dead_after,
                ),
            )
            .await
        {
            Ok(reply) => {
                last_ok = Instant::now();
                let missing: Vec<&String> = node
                    .actors
                    .iter()
                    .filter(|a| !reply.actors.contains(a))
                    .collect();
                let was_live = *node.live.borrow();
                let awaiting = node.awaiting_weights.load(Ordering::SeqCst);
                let none_live = !shared.nodes.iter().any(|n| *n.live.borrow());
                if missing.is_empty() && awaiting && none_live && last_try.elapsed() >= REJOIN_RETRY
                {
                    // The rejoin broadcast was not possible then (a step was changing
                    // the weights); a sync may not come while no node is live.
                    last_try = Instant::now();
                    let _publishing = shared.publish.lock().await;
                    if node.awaiting_weights.load(Ordering::SeqCst) {
                        rejoin_broadcast(&shared).await;
                    }
                    continue;
                }
                if missing.is_empty() && (was_live || awaiting) {
                    continue;
                }
                node.live.send_replace(false);
                match rejoin(&shared, node, &missing).await {
                    Ok(()) => info!(node = %addr, "node rejoined"),
                    Err(e) => warn!(node = %addr, error = %e, "node answered but could not rejoin"),
                }
            }
            Err(e) => {
                if *node.live.borrow() && last_ok.elapsed() >= shared.opts.dead_after {
                    node.live.send_replace(false);
                    warn!(node = %addr, error = %e, "node dead: no heartbeat for {:?}", shared.opts.dead_after);
                }
            }
        }
    }
}

/// Whether a node or rank 0 refused the weights (wrong shapes, bad request): an error
/// for the caller, never a lost node.
fn refused(e: &RuntimeError) -> bool {
    matches!(e, RuntimeError::Rpc { status, .. } if matches!(
        status.code(),
        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
    ))
}

/// A node that could not take `version`: refused weights are an error for the caller;
/// anything else marks the node dead (it gets the weights when it rejoins).
fn node_failed(node: &Node, e: RuntimeError, version: u64) -> Result<(), RuntimeError> {
    if refused(&e) {
        return Err(e);
    }
    warn!(node = node.client.addr(), version, error = %e, "weight sync failed; marking the node dead");
    node.live.send_replace(false);
    Ok(())
}

/// Every engine on `node` holds `p`'s version and bytes.
async fn verify_node(node: &Node, p: &Published) -> Result<(), RuntimeError> {
    let sorted = |mut d: Vec<manta_proto::weight_sync::TensorDigest>| {
        d.sort_by(|a, b| a.name.cmp(&b.name));
        d
    };
    let want = sorted(p.set.digests());
    let engines = node.client.engine_digests().await?;
    for e in &engines {
        let got = sorted(e.tensors.clone());
        if e.version != p.version || got != want {
            return Err(RuntimeError::Node {
                addr: node.client.addr().to_string(),
                message: format!(
                    "engine {} holds version {} after the rejoin sync of version {}{}",
                    e.actor,
                    e.version,
                    p.version,
                    if got != want {
                        ", with different weights"
                    } else {
                        ""
                    }
                ),
            });
        }
    }
    info!(
        node = node.client.addr(),
        version = p.version,
        engines = engines.len(),
        "rejoined node verified bit for bit"
    );
    Ok(())
}

/// Re-creates a returning node's missing actors, gives its engines the current weights
/// (a restarted engine starts from the model directory's weights) and marks it live.
async fn rejoin(shared: &Shared, node: &Node, missing: &[&String]) -> Result<(), RuntimeError> {
    for name in missing {
        node.client.spawn_rollout(name, &shared.spawn).await?;
    }
    // Publishing waits for this: the node goes live holding the newest version.
    let _publishing = shared.publish.lock().await;
    if shared.broadcasting.load(Ordering::SeqCst) {
        // Its actors are new: the next broadcast makes a group with them in it.
        node.incarnation.fetch_add(1, Ordering::SeqCst);
        node.awaiting_weights.store(true, Ordering::SeqCst);
        info!(
            node = node.client.addr(),
            "rejoined node waits for the next weight broadcast before it goes live"
        );
        rejoin_broadcast(shared).await;
        return Ok(());
    }
    let current = shared.weights.lock().ok().and_then(|w| w.clone());
    if let Some(p) = current {
        node.client
            .push_weights(p.set.clone(), p.version, p.chunk_bytes)
            .await?;
        let reply = node.client.apply_weights(p.version, p.pause).await?;
        info!(
            node = node.client.addr(),
            version = p.version,
            engines = reply.engines,
            "rejoined node synced to the current weights"
        );
        if shared.verify_rejoins.load(Ordering::Relaxed) {
            verify_node(node, &p).await?;
        }
    }
    node.live.send_replace(true);
    Ok(())
}

/// [`RemotePool::publish_broadcast`]'s work, under the publish lock the caller holds.
async fn broadcast_locked(
    shared: &Shared,
    root: &GroupRoot,
    tensors: Option<NamedTensors>,
    version: u64,
    pause: PauseMode,
    want_digests: bool,
) -> Result<(PoolSync, Option<Vec<wpb::TensorDigest>>), RuntimeError> {
    let nodes = &shared.nodes;
    let members: Vec<usize> = (0..nodes.len())
        .filter(|&i| *nodes[i].live.borrow() || nodes[i].awaiting_weights.load(Ordering::SeqCst))
        .collect();
    if members.is_empty() {
        return Err(RuntimeError::Placement(format!(
            "no live node to take weights version {version}"
        )));
    }
    let key: Vec<(usize, u64)> = members
        .iter()
        .map(|&i| (i, nodes[i].incarnation.load(Ordering::SeqCst)))
        .collect();
    // A re-created trainer lost the group it rooted: make a new one at once rather
    // than broadcast into the old one until its timeout.
    let root_incarnation = match &root.at {
        RootAt::Trainer { trainer, .. } => trainer.incarnation(),
        RootAt::Here { .. } => 0,
    };
    let mut slot = shared.group.lock().await;
    let rank0 = match slot.take() {
        Some(g) if g.members == key && g.root_incarnation == root_incarnation => g.rank0,
        stale => {
            // Its members changed: abort it, so dropping it waits on nobody.
            if let Some(old) = stale {
                old.rank0.abort().await;
            }
            let world = 1 + members
                .iter()
                .map(|&i| nodes[i].actors.len())
                .sum::<usize>();
            let rank0 = Rank0::make(root, world).await?;
            info!(
                group = %rank0.group_name(),
                ranks = world,
                backend = ?root.backend,
                nodes = members.len(),
                rank0 = %root.describe(),
                "weight-update group made for the workers' engines"
            );
            rank0
        }
    };
    let (master_address, master_port) = rank0.store();
    let backend = wire_backend(rank0.backend());
    let names = rank0.names(tensors.as_ref());
    let (group_name, world_size) = (rank0.group_name().to_string(), rank0.world_size());
    let timeout_s = rank0.timeout().as_secs().max(1) as u32;
    let mut next_rank = 1u32;
    let requests: Vec<wpb::ReceiveBroadcastRequest> = members
        .iter()
        .map(|&i| {
            let actors = nodes[i].actors.clone();
            let ranks = (0..actors.len() as u32).map(|k| next_rank + k).collect();
            next_rank += actors.len() as u32;
            wpb::ReceiveBroadcastRequest {
                version,
                pause: pause as i32,
                backend: backend as i32,
                master_address: master_address.clone(),
                master_port: u32::from(master_port),
                group_name: group_name.clone(),
                world_size: world_size as u32,
                actors,
                ranks,
                names: names.clone(),
                timeout_s,
            }
        })
        .collect();
    let aborter = rank0.aborter();
    // Which side failed first: rank 0 aborted for a member that failed (every member has
    // answered then), or the members aborted for rank 0.
    let members_failed = AtomicBool::new(false);
    let rank0_failed = AtomicBool::new(false);
    let receiving = async {
        let replies = join_all(
            members
                .iter()
                .zip(requests)
                .map(|(&i, req)| nodes[i].client.receive_broadcast(req)),
        )
        .await;
        // A member that gave up leaves rank 0 waiting for it: end the wait.
        if replies.iter().any(Result::is_err) {
            members_failed.store(true, Ordering::SeqCst);
            aborter.abort().await;
        }
        replies
    };
    let sending = async {
        let (rank0, sent) = rank0.broadcast(tensors, want_digests).await;
        // The members would wait for rank 0 until the group's timeout (on NCCL, c10d's
        // watchdog may then take their whole worker down): end their receive now.
        let on_its_own = !members_failed.load(Ordering::SeqCst);
        if let (Err(cause), true) = (&sent, on_its_own) {
            rank0_failed.store(true, Ordering::SeqCst);
            warn!(group = %group_name, rank0 = %root.describe(), cause = %cause, "rank 0's broadcast failed: aborting the members' receive");
            abort_members(nodes, &members, &group_name).await;
        }
        (rank0, sent)
    };
    let (replies, (rank0, sent)) = tokio::join!(receiving, sending);
    let failed_anywhere = sent.is_err() || replies.iter().any(Result::is_err);
    let rank0 = match rank0 {
        // Dropped below: an aborted group is freed without waiting on its peers.
        Some(r) if failed_anywhere => {
            r.abort().await;
            None
        }
        kept => kept,
    };
    let mut sync = PoolSync {
        nodes: 0,
        engines: 0,
        pause_to_resume_s: 0.0,
    };
    let mut failed = false;
    for (&i, reply) in members.iter().zip(replies) {
        match reply {
            Ok(reply) => {
                sync.nodes += 1;
                sync.engines += reply.engines as usize;
                sync.pause_to_resume_s = sync.pause_to_resume_s.max(reply.pause_to_resume_s);
            }
            // Its receive was aborted because rank 0 failed: rank 0's error is the one.
            Err(e) if rank0_failed.load(Ordering::SeqCst) && refused(&e) => {
                failed = true;
                debug!(node = nodes[i].client.addr(), version, error = %e, "member's receive ended after rank 0 failed");
            }
            Err(e) => {
                failed = true;
                node_failed(&nodes[i], e, version)?;
            }
        }
    }
    let digests = match sent {
        Ok(d) if !failed => d,
        sent => {
            // The group is aborted or broken: the next broadcast makes a new one.
            return Err(RuntimeError::Placement(format!(
                "weights version {version} did not reach every node by broadcast{}",
                sent.err()
                    .map(|e| format!(" (rank 0, {}: {e})", root.describe()))
                    .unwrap_or_default()
            )));
        }
    };
    for &i in &members {
        if nodes[i].awaiting_weights.swap(false, Ordering::SeqCst) {
            nodes[i].live.send_replace(true);
            info!(
                node = nodes[i].client.addr(),
                version, "rejoined node live with the broadcast weights"
            );
        }
    }
    *slot = rank0.map(|rank0| PoolGroup {
        rank0,
        members: key,
        root_incarnation,
    });
    Ok((sync, digests))
}

/// How long the driver waits for a member's worker to answer `AbortBroadcast`.
const ABORT_MEMBER_LIMIT: Duration = Duration::from_secs(10);

/// Has every member node abort its engines' receive in `group` at once; a worker that
/// does not answer is left to the group's timeout (its failures are only logged).
async fn abort_members(nodes: &[Node], members: &[usize], group: &str) {
    let calls = members.iter().map(|&i| async move {
        let client = &nodes[i].client;
        match tokio::time::timeout(ABORT_MEMBER_LIMIT, client.abort_broadcast(group)).await {
            Ok(Ok(aborted)) => {
                debug!(node = client.addr(), group, aborted, "member's receive aborted")
            }
            Ok(Err(e)) => {
                debug!(node = client.addr(), group, error = %e, "aborting a member's receive failed")
            }
            Err(_) => debug!(
                node = client.addr(),
                group,
                "aborting a member's receive: no answer within {ABORT_MEMBER_LIMIT:?}"
            ),
        }
    });
    join_all(calls).await;
}

/// Gives a rejoined node the current weights by a broadcast from the trainer's worker at
/// once, when it is the only node that could go live (else the step waiting for rollouts
/// would wait for it forever) and the trainer's weights are still the version last
/// broadcast. Called under the publish lock; `false`: not possible now.
async fn rejoin_broadcast(shared: &Shared) -> bool {
    if shared.nodes.iter().any(|n| *n.live.borrow()) {
        return false;
    }
    let Some(last) = shared.last_root.lock().ok().and_then(|l| l.clone()) else {
        return false;
    };
    let RootAt::Trainer { trainer, .. } = &last.root.at else {
        return false;
    };
    // No step or checkpoint load may change the weights while they go out.
    let Some(generation) = trainer.hold_weights() else {
        return false;
    };
    if *generation != last.generation {
        return false;
    }
    match broadcast_locked(shared, &last.root, None, last.version, last.pause, false).await {
        Ok((sync, _)) => {
            info!(
                version = last.version,
                engines = sync.engines,
                "rejoined node fed by a broadcast from the trainer's worker (no other node live)"
            );
            true
        }
        Err(e) => {
            warn!(version = last.version, error = %e, "rejoin broadcast failed; the node waits for the next sync");
            false
        }
    }
}
