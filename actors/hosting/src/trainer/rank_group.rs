//! Data-parallel trainer ranks on workers: how a rank's place in its group travels in
//! the spawn config ([`RankSpawn`]), what rank 0's worker opens before any rank is
//! spawned ([`RankGroups::open`]: NCCL's unique id, or the CPU ranks' store), and the
//! rank's `Collective`, built from both on the rank's worker ([`RankGroups::collective`]).
//!
//! The order is the driver's: `OpenRankGroup` on rank 0's worker, then every rank's
//! spawn at once (building a rank waits for the others in its first collective). The
//! mechanism follows the ranks' device, named explicitly: NCCL on the GPU the spawn
//! gives the rank, or the store group on the CPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use manta_cuda::rendezvous::TcpStore;
use manta_proto::trainer as tpb;
use manta_trainer::data_parallel::{
    Collective, NcclAborter, NcclCollective, StoreAborter, StoreCollective, StoreGroupSpec,
};
use serde::{Deserialize, Serialize};
use tonic::Status;
use tracing::{info, warn};

/// How the ranks of a group reach each other, as rank 0's worker opened it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RankLink {
    /// NCCL between the ranks' GPUs; the id rank 0's worker made.
    Nccl { unique_id: Vec<u8> },
    /// CPU tensors through the store rank 0's worker hosts at `master_address:port`.
    Store {
        master_address: String,
        port: u16,
        timeout_s: u64,
    },
}

/// A trainer rank's place in its data-parallel group (`TrainerSpawnConfig::rank`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RankSpawn {
    /// The group's name, as opened on rank 0's worker.
    pub group: String,
    pub rank: usize,
    pub world: usize,
    pub link: RankLink,
    /// Whether this rank writes the weights and state of its node's checkpoint
    /// directory: the first rank on each worker, since workers share no disk.
    pub checkpoint_owner: bool,
}

/// Stores opened by `OpenRankGroup` and not yet taken by rank 0's spawn, by group name.
/// Shared by the worker's trainer host and its `Trainer` service.
#[derive(Clone, Default)]
pub struct RankGroups {
    stores: Arc<Mutex<BTreeMap<String, TcpStore>>>,
}

impl RankGroups {
    fn stores(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, TcpStore>> {
        self.stores.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank 0's side of a new group on this worker: NCCL's unique id made for rank 0's
    /// GPU, or a store hosted on a free port of every interface (replacing one opened
    /// under the same name that no spawn took).
    pub async fn open(
        &self,
        req: tpb::OpenRankGroupRequest,
        offered_gpus: &[u32],
    ) -> Result<tpb::OpenRankGroupReply, Status> {
        if req.group.trim().is_empty() {
            return Err(Status::invalid_argument("the group needs a name"));
        }
        if req.world_size == 0 {
            return Err(Status::invalid_argument("world_size 0: a group has ranks"));
        }
        let timeout = Duration::from_secs(u64::from(req.timeout_s.max(1)));
        match tpb::RankBackend::try_from(req.backend) {
            Ok(tpb::RankBackend::Nccl) => {
                if !offered_gpus.contains(&req.gpu) {
                    return Err(Status::failed_precondition(format!(
                        "rank 0 of group {:?} is placed on GPU {}, but this worker offers {:?}",
                        req.group, req.gpu, offered_gpus
                    )));
                }
                let gpu = req.gpu as usize;
                let id = tokio::task::spawn_blocking(move || NcclCollective::unique_id_on(gpu))
                    .await
                    .map_err(|e| Status::internal(format!("making the NCCL id: {e}")))?
                    .map_err(|e| Status::failed_precondition(e.to_string()))?;
                info!(group = %req.group, world = req.world_size, gpu, "NCCL id made for trainer ranks");
                Ok(tpb::OpenRankGroupReply {
                    nccl_unique_id: id,
                    store_port: 0,
                })
            }
            Ok(tpb::RankBackend::Store) => {
                let world = req.world_size as usize;
                let store = tokio::task::spawn_blocking(move || TcpStore::host(0, world, timeout))
                    .await
                    .map_err(|e| Status::internal(format!("hosting the store: {e}")))?
                    .map_err(|e| Status::failed_precondition(e.to_string()))?;
                let port = store.port();
                info!(group = %req.group, world, port, "store hosted for trainer ranks");
                self.stores().insert(req.group, store);
                Ok(tpb::OpenRankGroupReply {
                    nccl_unique_id: Vec::new(),
                    store_port: u32::from(port),
                })
            }
            _ => Err(Status::invalid_argument(format!(
                "backend {} is not RANK_BACKEND_NCCL or RANK_BACKEND_STORE",
                req.backend
            ))),
        }
    }

    /// This rank's collective (blocking: NCCL waits for every rank to join), and for the
    /// store group the handle that ends its waits when the rank is stopped. The device
    /// is the rank's own: NCCL needs `gpu`, the store group none.
    pub fn collective(&self, spawn: &RankSpawn, gpu: Option<usize>) -> Result<JoinedRank, String> {
        let who = format!(
            "trainer rank {} of {} (group {:?})",
            spawn.rank, spawn.world, spawn.group
        );
        let store_group =
            |store: Option<TcpStore>, master_address: &str, port: u16, timeout_s: u64| {
                let spec = StoreGroupSpec {
                    master_address: master_address.to_string(),
                    master_port: port,
                    group: spawn.group.clone(),
                    rank: spawn.rank,
                    world: spawn.world,
                    timeout: Duration::from_secs(timeout_s.max(1)),
                };
                let comm = match store {
                    Some(store) => StoreCollective::over(store, &spec),
                    None => StoreCollective::join(&spec).map_err(|e| format!("{who}: {e}"))?,
                };
                let aborter = RankAborter::Store(comm.aborter());
                Ok(JoinedRank {
                    comm: Box::new(comm),
                    aborter,
                })
            };
        match (&spawn.link, gpu) {
            (RankLink::Nccl { unique_id }, Some(gpu)) => {
                NcclCollective::new(spawn.rank, spawn.world, unique_id, gpu)
                    .map(|c| JoinedRank {
                        aborter: RankAborter::Nccl(c.aborter()),
                        comm: Box::new(c),
                    })
                    .map_err(|e| format!("{who}: joining NCCL on GPU {gpu}: {e}"))
            }
            (RankLink::Nccl { .. }, None) => Err(format!(
                "{who}: the group is NCCL, but this rank was given no GPU"
            )),
            (RankLink::Store { .. }, Some(gpu)) => Err(format!(
                "{who}: the store group moves CPU tensors, but this rank was given GPU {gpu}"
            )),
            (
                RankLink::Store {
                    master_address,
                    port,
                    timeout_s,
                },
                None,
            ) => {
                // Rank 0 takes the store OpenRankGroup hosted here; the others connect.
                let hosted = if spawn.rank == 0 {
                    Some(self.stores().remove(&spawn.group).ok_or_else(|| {
                        format!(
                            "{who}: no store was opened for the group on this worker \
                             (OpenRankGroup first)"
                        )
                    })?)
                } else {
                    None
                };
                store_group(hosted, master_address, *port, *timeout_s)
            }
        }
    }
}

/// A rank's place in its group, joined: its collective, and what ends its waits when the
/// rank is stopped.
pub struct JoinedRank {
    pub comm: Box<dyn Collective>,
    pub aborter: RankAborter,
}

/// Ends a stopped rank's collective waits, whatever its group: the driver stops every
/// rank when one is lost, and a rank left waiting for the lost one would keep its actor
/// (and, under NCCL, its GPU) from the group that replaces it.
pub enum RankAborter {
    /// The store group's waits poll this and end at once.
    Store(StoreAborter),
    /// The NCCL communicator is aborted (`ncclCommAbort`): its kernels end, its
    /// collectives fail.
    Nccl(NcclAborter),
}

impl RankAborter {
    /// Blocking: an NCCL abort waits briefly for a call in progress and then for NCCL.
    pub fn abort(&self) {
        match self {
            Self::Store(a) => a.abort(),
            Self::Nccl(a) => {
                if let Err(e) = a.abort() {
                    warn!(error = %e, "aborting a stopped rank's NCCL communicator failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_trainer::data_parallel::ReduceOp;
    use tch::{Device, Kind, Tensor};

    fn store_request(world: u32) -> tpb::OpenRankGroupRequest {
        tpb::OpenRankGroupRequest {
            group: "g".into(),
            world_size: world,
            backend: tpb::RankBackend::Store as i32,
            gpu: 0,
            timeout_s: 20,
        }
    }

    /// The store rank 0's worker opens is the one rank 0's spawn takes; rank 1 joins it
    /// at the address the driver passes on, and the two sum in rank order.
    #[tokio::test]
    async fn a_store_group_opened_for_rank_0_joins_the_other_ranks() {
        let groups = RankGroups::default();
        let reply = groups.open(store_request(2), &[]).await.unwrap();
        let link = RankLink::Store {
            master_address: "127.0.0.1".into(),
            port: u16::try_from(reply.store_port).unwrap(),
            timeout_s: 20,
        };
        let spawn = |rank| RankSpawn {
            group: "g".into(),
            rank,
            world: 2,
            link: link.clone(),
            checkpoint_owner: true,
        };
        let sum = |comm: Box<dyn Collective>, value: f32| {
            std::thread::spawn(move || {
                let mut t = Tensor::from_slice(&[value]).to_kind(Kind::Float);
                comm.all_reduce(&mut t, ReduceOp::Sum).unwrap();
                (f32::try_from(&t).unwrap(), comm)
            })
        };
        let rank0 = groups.collective(&spawn(0), None).unwrap().comm;
        let joined1 = groups.collective(&spawn(1), None).unwrap();
        assert!(
            matches!(joined1.aborter, RankAborter::Store(_)),
            "a store rank can be stopped mid-wait"
        );
        let rank1 = joined1.comm;
        assert_eq!(
            (rank0.rank(), rank1.rank(), rank1.device()),
            (0, 1, Device::Cpu)
        );
        let (a, b) = (sum(rank0, 1.0), sum(rank1, 1e8));
        let ((x, _keep0), (y, _keep1)) = (a.join().unwrap(), b.join().unwrap());
        assert_eq!((x, y), (1.0 + 1e8, 1.0 + 1e8));
        // Rank 0's store was taken once.
        let err = groups.collective(&spawn(0), None).err().unwrap();
        assert!(err.contains("OpenRankGroup first"), "{err}");
    }

    /// The link must fit the rank's device: no hidden GPU, no CPU tensors into NCCL.
    #[tokio::test]
    async fn a_rank_whose_device_does_not_fit_its_link_is_refused() {
        let groups = RankGroups::default();
        let store = RankSpawn {
            group: "g".into(),
            rank: 1,
            world: 2,
            link: RankLink::Store {
                master_address: "127.0.0.1".into(),
                port: 1,
                timeout_s: 1,
            },
            checkpoint_owner: false,
        };
        let err = groups.collective(&store, Some(0)).err().unwrap();
        assert!(
            err.contains("CPU tensors") && err.contains("GPU 0"),
            "{err}"
        );
        let nccl = RankSpawn {
            link: RankLink::Nccl {
                unique_id: vec![0; 128],
            },
            ..store
        };
        let err = groups.collective(&nccl, None).err().unwrap();
        assert!(err.contains("no GPU"), "{err}");
        let mut req = store_request(2);
        req.backend = tpb::RankBackend::Nccl as i32;
        req.gpu = 3;
        let err = groups.open(req, &[0]).await.unwrap_err();
        assert!(
            err.message().contains("GPU 3") && err.message().contains("[0]"),
            "{err}"
        );
        req = store_request(0);
        assert!(groups.open(req, &[]).await.is_err());
    }
}
