//! Remote rollout actors across worker nodes: placement, heartbeats, failover of a
//! dead node's episodes to a live one (de-duplicated by sample id), and rejoin.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use manta_core::Sample;
use manta_rollout::{EpisodeRequest, GenerationSettings};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::client::WorkerClient;
use crate::lease::Lease;
use crate::spawn::RolloutSpawnConfig;
use crate::tls::ClientTls;
use crate::RuntimeError;

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
}

struct Shared {
    nodes: Vec<Node>,
    spawn: RolloutSpawnConfig,
    /// The weights every engine should run: (directory, version).
    weights: Mutex<Option<(String, u64)>>,
    opts: PoolOptions,
    next: AtomicUsize,
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
            });
        }
        let shared = Arc::new(Shared {
            nodes: built,
            spawn,
            weights: Mutex::new(None),
            opts,
            next: AtomicUsize::new(0),
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

    /// Loads `directory/model.safetensors` as `version` on every live node; a node that
    /// fails is marked dead so it reloads when it rejoins.
    pub async fn load_weights(&self, directory: &str, version: u64) -> Result<(), RuntimeError> {
        if let Ok(mut w) = self.shared.weights.lock() {
            *w = Some((directory.to_string(), version));
        }
        let mut loaded = 0;
        for node in &self.shared.nodes {
            if !*node.live.borrow() {
                continue;
            }
            match node.client.load_weights(directory, version).await {
                Ok(()) => loaded += 1,
                // The node is fine but cannot see the file: no other node will either.
                Err(RuntimeError::Rpc { addr, status })
                    if status.code() == tonic::Code::FailedPrecondition =>
                {
                    return Err(RuntimeError::Rpc { addr, status });
                }
                Err(e) => {
                    warn!(node = node.client.addr(), error = %e, "weight load failed; marking the node dead");
                    node.live.send_replace(false);
                }
            }
        }
        if loaded == 0 {
            return Err(RuntimeError::Placement(format!(
                "no live node took weights version {version}"
            )));
        }
        Ok(())
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
        let mut running = FuturesUnordered::new();
        for share in groups.into_values() {
            let (node, actor) = self.pick(None).await?;
            running.push(run_share(self.shared.clone(), node, actor, share, settings));
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
                warn!(
                    node = self.shared.nodes[node].client.addr(),
                    error = %e,
                    requeued = missing.len(),
                    "rollout share failed; re-queueing its episodes on another node"
                );
                if !missing.is_empty() {
                    let (other, actor) = self.pick(Some(node)).await?;
                    running.push(run_share(
                        self.shared.clone(),
                        other,
                        actor,
                        missing,
                        settings,
                    ));
                }
            }
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

    /// A live node (preferring one other than `avoid`) and one of its actors, round robin;
    /// waits for a node to come back when none is live.
    async fn pick(&self, avoid: Option<usize>) -> Result<(usize, String), RuntimeError> {
        let started = Instant::now();
        loop {
            let live: Vec<usize> = (0..self.shared.nodes.len())
                .filter(|&i| *self.shared.nodes[i].live.borrow())
                .collect();
            let preferred: Vec<usize> =
                live.iter().copied().filter(|&i| Some(i) != avoid).collect();
            let choices = if preferred.is_empty() {
                &live
            } else {
                &preferred
            };
            if !choices.is_empty() {
                let k = self.shared.next.fetch_add(1, Ordering::Relaxed);
                let node = choices[k % choices.len()];
                let actors = &self.shared.nodes[node].actors;
                return Ok((node, actors[(k / choices.len()) % actors.len()].clone()));
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

/// Streams one share from one node; ends early with an error when the stream breaks or
/// the node is declared dead. Returns what arrived either way.
async fn run_share(
    shared: Arc<Shared>,
    node: usize,
    actor: String,
    share: Vec<EpisodeRequest>,
    settings: GenerationSettings,
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

/// Heartbeats one node; marks it dead after `dead_after` without an answer, and on
/// its return re-spawns missing actors and reloads the current weights.
async fn heartbeat_loop(shared: Arc<Shared>, index: usize) {
    let node = &shared.nodes[index];
    let addr = node.client.addr().to_string();
    let mut ticker = tokio::time::interval(shared.opts.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_ok = Instant::now();
    let mut sequence = 0;
    loop {
        ticker.tick().await;
        sequence += 1;
        match node
            .client
            .heartbeat(sequence, shared.opts.heartbeat_interval)
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
                if missing.is_empty() && was_live {
                    continue;
                }
                node.live.send_replace(false);
                match rejoin(&shared, node, &missing).await {
                    Ok(()) => {
                        node.live.send_replace(true);
                        info!(node = %addr, "node rejoined");
                    }
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

async fn rejoin(shared: &Shared, node: &Node, missing: &[&String]) -> Result<(), RuntimeError> {
    for name in missing {
        node.client.spawn_rollout(name, &shared.spawn).await?;
    }
    let weights = shared.weights.lock().ok().and_then(|w| w.clone());
    if let Some((dir, version)) = weights {
        node.client.load_weights(&dir, version).await?;
    }
    Ok(())
}
