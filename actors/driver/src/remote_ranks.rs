//! `[trainer] ranks`: a data-parallel trainer (ZeRO-2) whose ranks live on worker
//! daemons, one or several per node. The driver checks every rank's node, asks rank 0's
//! worker to open the group (`OpenRankGroup`: NCCL's unique id made on rank 0's GPU, or
//! a store hosted there for CPU ranks), carries the reply to every rank's spawn over
//! Manta's gRPC, spawns all ranks at once (each waits in its first collective for the
//! others) and hands them to the step loop as one `TrainerHandle`
//! (`TrainerHandle::worker_ranks`, the same rank group as local data parallel).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::future::join_all;
use manta_config::{ClusterConfig, TrainSettings};
use manta_hosting::trainer::rank_group::{RankLink, RankSpawn};
use manta_hosting::{RemoteTrainer, TrainerCalls, TrainerSpawnConfig};
use manta_proto::trainer as tpb;
use manta_runtime::{ClientTls, Lease, WorkerClient};
use tracing::info;

use crate::trainer_handle::data_parallel::RestartRanks;
use crate::trainer_handle::rank_checkpoints::WorkerCheckpoints;
use crate::trainer_handle::TrainerHandle;

/// How long a CPU rank waits in one collective for the slowest rank (a step's backward
/// pass, rank 0 writing a checkpoint's weights) before the group is declared failed.
const STORE_WAIT: Duration = Duration::from_secs(30 * 60);

/// The ranks, started: the handle the step loop drives, and rank 0 (the root of a
/// weight-update group to the engines).
pub struct PlacedRanks {
    pub handle: TrainerHandle,
    pub rank0: Arc<RemoteTrainer>,
}

/// Worker connection settings shared with the rest of remote placement.
pub struct Reach<'a> {
    pub token: &'a str,
    pub tls: Option<&'a ClientTls>,
    pub lease_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub dead_after: Duration,
}

/// The host of a node's `host:port` address (brackets of an IPv6 literal dropped).
pub fn node_host(address: &str) -> String {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// Places `cluster.trainer.ranks` on their workers and starts them with `options`
/// (each rank's device is its own GPU, or the CPU).
pub async fn place(
    cluster: &ClusterConfig,
    settings: &TrainSettings,
    options: &manta_trainer::TrainerOptions,
    reach: &Reach<'_>,
) -> anyhow::Result<PlacedRanks> {
    let in_cluster = |e: manta_runtime::RuntimeError| {
        anyhow::Error::new(e).context(format!("cluster {}", cluster.path.display()))
    };
    let ranks = &cluster.trainer.ranks;
    let world = ranks.len();
    let run = settings.run_name.clone().unwrap_or_default();
    // One client per node (ranks of one node share it), each checked once per rank's GPU.
    let mut clients: Vec<WorkerClient> = Vec::with_capacity(world);
    for (r, place) in ranks.iter().enumerate() {
        let address = &cluster.nodes[place.node].address;
        let client = match ranks[..r].iter().position(|o| o.node == place.node) {
            Some(first) => clients[first].clone(),
            None => WorkerClient::connect(address, reach.token, reach.tls)
                .map_err(in_cluster)?
                .with_lease(Lease::new(reach.lease_timeout)),
        };
        let gpus: Vec<u32> = place.gpu.into_iter().collect();
        RemoteTrainer::check(&client, &gpus, &settings.model)
            .await
            .map_err(in_cluster)
            .with_context(|| format!("[trainer] ranks[{r}] (node {})", place.node))?;
        clients.push(client);
    }
    let opener = GroupOpener {
        rank0: clients[0].clone(),
        world,
        rank0_gpu: ranks[0].gpu,
        master_address: node_host(&cluster.nodes[ranks[0].node].address),
        // The first rank of each node writes that node's weights and state.
        owners: (0..world)
            .map(|r| !ranks[..r].iter().any(|o| o.node == ranks[r].node))
            .collect(),
        spawn_timeout: Duration::from_secs(cluster.spawn_timeout_s),
    };
    let places = opener
        .open()
        .await
        .map_err(|e| e.context(format!("cluster {}", cluster.path.display())))?;
    let starts = ranks
        .iter()
        .zip(places)
        .enumerate()
        .map(|(r, (place, rank))| {
            let spawn = TrainerSpawnConfig {
                rank: Some(rank),
                ..TrainerSpawnConfig::from_options(options)
            };
            let (client, gpus) = (clients[r].clone(), place.gpu.into_iter().collect());
            let spawn_timeout = opener.spawn_timeout;
            let (interval, dead_after) = (reach.heartbeat_interval, reach.dead_after);
            async move {
                let name = format!("trainer-rank-{r}");
                RemoteTrainer::start(
                    client,
                    &name,
                    spawn,
                    gpus,
                    spawn_timeout,
                    interval,
                    dead_after,
                )
                .await
            }
        });
    let mut started = Vec::with_capacity(world);
    let mut first_error = None;
    for (r, result) in join_all(starts).await.into_iter().enumerate() {
        match result {
            Ok(trainer) => {
                let (client, name) = trainer.placed();
                crate::shutdown::register(client, vec![name]);
                started.push(Arc::new(trainer));
            }
            Err(e) => {
                first_error.get_or_insert_with(|| {
                    anyhow::Error::new(e).context(format!(
                        "starting trainer rank {r} on node {} ({})",
                        ranks[r].node, cluster.nodes[ranks[r].node].address
                    ))
                });
            }
        }
    }
    if let Some(e) = first_error {
        for t in &started {
            t.shutdown().await;
        }
        return Err(e.context(format!("cluster {}", cluster.path.display())));
    }
    let nodes: Vec<String> = ranks
        .iter()
        .map(|p| cluster.nodes[p.node].address.clone())
        .collect();
    info!(
        world,
        backend = if opener.rank0_gpu.is_some() { "nccl" } else { "store" },
        nodes = ?nodes,
        "trainer ranks started on workers"
    );
    let rank0 = started[0].clone();
    let regroup = Arc::new(WorkerRankGroup {
        ranks: started.clone(),
        opener,
    });
    let handle = TrainerHandle::worker_ranks(
        started,
        options.algo.num_steps_per_rollout,
        WorkerCheckpoints { run, nodes },
        regroup,
    );
    Ok(PlacedRanks { handle, rank0 })
}

/// What opens the ranks' group on rank 0's worker (`OpenRankGroup`) — at placement and
/// again whenever the ranks are re-created, since a group's NCCL id or store lives only
/// as long as its ranks.
struct GroupOpener {
    rank0: WorkerClient,
    world: usize,
    /// Rank 0's GPU (NCCL ranks), or `None` for CPU ranks over a store.
    rank0_gpu: Option<u32>,
    /// The host the other ranks reach rank 0's store at.
    master_address: String,
    /// Per rank: whether it writes its node's weights and state in a checkpoint.
    owners: Vec<bool>,
    spawn_timeout: Duration,
}

impl GroupOpener {
    /// Opens a new group under a fresh name and returns every rank's place in it, in
    /// rank order, for its spawn config.
    async fn open(&self) -> anyhow::Result<Vec<RankSpawn>> {
        let group = manta_cuda::weight_group::unique_name("trainer-ranks");
        let request = tpb::OpenRankGroupRequest {
            group: group.clone(),
            world_size: self.world as u32,
            backend: match self.rank0_gpu {
                Some(_) => tpb::RankBackend::Nccl,
                None => tpb::RankBackend::Store,
            } as i32,
            gpu: self.rank0_gpu.unwrap_or(0),
            timeout_s: STORE_WAIT.as_secs() as u32,
        };
        let opened = self
            .rank0
            .open_rank_group(request, self.spawn_timeout)
            .await
            .context("opening the trainer ranks' group on rank 0's worker")?;
        let link = match self.rank0_gpu {
            Some(_) => RankLink::Nccl {
                unique_id: opened.nccl_unique_id,
            },
            None => RankLink::Store {
                master_address: self.master_address.clone(),
                port: u16::try_from(opened.store_port).context("rank 0's store port")?,
                timeout_s: STORE_WAIT.as_secs(),
            },
        };
        Ok(self
            .owners
            .iter()
            .enumerate()
            .map(|(rank, &checkpoint_owner)| RankSpawn {
                group: group.clone(),
                rank,
                world: self.world,
                link: link.clone(),
                checkpoint_owner,
            })
            .collect())
    }
}

/// The ranks on workers, re-created together as a new group when one is lost: a rank
/// cannot rejoin its old group (the NCCL id or store is gone, or its peers wait on a
/// collective it never finished), so every rank is stopped, the lost worker waited for,
/// a new group opened and every rank spawned into it with its initial weights; the
/// driver then restores the last checkpoint as it does for one trainer.
struct WorkerRankGroup {
    ranks: Vec<Arc<RemoteTrainer>>,
    opener: GroupOpener,
}

#[async_trait::async_trait]
impl RestartRanks for WorkerRankGroup {
    async fn restart(&self, timeout: Duration) -> anyhow::Result<()> {
        // Stopping a rank ends its collective waits (its worker aborts the store waits or
        // the NCCL communicator), so no survivor is left waiting for the lost rank.
        join_all(self.ranks.iter().map(|r| r.stop_hosted())).await;
        for (r, result) in join_all(self.ranks.iter().map(|t| t.wait_for_node(timeout)))
            .await
            .into_iter()
            .enumerate()
        {
            result.with_context(|| format!("trainer rank {r}"))?;
        }
        let places = self.opener.open().await?;
        // At once: each rank waits in its first collective for the others.
        let spawns = self
            .ranks
            .iter()
            .zip(places)
            .map(|(t, place)| t.respawn(Some(place)));
        let mut first_error = None;
        for (r, result) in join_all(spawns).await.into_iter().enumerate() {
            if let Err(e) = result {
                first_error.get_or_insert_with(|| {
                    anyhow::Error::new(e).context(format!("re-creating trainer rank {r}"))
                });
            }
        }
        if let Some(e) = first_error {
            join_all(self.ranks.iter().map(|r| r.stop_hosted())).await;
            return Err(e);
        }
        info!(
            world = self.ranks.len(),
            "trainer ranks re-created as a new group on their workers"
        );
        Ok(())
    }
}
