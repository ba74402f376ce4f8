//! `WeightSyncActor`: moves the trainer's weights into every engine of this process as a
//! new version: each engine pauses, takes the tensors into its own parameters, takes the
//! version and resumes. One NCCL broadcast feeds every engine when they sit on GPUs of
//! their own ([`crate::broadcast`]); else each engine copies the trainer's tensors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::broadcast::{BroadcastError, BroadcastGroup, BroadcastRoot};
use crate::sync::{TrainerParts, TrainerWeights};
use manta_engine::{NamedTensors, PauseMode, WeightPart};
use manta_hosting::weights::WeightSet;
use manta_hosting::TrainerCallError;
use manta_rollout::{IncomingWeights, RolloutMsg};
use manta_trainer::TrainerMsg;
use ractor::{call, Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tracing::{debug, info, warn};

/// What one sync moved.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReport {
    pub version: u64,
    pub tensors: usize,
    pub bytes: u64,
    pub engines: usize,
    pub seconds: f64,
    /// Longest pause → resume of an engine, seconds.
    pub pause_to_resume_s: f64,
    /// The weights went by one NCCL broadcast (else each engine copied them).
    pub broadcast: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum WeightSyncError {
    #[error("version {requested} is not newer than the current version {current}")]
    StaleVersion { requested: u64, current: u64 },
    #[error("trainer did not answer: {0}")]
    Trainer(String),
    #[error("an engine's weight copy did not finish: {0}")]
    CopyTask(String),
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
    /// As `Sync`, with how engines pause, and without refusing an older version (a
    /// rewind to a checkpoint).
    SyncWith(
        u64,
        SyncOptions,
        RpcReplyPort<Result<SyncReport, WeightSyncError>>,
    ),
    /// The last version every engine took.
    Version(RpcReplyPort<u64>),
    /// Engines that hold an older version than the last sync (a restarted SGLang server
    /// loses weights sent over NCCL) get the trainer's current weights again; answers
    /// their indices. Only between training steps, when the trainer's weights are the
    /// last version synced.
    Refresh(RpcReplyPort<Result<Vec<usize>, WeightSyncError>>),
}

/// How one sync runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncOptions {
    /// Drain: running requests finish on the old weights; Abort: they end now.
    pub pause: PauseMode,
    /// Accept a version not newer than the current one.
    pub allow_rewind: bool,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            pause: PauseMode::Drain,
            allow_rewind: false,
        }
    }
}

pub struct WeightSyncArgs {
    /// The trainer in this process, read through [`TrainerWeights::tensors`]: one
    /// trainer actor, or a rank group that must gather from every rank (ZeRO-3).
    pub trainer: Arc<dyn TrainerWeights>,
    pub engines: Vec<ActorRef<RolloutMsg>>,
    /// Where the trainer's tensors are broadcast from, when one group feeds every engine
    /// (`None`: each engine copies them).
    pub broadcast_from: Option<BroadcastRoot>,
}

pub struct WeightSyncState {
    args: WeightSyncArgs,
    version: u64,
    /// Rank 0 of the engines' weight-update group (see [`WeightSyncArgs::broadcast_from`]).
    broadcast: Option<BroadcastGroup>,
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
        let broadcast = args.broadcast_from.map(BroadcastGroup::new);
        Ok(WeightSyncState {
            args,
            version: 0,
            broadcast,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: WeightSyncMsg,
        state: &mut WeightSyncState,
    ) -> Result<(), ActorProcessingErr> {
        let (version, opts, reply) = match message {
            WeightSyncMsg::Sync(version, reply) => (version, SyncOptions::default(), reply),
            WeightSyncMsg::SyncWith(version, opts, reply) => (version, opts, reply),
            WeightSyncMsg::Version(reply) => {
                let _ = reply.send(state.version);
                return Ok(());
            }
            WeightSyncMsg::Refresh(reply) => {
                let _ = reply.send(refresh(state).await);
                return Ok(());
            }
        };
        let result = sync(state, version, opts).await;
        if let Ok(report) = &result {
            state.version = report.version;
        }
        let _ = reply.send(result);
        Ok(())
    }
}

/// Sends the trainer's weights, as the last version synced, to every engine that holds
/// an older one. A restarted engine must not serve (and be judged stale on) its model
/// directory's weights until the next sync: in synchronous mode its regenerated groups
/// would come back to it, stale again, and the step would never fill. Its running
/// requests are aborted, not drained: they run on weights no step trains on.
async fn refresh(state: &mut WeightSyncState) -> Result<Vec<usize>, WeightSyncError> {
    if state.version == 0 {
        return Ok(Vec::new());
    }
    let mut lagging = Vec::new();
    for (i, engine) in state.args.engines.iter().enumerate() {
        let held =
            call!(engine, RolloutMsg::WeightVersion).map_err(|e| WeightSyncError::Engine {
                engine: i,
                version: state.version,
                message: e.to_string(),
            })?;
        if held < state.version {
            lagging.push((i, held));
        }
    }
    if lagging.is_empty() {
        return Ok(Vec::new());
    }
    let version = state.version;
    if let Some(parts) = trainer_parts(state.args.trainer.as_ref()).await? {
        warn!(
            version,
            engines = ?lagging.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            "engines hold older weights than the last sync (they restarted); sending version {version} again"
        );
        let engines: Vec<_> = lagging
            .iter()
            .map(|&(i, _)| (i, state.args.engines[i].clone()))
            .collect();
        feed_parts(parts, &engines, version, PauseMode::Abort).await?;
        return Ok(lagging.into_iter().map(|(i, _)| i).collect());
    }
    let weights = trainer_tensors(state.args.trainer.as_ref()).await?;
    for &(i, held) in &lagging {
        warn!(
            engine = i,
            held,
            version,
            "engine holds older weights than the last sync (it restarted); sending version {version} again"
        );
        let copy = IncomingWeights::Tensors(shallow(&weights));
        let started = Instant::now();
        call!(
            state.args.engines[i],
            RolloutMsg::ApplyWeights,
            copy,
            version,
            PauseMode::Abort
        )
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|message| WeightSyncError::Engine {
            engine: i,
            version,
            message,
        })?;
        info!(
            engine = i,
            version,
            seconds = started.elapsed().as_secs_f64(),
            "engine has the current weights again"
        );
    }
    Ok(lagging.into_iter().map(|(i, _)| i).collect())
}

/// The trainer's weights in parts, when it hands them so (ZeRO-3 ranks).
async fn trainer_parts(
    trainer: &dyn TrainerWeights,
) -> Result<Option<TrainerParts>, WeightSyncError> {
    trainer
        .weight_parts()
        .await
        .map_err(|e| WeightSyncError::Trainer(e.to_string()))
}

/// Tensors and bytes `parts` will carry, from its layout.
fn layout_size(parts: &TrainerParts) -> (usize, u64) {
    let shapes = parts.layout.iter().flatten();
    let bytes = shapes
        .clone()
        .map(|(_, shape, kind)| {
            (shape.iter().product::<i64>().max(0) as usize * kind.elt_size_in_bytes()) as u64
        })
        .sum();
    (shapes.count(), bytes)
}

/// What one update in parts moved.
struct FedParts {
    tensors: usize,
    bytes: u64,
    /// Longest pause → resume of an engine.
    paused: Duration,
}

/// Feeds the trainer's `parts` to every engine of `engines` (index, actor) as `version`:
/// each engine pauses and copies every part as it comes; a part is answered to the
/// trainer once every engine has copied it (and dropped it), so the trainer gathers the
/// next one only then. An engine that fails stops receiving; the remaining parts are
/// still taken and answered, so every trainer rank finishes its gathers.
async fn feed_parts(
    mut parts: TrainerParts,
    engines: &[(usize, ActorRef<RolloutMsg>)],
    version: u64,
    pause: PauseMode,
) -> Result<FedParts, WeightSyncError> {
    let mut senders = Vec::with_capacity(engines.len());
    let mut applies = tokio::task::JoinSet::new();
    for (i, engine) in engines {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        senders.push(tx);
        let (i, engine) = (*i, engine.clone());
        applies.spawn(async move {
            let engine_err = |message: String| WeightSyncError::Engine {
                engine: i,
                version,
                message,
            };
            call!(
                engine,
                RolloutMsg::ApplyWeights,
                IncomingWeights::Parts(rx),
                version,
                pause
            )
            .map_err(|e| engine_err(e.to_string()))?
            .map_err(|e| engine_err(e.to_string()))
        });
    }
    let (mut tensors, mut bytes) = (0, 0u64);
    let mut feeding = true;
    while let Some(part) = parts.parts.recv().await {
        let (group, copied) = part.into_parts();
        tensors += group.len();
        bytes += group
            .iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum::<u64>();
        if feeding {
            let mut answers = Vec::with_capacity(senders.len());
            for tx in &senders {
                let (part, answer) = WeightPart::new(shallow(&group));
                if tx.send(part).await.is_err() {
                    feeding = false;
                }
                answers.push(answer);
            }
            drop(group);
            for answer in answers {
                // An engine that dropped its part unanswered failed its update.
                feeding &= answer.await.is_ok();
            }
        }
        copied.done();
        if !feeding {
            // The engines' answers say why; stop sending, keep answering the trainer.
            senders.clear();
        }
    }
    drop(senders);
    let mut paused = Duration::ZERO;
    let mut first_error = None;
    while let Some(joined) = applies.join_next().await {
        match joined {
            Ok(Ok(p)) => paused = paused.max(p),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(e) => {
                first_error.get_or_insert(WeightSyncError::CopyTask(e.to_string()));
            }
        }
    }
    parts
        .finish()
        .await
        .map_err(|e| WeightSyncError::Trainer(e.to_string()))?;
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(FedParts {
        tensors,
        bytes,
        paused,
    })
}

/// The in-process trainer's weights as tensors.
async fn trainer_tensors(trainer: &dyn TrainerWeights) -> Result<NamedTensors, WeightSyncError> {
    trainer
        .tensors()
        .await
        .map_err(|e| WeightSyncError::Trainer(e.to_string()))?
        .ok_or_else(|| {
            WeightSyncError::Trainer(
                "the trainer is not in this process (the in-process weight-sync actor reads \
                 its tensors)"
                    .into(),
            )
        })
}

/// One trainer actor of this process as weight sync reads it.
#[async_trait::async_trait]
impl TrainerWeights for ActorRef<TrainerMsg> {
    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        let weights = self.tensors().await?.unwrap_or_default();
        tokio::task::spawn_blocking(move || WeightSet::from_tensors(&weights))
            .await
            .map_err(in_process)?
            .map_err(in_process)
    }

    async fn tensors(&self) -> Result<Option<NamedTensors>, TrainerCallError> {
        call!(self, TrainerMsg::ExportWeights)
            .map(Some)
            .map_err(|e| in_process(format!("the trainer did not answer: {e}")))
    }

    fn worker_addr(&self) -> Option<&str> {
        None
    }
}

fn in_process(message: impl ToString) -> TrainerCallError {
    TrainerCallError::Failed {
        addr: "this process".into(),
        message: message.to_string(),
    }
}

/// Handles on the same tensors (no copy), for another engine or the broadcast.
fn shallow(weights: &NamedTensors) -> NamedTensors {
    weights
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}

async fn sync(
    state: &mut WeightSyncState,
    version: u64,
    opts: SyncOptions,
) -> Result<SyncReport, WeightSyncError> {
    if version <= state.version && !opts.allow_rewind {
        return Err(WeightSyncError::StaleVersion {
            requested: version,
            current: state.version,
        });
    }
    let started = Instant::now();
    if let Some(mut parts) = trainer_parts(state.args.trainer.as_ref()).await? {
        // ZeRO-3: the weights come a layer at a time as the ranks gather them; one
        // broadcast round per layer, or each engine copies each layer.
        if let Some(group) = state.broadcast.as_mut() {
            let (tensors, bytes) = layout_size(&parts);
            match group
                .publish_parts(parts, &state.args.engines, version, opts.pause)
                .await
            {
                Ok(paused) => {
                    let report = SyncReport {
                        version,
                        tensors,
                        bytes,
                        engines: state.args.engines.len(),
                        seconds: started.elapsed().as_secs_f64(),
                        pause_to_resume_s: paused.as_secs_f64(),
                        broadcast: true,
                    };
                    debug!(
                        version,
                        tensors,
                        bytes,
                        seconds = report.seconds,
                        "weights broadcast in parts"
                    );
                    return Ok(report);
                }
                Err((why, back)) => {
                    match why {
                        BroadcastError::Unusable(why) => {
                            warn!("weight broadcast cannot run ({why}); every engine copies the weights from now on");
                            state.broadcast = None;
                        }
                        BroadcastError::Failed(why) => warn!(
                            version,
                            "weight broadcast failed ({why}); the engines copy this version, the next sync makes a new group"
                        ),
                    }
                    // Parts already taken are gone: read the ranks again.
                    parts = match back {
                        Some(parts) => parts,
                        None => trainer_parts(state.args.trainer.as_ref())
                            .await?
                            .ok_or_else(|| {
                                WeightSyncError::Trainer(
                                    "the trainer stopped handing its weights in parts".into(),
                                )
                            })?,
                    };
                }
            }
        }
        let engines: Vec<_> = state.args.engines.iter().cloned().enumerate().collect();
        let fed = feed_parts(parts, &engines, version, opts.pause).await?;
        let report = SyncReport {
            version,
            tensors: fed.tensors,
            bytes: fed.bytes,
            engines: engines.len(),
            seconds: started.elapsed().as_secs_f64(),
            pause_to_resume_s: fed.paused.as_secs_f64(),
            broadcast: false,
        };
        debug!(
            version,
            tensors = fed.tensors,
            bytes = fed.bytes,
            seconds = report.seconds,
            "weights synced in parts"
        );
        return Ok(report);
    }
    let weights = trainer_tensors(state.args.trainer.as_ref()).await?;
    let bytes: u64 = weights
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum();
    let tensors = weights.len();
    let report = |pause_to_resume_s: f64, broadcast: bool| SyncReport {
        version,
        tensors,
        bytes,
        engines: state.args.engines.len(),
        seconds: started.elapsed().as_secs_f64(),
        pause_to_resume_s,
        broadcast,
    };
    if let Some(group) = state.broadcast.as_mut() {
        match group
            .publish(shallow(&weights), &state.args.engines, version, opts.pause)
            .await
        {
            Ok(paused) => {
                let report = report(paused.as_secs_f64(), true);
                debug!(version, tensors, bytes, seconds = report.seconds, "weights broadcast");
                return Ok(report);
            }
            Err(BroadcastError::Unusable(why)) => {
                warn!("weight broadcast cannot run ({why}); every engine copies the weights from now on");
                state.broadcast = None;
            }
            Err(BroadcastError::Failed(why)) => warn!(
                version,
                "weight broadcast failed ({why}); the engines copy this version, the next sync makes a new group"
            ),
        }
    }
    // Every engine copies at once (each from the trainer's memory into its own GPU), so
    // the sync takes about one engine's copy, not the sum, and the engines pause together.
    let mut copies = tokio::task::JoinSet::new();
    for (i, engine) in state.args.engines.iter().enumerate() {
        let copy = shallow(&weights);
        let engine = engine.clone();
        let pause = opts.pause;
        copies.spawn(async move {
            let engine_err = |message: String| WeightSyncError::Engine {
                engine: i,
                version,
                message,
            };
            call!(
                engine,
                RolloutMsg::ApplyWeights,
                IncomingWeights::Tensors(copy),
                version,
                pause
            )
            .map_err(|e| engine_err(e.to_string()))?
            .map_err(|e| engine_err(e.to_string()))
        });
    }
    let mut pause_to_resume_s = 0f64;
    let mut first_error = None;
    while let Some(joined) = copies.join_next().await {
        match joined {
            Ok(Ok(paused)) => pause_to_resume_s = pause_to_resume_s.max(paused.as_secs_f64()),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(e) => {
                first_error.get_or_insert(WeightSyncError::CopyTask(e.to_string()));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let report = report(pause_to_resume_s, false);
    debug!(
        version,
        tensors,
        bytes,
        seconds = report.seconds,
        "weights synced"
    );
    Ok(report)
}
