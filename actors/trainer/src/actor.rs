//! `TrainerActor`: the trainer behind a ractor mailbox.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::data_parallel::Collective;
use crate::trainer::{NamedTensors, TrainBatch, Trainer, TrainerError, TrainerOptions};

/// Messages a trainer rank handles, one at a time.
pub enum TrainerMsg {
    /// Run one GRPO step; replies with `train/*` metrics.
    TrainStep(
        TrainBatch,
        RpcReplyPort<Result<BTreeMap<String, f64>, TrainerError>>,
    ),
    /// Hand out the current weights for weight sync.
    ExportWeights(RpcReplyPort<NamedTensors>),
    /// The current weights, whole ([`Trainer::try_export_weights`]): under ZeRO-3 a
    /// collective, so every rank of the group must be sent it at once (the ranks'
    /// results are the same; one is used). A failed group is an error, not a panic.
    GatherWeights(RpcReplyPort<Result<NamedTensors, TrainerError>>),
    /// Hand the current weights to the visitor a shard group at a time
    /// ([`Trainer::visit_weights`]: under ZeRO-3 one decoder layer per call, gathered
    /// from the ranks — every rank must be sent it at once — and freed once the visitor
    /// returns, so weight sync never gathers the whole model; else one call with every
    /// weight).
    VisitWeights(WeightVisitor, RpcReplyPort<Result<(), TrainerError>>),
    /// The groups `VisitWeights` hands out, in order, by name, shape and kind
    /// ([`Trainer::weight_groups`]; no collective: rank 0 alone may be asked).
    WeightGroups(RpcReplyPort<WeightGroupShapes>),
    /// Save a checkpoint for `step` into the directory.
    SaveCheckpoint(PathBuf, u64, RpcReplyPort<Result<(), TrainerError>>),
    /// Restore from a checkpoint directory; replies with its step.
    LoadCheckpoint(PathBuf, RpcReplyPort<Result<u64, TrainerError>>),
}

pub type TrainerArgs = TrainerOptions;

/// [`TrainerMsg::WeightGroups`]' answer: each group's (name, shape, kind).
pub type WeightGroupShapes = Vec<Vec<(String, Vec<i64>, tch::Kind)>>;

/// What [`TrainerMsg::VisitWeights`] calls with each shard group. It runs on the rank's
/// thread and may block (wait for a receiver to copy the group). Under ZeRO-3 an error
/// stops this rank's gathers while the other ranks wait in them: a visitor whose reader
/// went away should keep returning `Ok` and drop what it is given.
pub type WeightVisitor = Box<dyn FnMut(NamedTensors) -> Result<(), TrainerError> + Send>;

pub struct TrainerActor;

impl Actor for TrainerActor {
    type Msg = TrainerMsg;
    type State = Trainer;
    type Arguments = TrainerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: TrainerArgs,
    ) -> Result<Trainer, ActorProcessingErr> {
        // Loading weights is blocking work; keep it off the async worker's hot path.
        Ok(tokio::task::block_in_place(|| Trainer::new(args))?)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: TrainerMsg,
        trainer: &mut Trainer,
    ) -> Result<(), ActorProcessingErr> {
        handle_message(message, trainer);
        Ok(())
    }
}

/// How the ranks of a group share the work, i.e. which constructor builds a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankGroupKind {
    /// Data parallel, ZeRO-2 ([`Trainer::new_data_parallel`]).
    Zero2,
    /// Data parallel, `--zero-stage 3` ([`Trainer::new_zero3`]; the bucket size is
    /// unused: its buckets are the layers).
    Zero3,
    /// `--context-parallel-size`: the whole group is one context-parallel group
    /// ([`Trainer::new_context_parallel`]); every rank must be sent the same batch.
    ContextParallel,
}

/// What a group rank's actor is built from: its options, its place in the group, the
/// gradient bucket size ([`Trainer::new_data_parallel`]) and the kind of group.
pub struct TrainerRankArgs {
    pub options: TrainerOptions,
    pub comm: Box<dyn Collective>,
    pub bucket_numel: usize,
    pub kind: RankGroupKind,
    /// Whether this rank writes its checkpoint directory's weights and state
    /// ([`Trainer::set_checkpoint_owner`]); `None`: rank 0 does (one shared directory).
    pub checkpoint_owner: Option<bool>,
}

/// [`TrainerActor`] for one rank of a data-parallel or context-parallel group: the same
/// messages, a trainer built as [`RankGroupKind`] says. Every rank of the group must be
/// started at once (building a rank waits for the others) and be sent the same messages.
pub struct TrainerRankActor;

/// A rank's trainer and its GPU, made the current CUDA device of whichever runtime
/// thread serves a message (ranks of one process sit on different GPUs).
pub struct TrainerRank {
    trainer: Trainer,
    gpu: Option<usize>,
}

fn make_current(gpu: Option<usize>) {
    if let Some(gpu) = gpu {
        if let Err(e) = manta_cuda::set_device(gpu) {
            tracing::warn!(gpu, error = %e, "trainer rank: setting the current CUDA device");
        }
    }
}

impl Actor for TrainerRankActor {
    type Msg = TrainerMsg;
    type State = TrainerRank;
    type Arguments = TrainerRankArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: TrainerRankArgs,
    ) -> Result<TrainerRank, ActorProcessingErr> {
        let gpu = match args.options.device {
            tch::Device::Cuda(i) => Some(i),
            _ => None,
        };
        make_current(gpu);
        let mut trainer = tokio::task::block_in_place(|| match args.kind {
            RankGroupKind::Zero2 => {
                Trainer::new_data_parallel(args.options, args.comm, args.bucket_numel)
            }
            RankGroupKind::Zero3 => Trainer::new_zero3(args.options, args.comm),
            RankGroupKind::ContextParallel => {
                Trainer::new_context_parallel(args.options, args.comm, args.bucket_numel)
            }
        })?;
        if let Some(owner) = args.checkpoint_owner {
            trainer.set_checkpoint_owner(owner);
        }
        Ok(TrainerRank { trainer, gpu })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: TrainerMsg,
        rank: &mut TrainerRank,
    ) -> Result<(), ActorProcessingErr> {
        make_current(rank.gpu);
        handle_message(message, &mut rank.trainer);
        Ok(())
    }
}

/// Serves one message on the actor's trainer (either actor).
fn handle_message(message: TrainerMsg, trainer: &mut Trainer) {
    // Compute is blocking; block_in_place lets other tasks (the environment server,
    // rollouts) keep running on the runtime's other workers.
    match message {
        TrainerMsg::TrainStep(batch, reply) => {
            let result = tokio::task::block_in_place(|| trainer.train_step(&batch));
            let _ = reply.send(result);
        }
        TrainerMsg::ExportWeights(reply) => {
            let _ = reply.send(trainer.export_weights());
        }
        TrainerMsg::GatherWeights(reply) => {
            // ZeRO-3 waits in collectives for the other ranks' actors.
            let result = tokio::task::block_in_place(|| trainer.try_export_weights());
            let _ = reply.send(result);
        }
        TrainerMsg::VisitWeights(visitor, reply) => {
            // ZeRO-3 waits in collectives for the other ranks' actors.
            let result = tokio::task::block_in_place(|| trainer.visit_weights(visitor));
            let _ = reply.send(result);
        }
        TrainerMsg::WeightGroups(reply) => {
            let _ = reply.send(trainer.weight_groups());
        }
        TrainerMsg::SaveCheckpoint(dir, step, reply) => {
            let result = tokio::task::block_in_place(|| trainer.save_checkpoint(&dir, step));
            let _ = reply.send(result);
        }
        TrainerMsg::LoadCheckpoint(dir, reply) => {
            let result = tokio::task::block_in_place(|| trainer.load_checkpoint(&dir));
            let _ = reply.send(result);
        }
    }
}
