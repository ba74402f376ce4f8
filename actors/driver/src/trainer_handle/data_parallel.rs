//! Data-parallel trainer ranks behind the same [`TrainerHandle`] as one trainer: in the
//! driver process (local mode, `[trainer] gpus` with several GPUs or `[trainer]
//! data_parallel_ranks`: one `TrainerRankActor` per rank, manta_trainer::data_parallel,
//! ZeRO-2, or ZeRO-3 with `--zero-stage 3`, NCCL between GPUs or threads on the CPU),
//! or on worker daemons (`[trainer] ranks`, placed by crate::remote_ranks: each rank a
//! `RemoteTrainer`, NCCL or rank 0's store between them). One [`RankGroup`] drives
//! both; only where checkpoints live differs (super::rank_checkpoints).
//!
//! Each step's global batch is cut into one share per rank so that the ranks' step
//! equals one trainer's step on the whole batch (loss weights divide by global counts);
//! every rank steps at once and rank 0's metrics, global after the ranks' all-reduce,
//! are the step's. Weights for sync come from rank 0 under ZeRO-2 (every rank holds the
//! same); under ZeRO-3 no rank holds them whole, so every rank visits them at once (each
//! layer's all-gather is a collective) and rank 0 hands them on a layer at a time
//! (super::weight_parts), never the whole model at once. A
//! checkpoint is saved by every rank into one directory (rank 0's weights and state,
//! each rank's ZeRO optimizer shard) and resume restores every rank from it, so it needs
//! the same rank count.
//!
//! With `--context-parallel-size N` the same N ranks are one context-parallel group
//! (`Trainer::new_context_parallel`): every rank is sent the whole batch (each holds a
//! share of every packed sequence's tokens), the weights are replicated as under ZeRO-2
//! (rank 0's are read), and checkpoints are ZeRO-2's (one optimizer shard per rank).

use std::collections::BTreeMap;

use manta_trainer::NamedTensors;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::future::join_all;
use futures::stream::{FuturesUnordered, StreamExt};
use manta_hosting::weights::WeightSet;
use manta_hosting::{RemoteTrainer, TrainerCallError};
use manta_trainer::data_parallel::zero::DEFAULT_BUCKET_NUMEL;
use manta_trainer::data_parallel::{Collective, NcclCollective, ThreadCollective};
use manta_trainer::{
    RankGroupKind, TrainBatch, TrainerMsg, TrainerOptions, TrainerRankActor, TrainerRankArgs,
};
use ractor::{Actor, ActorRef};
use tch::Device;
use tracing::{info, warn};

use super::local::LocalTrainer;
use super::rank_checkpoints::{RankCheckpoints, WorkerCheckpoints};
use super::remote::OnWorker;
use super::{TrainerBackend, TrainerHandle};

/// Where a local rank group runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankDevices {
    /// This many ranks on the CPU, as threads (`[trainer] data_parallel_ranks`).
    Cpu(usize),
    /// One rank per GPU, in order (`[trainer] gpus`), over NCCL.
    Gpus(Vec<u32>),
}

impl RankDevices {
    pub fn world(&self) -> usize {
        match self {
            Self::Cpu(n) => *n,
            Self::Gpus(gpus) => gpus.len(),
        }
    }
}

impl TrainerHandle {
    /// The ranks of a local data-parallel group, rank 0 first, each started by
    /// [`spawn_ranks`]; `steps_per_rollout` is the trainer's `num_steps_per_rollout`;
    /// `kind`: what they were started as (ZeRO-3: reading weights takes every rank;
    /// context parallel: every rank gets the whole batch).
    pub fn local_ranks(
        ranks: Vec<ActorRef<TrainerMsg>>,
        steps_per_rollout: usize,
        kind: RankGroupKind,
    ) -> Self {
        Self::new(RankGroup {
            ranks: ranks
                .into_iter()
                .map(|r| Box::new(LocalTrainer(r)) as Box<dyn TrainerBackend>)
                .collect(),
            steps_per_rollout: steps_per_rollout.max(1),
            warned_uneven: AtomicBool::new(false),
            kind,
            checkpoints: RankCheckpoints::Shared,
            where_: "the driver process (data-parallel ranks)".into(),
            regroup: None,
        })
    }

    /// The ranks of a ZeRO-2 group on worker daemons, rank 0 first, each started by
    /// crate::remote_ranks; their checkpoints stay on their own workers; `regroup`
    /// re-creates them all as a new group when one is lost.
    pub fn worker_ranks(
        ranks: Vec<Arc<RemoteTrainer>>,
        steps_per_rollout: usize,
        checkpoints: WorkerCheckpoints,
        regroup: Arc<dyn RestartRanks>,
    ) -> Self {
        let where_ = format!("data-parallel ranks on {}", checkpoints.nodes.join(", "));
        Self::new(RankGroup {
            ranks: ranks
                .into_iter()
                .map(|r| Box::new(OnWorker(r)) as Box<dyn TrainerBackend>)
                .collect(),
            steps_per_rollout: steps_per_rollout.max(1),
            warned_uneven: AtomicBool::new(false),
            kind: RankGroupKind::Zero2,
            checkpoints: RankCheckpoints::OnWorkers(checkpoints),
            where_,
            regroup: Some(regroup),
        })
    }
}

/// Starts one trainer rank actor per rank of `devices`, all at once (building a rank
/// waits for the others). `options.device` is replaced by each rank's device; `kind`
/// picks each rank's constructor.
pub async fn spawn_ranks(
    options: TrainerOptions,
    devices: &RankDevices,
    kind: RankGroupKind,
) -> anyhow::Result<Vec<ActorRef<TrainerMsg>>> {
    let world = devices.world();
    let comms: Vec<(Box<dyn Collective>, Device)> = match devices {
        RankDevices::Cpu(_) => ThreadCollective::group(world)
            .with_context(|| format!("[trainer] data_parallel_ranks = {world}"))?
            .into_iter()
            .map(|c| (Box::new(c) as Box<dyn Collective>, Device::Cpu))
            .collect(),
        RankDevices::Gpus(gpus) => nccl_group(gpus.clone()).await?,
    };
    let tasks: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, (comm, device))| {
            let args = TrainerRankArgs {
                options: TrainerOptions {
                    device,
                    ..options.clone()
                },
                comm,
                bucket_numel: DEFAULT_BUCKET_NUMEL,
                kind,
                checkpoint_owner: None,
            };
            // A task per rank: each builds its trainer in block_in_place and waits in
            // the group's first collective for the others.
            tokio::spawn(async move {
                Actor::spawn(Some(format!("trainer-rank-{rank}")), TrainerRankActor, args).await
            })
        })
        .collect();
    let mut ranks = Vec::new();
    let mut first_error = None;
    for (rank, task) in join_all(tasks).await.into_iter().enumerate() {
        match task {
            Ok(Ok((actor, _))) => ranks.push(actor),
            Ok(Err(e)) => {
                first_error.get_or_insert_with(|| format!("starting trainer rank {rank}: {e}"));
            }
            Err(e) => {
                first_error.get_or_insert_with(|| format!("starting trainer rank {rank}: {e}"));
            }
        }
    }
    if let Some(e) = first_error {
        for r in &ranks {
            r.stop(None);
        }
        anyhow::bail!("{e}");
    }
    let (zero_stage, context_parallel_size) = match kind {
        RankGroupKind::Zero2 => (2, 1),
        RankGroupKind::Zero3 => (3, 1),
        RankGroupKind::ContextParallel => (2, world),
    };
    info!(
        world,
        devices = ?devices,
        zero_stage,
        context_parallel_size,
        grad_reduce_in_bf16 = options.algo.grad_reduce_in_bf16,
        "trainer ranks started"
    );
    Ok(ranks)
}

/// Joins an in-process NCCL group over `gpus`, one rank per GPU: the unique id made
/// here, every rank joining at once on a thread of its own.
async fn nccl_group(gpus: Vec<u32>) -> anyhow::Result<Vec<(Box<dyn Collective>, Device)>> {
    let shown = format!("[trainer] gpus = {gpus:?}");
    // Made for rank 0's GPU: this process joins every rank.
    let id = NcclCollective::unique_id_on(gpus.first().copied().unwrap_or(0) as usize)
        .with_context(|| format!("{shown}: data-parallel ranks need NCCL"))?;
    let world = gpus.len();
    let joined = tokio::task::spawn_blocking(move || {
        std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter()
                .enumerate()
                .map(|(rank, &gpu)| {
                    let id = &id;
                    s.spawn(move || NcclCollective::new(rank, world, id, gpu as usize))
                })
                .collect();
            handles
                .into_iter()
                .zip(gpus.iter())
                .map(|(h, &gpu)| {
                    let comm = h
                        .join()
                        .map_err(|_| anyhow::anyhow!("joining NCCL on GPU {gpu} panicked"))?
                        .with_context(|| format!("joining NCCL on GPU {gpu}"))?;
                    Ok((
                        Box::new(comm) as Box<dyn Collective>,
                        Device::Cuda(gpu as usize),
                    ))
                })
                .collect::<anyhow::Result<Vec<_>>>()
        })
    })
    .await
    .context("joining the NCCL group")?;
    joined.with_context(|| shown.clone())
}

/// The trainer as a group of ranks, in this process or on workers: every call goes to
/// every rank at once (their collectives pair up), rank 0 answers for the group.
struct RankGroup {
    ranks: Vec<Box<dyn TrainerBackend>>,
    steps_per_rollout: usize,
    /// Whether the log already said that a batch could not be split exactly.
    warned_uneven: AtomicBool,
    /// ZeRO-3: no rank holds the weights whole, reading them is a collective; context
    /// parallel: every rank trains on the whole batch.
    kind: RankGroupKind,
    /// Where a checkpoint's parts go: one shared directory, or each worker's disk.
    checkpoints: RankCheckpoints,
    /// Where the group runs, for its errors.
    where_: String,
    /// How the whole group is re-created after a rank was lost (ranks on workers); local
    /// ranks live and die with the driver process.
    regroup: Option<Arc<dyn RestartRanks>>,
}

/// Re-creates every rank of a group on workers as a new group with its initial weights
/// (crate::remote_ranks): the one way a lost rank comes back, called by the driver's
/// trainer recovery through [`TrainerBackend::restart`] like a lone remote trainer's.
#[async_trait::async_trait]
pub trait RestartRanks: Send + Sync {
    /// Stops the surviving ranks (ending their collective waits), waits up to `timeout`
    /// for every rank's worker to answer, opens a new group and spawns every rank in it.
    async fn restart(&self, timeout: Duration) -> anyhow::Result<()>;
}

impl RankGroup {
    /// The whole weights under ZeRO-3: every rank gathers them at once (a collective
    /// that one rank alone would wait in forever) and rank 0's copy is kept.
    async fn gathered(&self) -> Result<NamedTensors, TrainerCallError> {
        Ok(every_rank(self.ranks.iter().map(|r| r.gather_weights()))
            .await?
            .swap_remove(0))
    }
}

/// How a rank's error begins when another rank failed first: that rank's error says
/// why, so it is the one reported.
const PEER_FAILED: &str = "another data-parallel rank";

/// Runs one call on every rank at once; their results in rank order, or the first error
/// ([`first_error`]). A rank whose worker was lost ends the wait at once: the others may
/// be waiting for it in a collective, which NCCL never ends (the store group only after
/// its timeout), so their answers are not awaited and the run hears why now.
async fn every_rank<T, F>(calls: impl IntoIterator<Item = F>) -> Result<Vec<T>, TrainerCallError>
where
    F: std::future::Future<Output = Result<T, TrainerCallError>>,
{
    let mut pending: FuturesUnordered<_> = calls
        .into_iter()
        .enumerate()
        .map(|(rank, call)| async move { (rank, call.await) })
        .collect();
    let mut results: Vec<Option<Result<T, TrainerCallError>>> =
        (0..pending.len()).map(|_| None).collect();
    let world = pending.len();
    while let Some((rank, result)) = pending.next().await {
        if let Err(TrainerCallError::Lost { addr, reason }) = result {
            // The log then says which rank went with its worker.
            return Err(TrainerCallError::Lost {
                addr,
                reason: format!("data-parallel rank {rank} of {world}: {reason}"),
            });
        }
        results[rank] = Some(result);
    }
    first_error(results.into_iter().flatten().collect())
}

/// The first error of the ranks' results, preferring one that says why over one that
/// only says another rank failed.
fn first_error<T>(results: Vec<Result<T, TrainerCallError>>) -> Result<Vec<T>, TrainerCallError> {
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        return Ok(ok);
    }
    let pick = errors
        .iter()
        .position(|e| !e.to_string().contains(PEER_FAILED))
        .unwrap_or(0);
    Err(errors.swap_remove(pick))
}

impl RankGroup {
    fn failed(&self, message: impl ToString) -> TrainerCallError {
        TrainerCallError::Failed {
            addr: self.where_.clone(),
            message: message.to_string(),
        }
    }
}

#[async_trait::async_trait]
impl TrainerBackend for RankGroup {
    async fn train_step(
        &self,
        step: u64,
        batch: TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerCallError> {
        let world = self.ranks.len();
        if self.kind == RankGroupKind::ContextParallel {
            // One context-parallel group: every rank takes the whole batch (the trainer
            // splits each packed row's tokens) and rank 0 reports the step.
            let results = every_rank(
                self.ranks
                    .iter()
                    .map(|rank| rank.train_step(step, batch.clone())),
            )
            .await;
            return Ok(results?.swap_remove(0));
        }
        let (shares, exact) = split_batch(batch, world, self.steps_per_rollout)
            .map_err(|e| self.failed(format!("training step {step}: {e}")))?;
        if !exact && !self.warned_uneven.swap(true, Ordering::Relaxed) {
            warn!(
                world,
                steps_per_rollout = self.steps_per_rollout,
                "the step's samples do not split evenly over the ranks and optimizer steps: \
                 each optimizer step still uses global counts, but takes other samples than \
                 one trainer would (use a batch that is a multiple of ranks × \
                 num_steps_per_rollout)"
            );
        }
        let results = every_rank(
            self.ranks
                .iter()
                .zip(shares)
                .map(|(rank, share)| rank.train_step(step, share)),
        )
        .await;
        Ok(results?.swap_remove(0))
    }

    async fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerCallError> {
        // A collective: every rank writes into its directory (its owner the weights and
        // state, each rank its optimizer shard) and the owner moves it into place once
        // all are written.
        let target = self.checkpoints.save_target(dir);
        every_rank(
            self.ranks
                .iter()
                .map(|rank| rank.save_checkpoint(&target, step)),
        )
        .await?;
        self.checkpoints
            .after_save(dir, step)
            .map_err(|e| self.failed(e))
    }

    async fn load_checkpoint(&self, dir: &Path) -> Result<u64, TrainerCallError> {
        let source = self
            .checkpoints
            .load_target(dir, self.ranks.len())
            .map_err(|e| self.failed(e))?;
        let loaded = every_rank(self.ranks.iter().map(|rank| rank.load_checkpoint(&source))).await;
        Ok(loaded?[0])
    }

    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError> {
        match self.weight_parts().await? {
            // ZeRO-3: a layer at a time onto the host.
            Some(parts) => super::weight_parts::weight_set(parts).await,
            // Every rank ends each step with the same weights (ZeRO-2 and context
            // parallel replicate them); reading rank 0's is no collective.
            None => self.ranks[0].weight_set().await,
        }
    }

    /// ZeRO-3: every rank visits its weights at once, rank 0's groups handed on one at
    /// a time (super::weight_parts); the other kinds replicate the weights and are read
    /// whole from rank 0.
    async fn weight_parts(
        &self,
    ) -> Result<Option<manta_weight_sync::TrainerParts>, TrainerCallError> {
        if self.kind != RankGroupKind::Zero3 {
            return Ok(None);
        }
        let not_here = || TrainerCallError::Failed {
            addr: "the driver process".into(),
            message: "ZeRO-3 weights are read in parts from ranks in this process only".into(),
        };
        // Rank 0 alone: the layout needs no collective.
        let layout = self.ranks[0].weight_groups().await?.ok_or_else(not_here)?;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut visits = Vec::with_capacity(self.ranks.len());
        for (r, rank) in self.ranks.iter().enumerate() {
            let visitor = if r == 0 {
                super::weight_parts::forwarding(tx.clone())
            } else {
                super::weight_parts::discarding()
            };
            // Ranks of one group are all in this process or all elsewhere: rank 0
            // answers first, before any rank waits in a gather.
            let Some(visit) = rank.visit_weights(visitor) else {
                return Err(not_here());
            };
            visits.push(visit);
        }
        Ok(Some(super::weight_parts::group(layout, rx, visits)))
    }

    /// ZeRO-3: the whole model gathered on rank 0 at once (weight sync reads
    /// [`TrainerBackend::weight_parts`] instead; this is for callers that need every
    /// tensor together).
    async fn tensors(&self) -> Result<Option<NamedTensors>, TrainerCallError> {
        if self.kind != RankGroupKind::Zero3 {
            return self.ranks[0].tensors().await;
        }
        self.gathered().await.map(Some)
    }

    /// Rank 0's worker (ranks on workers): it roots the weight sync to the engines.
    fn worker_addr(&self) -> Option<&str> {
        self.ranks[0].worker_addr()
    }

    /// One rank alone cannot rejoin (its group's NCCL id or store died with it), so the
    /// whole group is re-created; the caller restores the last checkpoint after.
    async fn restart(&self, timeout: Duration) -> anyhow::Result<()> {
        match &self.regroup {
            Some(regroup) => regroup.restart(timeout).await,
            None => anyhow::bail!("only data-parallel ranks on workers can be re-created"),
        }
    }

    async fn shutdown(&self) {
        for rank in &self.ranks {
            rank.shutdown().await;
        }
    }
}

/// Cuts a global batch into one share per rank so that the ranks' step equals one
/// trainer's: with `steps` optimizer steps per rollout the trainer takes chunk `k` of
/// its samples for step `k`, so each global chunk is split over the ranks and rank `r`'s
/// share is its piece of every chunk, in order. The flag says whether each rank's own
/// chunks then fall exactly on those pieces (always with one step; with more, when the
/// batch divides evenly); when not, the shares are still valid, only grouped into
/// optimizer steps differently than one trainer would.
pub fn split_batch(
    batch: TrainBatch,
    world: usize,
    steps: usize,
) -> anyhow::Result<(Vec<TrainBatch>, bool)> {
    let n = batch.samples.len();
    let steps = steps.max(1);
    if batch.advantages.len() != n {
        anyhow::bail!("{n} samples but {} advantages", batch.advantages.len());
    }
    if n < world * steps {
        anyhow::bail!(
            "{n} samples cannot be shared by {world} data-parallel ranks taking {steps} \
             optimizer step(s) each: every rank needs at least {steps}, so the step needs \
             at least {}",
            world * steps
        );
    }
    // pieces[r][k]: rank r's sample range of global chunk k.
    let chunk = |k: usize, len: usize| (k * len / steps)..((k + 1) * len / steps);
    let pieces: Vec<Vec<std::ops::Range<usize>>> = (0..world)
        .map(|r| {
            (0..steps)
                .map(|k| {
                    let c = chunk(k, n);
                    let m = c.len();
                    (c.start + r * m / world)..(c.start + (r + 1) * m / world)
                })
                .collect()
        })
        .collect();
    let exact = pieces.iter().all(|mine| {
        let total: usize = mine.iter().map(|p| p.len()).sum();
        mine.iter()
            .enumerate()
            .all(|(k, p)| chunk(k, total).len() == p.len())
    });
    let TrainBatch {
        samples,
        advantages,
        global_samples,
    } = batch;
    let shares = pieces
        .iter()
        .map(|mine| TrainBatch {
            samples: mine
                .iter()
                .flat_map(|p| samples[p.clone()].iter().cloned())
                .collect(),
            advantages: mine
                .iter()
                .flat_map(|p| advantages[p.clone()].iter().copied())
                .collect(),
            global_samples,
        })
        .collect();
    Ok((shares, exact))
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_core::{EpisodeMetadata, Sample, SampleStatus};

    fn batch(n: usize) -> TrainBatch {
        let samples = (0..n as u64)
            .map(|id| Sample {
                id,
                group_index: 0,
                index: id as u32,
                tokens: vec![1, 2, 3],
                response_length: 1,
                loss_mask: vec![1],
                rollout_log_probs: vec![-1.0],
                reward: 0.0,
                status: SampleStatus::Completed,
                weight_version: 0,
                metadata: EpisodeMetadata::default(),
                routed_experts: None,
            })
            .collect();
        TrainBatch {
            samples,
            advantages: (0..n).map(|i| i as f64).collect(),
            global_samples: n,
        }
    }

    fn ids(b: &TrainBatch) -> Vec<u64> {
        b.samples.iter().map(|s| s.id).collect()
    }

    #[test]
    fn one_optimizer_step_takes_contiguous_shares() {
        let (shares, exact) = split_batch(batch(7), 2, 1).unwrap();
        assert!(exact);
        assert_eq!(ids(&shares[0]), vec![0, 1, 2]);
        assert_eq!(ids(&shares[1]), vec![3, 4, 5, 6]);
        assert_eq!(shares[1].advantages, vec![3.0, 4.0, 5.0, 6.0]);
        assert!(shares.iter().all(|s| s.global_samples == 7));
    }

    #[test]
    fn each_optimizer_step_is_split_over_the_ranks() {
        // Two optimizer steps on 8 samples: step 0 takes 0..4, step 1 takes 4..8, so
        // rank 0 holds [0, 1 | 4, 5] and rank 1 [2, 3 | 6, 7].
        let (shares, exact) = split_batch(batch(8), 2, 2).unwrap();
        assert!(exact);
        assert_eq!(ids(&shares[0]), vec![0, 1, 4, 5]);
        assert_eq!(ids(&shares[1]), vec![2, 3, 6, 7]);
        // 9 samples: chunks of 4 and 5; rank 0 gets 2 + 2, rank 1 gets 2 + 3, and
        // rank 1's own halving (2 | 3) falls on its pieces.
        let (_, exact) = split_batch(batch(9), 2, 2).unwrap();
        assert!(exact);
        let (shares, exact) = split_batch(batch(10), 2, 3).unwrap();
        assert!(exact);
        assert_eq!(ids(&shares[0]), vec![0, 3, 6, 7]);
        // 15 samples, 2 steps over 5 ranks: chunks 7 and 8; rank 2 gets 2 of the first
        // and 1 of the second, but halves its 3 samples as 1 | 2.
        let (shares, exact) = split_batch(batch(15), 5, 2).unwrap();
        assert!(!exact);
        assert_eq!(ids(&shares[2]), vec![2, 3, 10]);
        let mut all: Vec<u64> = shares.iter().flat_map(ids).collect();
        all.sort();
        assert_eq!(all, (0..15).collect::<Vec<_>>());
    }

    type Call =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<u32, TrainerCallError>> + Send>>;

    #[tokio::test]
    async fn a_lost_rank_ends_the_wait_for_the_others() {
        // Rank 0 waits forever (in a collective for rank 1, say); rank 1's worker is gone.
        let calls: Vec<Call> = vec![
            Box::pin(futures::future::pending()),
            Box::pin(async {
                Err(TrainerCallError::Lost {
                    addr: "b:1".into(),
                    reason: "no heartbeat answer".into(),
                })
            }),
        ];
        let result = tokio::time::timeout(Duration::from_secs(10), every_rank(calls))
            .await
            .expect("the lost rank ends the wait");
        // The error names the rank that went, for the driver's recovery line.
        assert!(
            matches!(&result, Err(TrainerCallError::Lost { addr, reason })
                if addr == "b:1" && reason == "data-parallel rank 1 of 2: no heartbeat answer"),
            "{result:?}"
        );
        // Failures are all awaited, and the one that says why is reported.
        let failed = |message: &str| TrainerCallError::Failed {
            addr: "a:1".into(),
            message: message.into(),
        };
        let (peer, cause) = (
            failed(&format!("{PEER_FAILED} failed to write its shard")),
            failed("disk full"),
        );
        let calls: Vec<Call> = vec![
            Box::pin(async { Err(peer) }),
            Box::pin(async { Err(cause) }),
            Box::pin(async { Ok(3) }),
        ];
        let err = every_rank(calls).await.unwrap_err().to_string();
        assert!(err.contains("disk full"), "{err}");
        let calls: Vec<Call> = vec![Box::pin(async { Ok(1) }), Box::pin(async { Ok(2) })];
        assert_eq!(every_rank(calls).await.unwrap(), vec![1, 2]);
    }

    #[test]
    fn too_few_samples_for_the_ranks_is_an_error() {
        let e = split_batch(batch(3), 2, 2).unwrap_err().to_string();
        assert!(e.contains("3 samples") && e.contains("at least 4"), "{e}");
    }
}
