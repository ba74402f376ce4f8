//! Trainer actors on a worker: the [`TrainerHost`] that starts one on the GPUs it was
//! placed on, and the `Trainer` gRPC service (train step, checkpoints).

use manta_proto::common as pb;
use manta_proto::trainer as tpb;
use manta_proto::trainer::trainer_server::Trainer;
use manta_runtime::{ActorHost, HostedActor, SpawnRequest, WorkerDaemon};
use manta_trainer::{TrainBatch, TrainerMsg};
use ractor::{call, ActorRef};
use tonic::{Request, Response, Status};
use tracing::info;

use super::rank_group::RankGroups;
use super::spawn::{spawn_rank, spawn_trainer, TrainerSpawnConfig};

/// Builds trainer actors (`ACTOR_KIND_TRAINER`), alone or as ranks of a data-parallel
/// group; their handle is the `ActorRef` either way (the messages are the same).
#[derive(Default)]
pub struct TrainerHost {
    /// Groups whose rank 0 this worker opened, for rank 0's spawn.
    groups: RankGroups,
}

impl TrainerHost {
    pub fn new(groups: RankGroups) -> Self {
        Self { groups }
    }
}

#[tonic::async_trait]
impl ActorHost for TrainerHost {
    async fn spawn(&self, req: SpawnRequest) -> Result<HostedActor, Status> {
        let cfg =
            TrainerSpawnConfig::from_json(&req.config_json).map_err(Status::invalid_argument)?;
        if let Some(g) = req.gpus.iter().find(|g| !req.offered_gpus.contains(g)) {
            return Err(Status::failed_precondition(format!(
                "trainer {:?} asks for GPU {g}, but this worker offers {:?}",
                req.name, req.offered_gpus
            )));
        }
        let rank = cfg.rank.clone();
        let options = cfg
            .into_options(&req.gpus)
            .map_err(Status::failed_precondition)?;
        let (actor, aborter) = match &rank {
            None => spawn_trainer(&req.name, options).await.map(|a| (a, None)),
            Some(rank) => spawn_rank(&req.name, options, rank.clone(), &self.groups)
                .await
                .map(|(a, aborter)| (a, Some(aborter))),
        }
        .map_err(|e| Status::internal(format!("{e:#}")))?;
        info!(
            actor = %req.name,
            gpus = ?req.gpus,
            rank = ?rank.as_ref().map(|r| (r.rank, r.world)),
            "trainer spawned"
        );
        let hosted = HostedActor::new(actor.get_cell(), actor);
        Ok(match aborter {
            // A stopped rank may be waiting for a peer that is gone (the driver stops the
            // group when one rank is lost): its waits end, so the actor can stop.
            // Off the runtime's threads: an NCCL abort may wait on NCCL.
            Some(aborter) => hosted.on_stop(async move {
                let _ = tokio::task::spawn_blocking(move || aborter.abort()).await;
            }),
            None => hosted,
        })
    }
}

/// The trainer hosted under `name`, or the call's error.
pub(crate) async fn hosted_trainer(
    daemon: &WorkerDaemon,
    name: &str,
) -> Result<ActorRef<TrainerMsg>, Status> {
    daemon
        .hosted::<ActorRef<TrainerMsg>>(name)
        .await
        .ok_or_else(|| Status::not_found(format!("no trainer named {name:?} on this worker")))
}

/// The `Trainer` service over a daemon's hosted trainers.
#[derive(Clone)]
pub struct TrainerService {
    daemon: WorkerDaemon,
    /// Shared with the [`TrainerHost`]: what `OpenRankGroup` opened, rank 0's spawn takes.
    groups: RankGroups,
}

impl TrainerService {
    pub fn new(daemon: WorkerDaemon, groups: RankGroups) -> Self {
        Self { daemon, groups }
    }
}

fn trainer_call<T>(
    name: &str,
    result: Result<T, ractor::RactorErr<TrainerMsg>>,
) -> Result<T, Status> {
    result.map_err(|e| Status::unavailable(format!("trainer {name} did not answer: {e}")))
}

#[tonic::async_trait]
impl Trainer for TrainerService {
    async fn train_step(
        &self,
        request: Request<tpb::TrainStepRequest>,
    ) -> Result<Response<tpb::TrainStepReply>, Status> {
        let req = request.into_inner();
        let trainer = hosted_trainer(&self.daemon, &req.actor).await?;
        if req.advantages.len() != req.samples.len() {
            return Err(Status::invalid_argument(format!(
                "{} advantages for {} samples",
                req.advantages.len(),
                req.samples.len()
            )));
        }
        let samples = req
            .samples
            .into_iter()
            .map(manta_core::Sample::try_from)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let batch = TrainBatch {
            samples,
            advantages: req.advantages.iter().map(|&a| a as f64).collect(),
            global_samples: req.global_batch_samples as usize,
        };
        // When the rank's share of the step starts (fault runs aim at this moment).
        info!(
            trainer = %req.actor,
            step = req.step,
            samples = batch.samples.len(),
            "training step started"
        );
        let metrics = trainer_call(&req.actor, call!(trainer, TrainerMsg::TrainStep, batch))?
            .map_err(|e| Status::internal(format!("training step {} failed: {e}", req.step)))?;
        Ok(Response::new(tpb::TrainStepReply {
            metrics: metrics.into_iter().collect(),
        }))
    }

    async fn save_checkpoint(
        &self,
        request: Request<tpb::SaveCheckpointRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = request.into_inner();
        let trainer = hosted_trainer(&self.daemon, &req.actor).await?;
        let dir = std::path::PathBuf::from(&req.directory);
        trainer_call(
            &req.actor,
            call!(trainer, TrainerMsg::SaveCheckpoint, dir, req.step),
        )?
        .map_err(|e| Status::internal(format!("saving {}: {e}", req.directory)))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn load_checkpoint(
        &self,
        request: Request<tpb::LoadCheckpointRequest>,
    ) -> Result<Response<tpb::LoadCheckpointReply>, Status> {
        let req = request.into_inner();
        let trainer = hosted_trainer(&self.daemon, &req.actor).await?;
        let dir = std::path::PathBuf::from(&req.directory);
        let step = trainer_call(&req.actor, call!(trainer, TrainerMsg::LoadCheckpoint, dir))?
            .map_err(|e| Status::failed_precondition(format!("loading {}: {e}", req.directory)))?;
        Ok(Response::new(tpb::LoadCheckpointReply { step }))
    }

    async fn open_rank_group(
        &self,
        request: Request<tpb::OpenRankGroupRequest>,
    ) -> Result<Response<tpb::OpenRankGroupReply>, Status> {
        let reply = self
            .groups
            .open(request.into_inner(), self.daemon.gpus())
            .await?;
        Ok(Response::new(reply))
    }
}
