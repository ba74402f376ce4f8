//! The trainer: model + optimizer + the GRPO step, independent of actor plumbing so
//! it can be driven directly in tests and benchmarks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use manta_core::Sample;
use manta_model::{
    Attention, CausalLm, DeferredLogprobs, LayerHooks, ModelConfig, ModelError, NoHooks, Recompute,
    RecomputeError,
};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};
use tracing::info;

use crate::batch::{micro_batches, MicroBatchLayout};
use crate::context_parallel::{CpComm, CpLocal};
use crate::data_parallel::metrics::all_reduce_metrics;
use crate::data_parallel::zero::OUTER_BUCKET;
use crate::data_parallel::{
    Collective, CollectiveError, PrefetchStats, RankOptimizer, ShardBytes, ZeroAdamW,
};
use crate::loss::{
    policy_objective, sample_mean_weights, token_mean_weights, ClipRange, LossOptions, TokenBatch,
};
use crate::memory_plan;
use crate::optimizer::{AdamW, AdamWConfig};
use crate::profile::{self, Phase, StepProfile};
use crate::schedule::LrSchedule;
use crate::torch_trace::StepTrace;

/// How a data-parallel group shards the training state.
enum Sharding {
    /// Optimizer state and reduced gradients (buckets of this many elements).
    Zero2 { bucket_numel: usize },
    /// Parameters too, a decoder layer per shard group.
    Zero3,
}

/// Weights by HF name, as handed to weight sync.
pub type NamedTensors = Vec<(String, Tensor)>;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid training batch: {0}")]
    Batch(String),
    #[error("trainer configuration: {0}")]
    Config(String),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error(transparent)]
    Recompute(#[from] RecomputeError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    DoesNotFit(#[from] crate::memory_plan::DoesNotFit),
}

/// Everything the trainer needs to start.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// HF model directory (config.json; weights optional).
    pub model_dir: PathBuf,
    /// Seeds random init when the directory has no weights.
    pub seed: u64,
    pub device: Device,
    pub adam: AdamWConfig,
    pub clip: ClipRange,
    pub clip_grad: f64,
    /// Rollout temperature: log-probs are computed under logits / temperature, as the engine samples.
    pub temperature: f64,
    /// Token budget of a micro-batch (`--max-tokens-per-gpu`), as `layout` counts tokens.
    pub max_tokens_per_gpu: usize,
    /// Packed sequences (the default) or padded rows.
    pub layout: MicroBatchLayout,
    /// `--bf16`: bf16 weights and compute with fp32 master weights and fp32 AdamW
    /// state; `None` picks bf16 on CUDA and fp32 on the CPU.
    pub bf16: Option<bool>,
    /// Use the engine's log-probs as old_logp (else the current weights', i.e. ratio 1).
    pub use_rollout_logprobs: bool,
    /// Rows per chunk when computing token log-probs.
    pub logprob_chunk: i64,
    /// Layers recomputed in the backward pass instead of keeping their activations
    /// (Megatron's `--recompute-granularity full --recompute-method uniform|block
    /// --recompute-num-layers N`); `None` keeps every activation. The cookbook's
    /// `gradient_checkpointing = true` is [`Recompute::EVERY_LAYER`].
    pub recompute: Option<Recompute>,
    /// Loss options, LR schedule, updates per rollout, reference model.
    pub algo: AlgoOptions,
}

/// slime's algorithm flags beyond PPO-clip (REFERENCE.md §4); the default is plain GRPO
/// with one update per rollout at a constant learning rate.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AlgoOptions {
    pub loss: LossOptions,
    /// `None`: `adam.lr` throughout.
    pub lr_schedule: Option<LrSchedule>,
    /// Optimizer steps per rollout (`--num-steps-per-rollout`); 0 counts as 1.
    pub num_steps_per_rollout: usize,
    /// Frozen KL reference (`--ref-load`); `None`: the initial weights.
    pub ref_load: Option<PathBuf>,
    /// Miles' `--true-on-policy-mode`: the forward's attention through the batch-invariant
    /// kernel the engine also runs in this mode, so the trainer's log-probs equal the
    /// rollout's (`train/train_rollout_logprob_abs_diff` ~0). CUDA bf16 only.
    #[serde(default)]
    pub true_on_policy: bool,
    /// Megatron's `--moe-aux-loss-coeff`: the weight of each sparse layer's switch
    /// load-balancing loss in the backward pass (mixture-of-experts models; 0 adds none).
    #[serde(default)]
    pub moe_aux_loss_coeff: f64,
    /// Megatron's `--grad-reduce-in-bf16`: data-parallel ranks (ZeRO-2, ZeRO-3, context
    /// parallel) reduce-scatter the gradients in bf16 and keep their reduced-gradient
    /// shard in bf16 (accumulated over micro-batches in bf16), widened to fp32 a bucket
    /// at a time by the AdamW update: half the gradient shard's memory for bf16 rounding
    /// of the reduced gradients. bf16 weights and two ranks or more; refused otherwise.
    #[serde(default)]
    pub grad_reduce_in_bf16: bool,
}

/// One step's data for this rank.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub samples: Vec<Sample>,
    /// One advantage per sample.
    pub advantages: Vec<f64>,
    /// Samples across all ranks, for the per-sample mean.
    pub global_samples: usize,
}

/// What a checkpoint records besides weights and optimizer moments.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub step: u64,
    pub optimizer_steps: u64,
}

/// Held while a trainer seeds libtorch and draws its initial weights (Trainer::build).
static RANDOM_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Model, optimizer and step counter of one trainer rank.
pub struct Trainer {
    vs: nn::VarStore,
    model: CausalLm,
    /// The whole AdamW on one rank; this rank's ZeRO-2 shard in data parallel.
    optimizer: RankOptimizer,
    opts: TrainerOptions,
    /// Frozen reference policy, kept only with `use_kl_loss`.
    reference: Option<(nn::VarStore, CausalLm)>,
    /// `MANTA_INJECT_OOM_TOKENS`: fault injection for the out-of-memory recovery.
    inject_oom_tokens: Option<usize>,
    /// The optimizer's group is a context-parallel group ([`Trainer::new_context_parallel`]).
    context_parallel: bool,
    /// A data-parallel rank writing the weights and trainer_state.json of a checkpoint
    /// and moving it into place: rank 0 (`None`) when every rank sees one directory, the
    /// first rank of each node when nodes keep their own ([`Trainer::set_checkpoint_owner`]).
    checkpoint_owner: Option<bool>,
    /// Steps begun by this trainer: `MANTA_TORCH_PROFILE_STEP` counts them from 1.
    steps_begun: u64,
}

/// A micro-batch laid out for one forward pass: only loss-mask-1 tokens are gathered.
///
/// Packed (the default): the samples are concatenated into one row [1, sum of lengths]
/// with positions restarting at each sample and attention kept inside each sample
/// ([`Attention::Segments`]), so no padding is computed. Padded: one row per sample,
/// right-padded to the longest, with a key mask.
struct Packed {
    rows: i64,
    width: i64,
    input: Tensor,
    /// Padded layout: [rows, width], 1 on real tokens.
    key_mask: Option<Tensor>,
    /// Packed layout: each sample's length, in row order.
    lengths: Vec<i64>,
    positions: Tensor,
    /// Flat index of the hidden state predicting each trained token.
    gather: Tensor,
    targets: Tensor,
    /// Trained tokens per sample.
    masks: Vec<Vec<f32>>,
    segment: Tensor,
    counts: Tensor,
}

impl Packed {
    fn new(samples: &[Sample], device: Device, pack: bool) -> Self {
        let total: usize = samples.iter().map(|s| s.tokens.len()).sum();
        let longest = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let (rows, width) = if pack {
            (1, total)
        } else {
            (samples.len(), longest)
        };
        let mut ids = vec![0i64; rows * width];
        let mut key_mask = vec![0i64; rows * width];
        let mut positions = vec![0i64; rows * width];
        let (mut gather, mut targets, mut segment, mut counts) = (vec![], vec![], vec![], vec![]);
        let mut masks = Vec::with_capacity(samples.len());
        let mut offset = 0;
        for (b, s) in samples.iter().enumerate() {
            let base = if pack { offset } else { b * width };
            offset += s.tokens.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                ids[base + j] = t as i64;
                key_mask[base + j] = 1;
                positions[base + j] = j as i64;
            }
            let prompt = s.prompt_length();
            let mut mask = Vec::new();
            for (k, &m) in s.loss_mask.iter().enumerate() {
                if m == 1 {
                    let pos = prompt + k;
                    gather.push((base + pos - 1) as i64);
                    targets.push(s.tokens[pos] as i64);
                    segment.push(b as i64);
                    mask.push(1.0f32);
                }
            }
            counts.push(mask.len() as f32);
            masks.push(mask);
        }
        let (rows, width) = (rows as i64, width as i64);
        let key_mask =
            (!pack).then(|| Tensor::from_slice(&key_mask).view([rows, width]).to(device));
        let positions = if pack {
            Tensor::from_slice(&positions)
                .view([rows, width])
                .to(device)
        } else {
            // Padding positions keep counting, as they always did (they are masked out).
            Tensor::arange(width, (Kind::Int64, device))
                .unsqueeze(0)
                .expand([rows, width], false)
        };
        Self {
            rows,
            width,
            input: Tensor::from_slice(&ids).view([rows, width]).to(device),
            key_mask,
            lengths: if pack {
                samples.iter().map(|s| s.tokens.len() as i64).collect()
            } else {
                Vec::new()
            },
            positions,
            gather: Tensor::from_slice(&gather).to(device),
            targets: Tensor::from_slice(&targets).to(device),
            masks,
            segment: Tensor::from_slice(&segment).to(device),
            counts: Tensor::from_slice(&counts).to(device),
        }
    }

    /// How the rows attend: within each sample of the packed row, or causally with the
    /// padding masked.
    fn attention(&self) -> Attention<'_> {
        match &self.key_mask {
            Some(key_mask) => Attention::Causal {
                key_mask: Some(key_mask),
            },
            None => Attention::Segments {
                lengths: &self.lengths,
            },
        }
    }

    fn tokens(&self) -> i64 {
        self.targets.size()[0]
    }

    /// Log-probs of the trained tokens under `model`, without autograd; `hooks` gather
    /// ZeRO-3's layers ([`NoHooks`] otherwise).
    fn logprobs<H: LayerHooks>(
        &self,
        model: &CausalLm,
        hooks: &mut H,
        temperature: f64,
        chunk: i64,
    ) -> Result<Tensor, H::Error> {
        tch::no_grad(|| {
            let hidden = model.forward_hidden_hooked(
                &self.input,
                &self.positions,
                &self.attention(),
                hooks,
            )?;
            let selected = hidden
                .view([self.rows * self.width, -1])
                .index_select(0, &self.gather);
            Ok(
                manta_model::token_logprobs(model, &selected, &self.targets, temperature, chunk)
                    .0
                    .to_kind(Kind::Float),
            )
        })
    }
}

/// Never fails: the unhooked passes' result.
fn infallible<T>(r: Result<T, std::convert::Infallible>) -> T {
    match r {
        Ok(t) => t,
        Err(never) => match never {},
    }
}

/// A one-row, two-token input for ZeRO-3's filler passes.
fn filler_input(device: Device) -> (Tensor, Tensor) {
    let ids = Tensor::zeros([1, 2], (Kind::Int64, device));
    let positions = Tensor::arange(2, (Kind::Int64, device)).unsqueeze(0);
    (ids, positions)
}

/// On a GPU: logs what a rank will hold and refuses, before anything is allocated, a
/// run whose weights and optimizer state alone exceed the GPU (crate::memory_plan).
fn check_memory(
    cfg: &ModelConfig,
    opts: &TrainerOptions,
    bf16: bool,
    ranks: usize,
    zero_stage: u8,
) -> Result<(), TrainerError> {
    let Device::Cuda(index) = opts.device else {
        return Ok(());
    };
    let inputs = memory_plan::MemoryInputs {
        tokens_per_gpu: opts.max_tokens_per_gpu,
        data_parallel: ranks,
        zero_stage,
        bf16,
        grad_reduce_in_bf16: opts.algo.grad_reduce_in_bf16,
        recompute: opts.recompute,
        reference: opts.algo.loss.use_kl_loss,
        logprob_chunk: opts.logprob_chunk.max(1) as usize,
    };
    let plan = memory_plan::plan(cfg, &inputs);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    info!(
        device = index,
        static_gib = gib(plan.static_bytes()),
        build_gib = gib(plan.build_bytes()),
        activations_gib = gib(plan.activations + plan.logits),
        peak_gib = gib(plan.peak()),
        zero_stage,
        grad_reduce_in_bf16 = inputs.grad_reduce_in_bf16,
        "trainer memory plan per GPU"
    );
    let Ok(capacity) = manta_cuda::total_memory(index) else {
        return Ok(());
    };
    memory_plan::check(&plan, &inputs, capacity as u64)?;
    if plan.peak() > capacity as u64 {
        tracing::warn!(
            peak_gib = gib(plan.peak()),
            capacity_gib = gib(capacity as u64),
            "the planned peak exceeds the GPU: micro-batches that run out of memory are split \
             (slower); lower --max-tokens-per-gpu or recompute more layers (--recompute-num-layers)"
        );
    }
    Ok(())
}

impl Trainer {
    /// Builds the model from `model_dir/config.json` and loads its weights, or draws
    /// random ones from `seed` when the directory has none.
    pub fn new(opts: TrainerOptions) -> Result<Self, TrainerError> {
        Self::build(opts, None)
    }

    /// A data-parallel rank of `comm`'s group (crate::data_parallel): every rank starts
    /// from rank 0's weights, keeps the optimizer state of its shard only (ZeRO-2,
    /// gradients reduced in buckets of `bucket_numel` elements) and ends each step with
    /// the same weights as the others. A group of one is exactly [`Trainer::new`].
    pub fn new_data_parallel(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, TrainerError> {
        Self::build(opts, Some((comm, Sharding::Zero2 { bucket_numel })))
    }

    /// A ZeRO-3 rank (`--zero-stage 3`): as [`Trainer::new_data_parallel`], and the
    /// bf16 (or fp32) parameters are sharded too — one shard group per decoder layer
    /// and one for the embedding, final norm and LM head. A layer's parameters are
    /// all-gathered just before its forward and again before its backward (or kept from
    /// one to the other for layers not recomputed), its gradients reduce-scattered into
    /// this rank's fp32 slice as soon as its backward ends; the embedding, norm and head
    /// are gathered for a whole micro-batch. Unless `MANTA_ZERO3_PREFETCH` is off, the
    /// next layer's all-gather and each layer's reduce-scatter run on a side stream while
    /// the decoder computes (crate::data_parallel::prefetch), with the same results. At
    /// rest a rank holds only its slices.
    /// Every rank runs as many micro-batches (a rank with fewer fills in with passes of
    /// two tokens and no loss), so their collectives pair up. Refused with one rank.
    pub fn new_zero3(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
    ) -> Result<Self, TrainerError> {
        if comm.world_size() < 2 {
            return Err(TrainerError::Config(format!(
                "--zero-stage 3 shards the parameters over the data-parallel ranks and needs \
                 at least two; this group has {}",
                comm.world_size()
            )));
        }
        Self::build(opts, Some((comm, Sharding::Zero3)))
    }

    /// A rank of a context-parallel group (`--context-parallel-size`, crate
    /// `context_parallel`): every rank gets the same batch and holds a share of each
    /// packed micro-batch's tokens; weights are replicated, gradients summed over the
    /// group (ZeRO-2 over it, buckets of `bucket_numel`). The whole group is one CP
    /// group (data parallel × context parallel is not built). Refused with fewer than two
    /// ranks, the padded layout and true on-policy mode (whose kernels it does not use).
    pub fn new_context_parallel(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, TrainerError> {
        let size = comm.world_size();
        let refuse = |why: String| {
            Err(TrainerError::Config(format!(
                "--context-parallel-size {size}: {why}"
            )))
        };
        if size < 2 {
            return refuse("a context-parallel group needs at least two ranks".into());
        }
        if opts.layout != MicroBatchLayout::Packed {
            return refuse(
                "context parallelism splits packed rows; the padded layout is not supported".into(),
            );
        }
        if opts.algo.true_on_policy {
            return refuse("true on-policy mode's batch-invariant attention is not built for context parallelism".into());
        }
        let mut trainer = Self::build(opts, Some((comm, Sharding::Zero2 { bucket_numel })))?;
        trainer.context_parallel = true;
        Ok(trainer)
    }

    /// This micro-batch as this context-parallel rank holds it (None without CP).
    fn cp_local(&self, packed: &Packed) -> Result<Option<CpLocal>, TrainerError> {
        let Some(comm) = self
            .optimizer
            .collective()
            .filter(|_| self.context_parallel)
        else {
            return Ok(None);
        };
        CpLocal::new(
            &packed.lengths,
            &packed.input,
            &packed.positions,
            &packed.gather,
            comm,
            self.opts.device,
        )
        .map(Some)
    }

    fn build(
        opts: TrainerOptions,
        group: Option<(Box<dyn Collective>, Sharding)>,
    ) -> Result<Self, TrainerError> {
        let cfg = ModelConfig::from_file(&opts.model_dir.join("config.json"))?;
        let bf16 = opts.bf16.unwrap_or(opts.device.is_cuda());
        let ranks = group.as_ref().map_or(1, |(comm, _)| comm.world_size());
        let zero_stage = match &group {
            Some((_, Sharding::Zero3)) => 3,
            _ => 2,
        };
        let grad_reduce_in_bf16 = opts.algo.grad_reduce_in_bf16;
        if grad_reduce_in_bf16 && (ranks < 2 || !bf16) {
            let why = if ranks < 2 {
                format!(
                    "it reduces gradients over data-parallel ranks, and this trainer has {ranks} \
                     ([trainer] gpus with two or more GPUs, or data_parallel_ranks = N)"
                )
            } else {
                "it reduces bf16 gradients, and this trainer's weights are fp32 (--bf16 or \
                 [trainer] bf16 = true)"
                    .to_string()
            };
            return Err(TrainerError::Config(format!(
                "--grad-reduce-in-bf16 (or [train] grad_reduce_in_bf16): {why}; or drop the flag"
            )));
        }
        check_memory(&cfg, &opts, bf16, ranks, zero_stage)?;
        // Seeding and drawing the initial weights hold a process-wide lock: data-parallel
        // ranks in one process are built at once, and libtorch's generators (the CPU's,
        // and `manual_seed` reseeds every GPU's) are shared, so another rank reseeding in
        // the middle of rank 0's draws would make its random init differ run to run (and
        // from ranks in separate processes).
        let (mut vs, mut model) = {
            let _init = RANDOM_INIT.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(opts.seed as i64);
            let vs = nn::VarStore::new(opts.device);
            let model = CausalLm::new(&vs.root(), &cfg);
            (vs, model)
        };
        model.set_recompute(opts.recompute)?;
        model.set_moe_aux_loss_coeff(opts.algo.moe_aux_loss_coeff);
        if has_weights(&opts.model_dir) {
            manta_model::load_weights(&mut vs, &opts.model_dir)?;
            info!(dir = %opts.model_dir.display(), "trainer loaded weights");
        } else {
            info!(dir = %opts.model_dir.display(), seed = opts.seed, "no weights in model directory: random init");
        }
        if bf16 {
            // The optimizer keeps fp32 masters of these (AdamW::new).
            vs.bfloat16();
        }
        info!(bf16, device = ?opts.device, "trainer precision");
        if opts.algo.true_on_policy {
            model.set_invariant_attention(true).map_err(|e| {
                TrainerError::Config(format!("true on-policy mode (--true-on-policy-mode): {e}"))
            })?;
            info!("true on-policy mode: attention through the batch-invariant kernel");
        }
        // Before the reference copy: data parallel starts every rank from rank 0's weights.
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        let mut optimizer = match group {
            Some((comm, Sharding::Zero3)) => {
                RankOptimizer::Sharded(Box::new(ZeroAdamW::new_stage3(
                    params,
                    opts.adam,
                    comm,
                    cfg.num_hidden_layers as usize,
                    grad_reduce_in_bf16,
                )?))
            }
            Some((comm, Sharding::Zero2 { bucket_numel })) if comm.world_size() > 1 => {
                RankOptimizer::Sharded(Box::new(ZeroAdamW::new(
                    params,
                    opts.adam,
                    comm,
                    bucket_numel,
                    grad_reduce_in_bf16,
                )?))
            }
            _ => RankOptimizer::Whole(AdamW::new(params, opts.adam)),
        };
        let reference = if opts.algo.loss.use_kl_loss {
            let mut ref_vs = nn::VarStore::new(opts.device);
            let mut ref_model = CausalLm::new(&ref_vs.root(), &cfg);
            ref_model.set_gradient_checkpointing(false);
            if bf16 {
                ref_vs.bfloat16();
            }
            match &opts.algo.ref_load {
                Some(dir) => manta_model::load_weights(&mut ref_vs, dir)?,
                None => ref_vs.copy(&vs)?,
            }
            ref_vs.freeze();
            Some((ref_vs, ref_model))
        } else {
            None
        };
        // ZeRO-3: the reference (a whole model, as in ZeRO-2) has copied rank 0's weights;
        // from here on a rank holds only its slices.
        if let Some(zero) = optimizer.zero3_mut() {
            zero.release_all();
        }
        Ok(Self {
            vs,
            model,
            optimizer,
            opts,
            reference,
            inject_oom_tokens: fault::inject_oom_tokens(),
            context_parallel: false,
            checkpoint_owner: None,
            steps_begun: 0,
        })
    }

    /// Says whether this data-parallel rank writes the weights and trainer_state.json of
    /// its checkpoint directory and renames it into place. Ranks on worker daemons with
    /// no shared disk each see their own node's directory, so the first rank of every
    /// node owns it (and every node's copy can resume that node's ranks); in one process
    /// rank 0 alone does, the default.
    pub fn set_checkpoint_owner(&mut self, owner: bool) {
        self.checkpoint_owner = Some(owner);
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// Changes which layers are recomputed from the next micro-batch on (a benchmark
    /// looks for the fewest that fit in memory); rejects counts outside the model.
    pub fn set_recompute(&mut self, recompute: Option<Recompute>) -> Result<(), TrainerError> {
        self.model.set_recompute(recompute)?;
        self.opts.recompute = recompute;
        Ok(())
    }

    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Whether the model computes in bf16 with fp32 master weights (`--bf16`).
    pub fn is_bf16(&self) -> bool {
        self.optimizer.has_master_weights()
    }

    /// The optimizer's fp32 master weights by HF name (empty in an fp32 run), for
    /// checking that the bf16 weights follow them. In data parallel this gathers the
    /// shards (every rank must call it) and panics if the group fails; see
    /// [`Trainer::try_master_weights`].
    pub fn master_weights(&self) -> NamedTensors {
        self.try_master_weights()
            .unwrap_or_else(|e| panic!("gathering the master weights: {e}"))
    }

    /// [`Trainer::master_weights`], with a failed data-parallel group as an error.
    pub fn try_master_weights(&self) -> Result<NamedTensors, TrainerError> {
        Ok(self.optimizer.master_weights()?)
    }

    /// (rank, world size) of this trainer's data-parallel group; (0, 1) alone.
    pub fn data_parallel_rank(&self) -> (usize, usize) {
        self.optimizer
            .collective()
            .map_or((0, 1), |c| (c.rank(), c.world_size()))
    }

    /// Handles to the current weights by HF name. They alias the trainer's parameters:
    /// read them before the next step (weight sync runs between steps). ZeRO-3: full
    /// copies gathered from the ranks (every rank must call it; panics if the group
    /// fails, see [`Trainer::visit_weights`] for a layer at a time).
    pub fn export_weights(&self) -> NamedTensors {
        self.try_export_weights()
            .unwrap_or_else(|e| panic!("gathering the ZeRO-3 weights: {e}"))
    }

    /// [`Trainer::export_weights`], with a failed ZeRO-3 gather as an error (the
    /// driver's ranks answer weight sync through it).
    pub fn try_export_weights(&self) -> Result<NamedTensors, TrainerError> {
        if let Some(zero) = self.optimizer.zero3() {
            let mut named = NamedTensors::new();
            zero.visit_buckets(|views| {
                named.extend(views);
                Ok(())
            })?;
            named.sort_by(|a, b| a.0.cmp(&b.0));
            return Ok(named);
        }
        let mut named: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.detach()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(named)
    }

    /// The current weights by HF name, a shard group at a time (ZeRO-3: one decoder
    /// layer, or the embedding, final norm and head, gathered from the ranks — every rank
    /// must call it), so a reader (weight sync, HF export) never needs the whole model
    /// on the device beside its shards. Without ZeRO-3, one call with every weight.
    pub fn visit_weights(
        &self,
        visit: impl FnMut(NamedTensors) -> Result<(), TrainerError>,
    ) -> Result<(), TrainerError> {
        match self.optimizer.zero3() {
            Some(zero) => zero.visit_buckets(visit),
            None => {
                let mut visit = visit;
                visit(self.export_weights())
            }
        }
    }

    /// The groups [`Trainer::visit_weights`] hands out, in order, as (name, shape, kind):
    /// known without gathering anything (ZeRO-3: one per shard group; else one group of
    /// every weight, sorted by name).
    pub fn weight_groups(&self) -> Vec<Vec<(String, Vec<i64>, Kind)>> {
        if let Some(zero) = self.optimizer.zero3() {
            return zero.bucket_shapes();
        }
        let mut all: Vec<(String, Vec<i64>, Kind)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.size(), t.kind()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        vec![all]
    }

    /// ZeRO-3: the bytes this rank's parameters hold now (only its slices, which live
    /// in the optimizer, at rest: 0); `None` without ZeRO-3.
    pub fn zero3_parameter_bytes(&self) -> Option<usize> {
        self.optimizer.zero3().map(ZeroAdamW::parameter_bytes)
    }

    /// ZeRO-3: how this rank's layer prefetches went so far (all zero with
    /// `MANTA_ZERO3_PREFETCH` off); `None` without ZeRO-3.
    pub fn zero3_prefetch_stats(&self) -> Option<PrefetchStats> {
        self.optimizer.zero3().map(ZeroAdamW::prefetch_stats)
    }

    /// Bytes of this data-parallel rank's sharded optimizer state now, by what holds
    /// them, and the reduced gradients' kind; `None` for one trainer.
    pub fn shard_bytes(&self) -> Option<(ShardBytes, Kind)> {
        self.optimizer
            .sharded()
            .map(|o| (o.shard_bytes(), o.grad_kind()))
    }

    /// Rejects batches the model cannot train on, naming the sample and field.
    fn check_batch(&self, batch: &TrainBatch) -> Result<(), TrainerError> {
        if batch.samples.len() != batch.advantages.len() {
            return Err(TrainerError::Batch(format!(
                "{} samples but {} advantages",
                batch.samples.len(),
                batch.advantages.len()
            )));
        }
        for s in &batch.samples {
            s.validate().map_err(TrainerError::Batch)?;
            if s.prompt_length() == 0 {
                return Err(TrainerError::Batch(format!(
                    "sample {} has no prompt tokens",
                    s.id
                )));
            }
            let vocab = self.model.config().vocab_size as u32;
            if let Some(bad) = s.tokens.iter().find(|&&t| t >= vocab) {
                return Err(TrainerError::Batch(format!(
                    "sample {}: token id {bad} is outside the vocabulary ({vocab})",
                    s.id
                )));
            }
        }
        Ok(())
    }

    /// The loss gradient at the current weights (every micro-batch, one chunk, no
    /// optimizer step), by HF name, with the step's `train/*` loss metrics. For
    /// checking the gradient against finite differences of `train/loss`. In data
    /// parallel these are this rank's own (unreduced) share.
    pub fn gradients(
        &mut self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, f64>, NamedTensors), TrainerError> {
        if self.optimizer.zero3().is_some() {
            return Err(TrainerError::Config(
                "--zero-stage 3: per-parameter gradients are reduce-scattered as each layer's \
                 backward ends, so Trainer::gradients has none to return"
                    .into(),
            ));
        }
        self.check_batch(batch)?;
        self.optimizer.zero_grad();
        let lengths: Vec<usize> = batch.samples.iter().map(|s| s.tokens.len()).collect();
        let tokens: usize = batch.samples.iter().map(|s| s.generated_tokens()).sum();
        let mut acc = Accumulator::default();
        let ranges = micro_batches(&lengths, self.opts.max_tokens_per_gpu, self.opts.layout);
        let skipped =
            self.run_micro_batches(batch, ranges, None, batch.global_samples, tokens, &mut acc)?;
        acc.oom_skipped += skipped;
        let mut grads: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| {
                let g = t.grad();
                let g = if g.defined() {
                    g.copy()
                } else {
                    t.zeros_like()
                };
                (k, g)
            })
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        self.optimizer.zero_grad();
        let mut metrics: BTreeMap<String, f64> = acc
            .metrics
            .into_iter()
            .map(|(k, v)| (format!("train/{k}"), v))
            .collect();
        metrics.insert("train/oom_skipped".into(), acc.oom_skipped as f64);
        metrics.insert("train/oom_splits".into(), acc.oom_splits as f64);
        Ok((metrics, grads))
    }

    /// One GRPO step: forward each micro-batch, accumulate the clipped policy loss
    /// gradients, clip the global norm, AdamW. Returns `train/*` metrics, and with
    /// `MANTA_TRAINER_PROFILE` on this rank's seconds per phase (crate::profile). With
    /// `MANTA_TORCH_PROFILE` one step is traced (crate::torch_trace).
    pub fn train_step(
        &mut self,
        batch: &TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerError> {
        self.steps_begun += 1;
        let trace = StepTrace::start(
            self.steps_begun,
            self.data_parallel_rank().0,
            self.opts.device,
        );
        let profile = StepProfile::start(self.opts.device);
        let steps = self.opts.algo.num_steps_per_rollout.max(1);
        let checked = self.check_batch(batch).and_then(|()| {
            if steps > batch.samples.len() {
                return Err(TrainerError::Batch(format!(
                    "--num-steps-per-rollout {steps} is more than the {} samples of the step",
                    batch.samples.len()
                )));
            }
            Ok(())
        });
        match self.optimizer.collective() {
            // Every rank learns whether any rank rejected its share, so they all stop
            // here instead of the others waiting in the step's collectives.
            Some(comm) => agree(comm, checked, || {
                TrainerError::Batch(
                    "another data-parallel rank rejected its share of the batch".into(),
                )
            })?,
            None => checked?,
        }
        let lengths: Vec<usize> = batch.samples.iter().map(|s| s.tokens.len()).collect();
        let budget = self.opts.max_tokens_per_gpu;
        // π_old: the weights before this rollout's first update. With one update per
        // rollout the current weights are those, so no extra pass is needed.
        let old = if steps > 1 {
            Some(profile::scoped(Phase::OldLogprobs, || {
                self.old_logprobs(batch, &lengths, budget)
            })?)
        } else {
            None
        };
        let n = batch.samples.len();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut lr = self.opts.adam.lr;
        for k in 0..steps {
            // slime: global batch = samples / num_steps_per_rollout, in order.
            let chunk = (k * n / steps)..((k + 1) * n / steps);
            let mut chunk_global = batch.global_samples * chunk.len() / n.max(1);
            let mut chunk_tokens: usize = batch.samples[chunk.clone()]
                .iter()
                .map(|s| s.loss_mask.iter().filter(|&&m| m == 1).count())
                .sum();
            if let Some(comm) = self
                .optimizer
                .collective()
                .filter(|_| !self.context_parallel)
            {
                // Data parallel: the loss divides by the counts over every rank's chunk
                // (context-parallel ranks all hold the same chunk).
                let mut counts = [chunk.len() as f64, chunk_tokens as f64];
                comm.all_reduce_f64(&mut counts, crate::data_parallel::ReduceOp::Sum)?;
                (chunk_global, chunk_tokens) = (counts[0] as usize, counts[1] as usize);
            }
            self.optimizer.zero_grad();
            let mut acc = Accumulator::default();
            let base = chunk.start;
            let ranges = micro_batches(&lengths[chunk.clone()], budget, self.opts.layout)
                .into_iter()
                .map(|r| (base + r.start)..(base + r.end))
                .collect();
            let skipped = self.run_micro_batches(
                batch,
                ranges,
                old.as_deref(),
                chunk_global,
                chunk_tokens,
                &mut acc,
            )?;
            acc.oom_skipped += skipped;
            if let Some(comm) = self.optimizer.collective() {
                acc.all_reduce(comm)?;
            }
            if let Some(schedule) = &self.opts.algo.lr_schedule {
                self.optimizer
                    .set_lr(schedule.lr_at(self.optimizer.step_count()));
            }
            lr = self.optimizer.config().lr;
            let (clip_grad, optimizer) = (self.opts.clip_grad, &mut self.optimizer);
            let grad_norm = profile::scoped(Phase::Optimizer, || {
                let norm = optimizer.clip_grad_norm(clip_grad)?;
                optimizer.step()?;
                Ok::<f64, CollectiveError>(norm)
            })?;
            self.optimizer.zero_grad();
            *sums.entry("train/grad_norm".into()).or_default() += grad_norm;
            *sums.entry("train/tokens".into()).or_default() += acc.tokens as f64;
            *sums.entry("train/oom_skipped".into()).or_default() += acc.oom_skipped as f64;
            *sums.entry("train/oom_splits".into()).or_default() += acc.oom_splits as f64;
            for (name, v) in acc.metrics {
                *sums.entry(format!("train/{name}")).or_default() += v;
            }
        }
        // Several updates per rollout: each metric is the mean over the updates.
        let mut m: BTreeMap<String, f64> = sums
            .into_iter()
            .map(|(k, v)| {
                let v = if matches!(
                    k.as_str(),
                    "train/tokens" | "train/oom_skipped" | "train/oom_splits"
                ) {
                    v
                } else {
                    v / steps as f64
                };
                (k, v)
            })
            .collect();
        m.insert("train/lr".into(), lr);
        // The step ends when its update is on the device: otherwise the optimizer's
        // queued kernels run inside whatever comes next (a weight sync timed them as
        // ~half its 8B broadcast, and held the engines paused for them).
        if let Device::Cuda(i) = self.opts.device {
            tch::Cuda::synchronize(i as i64);
        }
        if let Some(profile) = profile {
            m.extend(profile.finish());
        }
        if let Some(trace) = trace {
            trace.finish();
        }
        Ok(m)
    }

    /// π_old's log-probs of every sample's trained tokens, one tensor per sample. ZeRO-3
    /// gathers the layers as the passes reach them and pads this rank's passes to the
    /// ranks' most with two-token ones.
    fn old_logprobs(
        &mut self,
        batch: &TrainBatch,
        lengths: &[usize],
        budget: usize,
    ) -> Result<Vec<Tensor>, TrainerError> {
        let ranges = micro_batches(lengths, budget, self.opts.layout);
        let pack = self.opts.layout == MicroBatchLayout::Packed;
        let (device, temperature, chunk) = (
            self.opts.device,
            self.opts.temperature,
            self.opts.logprob_chunk,
        );
        let fillers = self.zero3_fillers(ranges.len())?;
        let mut out = Vec::new();
        for r in ranges {
            let packed = Packed::new(&batch.samples[r], device, pack);
            let cp = self.cp_local(&packed)?;
            let lp = match (cp, self.optimizer.collective()) {
                (Some(cp), Some(comm)) => {
                    cp.logprobs(&self.model, &packed.targets, comm, temperature, chunk)?
                }
                _ => match self.optimizer.zero3_mut() {
                    None => {
                        infallible(packed.logprobs(&self.model, &mut NoHooks, temperature, chunk))
                    }
                    Some(zero) => {
                        zero.gather_bucket(OUTER_BUCKET)?;
                        let mut pass = zero.layer_pass();
                        let lp = packed.logprobs(&self.model, &mut pass, temperature, chunk);
                        let ended = pass.finish();
                        zero.release_bucket(OUTER_BUCKET);
                        let lp = lp?;
                        ended?;
                        lp
                    }
                },
            };
            let sizes: Vec<i64> = packed.masks.iter().map(|m| m.len() as i64).collect();
            out.extend(lp.split_with_sizes(&sizes, 0));
        }
        for _ in 0..fillers {
            self.zero3_filler_pass(false)?;
        }
        Ok(out)
    }

    /// ZeRO-3: how many filler passes this rank adds to its `own` so that every rank
    /// makes as many (0 without ZeRO-3).
    fn zero3_fillers(&self, own: usize) -> Result<usize, TrainerError> {
        let Some(zero) = self.optimizer.zero3() else {
            return Ok(0);
        };
        let mut most = [own as f64];
        zero.collective()
            .all_reduce_f64(&mut most, crate::data_parallel::ReduceOp::Max)?;
        Ok(most[0] as usize - own)
    }

    /// ZeRO-3: a pass over two tokens that adds nothing (no loss, zero gradients) but
    /// makes the same gathers and reduce-scatters as a real micro-batch, for a rank
    /// that has run out of its own; `backward` as a training micro-batch, else as a
    /// log-prob pass.
    fn zero3_filler_pass(&mut self, backward: bool) -> Result<(), TrainerError> {
        profile::scoped(Phase::Filler, || self.run_zero3_filler_pass(backward))
    }

    /// [`Trainer::zero3_filler_pass`]'s pass.
    fn run_zero3_filler_pass(&mut self, backward: bool) -> Result<(), TrainerError> {
        let (ids, positions) = filler_input(self.opts.device);
        let attention = Attention::Causal { key_mask: None };
        let Some(zero) = self.optimizer.zero3_mut() else {
            return Ok(());
        };
        zero.gather_bucket(OUTER_BUCKET)?;
        let mut pass = zero.layer_pass();
        let ran = if backward {
            tch::with_grad(|| {
                self.model
                    .forward_backward_hooked(&ids, &positions, &attention, &mut pass, |h| {
                        h.sum(Kind::Float) * 0.0
                    })
            })
        } else {
            tch::no_grad(|| {
                self.model
                    .forward_hidden_hooked(&ids, &positions, &attention, &mut pass)
            })
        };
        let ended = pass.finish();
        let _ = ran?;
        ended?;
        if backward {
            zero.reduce_bucket(OUTER_BUCKET)?;
        } else {
            zero.release_bucket(OUTER_BUCKET);
        }
        Ok(())
    }

    /// Runs the micro-batches `ranges` (indices into `batch`). A micro-batch that runs
    /// out of memory is split in halves and retried; a single sample that still does not
    /// fit is skipped (it adds nothing to the loss) and counted. Returns the count.
    ///
    /// A micro-batch's metrics count only when it succeeds. Its gradients are added in
    /// one backward pass, so an out-of-memory error raised inside that pass can leave part
    /// of them accumulated (in practice OOM strikes in the forward pass, whose activations
    /// dominate).
    fn run_micro_batches(
        &mut self,
        batch: &TrainBatch,
        ranges: Vec<std::ops::Range<usize>>,
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<usize, TrainerError> {
        if self.optimizer.zero3().is_some() || self.context_parallel {
            return self.run_zero3_micro_batches(
                batch,
                ranges,
                old,
                global_samples,
                global_tokens,
                acc,
            );
        }
        let mut queue: std::collections::VecDeque<_> = ranges.into();
        let mut skipped = 0;
        while let Some(r) = queue.pop_front() {
            let mut local = Accumulator::default();
            let result = self.try_micro_step(
                &batch.samples[r.clone()],
                &batch.advantages[r.clone()],
                old.map(|o| &o[r.clone()]),
                global_samples,
                global_tokens,
                &mut local,
            );
            match result {
                Ok(()) => acc.merge(local),
                Err(TrainerError::OutOfMemory(msg)) if r.len() > 1 => {
                    acc.oom_splits += 1;
                    let mid = r.start + r.len() / 2;
                    tracing::warn!(samples = r.len(), %msg, "micro-batch out of memory: splitting it in halves");
                    queue.push_front(mid..r.end);
                    queue.push_front(r.start..mid);
                }
                Err(TrainerError::OutOfMemory(msg)) => {
                    tracing::warn!(sample = batch.samples[r.start].id, %msg, "a single sample does not fit in memory: skipped");
                    skipped += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(skipped)
    }

    /// [`Trainer::run_micro_batches`] of a ZeRO-3 or context-parallel rank (the latter's
    /// ranks all run the same micro-batches, no fillers): every rank runs as many passes
    /// (fillers after its own), each pass's layers gathered and reduced in the same
    /// order. A micro-batch out of memory is not split (the other ranks are already in
    /// its collectives): the step fails.
    fn run_zero3_micro_batches(
        &mut self,
        batch: &TrainBatch,
        ranges: Vec<std::ops::Range<usize>>,
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<usize, TrainerError> {
        let fillers = self.zero3_fillers(ranges.len())?;
        for r in ranges {
            let mut local = Accumulator::default();
            match self.try_micro_step(
                &batch.samples[r.clone()],
                &batch.advantages[r.clone()],
                old.map(|o| &o[r.clone()]),
                global_samples,
                global_tokens,
                &mut local,
            ) {
                Ok(()) => acc.merge(local),
                Err(TrainerError::OutOfMemory(msg)) => {
                    return Err(TrainerError::OutOfMemory(format!(
                        "{msg} (--zero-stage 3 and --context-parallel-size cannot split a \
                         micro-batch: lower --max-tokens-per-gpu)"
                    )))
                }
                Err(e) => return Err(e),
            }
        }
        for _ in 0..fillers {
            self.zero3_filler_pass(true)?;
        }
        Ok(0)
    }

    /// [`Trainer::micro_step`], with libtorch's out-of-memory panics turned into
    /// [`TrainerError::OutOfMemory`]. `MANTA_INJECT_OOM_TOKENS=N` (tests) makes every
    /// micro-batch whose laid-out size exceeds N tokens fail that way, from inside a
    /// no-grad region as a real one can.
    fn try_micro_step(
        &mut self,
        samples: &[Sample],
        advantages: &[f64],
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<(), TrainerError> {
        let inject = self.inject_oom_tokens.and_then(|limit| {
            let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
            let laid_out = self.opts.layout.cost(&lengths);
            (laid_out > limit).then(|| {
                format!("CUDA out of memory (injected: {laid_out} laid-out tokens > MANTA_INJECT_OOM_TOKENS={limit})")
            })
        });
        // tch::no_grad is not unwind-safe: a panic inside one (an out-of-memory error in a
        // log-prob pass) leaves autograd off for this thread, and the retry would build no
        // graph. The guard puts the mode back as it was on entry whatever happens inside;
        // the step itself runs with autograd on.
        let _restore_grad_mode = tch::no_grad_guard();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tch::with_grad(|| {
                if let Some(msg) = &inject {
                    tch::no_grad(|| panic!("{msg}"));
                }
                // Starts as the micro-batch's layout; micro_step moves on through the
                // passes, and the phase around it resumes when it returns.
                profile::scoped(Phase::Prepare, || {
                    self.micro_step(samples, advantages, old, global_samples, global_tokens, acc)
                })
            })
        }));
        match run {
            Ok(result) => result,
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                if msg.contains("out of memory") {
                    Err(TrainerError::OutOfMemory(msg))
                } else {
                    std::panic::resume_unwind(payload)
                }
            }
        }
    }

    fn micro_step(
        &mut self,
        samples: &[Sample],
        advantages: &[f64],
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<(), TrainerError> {
        let device = self.opts.device;
        let packed = Packed::new(
            samples,
            device,
            self.opts.layout == MicroBatchLayout::Packed,
        );
        if packed.tokens() == 0 {
            // ZeRO-3: the other ranks still expect this pass's collectives.
            return self.zero3_filler_pass(true);
        }
        let loss_opts = self.opts.algo.loss;
        let weights = if loss_opts.calculate_per_token_loss {
            token_mean_weights(&packed.masks, global_tokens)
        } else {
            sample_mean_weights(&packed.masks, global_samples)
        };
        let mut adv = Vec::new();
        let mut rollout_lp = Vec::new();
        for (s, &a) in samples.iter().zip(advantages) {
            for (k, &m) in s.loss_mask.iter().enumerate() {
                if m == 1 {
                    adv.push(a as f32);
                    rollout_lp.push(s.rollout_log_probs[k]);
                }
            }
        }
        let rollout_lp = Tensor::from_slice(&rollout_lp).to(device);
        let adv = Tensor::from_slice(&adv).to(device);
        let w = Tensor::from_slice(&weights).to(device);
        let old = old.map(|o| Tensor::cat(o, 0).to(device));
        let cp = self.cp_local(&packed)?;
        let comm = self.optimizer.collective();
        if self.reference.is_some() {
            profile::enter(Phase::RefLogprobs);
        }
        let ref_logp = match (&self.reference, &cp, comm) {
            (Some((_, model)), Some(cp), Some(comm)) => Some(cp.logprobs(
                model,
                &packed.targets,
                comm,
                self.opts.temperature,
                self.opts.logprob_chunk,
            )?),
            (Some((_, model)), _, _) => Some(infallible(packed.logprobs(
                model,
                &mut NoHooks,
                self.opts.temperature,
                self.opts.logprob_chunk,
            ))),
            (None, _, _) => None,
        };
        let (model, opts) = (&self.model, &self.opts);
        let (rows, width) = (packed.rows, packed.width);
        // Context parallel: every rank computes the same loss; rank 0 alone reports it.
        let report = cp.is_none() || comm.is_some_and(|c| c.rank() == 0);
        // The LM head's backward is deferred and chunked (DeferredLogprobs): the loss
        // path holds one chunk's softmax at a time, the entropy bonus's gradient included.
        let token_terms = |selected: &Tensor, targets: &Tensor| {
            DeferredLogprobs::new(
                model,
                selected,
                targets,
                opts.temperature,
                opts.logprob_chunk,
                loss_opts.entropy_coef != 0.0,
            )
        };
        // forward_backward recomputes each layer in backward when gradient checkpointing
        // is on; the loss also collects the step's metrics.
        let mut objective = |logp: Tensor, entropy: Tensor| {
            let train_logp = old
                .as_ref()
                .map_or_else(|| logp.detach(), |o| o.shallow_clone());
            let old_logp = if opts.use_rollout_logprobs {
                rollout_lp.shallow_clone()
            } else {
                train_logp.shallow_clone()
            };
            let terms = policy_objective(
                &TokenBatch {
                    logp: &logp,
                    entropy: &entropy,
                    old_logp: &old_logp,
                    train_logp: &train_logp,
                    rollout_logp: &rollout_lp,
                    ref_logp: ref_logp.as_ref(),
                    advantages: &adv,
                    weights: &w,
                    segment: &packed.segment,
                    counts: &packed.counts,
                    use_rollout_logprobs: opts.use_rollout_logprobs,
                },
                opts.clip,
                &loss_opts,
            );
            if report {
                for (name, v) in terms.metrics {
                    *acc.metrics.entry(name).or_default() += v;
                }
            }
            // The loss ends the forward pass: what runs after it is the backward.
            profile::enter(Phase::Backward);
            terms.loss
        };
        profile::enter(Phase::Forward);
        if let (Some(cp), Some(comm)) = (&cp, comm) {
            let group = CpComm(comm);
            let _ = self.model.forward_backward_cp(
                &cp.input,
                &cp.positions,
                &cp.row,
                &group,
                |hidden| {
                    if cp.owns_none() {
                        let none = Tensor::zeros([0], (Kind::Float, device));
                        return Ok(objective(cp.full(&none, comm)?, cp.full(&none, comm)?));
                    }
                    let selected = hidden
                        .view([cp.row.local_len(), -1])
                        .index_select(0, &cp.own_at);
                    let terms = token_terms(&selected, &packed.targets.index_select(0, &cp.own));
                    // `full` passes the loss's gradient to this rank's own tokens only.
                    let loss = objective(
                        cp.full(terms.logp(), comm)?,
                        cp.full(terms.entropy(), comm)?,
                    );
                    Ok(terms.backward(&loss))
                },
            )?;
            if report {
                acc.tokens += packed.tokens() as usize;
            }
            return Ok(());
        }
        let loss_fn = |hidden: &Tensor| {
            let selected = hidden
                .view([rows * width, -1])
                .index_select(0, &packed.gather);
            let terms = token_terms(&selected, &packed.targets);
            let loss = objective(
                terms.logp().shallow_clone(),
                terms.entropy().shallow_clone(),
            );
            terms.backward(&loss)
        };
        let attention = packed.attention();
        match self.optimizer.zero3_mut() {
            None => {
                let _ = self.model.forward_backward(
                    &packed.input,
                    &packed.positions,
                    &attention,
                    loss_fn,
                );
            }
            Some(zero) => {
                zero.gather_bucket(OUTER_BUCKET)?;
                let mut pass = zero.layer_pass();
                let ran = self.model.forward_backward_hooked(
                    &packed.input,
                    &packed.positions,
                    &attention,
                    &mut pass,
                    loss_fn,
                );
                let ended = pass.finish();
                let _ = ran?;
                ended?;
                zero.reduce_bucket(OUTER_BUCKET)?;
            }
        }
        acc.tokens += packed.tokens() as usize;
        Ok(())
    }

    /// Writes `dir/` with HF weights (config.json, model.safetensors), optimizer moments
    /// and trainer_state.json. Written to `dir.tmp` first and renamed, so an interrupted
    /// save never leaves a half checkpoint under the final name.
    pub fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerError> {
        if let Some(comm) = self.optimizer.collective() {
            return self.save_sharded_checkpoint(comm, dir, step);
        }
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        manta_model::save_pretrained(&self.vs, self.model.config(), &tmp)?;
        fault::crash_mid_save_if_asked(&tmp, step);
        self.optimizer.save(&tmp)?;
        let state = TrainerState {
            step,
            optimizer_steps: self.optimizer.step_count(),
        };
        let json = serde_json::to_string_pretty(&state).map_err(|e| err(e.to_string()))?;
        std::fs::write(tmp.join("trainer_state.json"), json).map_err(|e| err(e.to_string()))?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// [`Trainer::save_checkpoint`] of a data-parallel rank (every rank calls it, with a
    /// directory they all see): rank 0 writes the weights and trainer_state.json into
    /// `dir.tmp`, every rank its optimizer shard (`optimizer.rank<r>-of-<world>`), and
    /// rank 0 renames the directory once all are written. Where nodes keep their own
    /// disks, each node's owner ([`Trainer::set_checkpoint_owner`]) does rank 0's part
    /// in its node's directory. A failure on any rank fails the save on every rank.
    fn save_sharded_checkpoint(
        &self,
        comm: &dyn Collective,
        dir: &Path,
        step: u64,
    ) -> Result<(), TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let tmp = dir.with_extension("tmp");
        // Rank 0, or the first rank of each node whose disk is its own.
        let owner = self.checkpoint_owner.unwrap_or(comm.rank() == 0);
        // ZeRO-3: every rank takes part in gathering the weights a shard group at a time;
        // the owner keeps host copies to write (the device holds one group beyond its shards).
        let gathered: Option<NamedTensors> = match self.optimizer.zero3() {
            Some(zero) => {
                let mut named = NamedTensors::new();
                zero.visit_buckets(|views| {
                    if owner {
                        named.extend(
                            views
                                .into_iter()
                                .map(|(k, t)| (k, t.to_device(Device::Cpu))),
                        );
                    }
                    Ok(())
                })?;
                Some(named)
            }
            None => None,
        };
        let weights = || -> Result<(), TrainerError> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
            }
            std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
            match &gathered {
                Some(named) => manta_model::save_pretrained_tensors(
                    named.iter().map(|(k, t)| (k.clone(), t.shallow_clone())),
                    self.model.config(),
                    &tmp,
                )?,
                None => manta_model::save_pretrained(&self.vs, self.model.config(), &tmp)?,
            }
            fault::crash_mid_save_if_asked(&tmp, step);
            let state = TrainerState {
                step,
                optimizer_steps: self.optimizer.step_count(),
            };
            let json = serde_json::to_string_pretty(&state).map_err(|e| err(e.to_string()))?;
            std::fs::write(tmp.join("trainer_state.json"), json).map_err(|e| err(e.to_string()))
        };
        let elsewhere = |what: &str| {
            let what = what.to_string();
            move || err(format!("another data-parallel rank failed to {what}"))
        };
        let local = if owner { weights() } else { Ok(()) };
        agree(comm, local, elsewhere("write the weights"))?;
        let local = self.optimizer.save(&tmp).map_err(TrainerError::from);
        agree(comm, local, elsewhere("write its optimizer shard"))?;
        let publish = || -> Result<(), TrainerError> {
            if dir.exists() {
                std::fs::remove_dir_all(dir).map_err(|e| err(e.to_string()))?;
            }
            std::fs::rename(&tmp, dir).map_err(|e| err(e.to_string()))
        };
        let local = if owner { publish() } else { Ok(()) };
        agree(comm, local, elsewhere("move the checkpoint into place"))
    }

    /// Restores weights, optimizer and step from a directory written by
    /// [`Trainer::save_checkpoint`]. Returns the step it was saved at.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64, TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let local = (|| -> Result<TrainerState, TrainerError> {
            let text = std::fs::read_to_string(dir.join("trainer_state.json"))
                .map_err(|e| err(format!("trainer_state.json: {e}")))?;
            let state: TrainerState =
                serde_json::from_str(&text).map_err(|e| err(format!("trainer_state.json: {e}")))?;
            // ZeRO-3's parameters hold nothing at rest: its optimizer shards (the fp32
            // masters) restore them.
            if self.optimizer.zero3().is_none() {
                manta_model::load_weights(&mut self.vs, dir)?;
            }
            Ok(state)
        })();
        // Data parallel: the optimizer's load runs collectives, so every rank first learns
        // whether all ranks read their checkpoint; one unreadable copy stops them all
        // instead of leaving the others waiting in an all-gather (NCCL would hang).
        let state = match self.optimizer.collective() {
            Some(comm) => {
                let (state, status) = match local {
                    Ok(state) => (Some(state), Ok(())),
                    Err(e) => (None, Err(e)),
                };
                agree(comm, status, || {
                    err("another data-parallel rank could not read the checkpoint".into())
                })?;
                state.ok_or_else(|| err("checkpoint state missing after agreement".into()))?
            }
            None => local?,
        };
        self.optimizer
            .load(dir, state.optimizer_steps)
            .map_err(err)?;
        Ok(state.step)
    }
}

/// One phase's outcome agreed by every data-parallel rank: this rank's error, or
/// `elsewhere()` when only another rank failed, so all ranks stop together.
fn agree(
    comm: &dyn Collective,
    local: Result<(), TrainerError>,
    elsewhere: impl FnOnce() -> TrainerError,
) -> Result<(), TrainerError> {
    let mut failed = [f64::from(u8::from(local.is_err()))];
    comm.all_reduce_f64(&mut failed, crate::data_parallel::ReduceOp::Max)?;
    local?;
    if failed[0] > 0.0 {
        return Err(elsewhere());
    }
    Ok(())
}

/// Fault injection for tests, compiled only with the `fault-injection` feature (the test
/// suite's dev-dependencies turn it on; `make run` and release builds never have it).
#[cfg(feature = "fault-injection")]
mod fault {
    use std::path::Path;

    /// `MANTA_INJECT_OOM_TOKENS=N`: micro-batches over N laid-out tokens fail as if out of
    /// memory (the recovery's tests).
    pub(super) fn inject_oom_tokens() -> Option<usize> {
        std::env::var("MANTA_INJECT_OOM_TOKENS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    }

    /// `MANTA_CRASH_MID_SAVE=<step>`: the process dies while saving that step, after
    /// tearing the weights file in half, as a crash or a full disk would leave it.
    pub(super) fn crash_mid_save_if_asked(tmp: &Path, step: u64) {
        let asked = std::env::var("MANTA_CRASH_MID_SAVE")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        if asked != Some(step) {
            return;
        }
        let weights = tmp.join("model.safetensors");
        if let Ok(meta) = std::fs::metadata(&weights) {
            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&weights) {
                let _ = f.set_len(meta.len() / 2);
            }
        }
        eprintln!("MANTA_CRASH_MID_SAVE={step}: crashing in the middle of the save");
        std::process::abort();
    }
}

#[cfg(not(feature = "fault-injection"))]
mod fault {
    pub(super) fn inject_oom_tokens() -> Option<usize> {
        None
    }

    pub(super) fn crash_mid_save_if_asked(_tmp: &std::path::Path, _step: u64) {}
}

/// Whether `dir` holds HF weights (single file or sharded).
pub fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists()
}

#[derive(Default)]
struct Accumulator {
    /// Weighted metric sums over the micro-batches of one optimizer step.
    metrics: BTreeMap<&'static str, f64>,
    tokens: usize,
    /// Samples skipped because they did not fit in memory even alone.
    oom_skipped: usize,
    /// Micro-batches split in halves after running out of memory.
    oom_splits: usize,
}

impl Accumulator {
    /// Sums the ranks' accumulators (data parallel): every rank then reports the step's
    /// global metrics.
    fn all_reduce(&mut self, comm: &dyn Collective) -> Result<(), CollectiveError> {
        let mut counts = [
            self.tokens as f64,
            self.oom_skipped as f64,
            self.oom_splits as f64,
        ];
        all_reduce_metrics(comm, &mut self.metrics, &mut counts)?;
        self.tokens = counts[0] as usize;
        self.oom_skipped = counts[1] as usize;
        self.oom_splits = counts[2] as usize;
        Ok(())
    }

    fn merge(&mut self, other: Accumulator) {
        for (k, v) in other.metrics {
            *self.metrics.entry(k).or_default() += v;
        }
        self.tokens += other.tokens;
        self.oom_skipped += other.oom_skipped;
        self.oom_splits += other.oom_splits;
    }
}
