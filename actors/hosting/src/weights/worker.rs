//! The worker's `WeightSync` service: weights arrive and leave as streams of bounded
//! chunks ([`super::wire`]), so no disk is shared between trainer and engines.
//!
//! A push only stages a version (checked, in memory); `ApplyWeights` then pauses each
//! engine on the node, copies the weights in, bumps its version and resumes it. The
//! transfer happens while engines still run, so the pause covers the copy alone.
//!
//! Broadcasts: the worker's engines join a group (`ReceiveBroadcast`), and a trainer's
//! worker roots one (`OpenWeightGroup`, `BroadcastWeights`, `CloseWeightGroup`:
//! [`super::root`]). `AbortBroadcast` ends the engines' receive when rank 0 failed
//! ([`super::aborts`]).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use manta_cuda::weight_group::Backend;
use manta_engine::{BroadcastFeed, PauseMode};
use manta_proto::weight_sync as wpb;
use manta_proto::weight_sync::weight_sync_server::WeightSync;
use manta_rollout::{IncomingWeights, RolloutMsg};
use manta_runtime::WorkerDaemon;
use manta_trainer::{NamedTensors, TrainerMsg};
use ractor::call;
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};
use tracing::info;

use super::aborts::BroadcastAborts;
use super::root::TrainerRoots;
use super::wire::{self as weights, Assembler, WeightChunk, WeightSet, WeightsError};
use crate::rollout::worker::HostedRollout;
use crate::trainer::worker::hosted_trainer;

type ChunkStream = Pin<Box<dyn Stream<Item = Result<WeightChunk, Status>> + Send>>;

fn bad_weights(e: WeightsError) -> Status {
    Status::invalid_argument(e.to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, WeightsError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(bad_weights)
}

/// The `WeightSync` service over a daemon's hosted trainers and rollout actors.
#[derive(Clone)]
pub struct WeightSyncService {
    daemon: WorkerDaemon,
    /// Weights pushed for `ApplyWeights`, by version (CPU tensors; the newest two).
    staged: Arc<Mutex<BTreeMap<u64, NamedTensors>>>,
    /// Groups this worker roots for its trainers (`OpenWeightGroup`).
    roots: TrainerRoots,
    /// The engines receiving a broadcast now, for `AbortBroadcast`.
    aborts: BroadcastAborts,
}

impl WeightSyncService {
    pub fn new(daemon: WorkerDaemon) -> Self {
        Self {
            daemon,
            staged: Arc::default(),
            roots: TrainerRoots::default(),
            aborts: BroadcastAborts::default(),
        }
    }

    async fn rollout_actors(&self) -> Vec<(String, ractor::ActorRef<RolloutMsg>)> {
        self.daemon
            .all_hosted::<HostedRollout>()
            .await
            .into_iter()
            .map(|(name, h)| (name, h.actor))
            .collect()
    }
}

#[tonic::async_trait]
impl WeightSync for WeightSyncService {
    type PullWeightsStream = ChunkStream;

    async fn pull_weights(
        &self,
        request: Request<wpb::PullWeightsRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let name = request.into_inner().actor;
        let trainer = hosted_trainer(&self.daemon, &name).await?;
        let chunk = weights::chunk_bytes().map_err(|e| Status::internal(e.to_string()))?;
        let tensors = call!(trainer, TrainerMsg::ExportWeights)
            .map_err(|e| Status::unavailable(format!("trainer {name} did not answer: {e}")))?;
        let set = blocking(move || WeightSet::from_tensors(&tensors)).await?;
        let chunks = Arc::new(set).chunks(0, chunk).map(Ok::<_, Status>);
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn push_weights(
        &self,
        request: Request<tonic::Streaming<WeightChunk>>,
    ) -> Result<Response<wpb::PushWeightsReply>, Status> {
        let mut stream = request.into_inner();
        let mut asm = Assembler::new();
        while let Some(chunk) = stream.message().await? {
            asm.push(chunk).map_err(bad_weights)?;
        }
        let (version, set) = asm.finish().map_err(bad_weights)?;
        let reply = wpb::PushWeightsReply {
            version,
            tensors: set.tensors.len() as u32,
            bytes: set.bytes(),
        };
        let tensors = blocking(move || set.to_tensors()).await?;
        {
            // A rejoin and a step's sync may overlap: keep the two newest versions.
            let mut staged = self.staged.lock().await;
            staged.insert(version, tensors);
            while staged.len() > 2 {
                staged.pop_first();
            }
        }
        info!(
            version,
            tensors = reply.tensors,
            bytes = reply.bytes,
            "weights staged"
        );
        Ok(Response::new(reply))
    }

    async fn apply_weights(
        &self,
        request: Request<wpb::ApplyWeightsRequest>,
    ) -> Result<Response<wpb::ApplyWeightsReply>, Status> {
        let req = request.into_inner();
        let mode = pause_mode(req.pause)?;
        let tensors = {
            let mut staged = self.staged.lock().await;
            let Some(tensors) = staged.remove(&req.version) else {
                let staged: Vec<u64> = staged.keys().copied().collect();
                return Err(Status::failed_precondition(format!(
                    "weights version {} were not pushed to this worker (staged: {staged:?})",
                    req.version
                )));
            };
            // Older versions will not be applied any more.
            staged.retain(|v, _| *v > req.version);
            tensors
        };
        let actors = self.rollout_actors().await;
        let mut longest = 0f64;
        for (name, actor) in &actors {
            let copy = tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            let paused = call!(
                actor,
                RolloutMsg::ApplyWeights,
                IncomingWeights::Tensors(copy),
                req.version,
                mode
            )
            .map_err(|e| Status::unavailable(format!("actor {name}: {e}")))?
            .map_err(|e| Status::failed_precondition(format!("actor {name}: {e}")))?;
            longest = longest.max(paused.as_secs_f64());
        }
        info!(
            version = req.version,
            engines = actors.len(),
            pause_to_resume_s = longest,
            "weights applied"
        );
        Ok(Response::new(wpb::ApplyWeightsReply {
            version: req.version,
            engines: actors.len() as u32,
            pause_to_resume_s: longest,
        }))
    }

    async fn receive_broadcast(
        &self,
        request: Request<wpb::ReceiveBroadcastRequest>,
    ) -> Result<Response<wpb::ApplyWeightsReply>, Status> {
        let req = request.into_inner();
        let mode = pause_mode(req.pause)?;
        let backend = match wpb::GroupBackend::try_from(req.backend) {
            Ok(wpb::GroupBackend::Nccl) => Backend::Nccl,
            Ok(wpb::GroupBackend::Store) => Backend::Store,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "backend {} is not GROUP_BACKEND_NCCL or GROUP_BACKEND_STORE",
                    req.backend
                )))
            }
        };
        if req.actors.is_empty() || req.actors.len() != req.ranks.len() {
            return Err(Status::invalid_argument(format!(
                "{} actors and {} ranks: one rank per actor, at least one",
                req.actors.len(),
                req.ranks.len()
            )));
        }
        let master_port = u16::try_from(req.master_port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                Status::invalid_argument(format!("master_port {} is not a port", req.master_port))
            })?;
        let world_size = req.world_size as usize;
        if let Some(rank) = req
            .ranks
            .iter()
            .find(|r| **r == 0 || **r as usize >= world_size)
        {
            return Err(Status::invalid_argument(format!(
                "rank {rank} is not in 1..{world_size} (rank 0 is the sender)"
            )));
        }
        if self.aborts.was_aborted(&req.group_name) {
            return Err(Status::failed_precondition(format!(
                "weight-update group {:?} was aborted (rank 0's broadcast failed)",
                req.group_name
            )));
        }
        let hosted: BTreeMap<String, ractor::ActorRef<RolloutMsg>> =
            self.rollout_actors().await.into_iter().collect();
        // Held until every engine answered: AbortBroadcast reaches them meanwhile.
        let round = self.aborts.round();
        // Every member must be in the broadcast at once: all engines receive together.
        let mut receivers = tokio::task::JoinSet::new();
        for (name, rank) in req.actors.iter().zip(&req.ranks) {
            let actor = hosted.get(name).cloned().ok_or_else(|| {
                Status::not_found(format!(
                    "no rollout actor {name} on this worker (hosted: {:?})",
                    hosted.keys().collect::<Vec<_>>()
                ))
            })?;
            let feed = BroadcastFeed {
                backend,
                master_address: req.master_address.clone(),
                master_port,
                rank: *rank as usize,
                world_size,
                group_name: req.group_name.clone(),
                timeout: std::time::Duration::from_secs(u64::from(req.timeout_s.max(1))),
                names: req.names.clone(),
                // Workers' groups send every tensor in one round.
                rounds: Vec::new(),
                on_receive: Some(round.hook()),
            };
            let (name, version) = (name.clone(), req.version);
            receivers.spawn(async move {
                call!(
                    actor,
                    RolloutMsg::ApplyWeights,
                    IncomingWeights::Broadcast(feed),
                    version,
                    mode
                )
                .map_err(|e| Status::unavailable(format!("actor {name}: {e}")))?
                .map_err(|e| Status::failed_precondition(format!("actor {name}: {e}")))
            });
        }
        let mut longest = 0f64;
        let mut first_error = None;
        while let Some(joined) = receivers.join_next().await {
            match joined {
                Ok(Ok(paused)) => longest = longest.max(paused.as_secs_f64()),
                Ok(Err(status)) => {
                    first_error.get_or_insert(status);
                }
                Err(e) => {
                    first_error.get_or_insert(Status::internal(e.to_string()));
                }
            }
        }
        drop(round);
        if let Some(status) = first_error {
            return Err(status);
        }
        info!(
            version = req.version,
            group = %req.group_name,
            engines = req.actors.len(),
            pause_to_resume_s = longest,
            "weights received by broadcast"
        );
        Ok(Response::new(wpb::ApplyWeightsReply {
            version: req.version,
            engines: req.actors.len() as u32,
            pause_to_resume_s: longest,
        }))
    }

    async fn abort_broadcast(
        &self,
        request: Request<wpb::AbortBroadcastRequest>,
    ) -> Result<Response<wpb::AbortBroadcastReply>, Status> {
        let group = request.into_inner().group_name;
        let aborts = self.aborts.clone();
        let name = group.clone();
        // An NCCL abort may block a while: off the async threads.
        let aborted = tokio::task::spawn_blocking(move || aborts.abort(&name))
            .await
            .map_err(|e| Status::internal(format!("aborting group {group:?}: {e}")))?;
        info!(group = %group, engines = aborted, "broadcast receive aborted (rank 0 failed)");
        Ok(Response::new(wpb::AbortBroadcastReply {
            aborted: aborted as u32,
        }))
    }

    async fn open_weight_group(
        &self,
        request: Request<wpb::OpenWeightGroupRequest>,
    ) -> Result<Response<wpb::OpenWeightGroupReply>, Status> {
        let reply = self.roots.open(&self.daemon, request.into_inner()).await?;
        Ok(Response::new(reply))
    }

    async fn broadcast_weights(
        &self,
        request: Request<wpb::BroadcastWeightsRequest>,
    ) -> Result<Response<wpb::BroadcastWeightsReply>, Status> {
        let reply = self
            .roots
            .broadcast(&self.daemon, request.into_inner())
            .await?;
        Ok(Response::new(reply))
    }

    async fn close_weight_group(
        &self,
        request: Request<wpb::CloseWeightGroupRequest>,
    ) -> Result<Response<wpb::CloseWeightGroupReply>, Status> {
        let req = request.into_inner();
        let closed = self.roots.close(&req.actor, &req.group_name).await;
        Ok(Response::new(wpb::CloseWeightGroupReply { closed }))
    }

    async fn engine_digests(
        &self,
        _request: Request<wpb::EngineDigestsRequest>,
    ) -> Result<Response<wpb::EngineDigestsReply>, Status> {
        let mut engines = Vec::new();
        for (name, actor) in self.rollout_actors().await {
            let tensors = call!(actor, RolloutMsg::ReadWeights)
                .map_err(|e| Status::unavailable(format!("actor {name}: {e}")))?
                .map_err(|e| Status::failed_precondition(format!("actor {name}: {e}")))?;
            let version = call!(actor, RolloutMsg::WeightVersion)
                .map_err(|e| Status::unavailable(format!("actor {name}: {e}")))?;
            let digests = blocking(move || weights::digest_tensors(&tensors)).await?;
            engines.push(wpb::EngineDigest {
                actor: name,
                version,
                tensors: digests,
            });
        }
        Ok(Response::new(wpb::EngineDigestsReply { engines }))
    }
}

fn pause_mode(wire: i32) -> Result<PauseMode, Status> {
    match wpb::PauseMode::try_from(wire) {
        Ok(wpb::PauseMode::Drain) => Ok(PauseMode::Drain),
        Ok(wpb::PauseMode::Abort) => Ok(PauseMode::Abort),
        Err(_) => Err(Status::invalid_argument(format!(
            "pause mode {wire} is not PAUSE_MODE_DRAIN or PAUSE_MODE_ABORT"
        ))),
    }
}
