//! The settings a run goes with, after every layer and default is applied
//! ([`super::TrainOverrides::resolve`]).

use std::path::PathBuf;

use manta_core::algo::{AdvantageEstimator, DecayStyle, KlType, TisMode};
use serde::Serialize;

use crate::eval::EvalSettings;

/// Resolved settings the driver runs with.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TrainSettings {
    /// Model directory in HF layout (config.json, tokenizer files, optional weights).
    pub model: PathBuf,
    pub lr: f64,
    /// Samples per prompt (the GRPO group size).
    pub n_samples: usize,
    /// Prompts per step.
    pub rollout_batch_size: usize,
    /// Most tokens one generate call may produce.
    pub max_response_len: usize,
    /// Training token budget per micro-batch.
    pub max_tokens_per_gpu: usize,
    pub temperature: f64,
    /// Nucleus sampling of rollouts: the smallest set of tokens holding this much
    /// probability (1.0: the whole distribution).
    pub top_p: f64,
    /// Sample among the k most likely tokens (-1: all).
    pub top_k: i64,
    /// Checkpoint directory; `None` disables checkpoints.
    pub save: Option<PathBuf>,
    /// Resume from the latest checkpoint in this directory.
    pub load: Option<PathBuf>,
    /// Steps between checkpoints (0 = only at the end).
    pub save_interval: usize,
    /// Number of training steps.
    pub num_rollout: usize,
    pub seed: u64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub eps_clip: f64,
    pub eps_clip_high: f64,
    pub clip_grad: f64,
    /// Layers recomputed in backward instead of storing their activations; `None`
    /// keeps every activation. From `recompute_*` when set, else
    /// `gradient_checkpointing` (every layer, uniform groups of one).
    pub recompute: Option<LayerRecompute>,
    /// ZeRO stage of data-parallel trainer ranks: 2 (optimizer state and gradients
    /// sharded) or 3 (parameters too, gathered a layer at a time). One of
    /// [`ZERO_STAGES`]; with one trainer it changes nothing (the driver refuses 3).
    pub zero_stage: u8,
    /// Trainer ranks sharing each sequence's tokens (1: off). Above 1 the driver runs
    /// the local rank group, which must have exactly this many ranks, as one
    /// context-parallel group.
    pub context_parallel_size: usize,
    /// Gradients reduce-scattered in bf16 and each rank's reduced-gradient shard kept
    /// in bf16 (half its memory, bf16 rounding of the reduced gradients); needs bf16
    /// weights and two data-parallel ranks or more (the driver refuses it otherwise).
    pub grad_reduce_in_bf16: bool,
    /// Whole-episode token budget (prompt + all turns).
    pub context_len: usize,
    /// tasks.jsonl to train from; `None` lists tasks from the environment servers.
    pub task_data: Option<PathBuf>,
    pub run_name: Option<String>,
    /// Where `runs/<run>/metrics.jsonl` goes.
    pub runs_dir: PathBuf,
    /// Weights & Biases project; `None` keeps W&B off.
    pub wandb_project: Option<String>,
    /// W&B run name [the run's directory name].
    pub wandb_run: Option<String>,
    /// slime's loss and schedule options (REFERENCE.md §4), slime's defaults.
    pub algo: AlgoSettings,
    /// `--save-debug-rollout-data`: a path with `{rollout_id}`, one file per step.
    pub save_debug_rollout_data: Option<String>,
    /// `--load-debug-rollout-data`: train from such files; no engine, no environment.
    pub load_debug_rollout_data: Option<String>,
    /// `--debug-rollout-only`: run the rollouts of every step and train nothing (the
    /// engines keep their first weights): rollout throughput on its own.
    pub debug_rollout_only: bool,
    /// How rollouts feed steps: over-sampling, dynamic sampling, asynchronous mode.
    pub sampling: SamplingSettings,
    /// Evaluation during training (slime's `--eval-*` flags).
    pub eval: EvalSettings,
}

/// Megatron's full-granularity activation recompute, resolved.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LayerRecompute {
    /// One of [`RECOMPUTE_METHODS`].
    pub method: String,
    /// At least 1; the trainer checks it against the model's layer count.
    pub num_layers: usize,
}

/// slime's over-sampling, dynamic-sampling and asynchronous-training options, resolved.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SamplingSettings {
    /// Groups started at a time while the step's batch is short [rollout_batch_size].
    pub over_sampling_batch_size: usize,
    /// The group filter of dynamic sampling (one of [`DYNAMIC_SAMPLING_FILTERS`], by its
    /// short name); `None` keeps every group.
    pub dynamic_sampling_filter: Option<String>,
    /// 0: synchronous steps. N ≥ 1: the next step's rollouts run while the trainer
    /// trains, and samples whose oldest token is at most N weight versions behind the
    /// trainer are trained on (older ones are regenerated).
    pub max_weight_staleness: u64,
    /// Episodes that span a weight update keep their tokens and go on with the new
    /// weights (each token's version recorded); without it such episodes are regenerated.
    pub partial_rollout: bool,
}

/// slime's algorithm flags, resolved. Names are slime's; the choices are
/// [`manta_core::algo`]'s enums, as the trainer takes them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AlgoSettings {
    pub advantage_estimator: AdvantageEstimator,
    /// Dual-clip bound (> 1); `None` is off.
    pub eps_clip_c: Option<f64>,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: KlType,
    pub use_unbiased_kl: bool,
    /// Frozen reference weights; `None` is the initial model.
    pub ref_load: Option<PathBuf>,
    pub entropy_coef: f64,
    pub disable_grpo_std_normalization: bool,
    pub normalize_advantages: bool,
    pub use_rollout_logprobs: bool,
    /// Engine and trainer attention through one batch-invariant kernel (CUDA bf16 only).
    pub true_on_policy_mode: bool,
    /// Weight of the per-layer load-balancing loss of MoE models [0].
    pub moe_aux_loss_coeff: f64,
    /// The trainer routes each token to the experts the rollout engine chose (R3).
    pub use_rollout_routing_replay: bool,
    pub use_tis: bool,
    pub tis_clip: f64,
    pub tis_clip_low: f64,
    /// `truncate` (clamp the weight) or `mask` (zero tokens outside the band).
    pub tis_mode: TisMode,
    pub use_opsm: bool,
    pub opsm_delta: f64,
    pub calculate_per_token_loss: bool,
    pub num_steps_per_rollout: usize,
    pub lr_decay_style: DecayStyle,
    pub lr_warmup_iters: u64,
    pub min_lr: f64,
}
