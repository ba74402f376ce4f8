//! Rank 0 of the pool's weight-update group, wherever it lives: this process (the
//! trainer in the driver; the caller hands over its tensors) or the trainer's worker,
//! which hosts the store and broadcasts its trainer's parameters when asked over gRPC
//! (`OpenWeightGroup`, `BroadcastWeights`, `CloseWeightGroup`: weights/root.rs). The
//! pool's membership rules ([`super::pool::RemotePool::publish_broadcast`]) are the
//! same for both; only making, feeding and aborting rank 0 differ, here.

use std::sync::Arc;
use std::time::Duration;

use manta_cuda::process_group::GroupSpec;
use manta_cuda::weight_group::{unique_name, Backend, GroupAborter, WeightGroup};
use manta_proto::weight_sync as wpb;
use manta_runtime::RuntimeError;
use manta_trainer::NamedTensors;

use crate::trainer::remote::RemoteTrainer;
use crate::weights::WeightSyncCalls;

/// Rank 0 of the pool's weight-update group.
#[derive(Clone)]
pub struct GroupRoot {
    pub backend: Backend,
    /// Bounds joining and each broadcast.
    pub timeout: Duration,
    pub at: RootAt,
}

/// Where rank 0 is.
#[derive(Clone)]
pub enum RootAt {
    /// This process hosts the store at `master_address` (where the workers reach it) and
    /// broadcasts the tensors it is given from CUDA `device` (NCCL; the store ignores it).
    Here {
        master_address: String,
        device: usize,
    },
    /// The trainer's worker hosts the store at `master_address` (its node's host in
    /// cluster.toml; the port is chosen there) and broadcasts its trainer's parameters,
    /// from the GPU they are on (NCCL).
    Trainer {
        trainer: Arc<RemoteTrainer>,
        master_address: String,
    },
}

impl GroupRoot {
    /// Who rank 0 is, for logs.
    pub fn describe(&self) -> String {
        match &self.at {
            RootAt::Here { .. } => "the trainer in the driver".into(),
            RootAt::Trainer { trainer, .. } => format!("the trainer on worker {}", trainer.addr()),
        }
    }
}

/// Rank 0 of a group made for the pool.
pub(crate) enum Rank0 {
    Here(WeightGroup),
    Trainer {
        trainer: Arc<RemoteTrainer>,
        spec: GroupSpec,
        backend: Backend,
        /// The tensor order the trainer's worker broadcasts in.
        names: Vec<String>,
    },
}

/// Ends rank 0's wait for members that gave up.
pub(crate) enum Rank0Aborter {
    Here(GroupAborter),
    Trainer {
        trainer: Arc<RemoteTrainer>,
        group: String,
    },
}

impl Rank0Aborter {
    pub(crate) async fn abort(&self) {
        match self {
            Rank0Aborter::Here(a) => {
                let _ = a.abort();
            }
            Rank0Aborter::Trainer { trainer, group } => {
                let (client, actor) = trainer.placed();
                // A worker that is gone has dropped the group with it.
                let _ = client.close_weight_group(&actor, group).await;
            }
        }
    }
}

fn placement(message: String) -> RuntimeError {
    RuntimeError::Placement(message)
}

impl Rank0 {
    /// Makes rank 0 of a new group of `world` ranks under `root`.
    pub(crate) async fn make(root: &GroupRoot, world: usize) -> Result<Self, RuntimeError> {
        let group_name = unique_name("manta-pool");
        match &root.at {
            RootAt::Here {
                master_address,
                device,
            } => {
                let spec = GroupSpec {
                    master_address: master_address.clone(),
                    master_port: 0,
                    rank: 0,
                    world_size: world,
                    group_name,
                    device: *device,
                    timeout: root.timeout,
                };
                let backend = root.backend;
                let group = tokio::task::spawn_blocking(move || WeightGroup::join(spec, backend))
                    .await
                    .map_err(|e| placement(format!("joining the group: {e}")))?
                    .map_err(|e| placement(e.to_string()))?;
                Ok(Rank0::Here(group))
            }
            RootAt::Trainer {
                trainer,
                master_address,
            } => {
                let (client, actor) = trainer.placed();
                let reply = client
                    .open_weight_group(wpb::OpenWeightGroupRequest {
                        actor,
                        backend: wire_backend(root.backend) as i32,
                        master_address: master_address.clone(),
                        group_name: group_name.clone(),
                        world_size: world as u32,
                        timeout_s: root.timeout.as_secs().max(1) as u32,
                    })
                    .await?;
                let master_port = u16::try_from(reply.master_port)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        placement(format!(
                            "the trainer's worker {} answered master_port {}",
                            trainer.addr(),
                            reply.master_port
                        ))
                    })?;
                Ok(Rank0::Trainer {
                    trainer: trainer.clone(),
                    spec: GroupSpec {
                        master_address: master_address.clone(),
                        master_port,
                        rank: 0,
                        world_size: world,
                        group_name,
                        device: 0,
                        timeout: root.timeout,
                    },
                    backend: root.backend,
                    names: reply.names,
                })
            }
        }
    }

    pub(crate) fn group_name(&self) -> &str {
        &self.spec().group_name
    }

    fn spec(&self) -> &GroupSpec {
        match self {
            Rank0::Here(g) => g.spec(),
            Rank0::Trainer { spec, .. } => spec,
        }
    }

    pub(crate) fn backend(&self) -> Backend {
        match self {
            Rank0::Here(g) => g.backend(),
            Rank0::Trainer { backend, .. } => *backend,
        }
    }

    /// The store's address and port, as the members join it.
    pub(crate) fn store(&self) -> (String, u16) {
        match self {
            Rank0::Here(g) => (g.spec().master_address.clone(), g.store_port()),
            Rank0::Trainer { spec, .. } => (spec.master_address.clone(), spec.master_port),
        }
    }

    pub(crate) fn world_size(&self) -> usize {
        self.spec().world_size
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.spec().timeout
    }

    /// The order rank 0 broadcasts in: `tensors`' (here) or the trainer's worker's.
    pub(crate) fn names(&self, tensors: Option<&NamedTensors>) -> Vec<String> {
        match self {
            Rank0::Here(_) => tensors
                .map(|t| t.iter().map(|(n, _)| n.clone()).collect())
                .unwrap_or_default(),
            Rank0::Trainer { names, .. } => names.clone(),
        }
    }

    pub(crate) fn aborter(&self) -> Rank0Aborter {
        match self {
            Rank0::Here(g) => Rank0Aborter::Here(g.aborter()),
            Rank0::Trainer { trainer, spec, .. } => Rank0Aborter::Trainer {
                trainer: trainer.clone(),
                group: spec.group_name.clone(),
            },
        }
    }

    /// Aborts the group (dropping it then waits on no peer) and drops it.
    pub(crate) async fn abort(self) {
        self.aborter().abort().await;
    }

    /// Rank 0's half of one broadcast: `tensors` from here, or the trainer's parameters
    /// from its worker (with their digests when `want_digests`). Gives the group back
    /// (`None`: lost with a panicked task).
    pub(crate) async fn broadcast(
        self,
        tensors: Option<NamedTensors>,
        want_digests: bool,
    ) -> (Option<Self>, Result<Option<Vec<wpb::TensorDigest>>, String>) {
        match self {
            Rank0::Here(group) => {
                let Some(tensors) = tensors else {
                    return (
                        Some(Rank0::Here(group)),
                        Err("a group rooted in this process needs the trainer's tensors".into()),
                    );
                };
                let task = tokio::task::spawn_blocking(move || {
                    let mut group = group;
                    let sent = group.broadcast(&tensors, 0);
                    (group, sent)
                })
                .await;
                match task {
                    Ok((group, sent)) => (
                        Some(Rank0::Here(group)),
                        sent.map(|()| None).map_err(|e| e.to_string()),
                    ),
                    // The task panicked holding the group: nothing is left to abort.
                    Err(e) => (None, Err(format!("the broadcast task: {e}"))),
                }
            }
            Rank0::Trainer {
                trainer,
                spec,
                backend,
                names,
            } => {
                let (client, actor) = trainer.placed();
                let sent = client
                    .broadcast_weights(wpb::BroadcastWeightsRequest {
                        actor,
                        group_name: spec.group_name.clone(),
                        names: names.clone(),
                        want_digests,
                    })
                    .await
                    .map(|reply| want_digests.then_some(reply.digests))
                    .map_err(|e| e.to_string());
                (
                    Some(Rank0::Trainer {
                        trainer,
                        spec,
                        backend,
                        names,
                    }),
                    sent,
                )
            }
        }
    }
}

/// The wire's name for `backend`.
pub(crate) fn wire_backend(backend: Backend) -> wpb::GroupBackend {
    match backend {
        Backend::Nccl => wpb::GroupBackend::Nccl,
        Backend::Store => wpb::GroupBackend::Store,
    }
}
