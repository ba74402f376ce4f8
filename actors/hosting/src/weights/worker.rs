//! The worker's `WeightSync` service: weights arrive and leave as streams of bounded
//! chunks ([`super::wire`]), so no disk is shared between trainer and engines.
//!
//! A push only stages a version (checked, in memory); `ApplyWeights` then pauses each
//! engine on the node, copies the weights in, bumps its version and resumes it. The
//! transfer happens while engines still run, so the pause covers the copy alone.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use manta_engine::PauseMode;
use manta_proto::weight_sync as wpb;
use manta_proto::weight_sync::weight_sync_server::WeightSync;
use manta_rollout::{IncomingWeights, RolloutMsg};
use manta_runtime::WorkerDaemon;
use manta_trainer::{NamedTensors, TrainerMsg};
use ractor::call;
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};
use tracing::info;

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
}

impl WeightSyncService {
    pub fn new(daemon: WorkerDaemon) -> Self {
        Self {
            daemon,
            staged: Arc::default(),
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
        let mode = match wpb::PauseMode::try_from(req.pause) {
            Ok(wpb::PauseMode::Drain) => PauseMode::Drain,
            Ok(wpb::PauseMode::Abort) => PauseMode::Abort,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "pause mode {} is not PAUSE_MODE_DRAIN or PAUSE_MODE_ABORT",
                    req.pause
                )))
            }
        };
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
