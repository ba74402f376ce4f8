//! `WeightSyncActor`: after each training step, moves the trainer's weights into every
//! engine and bumps the weight version. In local mode the tensors move in-process
//! (the engine copies them into its own parameters); across GPUs the same message
//! interface will drive NCCL broadcast and CUDA IPC.

use std::time::Instant;

use manta_rollout::RolloutMsg;
use manta_trainer::TrainerMsg;
use ractor::{call, Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tracing::debug;

/// What one sync moved.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReport {
    pub version: u64,
    pub tensors: usize,
    pub bytes: u64,
    pub engines: usize,
    pub seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum WeightSyncError {
    #[error("version {requested} is not newer than the current version {current}")]
    StaleVersion { requested: u64, current: u64 },
    #[error("trainer did not answer: {0}")]
    Trainer(String),
    #[error("engine {engine} did not take version {version}: {message}")]
    Engine {
        engine: usize,
        version: u64,
        message: String,
    },
}

pub enum WeightSyncMsg {
    /// Push the trainer's current weights to all engines as `version`.
    Sync(u64, RpcReplyPort<Result<SyncReport, WeightSyncError>>),
    /// The last version every engine took.
    Version(RpcReplyPort<u64>),
}

pub struct WeightSyncArgs {
    pub trainer: ActorRef<TrainerMsg>,
    pub engines: Vec<ActorRef<RolloutMsg>>,
}

pub struct WeightSyncState {
    args: WeightSyncArgs,
    version: u64,
}

pub struct WeightSyncActor;

impl Actor for WeightSyncActor {
    type Msg = WeightSyncMsg;
    type State = WeightSyncState;
    type Arguments = WeightSyncArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: WeightSyncArgs,
    ) -> Result<WeightSyncState, ActorProcessingErr> {
        Ok(WeightSyncState { args, version: 0 })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: WeightSyncMsg,
        state: &mut WeightSyncState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            WeightSyncMsg::Sync(version, reply) => {
                let result = sync(state, version).await;
                if let Ok(report) = &result {
                    state.version = report.version;
                }
                let _ = reply.send(result);
            }
            WeightSyncMsg::Version(reply) => {
                let _ = reply.send(state.version);
            }
        }
        Ok(())
    }
}

async fn sync(state: &WeightSyncState, version: u64) -> Result<SyncReport, WeightSyncError> {
    if version <= state.version {
        return Err(WeightSyncError::StaleVersion {
            requested: version,
            current: state.version,
        });
    }
    let started = Instant::now();
    let weights = call!(state.args.trainer, TrainerMsg::ExportWeights)
        .map_err(|e| WeightSyncError::Trainer(e.to_string()))?;
    let bytes: u64 = weights
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum();
    let tensors = weights.len();
    for (i, engine) in state.args.engines.iter().enumerate() {
        let copy = weights
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let engine_err = |message: String| WeightSyncError::Engine {
            engine: i,
            version,
            message,
        };
        call!(engine, RolloutMsg::UpdateWeights, copy, version)
            .map_err(|e| engine_err(e.to_string()))?
            .map_err(|e| engine_err(e.to_string()))?;
    }
    let report = SyncReport {
        version,
        tensors,
        bytes,
        engines: state.args.engines.len(),
        seconds: started.elapsed().as_secs_f64(),
    };
    debug!(
        version,
        tensors,
        bytes,
        seconds = report.seconds,
        "weights synced"
    );
    Ok(report)
}
