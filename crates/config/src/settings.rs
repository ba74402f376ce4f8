//! Training hyperparameters: the cookbook's run.sh flags, resolved from the command
//! line, then cluster.toml's `[train]`, then the cookbook's defaults.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Every training setting, each optional: one layer of configuration (a `[train]`
/// table or the command line). Names are run.sh's flags with `_` for `-`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainOverrides {
    pub model: Option<PathBuf>,
    pub lr: Option<f64>,
    pub n_samples: Option<usize>,
    pub rollout_batch_size: Option<usize>,
    pub max_response_len: Option<usize>,
    pub max_tokens_per_gpu: Option<usize>,
    pub temperature: Option<f64>,
    pub save: Option<PathBuf>,
    pub load: Option<PathBuf>,
    pub save_interval: Option<usize>,
    pub num_rollout: Option<usize>,
    pub seed: Option<u64>,
    pub weight_decay: Option<f64>,
    pub adam_beta1: Option<f64>,
    pub adam_beta2: Option<f64>,
    pub adam_eps: Option<f64>,
    pub eps_clip: Option<f64>,
    pub eps_clip_high: Option<f64>,
    pub clip_grad: Option<f64>,
    pub gradient_checkpointing: Option<bool>,
    /// Megatron's `--recompute-granularity full|selective`; when set it decides instead
    /// of `gradient_checkpointing`.
    pub recompute_granularity: Option<String>,
    /// `--recompute-method uniform|block` (with `full`).
    pub recompute_method: Option<String>,
    /// `--recompute-num-layers N` (with `full`): group size (uniform) or how many of the
    /// first layers are recomputed (block).
    pub recompute_num_layers: Option<usize>,
    /// Megatron/DeepSpeed's `--zero-stage`: 2 shards optimizer state and gradients over
    /// the data-parallel ranks, 3 the parameters too.
    pub zero_stage: Option<u8>,
    /// Megatron's `--context-parallel-size N`: each packed sequence's tokens split over
    /// N trainer ranks (the whole local rank group; data parallel × CP is not built).
    pub context_parallel_size: Option<usize>,
    /// Megatron's `--grad-reduce-in-bf16`: data-parallel ranks reduce the gradients in
    /// bf16 and keep their reduced-gradient shard in bf16.
    pub grad_reduce_in_bf16: Option<bool>,
    pub context_len: Option<usize>,
    pub task_data: Option<PathBuf>,
    pub run_name: Option<String>,
    pub runs_dir: Option<PathBuf>,
    pub wandb_project: Option<String>,
    pub wandb_run: Option<String>,
    pub advantage_estimator: Option<String>,
    pub eps_clip_c: Option<f64>,
    pub use_kl_loss: Option<bool>,
    pub kl_loss_coef: Option<f64>,
    pub kl_loss_type: Option<String>,
    pub use_unbiased_kl: Option<bool>,
    pub ref_load: Option<PathBuf>,
    pub entropy_coef: Option<f64>,
    pub disable_grpo_std_normalization: Option<bool>,
    pub normalize_advantages: Option<bool>,
    pub use_rollout_logprobs: Option<bool>,
    /// Miles' `--true-on-policy-mode`: engine and trainer attention through one
    /// batch-invariant kernel (CUDA bf16), so their log-probs agree.
    pub true_on_policy_mode: Option<bool>,
    /// Megatron's `--moe-aux-loss-coeff` (mixture-of-experts models).
    pub moe_aux_loss_coeff: Option<f64>,
    pub use_tis: Option<bool>,
    pub tis_clip: Option<f64>,
    pub tis_clip_low: Option<f64>,
    pub tis_mode: Option<String>,
    pub use_opsm: Option<bool>,
    pub opsm_delta: Option<f64>,
    pub calculate_per_token_loss: Option<bool>,
    pub num_steps_per_rollout: Option<usize>,
    /// slime's `--global-batch-size`: samples per optimizer step; derives
    /// `num_steps_per_rollout` (or is checked against it).
    pub global_batch_size: Option<usize>,
    pub lr_decay_style: Option<String>,
    pub lr_warmup_iters: Option<u64>,
    pub min_lr: Option<f64>,
    pub save_debug_rollout_data: Option<String>,
    pub load_debug_rollout_data: Option<String>,
    pub debug_rollout_only: Option<bool>,
    pub over_sampling_batch_size: Option<usize>,
    pub dynamic_sampling_filter_path: Option<String>,
    pub max_weight_staleness: Option<u64>,
    pub partial_rollout: Option<bool>,
}

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

/// Values of `--dynamic-sampling-filter-path`: slime's filter functions, by their short
/// name or their slime module path.
pub const DYNAMIC_SAMPLING_FILTERS: &[&str] = &["check_reward_nonzero_std"];

/// The module slime's built-in dynamic sampling filters live in.
const SLIME_FILTER_MODULE: &str = "slime.rollout.filter_hub.dynamic_sampling_filters.";

/// The short name of a dynamic sampling filter path, or `None` when it is not one
/// Manta implements.
pub fn dynamic_sampling_filter_name(path: &str) -> Option<&'static str> {
    let short = path.strip_prefix(SLIME_FILTER_MODULE).unwrap_or(path);
    DYNAMIC_SAMPLING_FILTERS
        .iter()
        .copied()
        .find(|name| *name == short)
}

/// slime's algorithm flags, resolved. Names are slime's; enums stay strings here
/// (validated against [`ADVANTAGE_ESTIMATORS`] etc.) and are parsed by the trainer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AlgoSettings {
    pub advantage_estimator: String,
    /// Dual-clip bound (> 1); `None` is off.
    pub eps_clip_c: Option<f64>,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
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
    pub use_tis: bool,
    pub tis_clip: f64,
    pub tis_clip_low: f64,
    /// `truncate` (clamp the weight) or `mask` (zero tokens outside the band).
    pub tis_mode: String,
    pub use_opsm: bool,
    pub opsm_delta: f64,
    pub calculate_per_token_loss: bool,
    pub num_steps_per_rollout: usize,
    pub lr_decay_style: String,
    pub lr_warmup_iters: u64,
    pub min_lr: f64,
}

/// The cookbook's prompts per step.
const DEFAULT_ROLLOUT_BATCH_SIZE: usize = 32;
/// The cookbook's samples per prompt.
const DEFAULT_N_SAMPLES: usize = 16;

/// Values of `--advantage-estimator`.
pub const ADVANTAGE_ESTIMATORS: &[&str] = &[
    "grpo",
    "gspo",
    "cispo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
];
/// Values of `--kl-loss-type`.
pub const KL_LOSS_TYPES: &[&str] = &["k1", "k2", "k3", "low_var_kl"];
/// Values of `--tis-mode`.
pub const TIS_MODES: &[&str] = &["truncate", "mask"];
/// Values of `--recompute-granularity`. `selective` is Megatron's core-attention
/// recompute: SDPA's flash kernels never store the attention matrix and recompute it in
/// their backward pass anyway, so it recomputes no layer here.
pub const RECOMPUTE_GRANULARITIES: &[&str] = &["full", "selective"];
/// Values of `--recompute-method`.
pub const RECOMPUTE_METHODS: &[&str] = &["uniform", "block"];
/// Values of `--zero-stage`.
pub const ZERO_STAGES: &[u8] = &[2, 3];
/// Values of `--lr-decay-style`.
pub const LR_DECAY_STYLES: &[&str] = &["constant", "linear", "cosine"];

impl TrainOverrides {
    /// `self` wins over `lower` key by key.
    pub fn over(self, lower: TrainOverrides) -> TrainOverrides {
        macro_rules! pick {
            ($($f:ident),*) => { TrainOverrides { $($f: self.$f.or(lower.$f)),* } };
        }
        pick!(
            model,
            lr,
            n_samples,
            rollout_batch_size,
            max_response_len,
            max_tokens_per_gpu,
            temperature,
            save,
            load,
            save_interval,
            num_rollout,
            seed,
            weight_decay,
            adam_beta1,
            adam_beta2,
            adam_eps,
            eps_clip,
            eps_clip_high,
            clip_grad,
            gradient_checkpointing,
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            zero_stage,
            context_parallel_size,
            grad_reduce_in_bf16,
            context_len,
            task_data,
            run_name,
            runs_dir,
            wandb_project,
            wandb_run,
            advantage_estimator,
            eps_clip_c,
            use_kl_loss,
            kl_loss_coef,
            kl_loss_type,
            use_unbiased_kl,
            ref_load,
            entropy_coef,
            disable_grpo_std_normalization,
            normalize_advantages,
            use_rollout_logprobs,
            true_on_policy_mode,
            moe_aux_loss_coeff,
            use_tis,
            tis_clip,
            tis_clip_low,
            tis_mode,
            use_opsm,
            opsm_delta,
            calculate_per_token_loss,
            num_steps_per_rollout,
            global_batch_size,
            lr_decay_style,
            lr_warmup_iters,
            min_lr,
            save_debug_rollout_data,
            load_debug_rollout_data,
            debug_rollout_only,
            over_sampling_batch_size,
            dynamic_sampling_filter_path,
            max_weight_staleness,
            partial_rollout
        )
    }

    /// Checks values that parse but make no sense; `prefix` is the key's table (`train.`
    /// in cluster.toml, `--` on the command line).
    pub fn validate(&self, origin: &Path, prefix: &str) -> Result<(), ConfigError> {
        // On the command line keys are flags: `--n-samples`, not `n_samples`.
        let key = |k: &str| {
            if prefix == "--" {
                format!("--{}", k.replace('_', "-"))
            } else {
                format!("{prefix}{k}")
            }
        };
        let positive_f = [
            ("lr", self.lr),
            ("temperature", self.temperature),
            ("adam_eps", self.adam_eps),
            ("clip_grad", self.clip_grad),
        ];
        for (name, value) in positive_f {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        v,
                        "must be a finite number > 0",
                    ));
                }
            }
        }
        let unit = [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
            ("eps_clip", self.eps_clip),
            ("eps_clip_high", self.eps_clip_high),
            ("weight_decay", self.weight_decay),
        ];
        for (name, value) in unit {
            if let Some(v) = value {
                if !(0.0..1.0).contains(&v) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        v,
                        "must be in [0, 1)",
                    ));
                }
            }
        }
        let at_least_one = [
            ("n_samples", self.n_samples),
            ("rollout_batch_size", self.rollout_batch_size),
            ("max_response_len", self.max_response_len),
            ("max_tokens_per_gpu", self.max_tokens_per_gpu),
            ("num_rollout", self.num_rollout),
            ("context_len", self.context_len),
            ("num_steps_per_rollout", self.num_steps_per_rollout),
            ("global_batch_size", self.global_batch_size),
            ("over_sampling_batch_size", self.over_sampling_batch_size),
            ("recompute_num_layers", self.recompute_num_layers),
            ("context_parallel_size", self.context_parallel_size),
        ];
        for (name, value) in at_least_one {
            if value == Some(0) {
                return Err(ConfigError::invalid(
                    origin,
                    key(name),
                    0,
                    "must be at least 1",
                ));
            }
        }
        let non_empty = [
            ("run_name", &self.run_name),
            ("wandb_project", &self.wandb_project),
            ("wandb_run", &self.wandb_run),
        ];
        for (name, value) in non_empty {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(ConfigError::invalid(
                    origin,
                    key(name),
                    "\"\"",
                    "must not be empty",
                ));
            }
        }
        let choices = [
            (
                "advantage_estimator",
                &self.advantage_estimator,
                ADVANTAGE_ESTIMATORS,
            ),
            ("kl_loss_type", &self.kl_loss_type, KL_LOSS_TYPES),
            ("tis_mode", &self.tis_mode, TIS_MODES),
            ("lr_decay_style", &self.lr_decay_style, LR_DECAY_STYLES),
            (
                "recompute_granularity",
                &self.recompute_granularity,
                RECOMPUTE_GRANULARITIES,
            ),
            (
                "recompute_method",
                &self.recompute_method,
                RECOMPUTE_METHODS,
            ),
        ];
        for (name, value, allowed) in choices {
            if let Some(v) = value {
                if !allowed.contains(&v.as_str()) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        format!("{v:?}"),
                        format!("must be one of {}", allowed.join(", ")),
                    ));
                }
            }
        }
        let non_negative = [
            ("kl_loss_coef", self.kl_loss_coef),
            ("tis_clip", self.tis_clip),
            ("tis_clip_low", self.tis_clip_low),
            ("min_lr", self.min_lr),
            ("opsm_delta", self.opsm_delta),
        ];
        for (name, value) in non_negative {
            if let Some(v) = value {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        v,
                        "must be a finite number >= 0",
                    ));
                }
            }
        }
        if let Some(v) = self.entropy_coef {
            if !v.is_finite() {
                return Err(ConfigError::invalid(
                    origin,
                    key("entropy_coef"),
                    v,
                    "must be finite",
                ));
            }
        }
        if let Some(v) = self.eps_clip_c {
            if !(v.is_finite() && v > 1.0) {
                return Err(ConfigError::invalid(
                    origin,
                    key("eps_clip_c"),
                    v,
                    "the dual-clip bound must be a finite number > 1",
                ));
            }
        }
        if let Some(path) = &self.dynamic_sampling_filter_path {
            if dynamic_sampling_filter_name(path).is_none() {
                return Err(ConfigError::invalid(
                    origin,
                    key("dynamic_sampling_filter_path"),
                    format!("{path:?}"),
                    format!(
                        "must be one of {} (or {SLIME_FILTER_MODULE}<name>)",
                        DYNAMIC_SAMPLING_FILTERS.join(", ")
                    ),
                ));
            }
        }
        if self.partial_rollout == Some(true) && self.max_weight_staleness == Some(0) {
            return Err(ConfigError::invalid(
                origin,
                key("max_weight_staleness"),
                0,
                "partial rollouts keep tokens of an older weight version: set it to at least 1",
            ));
        }
        if let Some(stage) = self.zero_stage {
            if !ZERO_STAGES.contains(&stage) {
                return Err(ConfigError::invalid(
                    origin,
                    key("zero_stage"),
                    stage,
                    "must be 2 (optimizer state and gradients sharded) or 3 (parameters too)",
                ));
            }
        }
        self.validate_recompute(origin, &key)?;
        if let (Some(low), Some(high)) = (self.tis_clip_low, self.tis_clip) {
            if low > high {
                return Err(ConfigError::invalid(
                    origin,
                    key("tis_clip_low"),
                    low,
                    format!("must not exceed tis_clip ({high})"),
                ));
            }
        }
        Ok(())
    }

    /// Megatron's rules for the recompute flags, which go together in one layer (one
    /// command line, one `[train]` table): `full` needs a method and a layer count,
    /// `selective` takes neither, and neither is meaningful without a granularity.
    fn validate_recompute(
        &self,
        origin: &Path,
        key: &dyn Fn(&str) -> String,
    ) -> Result<(), ConfigError> {
        let method = self.recompute_method.as_deref();
        let layers = self.recompute_num_layers;
        let stray = [
            ("recompute_method", method.map(|m| format!("{m:?}"))),
            ("recompute_num_layers", layers.map(|n| n.to_string())),
        ];
        match self.recompute_granularity.as_deref() {
            Some("full") => {
                if method.is_none() {
                    return Err(ConfigError::invalid(
                        origin,
                        key("recompute_granularity"),
                        "\"full\"",
                        format!("needs {} (uniform or block)", key("recompute_method")),
                    ));
                }
                if layers.is_none() {
                    return Err(ConfigError::invalid(
                        origin,
                        key("recompute_granularity"),
                        "\"full\"",
                        format!(
                            "needs {} (at least 1, at most the model's layers)",
                            key("recompute_num_layers")
                        ),
                    ));
                }
            }
            Some(other) => {
                if let Some((name, Some(value))) = stray.iter().find(|(_, v)| v.is_some()) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        value,
                        format!(
                            "applies only with {} = full, not {other:?}",
                            key("recompute_granularity")
                        ),
                    ));
                }
            }
            None => {
                if let Some((name, Some(value))) = stray.iter().find(|(_, v)| v.is_some()) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        value,
                        format!("needs {} = full", key("recompute_granularity")),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks of the merged layers (flags over cluster.toml): slime's
    /// `global_batch_size` must split the step's samples (rollout_batch_size ×
    /// n_samples) into whole optimizer steps, `num_steps_per_rollout` of them when that
    /// is set too.
    pub fn validate_merged(&self) -> Result<(), ConfigError> {
        let Some(global) = self.global_batch_size else {
            return Ok(());
        };
        let rollout_batch_size = self
            .rollout_batch_size
            .unwrap_or(DEFAULT_ROLLOUT_BATCH_SIZE);
        let n_samples = self.n_samples.unwrap_or(DEFAULT_N_SAMPLES);
        let samples = rollout_batch_size * n_samples;
        let origin = Path::new("command line or cluster.toml [train]");
        if global == 0 || !samples.is_multiple_of(global) {
            return Err(ConfigError::invalid(
                origin,
                "--global-batch-size",
                global,
                format!(
                    "must divide rollout-batch-size × n-samples = {rollout_batch_size} × \
                     {n_samples} = {samples} (one optimizer step per {global} samples)"
                ),
            ));
        }
        if let Some(steps) = self.num_steps_per_rollout {
            if steps * global != samples {
                return Err(ConfigError::invalid(
                    origin,
                    "--global-batch-size",
                    global,
                    format!(
                        "disagrees with --num-steps-per-rollout {steps}: {steps} steps of \
                         {global} samples is not rollout-batch-size × n-samples = {samples}"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Fills what is still unset with the cookbook's defaults.
    pub fn resolve(self) -> TrainSettings {
        let eps_clip = self.eps_clip.unwrap_or(0.2);
        let rollout_batch_size = self
            .rollout_batch_size
            .unwrap_or(DEFAULT_ROLLOUT_BATCH_SIZE);
        let n_samples = self.n_samples.unwrap_or(DEFAULT_N_SAMPLES);
        // slime: num_steps_per_rollout = rollout_batch_size × n_samples ÷ global_batch_size.
        let num_steps_per_rollout = self.num_steps_per_rollout.unwrap_or_else(|| {
            self.global_batch_size
                .filter(|g| *g > 0)
                .map(|g| (rollout_batch_size * n_samples / g).max(1))
                .unwrap_or(1)
        });
        let partial_rollout = self.partial_rollout.unwrap_or(false);
        TrainSettings {
            model: self
                .model
                .unwrap_or_else(|| PathBuf::from("assets/tiny-qwen3")),
            lr: self.lr.unwrap_or(1e-5),
            n_samples,
            rollout_batch_size,
            max_response_len: self.max_response_len.unwrap_or(4096),
            max_tokens_per_gpu: self.max_tokens_per_gpu.unwrap_or(8192),
            temperature: self.temperature.unwrap_or(1.0),
            save: self.save,
            load: self.load,
            save_interval: self.save_interval.unwrap_or(10),
            num_rollout: self.num_rollout.unwrap_or(3000),
            seed: self.seed.unwrap_or(42),
            weight_decay: self.weight_decay.unwrap_or(0.0),
            adam_beta1: self.adam_beta1.unwrap_or(0.9),
            adam_beta2: self.adam_beta2.unwrap_or(0.999),
            adam_eps: self.adam_eps.unwrap_or(1e-8),
            eps_clip,
            eps_clip_high: self.eps_clip_high.unwrap_or(eps_clip),
            clip_grad: self.clip_grad.unwrap_or(1.0),
            recompute: match self.recompute_granularity.as_deref() {
                Some("full") => Some(LayerRecompute {
                    method: self.recompute_method.unwrap_or_else(|| "uniform".into()),
                    num_layers: self.recompute_num_layers.unwrap_or(1),
                }),
                Some(_) => None,
                None => self
                    .gradient_checkpointing
                    .unwrap_or(true)
                    .then(|| LayerRecompute {
                        method: "uniform".into(),
                        num_layers: 1,
                    }),
            },
            zero_stage: self.zero_stage.unwrap_or(2),
            context_parallel_size: self.context_parallel_size.unwrap_or(1),
            grad_reduce_in_bf16: self.grad_reduce_in_bf16.unwrap_or(false),
            context_len: self.context_len.unwrap_or(8192),
            task_data: self.task_data,
            run_name: self.run_name,
            runs_dir: self.runs_dir.unwrap_or_else(|| PathBuf::from("runs")),
            wandb_project: self.wandb_project,
            wandb_run: self.wandb_run,
            algo: AlgoSettings {
                advantage_estimator: self.advantage_estimator.unwrap_or_else(|| "grpo".into()),
                eps_clip_c: self.eps_clip_c,
                use_kl_loss: self.use_kl_loss.unwrap_or(false),
                kl_loss_coef: self.kl_loss_coef.unwrap_or(0.0),
                kl_loss_type: self.kl_loss_type.unwrap_or_else(|| "k1".into()),
                use_unbiased_kl: self.use_unbiased_kl.unwrap_or(false),
                ref_load: self.ref_load,
                entropy_coef: self.entropy_coef.unwrap_or(0.0),
                disable_grpo_std_normalization: self
                    .disable_grpo_std_normalization
                    .unwrap_or(false),
                normalize_advantages: self.normalize_advantages.unwrap_or(false),
                use_rollout_logprobs: self.use_rollout_logprobs.unwrap_or(false),
                true_on_policy_mode: self.true_on_policy_mode.unwrap_or(false),
                moe_aux_loss_coeff: self.moe_aux_loss_coeff.unwrap_or(0.0),
                use_tis: self.use_tis.unwrap_or(false),
                tis_clip: self.tis_clip.unwrap_or(2.0),
                tis_clip_low: self.tis_clip_low.unwrap_or(0.0),
                tis_mode: self.tis_mode.unwrap_or_else(|| "truncate".into()),
                use_opsm: self.use_opsm.unwrap_or(false),
                opsm_delta: self.opsm_delta.unwrap_or(1e-4),
                calculate_per_token_loss: self.calculate_per_token_loss.unwrap_or(false),
                num_steps_per_rollout,
                lr_decay_style: self.lr_decay_style.unwrap_or_else(|| "constant".into()),
                lr_warmup_iters: self.lr_warmup_iters.unwrap_or(0),
                min_lr: self.min_lr.unwrap_or(0.0),
            },
            save_debug_rollout_data: self.save_debug_rollout_data,
            load_debug_rollout_data: self.load_debug_rollout_data,
            debug_rollout_only: self.debug_rollout_only.unwrap_or(false),
            sampling: SamplingSettings {
                over_sampling_batch_size: self
                    .over_sampling_batch_size
                    .unwrap_or(rollout_batch_size),
                dynamic_sampling_filter: self
                    .dynamic_sampling_filter_path
                    .as_deref()
                    .and_then(dynamic_sampling_filter_name)
                    .map(str::to_string),
                // Partial rollouts hold older tokens by definition: one version at least.
                max_weight_staleness: self
                    .max_weight_staleness
                    .unwrap_or(u64::from(partial_rollout)),
                partial_rollout,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message `validate` gives for `o`, read from `file` with key `prefix`.
    fn validation_error(o: &TrainOverrides, file: &str, prefix: &str) -> String {
        o.validate(Path::new(file), prefix)
            .expect_err("invalid overrides")
            .to_string()
    }

    #[test]
    fn upper_layer_wins_and_defaults_fill_the_rest() {
        let flags = TrainOverrides {
            lr: Some(0.01),
            ..Default::default()
        };
        let file = TrainOverrides {
            lr: Some(0.5),
            n_samples: Some(4),
            ..Default::default()
        };
        let s = flags.over(file).resolve();
        assert_eq!(s.lr, 0.01);
        assert_eq!(s.n_samples, 4);
        assert_eq!(s.rollout_batch_size, 32);
        assert_eq!(s.eps_clip_high, 0.2);
    }

    #[test]
    fn an_empty_wandb_project_is_named() {
        let o = TrainOverrides {
            wandb_project: Some(" ".into()),
            ..Default::default()
        };
        let err = validation_error(&o, "command line", "--");
        assert!(
            err.contains("--wandb-project") && err.contains("must not be empty"),
            "{err}"
        );
    }

    #[test]
    fn zero_and_out_of_range_values_are_named() {
        let o = TrainOverrides {
            n_samples: Some(0),
            ..Default::default()
        };
        let err = validation_error(&o, "command line", "--");
        assert!(
            err.contains("--n-samples") && err.contains("at least 1"),
            "{err}"
        );
        let o = TrainOverrides {
            adam_beta2: Some(1.5),
            ..Default::default()
        };
        let err = validation_error(&o, "c.toml", "train.");
        assert!(
            err.contains("train.adam_beta2") && err.contains("1.5"),
            "{err}"
        );
    }

    #[test]
    fn zero_stage_is_2_or_3_and_defaults_to_2() {
        assert_eq!(TrainOverrides::default().resolve().zero_stage, 2);
        for stage in [2, 3] {
            let o = TrainOverrides {
                zero_stage: Some(stage),
                ..Default::default()
            };
            o.validate(Path::new("command line"), "--").unwrap();
            assert_eq!(o.resolve().zero_stage, stage);
        }
        for stage in [0, 1, 4] {
            let o = TrainOverrides {
                zero_stage: Some(stage),
                ..Default::default()
            };
            let err = validation_error(&o, "command line", "--");
            assert!(
                err.contains("--zero-stage") && err.contains(&stage.to_string()),
                "{err}"
            );
            let err = validation_error(&o, "c.toml", "train.");
            assert!(err.contains("train.zero_stage"), "{err}");
        }
    }

    #[test]
    fn grad_reduce_in_bf16_defaults_to_off_and_a_layer_turns_it_on() {
        assert!(!TrainOverrides::default().resolve().grad_reduce_in_bf16);
        let on = TrainOverrides {
            grad_reduce_in_bf16: Some(true),
            ..Default::default()
        };
        assert!(on.clone().resolve().grad_reduce_in_bf16);
        // cluster.toml's `[train] grad_reduce_in_bf16 = true` under an unset flag.
        assert!(
            TrainOverrides::default()
                .over(on)
                .resolve()
                .grad_reduce_in_bf16
        );
        let file: TrainOverrides = toml::from_str("grad_reduce_in_bf16 = true").unwrap();
        assert_eq!(file.grad_reduce_in_bf16, Some(true));
    }

    #[test]
    fn context_parallel_size_defaults_to_1_and_refuses_0() {
        assert_eq!(TrainOverrides::default().resolve().context_parallel_size, 1);
        let o = TrainOverrides {
            context_parallel_size: Some(2),
            ..Default::default()
        };
        o.validate(Path::new("command line"), "--").unwrap();
        assert_eq!(o.resolve().context_parallel_size, 2);
        let zero = TrainOverrides {
            context_parallel_size: Some(0),
            ..Default::default()
        };
        let err = validation_error(&zero, "command line", "--");
        assert!(
            err.contains("--context-parallel-size") && err.contains('0'),
            "{err}"
        );
        let err = validation_error(&zero, "c.toml", "train.");
        assert!(err.contains("train.context_parallel_size"), "{err}");
    }

    #[test]
    fn loss_flags_layer_and_bad_choices_are_named() {
        let flags = TrainOverrides {
            use_kl_loss: Some(true),
            kl_loss_type: Some("low_var_kl".into()),
            ..Default::default()
        };
        let file = TrainOverrides {
            kl_loss_type: Some("k2".into()),
            kl_loss_coef: Some(0.01),
            ..Default::default()
        };
        let s = flags.over(file).resolve();
        assert!(s.algo.use_kl_loss);
        assert_eq!(s.algo.kl_loss_type, "low_var_kl");
        assert_eq!(s.algo.kl_loss_coef, 0.01);
        assert_eq!(s.algo.advantage_estimator, "grpo");
        assert_eq!((s.algo.tis_clip, s.algo.tis_clip_low), (2.0, 0.0));
        assert_eq!(s.algo.num_steps_per_rollout, 1);
        let bad = TrainOverrides {
            advantage_estimator: Some("ppo".into()),
            ..Default::default()
        };
        let err = validation_error(&bad, "command line", "--");
        assert!(
            err.contains("--advantage-estimator")
                && err.contains("\"ppo\"")
                && err.contains("gspo"),
            "{err}"
        );
        let bad = TrainOverrides {
            eps_clip_c: Some(0.5),
            ..Default::default()
        };
        let err = validation_error(&bad, "c.toml", "train.");
        assert!(
            err.contains("train.eps_clip_c") && err.contains("> 1"),
            "{err}"
        );
        let bad = TrainOverrides {
            tis_clip: Some(1.0),
            tis_clip_low: Some(2.0),
            ..Default::default()
        };
        let err = validation_error(&bad, "command line", "--");
        assert!(err.contains("--tis-clip-low"), "{err}");
    }

    #[test]
    fn recompute_flags_resolve_as_megatron_and_bad_values_are_named() {
        // Default: the cookbook's gradient checkpointing, every layer.
        let every = Some(LayerRecompute {
            method: "uniform".into(),
            num_layers: 1,
        });
        assert_eq!(TrainOverrides::default().resolve().recompute, every);
        let off = TrainOverrides {
            gradient_checkpointing: Some(false),
            ..Default::default()
        };
        assert_eq!(off.clone().resolve().recompute, None);
        // The recompute flags win over gradient_checkpointing, from any layer.
        let block = TrainOverrides {
            recompute_granularity: Some("full".into()),
            recompute_method: Some("block".into()),
            recompute_num_layers: Some(30),
            ..Default::default()
        };
        block.validate(Path::new("c.toml"), "train.").unwrap();
        let s = block.clone().over(off).resolve();
        assert_eq!(
            s.recompute,
            Some(LayerRecompute {
                method: "block".into(),
                num_layers: 30
            })
        );
        let selective = TrainOverrides {
            recompute_granularity: Some("selective".into()),
            ..Default::default()
        };
        assert_eq!(selective.over(block.clone()).resolve().recompute, None);

        let bad_method = TrainOverrides {
            recompute_method: Some("blocks".into()),
            ..block.clone()
        };
        let err = validation_error(&bad_method, "command line", "--");
        assert!(
            err.contains("--recompute-method")
                && err.contains("\"blocks\"")
                && err.contains("uniform, block"),
            "{err}"
        );
        let bad_granularity = TrainOverrides {
            recompute_granularity: Some("partial".into()),
            ..Default::default()
        };
        let err = validation_error(&bad_granularity, "c.toml", "train.");
        assert!(
            err.contains("train.recompute_granularity") && err.contains("\"partial\""),
            "{err}"
        );
        let zero = TrainOverrides {
            recompute_num_layers: Some(0),
            ..block.clone()
        };
        let err = validation_error(&zero, "command line", "--");
        assert!(
            err.contains("--recompute-num-layers") && err.contains("at least 1"),
            "{err}"
        );
        let no_method = TrainOverrides {
            recompute_method: None,
            ..block.clone()
        };
        let err = validation_error(&no_method, "command line", "--");
        assert!(
            err.contains("--recompute-granularity") && err.contains("--recompute-method"),
            "{err}"
        );
        let no_layers = TrainOverrides {
            recompute_num_layers: None,
            ..block.clone()
        };
        let err = validation_error(&no_layers, "c.toml", "train.");
        assert!(err.contains("train.recompute_num_layers"), "{err}");
        let orphan = TrainOverrides {
            recompute_num_layers: Some(4),
            ..Default::default()
        };
        let err = validation_error(&orphan, "command line", "--");
        assert!(
            err.contains("--recompute-num-layers")
                && err.contains('4')
                && err.contains("--recompute-granularity"),
            "{err}"
        );
        let selective_with_layers = TrainOverrides {
            recompute_granularity: Some("selective".into()),
            recompute_num_layers: Some(2),
            ..Default::default()
        };
        let err = validation_error(&selective_with_layers, "command line", "--");
        assert!(
            err.contains("--recompute-num-layers") && err.contains("only with"),
            "{err}"
        );
    }

    #[test]
    fn sampling_options_default_resolve_and_bad_values_are_named() {
        let s = TrainOverrides {
            rollout_batch_size: Some(6),
            ..Default::default()
        }
        .resolve();
        assert_eq!(s.sampling.over_sampling_batch_size, 6);
        assert_eq!(s.sampling.dynamic_sampling_filter, None);
        assert_eq!(
            (s.sampling.max_weight_staleness, s.sampling.partial_rollout),
            (0, false)
        );
        let s = TrainOverrides {
            dynamic_sampling_filter_path: Some(
                "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std".into(),
            ),
            partial_rollout: Some(true),
            over_sampling_batch_size: Some(64),
            ..Default::default()
        }
        .resolve();
        assert_eq!(
            s.sampling.dynamic_sampling_filter.as_deref(),
            Some("check_reward_nonzero_std")
        );
        assert_eq!(s.sampling.over_sampling_batch_size, 64);
        assert_eq!(s.sampling.max_weight_staleness, 1);
        let bad = TrainOverrides {
            dynamic_sampling_filter_path: Some("my.module.keep_all".into()),
            ..Default::default()
        };
        let err = validation_error(&bad, "c.toml", "train.");
        assert!(
            err.contains("train.dynamic_sampling_filter_path")
                && err.contains("my.module.keep_all")
                && err.contains("check_reward_nonzero_std"),
            "{err}"
        );
        let bad = TrainOverrides {
            over_sampling_batch_size: Some(0),
            ..Default::default()
        };
        let err = validation_error(&bad, "command line", "--");
        assert!(err.contains("--over-sampling-batch-size"), "{err}");
        let bad = TrainOverrides {
            partial_rollout: Some(true),
            max_weight_staleness: Some(0),
            ..Default::default()
        };
        let err = validation_error(&bad, "command line", "--");
        assert!(
            err.contains("--max-weight-staleness") && err.contains("at least 1"),
            "{err}"
        );
    }
}
