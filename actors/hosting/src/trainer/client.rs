//! The driver's side of a trainer on a worker: spawning it, train steps and
//! checkpoints, over the worker's channel.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use manta_proto::cluster as cpb;
use manta_proto::common as pb;
use manta_proto::trainer as tpb;
use manta_proto::trainer::trainer_client::TrainerClient as TrainerRpc;
use manta_runtime::{AuthedChannel, RuntimeError, WorkerClient};
use manta_trainer::TrainBatch;

use super::spawn::TrainerSpawnConfig;

/// Largest message to or from a trainer (a rank's share of a batch).
pub const MAX_TRAINER_MESSAGE: usize = 1 << 30;

/// Trainer calls on a worker (implemented for [`WorkerClient`]).
pub trait TrainerCalls {
    /// Starts a trainer actor named `name` on the worker, on `gpus` (none: CPU).
    fn spawn_trainer(
        &self,
        name: &str,
        cfg: &TrainerSpawnConfig,
        gpus: &[u32],
        limit: Duration,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// One GRPO step on trainer `actor` (no time limit: a step takes what it takes;
    /// a lost worker breaks the connection).
    fn train_step(
        &self,
        actor: &str,
        step: u64,
        batch: &TrainBatch,
    ) -> impl Future<Output = Result<BTreeMap<String, f64>, RuntimeError>> + Send;

    fn save_checkpoint(
        &self,
        actor: &str,
        directory: &str,
        step: u64,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Restores trainer `actor` from a checkpoint; returns the checkpoint's step.
    fn load_checkpoint(
        &self,
        actor: &str,
        directory: &str,
    ) -> impl Future<Output = Result<u64, RuntimeError>> + Send;

    /// Opens rank 0's side of a data-parallel group on this worker (NCCL id or store),
    /// before any rank is spawned.
    fn open_rank_group(
        &self,
        request: tpb::OpenRankGroupRequest,
        limit: Duration,
    ) -> impl Future<Output = Result<tpb::OpenRankGroupReply, RuntimeError>> + Send;
}

fn trainer_rpc(client: &WorkerClient) -> TrainerRpc<AuthedChannel> {
    TrainerRpc::new(client.channel())
        .max_encoding_message_size(MAX_TRAINER_MESSAGE)
        .max_decoding_message_size(MAX_TRAINER_MESSAGE)
}

impl TrainerCalls for WorkerClient {
    async fn spawn_trainer(
        &self,
        name: &str,
        cfg: &TrainerSpawnConfig,
        gpus: &[u32],
        limit: Duration,
    ) -> Result<(), RuntimeError> {
        let config_json =
            serde_json::to_string(cfg).map_err(|e| RuntimeError::Spawn(e.to_string()))?;
        self.spawn_actor(cpb::ActorKind::Trainer, name, gpus, config_json, limit)
            .await
    }

    async fn train_step(
        &self,
        actor: &str,
        step: u64,
        batch: &TrainBatch,
    ) -> Result<BTreeMap<String, f64>, RuntimeError> {
        let request = tpb::TrainStepRequest {
            step,
            samples: batch.samples.iter().map(pb::Sample::from).collect(),
            advantages: batch.advantages.iter().map(|&a| a as f32).collect(),
            global_batch_samples: batch.global_samples as u32,
            actor: actor.to_string(),
        };
        let reply = trainer_rpc(self)
            .train_step(request)
            .await
            .map_err(|s| self.rpc_error(s))?
            .into_inner();
        Ok(reply.metrics.into_iter().collect())
    }

    async fn save_checkpoint(
        &self,
        actor: &str,
        directory: &str,
        step: u64,
    ) -> Result<(), RuntimeError> {
        trainer_rpc(self)
            .save_checkpoint(tpb::SaveCheckpointRequest {
                directory: directory.to_string(),
                step,
                actor: actor.to_string(),
            })
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(())
    }

    async fn load_checkpoint(&self, actor: &str, directory: &str) -> Result<u64, RuntimeError> {
        let reply = trainer_rpc(self)
            .load_checkpoint(tpb::LoadCheckpointRequest {
                directory: directory.to_string(),
                actor: actor.to_string(),
            })
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner().step)
    }

    async fn open_rank_group(
        &self,
        request: tpb::OpenRankGroupRequest,
        limit: Duration,
    ) -> Result<tpb::OpenRankGroupReply, RuntimeError> {
        let mut request = tonic::Request::new(request);
        request.set_timeout(limit);
        let reply = trainer_rpc(self)
            .open_rank_group(request)
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }
}
