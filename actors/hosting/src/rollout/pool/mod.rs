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

mod broadcast;
mod heartbeat;
mod state;

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
use tracing::{debug, warn};

use manta_proto::weight_sync as wpb;
use manta_trainer::NamedTensors;

use self::broadcast::broadcast_locked;
use self::heartbeat::{heartbeat_loop, renew_lease};
use self::state::{node_failed, refused, Node, Published, RootBroadcast, Shared};
pub use self::state::{PoolOptions, PoolSync};
use super::client::RolloutCalls;
pub use super::rank0::{GroupRoot, RootAt};
use super::spawn::RolloutSpawnConfig;
use crate::weights::{WeightSet, WeightSyncCalls};
pub use manta_proto::weight_sync::PauseMode;

/// A node as the cluster file describes it.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub address: String,
    /// GPUs the node must offer (empty: CPU only).
    pub gpus: Vec<u32>,
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
