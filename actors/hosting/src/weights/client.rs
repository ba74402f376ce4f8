//! The driver's side of weight sync on a worker: pulling a trainer's weights, pushing
//! and applying a version on the engines, reading back what they hold.

use std::future::Future;
use std::sync::Arc;

use manta_proto::weight_sync as wpb;
use manta_proto::weight_sync::weight_sync_client::WeightSyncClient as WeightSyncRpc;
use manta_runtime::{AuthedChannel, RuntimeError, WorkerClient};

use super::wire::{Assembler, WeightSet, WeightsError, MAX_WEIGHT_MESSAGE};

/// Weight-sync calls on a worker (implemented for [`WorkerClient`]).
pub trait WeightSyncCalls {
    /// Streams trainer `actor`'s current weights off the worker.
    fn pull_weights(
        &self,
        actor: &str,
    ) -> impl Future<Output = Result<WeightSet, RuntimeError>> + Send;

    /// Sends `set` as `version` in chunks of `chunk_bytes`; the worker stages it.
    fn push_weights(
        &self,
        set: Arc<WeightSet>,
        version: u64,
        chunk_bytes: usize,
    ) -> impl Future<Output = Result<wpb::PushWeightsReply, RuntimeError>> + Send;

    /// Applies the staged `version` to every engine on the worker (pause, copy, bump,
    /// resume).
    fn apply_weights(
        &self,
        version: u64,
        pause: wpb::PauseMode,
    ) -> impl Future<Output = Result<wpb::ApplyWeightsReply, RuntimeError>> + Send;

    /// What each rollout engine on the worker holds, tensor by tensor.
    fn engine_digests(
        &self,
    ) -> impl Future<Output = Result<Vec<wpb::EngineDigest>, RuntimeError>> + Send;

    /// Has the worker's engines named in `request` join its group and receive one
    /// version by broadcast (rank 0 broadcasts meanwhile).
    fn receive_broadcast(
        &self,
        request: wpb::ReceiveBroadcastRequest,
    ) -> impl Future<Output = Result<wpb::ApplyWeightsReply, RuntimeError>> + Send;

    /// Ends the receive of the worker's engines in `group` (rank 0's side failed);
    /// answers how many engines were receiving in it.
    fn abort_broadcast(
        &self,
        group: &str,
    ) -> impl Future<Output = Result<u32, RuntimeError>> + Send;

    /// Has the worker root a weight-update group for its trainer (see
    /// `OpenWeightGroup`): the store's port and the tensor order come back.
    fn open_weight_group(
        &self,
        request: wpb::OpenWeightGroupRequest,
    ) -> impl Future<Output = Result<wpb::OpenWeightGroupReply, RuntimeError>> + Send;

    /// Has the worker broadcast its trainer's parameters through the group it roots.
    fn broadcast_weights(
        &self,
        request: wpb::BroadcastWeightsRequest,
    ) -> impl Future<Output = Result<wpb::BroadcastWeightsReply, RuntimeError>> + Send;

    /// Aborts and drops the group the worker roots for trainer `actor`, if it is `group`.
    fn close_weight_group(
        &self,
        actor: &str,
        group: &str,
    ) -> impl Future<Output = Result<bool, RuntimeError>> + Send;
}

fn weight_sync_rpc(client: &WorkerClient) -> WeightSyncRpc<AuthedChannel> {
    WeightSyncRpc::new(client.channel())
        .max_encoding_message_size(MAX_WEIGHT_MESSAGE)
        .max_decoding_message_size(MAX_WEIGHT_MESSAGE)
}

fn weights_error(client: &WorkerClient, e: WeightsError) -> RuntimeError {
    RuntimeError::Node {
        addr: client.addr().to_string(),
        message: e.to_string(),
    }
}

impl WeightSyncCalls for WorkerClient {
    async fn pull_weights(&self, actor: &str) -> Result<WeightSet, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let mut stream = c
            .pull_weights(wpb::PullWeightsRequest {
                actor: actor.to_string(),
            })
            .await
            .map_err(|s| self.rpc_error(s))?
            .into_inner();
        let mut asm = Assembler::new();
        while let Some(chunk) = stream.message().await.map_err(|s| self.rpc_error(s))? {
            asm.push(chunk).map_err(|e| weights_error(self, e))?;
        }
        let (_, set) = asm.finish().map_err(|e| weights_error(self, e))?;
        Ok(set)
    }

    async fn push_weights(
        &self,
        set: Arc<WeightSet>,
        version: u64,
        chunk_bytes: usize,
    ) -> Result<wpb::PushWeightsReply, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let chunks = futures::stream::iter(set.chunks(version, chunk_bytes));
        let reply = c
            .push_weights(chunks)
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }

    async fn apply_weights(
        &self,
        version: u64,
        pause: wpb::PauseMode,
    ) -> Result<wpb::ApplyWeightsReply, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .apply_weights(wpb::ApplyWeightsRequest {
                version,
                pause: pause as i32,
            })
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }

    async fn receive_broadcast(
        &self,
        request: wpb::ReceiveBroadcastRequest,
    ) -> Result<wpb::ApplyWeightsReply, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .receive_broadcast(request)
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }

    async fn abort_broadcast(&self, group: &str) -> Result<u32, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .abort_broadcast(wpb::AbortBroadcastRequest {
                group_name: group.to_string(),
            })
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner().aborted)
    }

    async fn open_weight_group(
        &self,
        request: wpb::OpenWeightGroupRequest,
    ) -> Result<wpb::OpenWeightGroupReply, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .open_weight_group(request)
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }

    async fn broadcast_weights(
        &self,
        request: wpb::BroadcastWeightsRequest,
    ) -> Result<wpb::BroadcastWeightsReply, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .broadcast_weights(request)
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner())
    }

    async fn close_weight_group(&self, actor: &str, group: &str) -> Result<bool, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .close_weight_group(wpb::CloseWeightGroupRequest {
                actor: actor.to_string(),
                group_name: group.to_string(),
            })
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner().closed)
    }

    async fn engine_digests(&self) -> Result<Vec<wpb::EngineDigest>, RuntimeError> {
        let mut c = weight_sync_rpc(self);
        let reply = c
            .engine_digests(wpb::EngineDigestsRequest {})
            .await
            .map_err(|s| self.rpc_error(s))?;
        Ok(reply.into_inner().engines)
    }
}
