//! The trainer: model + optimizer + the GRPO step, independent of actor plumbing so
//! it can be driven directly in tests and benchmarks.

use std::path::PathBuf;

use manta_core::Sample;
use manta_model::{CausalLm, ModelConfig, Recompute};
use serde::{Deserialize, Serialize};
use tch::{nn, Device};

use crate::batch::MicroBatchLayout;
use crate::data_parallel::RankOptimizer;
use crate::loss::{ClipRange, LossOptions};
use crate::optimizer::AdamWConfig;
use crate::schedule::LrSchedule;

/// How a data-parallel group shards the training state.
enum Sharding {
    /// Optimizer state and reduced gradients (buckets of this many elements).
    Zero2 { bucket_numel: usize },
    /// Parameters too, a decoder layer per shard group.
    Zero3,
}

pub use manta_model::NamedTensors;

pub use crate::error::TrainerError;

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
    /// Miles' `--use-rollout-routing-replay` (R3): the forward (recomputed layers and
    /// old log-probs included) routes each token to the experts the rollout engine chose
    /// (the samples' `routed_experts`), the gate weights still from the trainer's own
    /// router. Mixture-of-experts models only.
    #[serde(default)]
    pub use_rollout_routing_replay: bool,
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

mod accumulator;
mod build;
mod checkpoint;
mod memory_check;
mod micro_batches;
mod packing;
mod routing_replay;
mod step;
mod weights;
mod zero3_fillers;

pub use checkpoint::has_weights;

impl Trainer {
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
