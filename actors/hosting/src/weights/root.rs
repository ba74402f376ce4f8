//! Rank 0 of a weight-update group on the trainer's worker: the trainer's parameters go
//! from its model straight into the engines' (NCCL, or the store backend on CPUs), with
//! no copy of the weights over gRPC. The driver still decides who is in the group (it
//! tells the engines' workers `ReceiveBroadcast`); this worker only hosts the store,
//! keeps the group between syncs and broadcasts when asked.
//!
//! One group per trainer actor: opening one aborts and drops the one before. A broadcast
//! that fails aborts and drops its group, so nothing waits on a peer that is gone.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use manta_cuda::process_group::GroupSpec;
use manta_cuda::weight_group::{Backend, GroupAborter, WeightGroup};
use manta_proto::weight_sync as wpb;
use manta_runtime::WorkerDaemon;
use manta_trainer::{NamedTensors, TrainerMsg};
use ractor::call;
use tokio::sync::Mutex;
use tonic::Status;
use tracing::{info, warn};

use super::wire::digest_tensors;
use crate::trainer::worker::hosted_trainer;

/// A group this worker roots for one trainer.
struct Held {
    name: String,
    backend: Backend,
    /// Ends a broadcast in flight (the group itself is busy then).
    aborter: GroupAborter,
    group: Arc<StdMutex<Option<WeightGroup>>>,
    names: Vec<String>,
}

/// The groups this worker roots, by trainer actor.
#[derive(Clone, Default)]
pub struct TrainerRoots {
    held: Arc<Mutex<BTreeMap<String, Held>>>,
}

fn backend_of(wire: i32) -> Result<Backend, Status> {
    match wpb::GroupBackend::try_from(wire) {
        Ok(wpb::GroupBackend::Nccl) => Ok(Backend::Nccl),
        Ok(wpb::GroupBackend::Store) => Ok(Backend::Store),
        Err(_) => Err(Status::invalid_argument(format!(
            "backend {wire} is not GROUP_BACKEND_NCCL or GROUP_BACKEND_STORE"
        ))),
    }
}

async fn export(daemon: &WorkerDaemon, actor: &str) -> Result<NamedTensors, Status> {
    let trainer = hosted_trainer(daemon, actor).await?;
    call!(trainer, TrainerMsg::ExportWeights)
        .map_err(|e| Status::unavailable(format!("trainer {actor} did not answer: {e}")))
}

impl TrainerRoots {
    /// Hosts a new group for trainer `req.actor` (any free port) and names the order its
    /// tensors will go in. NCCL broadcasts from the GPU the trainer's weights are on.
    pub async fn open(
        &self,
        daemon: &WorkerDaemon,
        req: wpb::OpenWeightGroupRequest,
    ) -> Result<wpb::OpenWeightGroupReply, Status> {
        let backend = backend_of(req.backend)?;
        if req.master_address.trim().is_empty() {
            return Err(Status::invalid_argument(
                "master_address is empty: the members need this node's address",
            ));
        }
        if req.world_size < 2 {
            return Err(Status::invalid_argument(format!(
                "world_size {}: rank 0 and at least one member",
                req.world_size
            )));
        }
        let tensors = export(daemon, &req.actor).await?;
        let device = match (backend, tensors.first().map(|(_, t)| t.device())) {
            (Backend::Nccl, Some(tch::Device::Cuda(i))) => i,
            (Backend::Nccl, _) => {
                return Err(Status::failed_precondition(format!(
                "NCCL broadcasts from the trainer's GPU, but trainer {}'s weights are not on one",
                req.actor
            )))
            }
            (Backend::Store, _) => 0,
        };
        let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        drop(tensors);
        // The group before is aborted first: dropping it then waits on nobody.
        self.close_any(&req.actor).await;
        let spec = GroupSpec {
            master_address: req.master_address.clone(),
            master_port: 0,
            rank: 0,
            world_size: req.world_size as usize,
            group_name: req.group_name.clone(),
            device,
            timeout: Duration::from_secs(u64::from(req.timeout_s.max(1))),
        };
        let group = tokio::task::spawn_blocking(move || WeightGroup::join(spec, backend))
            .await
            .map_err(|e| Status::internal(format!("joining the group: {e}")))?
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let master_port = u32::from(group.store_port());
        info!(
            trainer = %req.actor,
            group = %req.group_name,
            ranks = req.world_size,
            backend = ?backend,
            port = master_port,
            "weight-update group rooted at the trainer"
        );
        self.held.lock().await.insert(
            req.actor.clone(),
            Held {
                name: req.group_name,
                backend,
                aborter: group.aborter(),
                group: Arc::new(StdMutex::new(Some(group))),
                names: names.clone(),
            },
        );
        Ok(wpb::OpenWeightGroupReply { master_port, names })
    }

    /// Broadcasts trainer `req.actor`'s current parameters through its group.
    pub async fn broadcast(
        &self,
        daemon: &WorkerDaemon,
        req: wpb::BroadcastWeightsRequest,
    ) -> Result<wpb::BroadcastWeightsReply, Status> {
        let (group, backend) = {
            let held = self.held.lock().await;
            match held.get(&req.actor) {
                Some(h) if h.name == req.group_name => {
                    if h.names != req.names {
                        return Err(Status::failed_precondition(format!(
                            "group {}: the members were told another tensor order than trainer {}'s",
                            req.group_name, req.actor
                        )));
                    }
                    (h.group.clone(), h.backend)
                }
                other => {
                    return Err(Status::failed_precondition(format!(
                        "no weight-update group {:?} for trainer {} on this worker (it holds {}): \
                         the worker restarted or the group was closed",
                        req.group_name,
                        req.actor,
                        other.map_or("none".to_string(), |h| format!("{:?}", h.name))
                    )))
                }
            }
        };
        let tensors = export(daemon, &req.actor).await?;
        let names: Vec<&String> = tensors.iter().map(|(n, _)| n).collect();
        if names.len() != req.names.len() || names.iter().zip(&req.names).any(|(a, b)| *a != b) {
            return Err(Status::failed_precondition(format!(
                "trainer {}'s tensors changed since group {} was opened",
                req.actor, req.group_name
            )));
        }
        let started = Instant::now();
        let want_digests = req.want_digests;
        let outcome = tokio::task::spawn_blocking(move || {
            // The store backend moves host memory: a GPU trainer's weights are copied to
            // the CPU here, on its own node (nothing crosses gRPC).
            let tensors: NamedTensors = match backend {
                Backend::Store => tensors
                    .into_iter()
                    .map(|(n, t)| (n, t.to_device(tch::Device::Cpu).contiguous()))
                    .collect(),
                Backend::Nccl => tensors,
            };
            let bytes: u64 = tensors
                .iter()
                .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum();
            let mut slot = group
                .lock()
                .map_err(|_| "the group's lock was poisoned".to_string())?;
            let Some(g) = slot.as_mut() else {
                return Err("the group was closed".to_string());
            };
            // One line when the collective starts: a peer lost from here on is lost
            // mid-broadcast (what the fault runs aim at).
            info!(
                tensors = tensors.len(),
                bytes, "broadcasting the trainer's weights"
            );
            let collective = Instant::now();
            if let Err(e) = g.broadcast(&tensors, 0) {
                // Aborted before it is dropped: dropping waits on no peer.
                let _ = g.aborter().abort();
                *slot = None;
                return Err(e.to_string());
            }
            let enqueue_s = g.last_enqueue().map(|d| d.as_secs_f64());
            drop(slot);
            // The collective alone (the reply's seconds also count the digests when
            // verifying): what to set beside a bare torch.distributed broadcast.
            let seconds = collective.elapsed().as_secs_f64();
            info!(
                tensors = tensors.len(),
                bytes,
                seconds,
                enqueue_s,
                gb_per_s = bytes as f64 / seconds.max(1e-9) / 1e9,
                "weights broadcast from the trainer's worker"
            );
            let digests = if want_digests {
                digest_tensors(&tensors).map_err(|e| e.to_string())?
            } else {
                Vec::new()
            };
            Ok((tensors.len(), bytes, digests))
        })
        .await
        .map_err(|e| Status::internal(format!("the broadcast task: {e}")))?;
        match outcome {
            Ok((count, bytes, digests)) => Ok(wpb::BroadcastWeightsReply {
                tensors: count as u32,
                bytes,
                seconds: started.elapsed().as_secs_f64(),
                digests,
            }),
            Err(message) => {
                self.forget(&req.actor, &req.group_name).await;
                warn!(trainer = %req.actor, group = %req.group_name, error = %message, "broadcast failed; group aborted");
                Err(Status::aborted(format!(
                    "broadcast of trainer {}'s weights through group {}: {message}",
                    req.actor, req.group_name
                )))
            }
        }
    }

    /// Aborts and drops trainer `actor`'s group if it is `name`; whether it was.
    pub async fn close(&self, actor: &str, name: &str) -> bool {
        let mut held = self.held.lock().await;
        if held.get(actor).is_some_and(|h| h.name == name) {
            if let Some(h) = held.remove(actor) {
                let _ = h.aborter.abort();
                info!(trainer = %actor, group = %name, "weight-update group closed");
            }
            return true;
        }
        false
    }

    /// Aborts and drops whatever group trainer `actor` has.
    async fn close_any(&self, actor: &str) {
        if let Some(h) = self.held.lock().await.remove(actor) {
            let _ = h.aborter.abort();
        }
    }

    /// Drops trainer `actor`'s group `name` (already aborted).
    async fn forget(&self, actor: &str, name: &str) {
        let mut held = self.held.lock().await;
        if held.get(actor).is_some_and(|h| h.name == name) {
            held.remove(actor);
        }
    }
}
