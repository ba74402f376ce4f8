//! `RolloutActor`: runs batches of episodes on its engine, many in flight at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::stream::{self, StreamExt};
use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tracing::Instrument;

use crate::episode::{
    run_episode, EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings,
};
use manta_engine::{BroadcastFeed, EngineError, NamedTensors, PauseMode, WeightShape};

/// How new weights reach an engine.
pub enum IncomingWeights {
    /// Tensors in this process; the engine copies them into its own.
    Tensors(NamedTensors),
    /// Broadcast by rank 0 of a weight-update group the engine joins.
    Broadcast(BroadcastFeed),
    /// A group of parameters at a time, each answered once copied (a ZeRO-3 trainer
    /// gathers the next group only then).
    Parts(manta_engine::WeightParts),
}

/// Messages a rollout actor handles.
pub enum RolloutMsg {
    /// Run these episodes (up to `max_concurrent_episodes` at once); reply with every
    /// sample, failed ones included (marked `Failed`), in request order.
    RunEpisodes(
        Vec<EpisodeRequest>,
        GenerationSettings,
        RpcReplyPort<Vec<Sample>>,
    ),
    /// Load new weights into the engine and set its version.
    UpdateWeights(NamedTensors, u64, RpcReplyPort<Result<(), EngineError>>),
    /// The version protocol: pause generation (`PauseMode::Drain` lets running requests
    /// finish, `Abort` ends them with their partial output), load the weights, set the
    /// version, resume. Replies with the pause-to-resume time.
    ApplyWeights(
        IncomingWeights,
        u64,
        PauseMode,
        RpcReplyPort<Result<std::time::Duration, EngineError>>,
    ),
    /// A copy of the engine's weights (to verify a sync bit for bit).
    ReadWeights(RpcReplyPort<Result<NamedTensors, EngineError>>),
    /// Every parameter's name, shape and dtype (what a broadcast must match).
    WeightShapes(RpcReplyPort<Result<Vec<WeightShape>, EngineError>>),
    /// The engine's current weight version.
    WeightVersion(RpcReplyPort<u64>),
    /// Free the engine's KV cache while a colocated trainer steps (`Ok(false)`: busy).
    ReleaseMemory(RpcReplyPort<Result<bool, EngineError>>),
    /// Allocate it again.
    ResumeMemory(RpcReplyPort<Result<(), EngineError>>),
}

pub struct RolloutArgs {
    pub context: EpisodeContext,
    /// Environments by `Owner/Name`.
    pub environments: BTreeMap<String, EnvironmentHandle>,
    pub max_concurrent_episodes: usize,
}

pub struct RolloutState {
    shared: Arc<Shared>,
}

struct Shared {
    context: EpisodeContext,
    environments: BTreeMap<String, EnvironmentHandle>,
    max_concurrent: usize,
    /// Bounds episodes in flight across all `RunEpisodes` calls (the driver sends one
    /// call per group, a worker one per episode).
    episodes: tokio::sync::Semaphore,
}

pub struct RolloutActor;

impl Actor for RolloutActor {
    type Msg = RolloutMsg;
    type State = RolloutState;
    type Arguments = RolloutArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: RolloutArgs,
    ) -> Result<RolloutState, ActorProcessingErr> {
        Ok(RolloutState {
            shared: Arc::new(Shared {
                context: args.context,
                environments: args.environments,
                max_concurrent: args.max_concurrent_episodes.max(1),
                episodes: tokio::sync::Semaphore::new(args.max_concurrent_episodes.max(1)),
            }),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: RolloutMsg,
        state: &mut RolloutState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            RolloutMsg::RunEpisodes(requests, settings, reply) => {
                // Episodes run on their own task so the mailbox stays responsive. ractor
                // runs `handle` in the sender's span (the driver's `step`); the spawned task
                // would lose it, so carry it over: episode spans are the step's children.
                let shared = state.shared.clone();
                let parent = tracing::Span::current();
                tokio::spawn(
                    async move {
                        let samples = run_all(&shared, requests, settings).await;
                        let _ = reply.send(samples);
                    }
                    .instrument(parent),
                );
            }
            RolloutMsg::UpdateWeights(weights, version, reply) => {
                let result = state
                    .shared
                    .context
                    .engine
                    .update_weights(weights, version)
                    .await;
                let _ = reply.send(result);
            }
            RolloutMsg::ApplyWeights(weights, version, mode, reply) => {
                let engine = &state.shared.context.engine;
                let _ = reply.send(apply_weights(engine.as_ref(), weights, version, mode).await);
            }
            RolloutMsg::ReleaseMemory(reply) => {
                let engine = &state.shared.context.engine;
                let _ = reply.send(engine.release_memory_occupation().await);
            }
            RolloutMsg::ResumeMemory(reply) => {
                let engine = &state.shared.context.engine;
                let _ = reply.send(engine.resume_memory_occupation().await);
            }
            RolloutMsg::ReadWeights(reply) => {
                let _ = reply.send(state.shared.context.engine.read_weights().await);
            }
            RolloutMsg::WeightShapes(reply) => {
                let _ = reply.send(state.shared.context.engine.weight_shapes().await);
            }
            RolloutMsg::WeightVersion(reply) => {
                let _ = reply.send(state.shared.context.engine.weight_version());
            }
        }
        Ok(())
    }
}

/// Pause → update → resume, timed from the pause request to the resume's answer.
/// Engines that cannot pause take the update between requests (their update is a
/// barrier of its own).
async fn apply_weights(
    engine: &dyn manta_engine::Engine,
    weights: IncomingWeights,
    version: u64,
    mode: PauseMode,
) -> Result<std::time::Duration, EngineError> {
    let started = std::time::Instant::now();
    let paused = match engine.pause(mode).await {
        Ok(()) => true,
        Err(EngineError::Unsupported(_)) => false,
        Err(e) => return Err(e),
    };
    let updated = match weights {
        IncomingWeights::Tensors(w) => engine.update_weights(w, version).await,
        IncomingWeights::Broadcast(feed) => engine.update_weights_broadcast(feed, version).await,
        IncomingWeights::Parts(parts) => engine.update_weights_in_parts(parts, version).await,
    };
    if paused {
        // Resume even when the update failed: the engine keeps serving the old weights.
        engine.resume().await?;
    }
    updated.map(|()| started.elapsed())
}

async fn run_all(
    shared: &Shared,
    requests: Vec<EpisodeRequest>,
    settings: GenerationSettings,
) -> Vec<Sample> {
    let count = requests.len();
    let started = std::time::Instant::now();
    let samples: Vec<Sample> = stream::iter(requests.into_iter().map(|request| async move {
        // Never closed, so the permit always comes.
        let _permit = shared.episodes.acquire().await;
        match shared.environments.get(&request.task.environment) {
            Some(env) => run_episode(&shared.context, env, &request, settings).await,
            None => unknown_environment(&request),
        }
    }))
    .buffered(shared.max_concurrent)
    .collect()
    .await;
    tracing::debug!(
        episodes = count,
        seconds = started.elapsed().as_secs_f64(),
        "rollout batch done"
    );
    samples
}

fn unknown_environment(request: &EpisodeRequest) -> Sample {
    Sample {
        id: request.sample_id,
        group_index: request.group_index,
        index: request.index,
        tokens: Vec::new(),
        response_length: 0,
        loss_mask: Vec::new(),
        rollout_log_probs: Vec::new(),
        reward: 0.0,
        status: SampleStatus::Failed,
        weight_version: 0,
        metadata: EpisodeMetadata {
            environment: request.task.environment.clone(),
            task_hash: request.task.task_hash.clone(),
            stop_reason: "environment_error".into(),
            error: Some(format!(
                "environment {} is not configured on this rollout actor",
                request.task.environment
            )),
            ..Default::default()
        },
        routed_experts: None,
    }
}
