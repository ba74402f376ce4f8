//! Training hyperparameters: the cookbook's run.sh flags, resolved from the command
//! line, then cluster.toml's `[train]`, then the cookbook's defaults.

use std::path::{Path, PathBuf};

use manta_core::algo::{AdvantageEstimator, DecayStyle, KlType, TisMode};
use serde::{Deserialize, Serialize};

pub use self::resolved::{AlgoSettings, LayerRecompute, SamplingSettings, TrainSettings};

use crate::checks;
use crate::error::ConfigError;
use crate::eval::{EvalLayer, RolloutSampling};

/// Every training setting, each optional: one layer of configuration (the command line,
/// a `--train-settings` file, or cluster.toml's `[train]`). Each field is both the flag
/// (`--n-samples`) and the `[train]` key (`n_samples`), with its help text here: a setting is
/// declared once. Switches are `Option<bool>`: absent leaves the lower layer's choice.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct TrainOverrides {
    /// Model directory in Hugging Face layout (config.json, tokenizer.json, weights), or
    /// a hub name (ORG/NAME) found in the local Hugging Face cache (HF_HUB_CACHE, else
    /// HF_HOME/hub, else ~/.cache/huggingface/hub). Without weights, the model is
    /// randomly initialised from --seed.
    #[arg(long, visible_alias = "hf-checkpoint")]
    pub model: Option<PathBuf>,
    /// Learning rate [cookbook: 1e-5].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Samples per prompt: the GRPO group size [16].
    #[arg(long, visible_alias = "n-samples-per-prompt")]
    pub n_samples: Option<usize>,
    /// Prompts per step [32].
    #[arg(long)]
    pub rollout_batch_size: Option<usize>,
    /// Most tokens per generate call [4096].
    #[arg(long, visible_alias = "rollout-max-response-len")]
    pub max_response_len: Option<usize>,
    /// Training tokens per micro-batch per GPU [8192].
    #[arg(long)]
    pub max_tokens_per_gpu: Option<usize>,
    /// Sampling temperature [1.0].
    #[arg(long, visible_alias = "rollout-temperature")]
    pub temperature: Option<f64>,
    /// Nucleus sampling of rollouts: sample among the most likely tokens holding this
    /// much probability, in (0, 1] [1.0: off].
    #[arg(long, visible_alias = "rollout-top-p")]
    pub top_p: Option<f64>,
    /// Sample among the k most likely tokens; -1 or 0 is off [-1].
    #[arg(long, visible_alias = "rollout-top-k", allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Directory for checkpoints (HF weights + optimizer + trainer state).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from the latest checkpoint in this directory; a directory without one
    /// (missing, empty, or only other files) starts the run fresh, as Miles does, so
    /// run.sh can pass the same directory to --save and --load.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Steps between checkpoints [10]; 0 saves only at the end.
    #[arg(long)]
    pub save_interval: Option<usize>,
    /// Number of training steps [3000].
    #[arg(long)]
    pub num_rollout: Option<usize>,
    /// Seed for model init, task order and sampling [42].
    #[arg(long)]
    pub seed: Option<u64>,
    /// AdamW weight decay [0.0].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// AdamW beta1 [0.9].
    #[arg(long)]
    pub adam_beta1: Option<f64>,
    /// AdamW beta2 [0.999].
    #[arg(long)]
    pub adam_beta2: Option<f64>,
    /// AdamW epsilon [1e-8].
    #[arg(long)]
    pub adam_eps: Option<f64>,
    /// PPO clip range [0.2].
    #[arg(long)]
    pub eps_clip: Option<f64>,
    /// Upper clip range [= --eps-clip].
    #[arg(long)]
    pub eps_clip_high: Option<f64>,
    /// Gradient norm clip [1.0].
    #[arg(long)]
    pub clip_grad: Option<f64>,
    /// Recompute each layer in backward instead of keeping activations; bare (as slime
    /// spells it) means true [true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub gradient_checkpointing: Option<bool>,
    /// Megatron's activation recompute: full (layers, with --recompute-method and
    /// --recompute-num-layers) or selective (core attention only, which SDPA's flash
    /// kernels already recompute: no layer is) [unset: --gradient-checkpointing decides].
    #[arg(long)]
    pub recompute_granularity: Option<String>,
    /// uniform: groups of --recompute-num-layers layers, each recomputed as a unit;
    /// block: the first --recompute-num-layers layers recomputed, the rest keep activations.
    #[arg(long)]
    pub recompute_method: Option<String>,
    /// Layers per group (uniform) or recomputed layers (block), 1..=the model's layers.
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// ZeRO stage of the data-parallel trainer ranks (Megatron/DeepSpeed's name): 2
    /// shards the optimizer state and gradients; 3 shards the parameters too, each layer
    /// all-gathered for its forward and backward, so a rank holds 1/N of the weights at
    /// rest. 3 needs at least two ranks (local mode's `[trainer] gpus` or
    /// `data_parallel_ranks`) [2].
    #[arg(long, value_name = "2|3")]
    pub zero_stage: Option<u8>,
    /// Context parallelism (Megatron's name): each packed sequence's tokens are split
    /// over N trainer ranks, which all train on the same whole batch, for episodes
    /// longer than one rank's memory. Local mode's rank count (`[trainer] gpus` or
    /// `data_parallel_ranks`) must equal N (data parallel × context parallel is not
    /// built); not with --zero-stage 3, remote mode or --true-on-policy-mode [1].
    #[arg(long, value_name = "N")]
    pub context_parallel_size: Option<usize>,
    /// Megatron-LM's name: reduce-scatter the gradients in bf16 and keep each rank's
    /// reduced-gradient shard in bf16, accumulated over micro-batches in bf16 and widened
    /// to fp32 a bucket at a time by the AdamW step. Trades half the gradient shard's
    /// memory (8B over two ranks: 7.6 GiB a GPU) for bf16 rounding of the reduced
    /// gradients. Needs bf16 weights and two data-parallel ranks or more (ZeRO-2, ZeRO-3
    /// or context parallel); refused otherwise [off: fp32].
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub grad_reduce_in_bf16: Option<bool>,
    /// Whole-episode token budget: prompt plus all turns [8192].
    #[arg(long, visible_alias = "max-total-len")]
    pub context_len: Option<usize>,
    /// tasks.jsonl to train from (from `prepare-tasks`); default: list tasks from the servers.
    #[arg(long, visible_alias = "prompt-data")]
    pub task_data: Option<PathBuf>,
    /// Name of this run's folder under --runs-dir [a timestamp].
    #[arg(long)]
    pub run_name: Option<String>,
    /// Where runs/<run>/metrics.jsonl and the plot go [runs].
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
    /// Log every step's metrics to this Weights & Biases project (needs Python with the
    /// `wandb` package: $MANTA_PYTHON or python3; WANDB_API_KEY, WANDB_MODE apply).
    #[arg(long)]
    pub wandb_project: Option<String>,
    /// W&B run name [the run's directory name under --runs-dir].
    #[arg(long, visible_alias = "wandb-run-name")]
    pub wandb_run: Option<String>,
    /// How rewards become advantages, and the policy loss: grpo, gspo (sequence-level
    /// ratio), cispo, reinforce_plus_plus, reinforce_plus_plus_baseline [grpo].
    #[arg(long, value_enum, hide_possible_values = true)]
    pub advantage_estimator: Option<AdvantageEstimator>,
    /// Dual-clip bound (> 1) on the loss of negative-advantage tokens [off].
    #[arg(long)]
    pub eps_clip_c: Option<f64>,
    /// Add a KL penalty to the frozen reference model to the loss.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_kl_loss: Option<bool>,
    /// Weight of the KL loss [0].
    #[arg(long)]
    pub kl_loss_coef: Option<f64>,
    /// KL estimator: k1, k2, k3, low_var_kl [k1].
    #[arg(long, value_enum, hide_possible_values = true)]
    pub kl_loss_type: Option<KlType>,
    /// Weight the KL estimate by the importance ratio π/π_old.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_unbiased_kl: Option<bool>,
    /// Reference model directory for the KL loss [the initial model].
    #[arg(long)]
    pub ref_load: Option<PathBuf>,
    /// Entropy bonus coefficient [0].
    #[arg(long, allow_negative_numbers = true)]
    pub entropy_coef: Option<f64>,
    /// GRPO advantages: centre rewards within the group without dividing by the std.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub disable_grpo_std_normalization: Option<bool>,
    /// Whiten advantages over all trained tokens of the step.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub normalize_advantages: Option<bool>,
    /// π_old is the engine's log-probs instead of the trainer's.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_rollout_logprobs: Option<bool>,
    /// True on-policy (Miles' flag): the native engine runs the trainer's layer ops and both
    /// compute attention with one batch-invariant kernel, so
    /// train/train_rollout_logprob_abs_diff drops to ~0. CUDA bf16 only; decoding is slower.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub true_on_policy_mode: Option<bool>,
    /// Mixture-of-experts models: the weight of Megatron's per-layer load-balancing loss,
    /// added to the policy loss [0, as slime's and Miles' Qwen3-30B-A3B recipes set it].
    #[arg(long)]
    pub moe_aux_loss_coeff: Option<f64>,
    /// Rollout routing replay (R3, Miles' flag; mixture-of-experts models): engines return
    /// each token's routed experts and the trainer routes by them, gate weights from its
    /// own router; train/routing_mismatch reports the drift.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_rollout_routing_replay: Option<bool>,
    /// Truncated importance sampling of the loss by exp(train − rollout log-prob).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_tis: Option<bool>,
    /// Upper TIS bound [2.0].
    #[arg(long)]
    pub tis_clip: Option<f64>,
    /// Lower TIS bound [0].
    #[arg(long)]
    pub tis_clip_low: Option<f64>,
    /// truncate: clamp the TIS weight into the band; mask: zero tokens outside it
    /// (slime's icepop) [truncate].
    #[arg(long, value_enum, hide_possible_values = true)]
    pub tis_mode: Option<TisMode>,
    /// Off-policy sequence masking: drop negative-advantage samples whose mean
    /// log-ratio old/new exceeds --opsm-delta.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub use_opsm: Option<bool>,
    /// OPSM threshold [1e-4].
    #[arg(long)]
    pub opsm_delta: Option<f64>,
    /// Average the loss over all tokens of the step instead of per sample first.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub calculate_per_token_loss: Option<bool>,
    /// Optimizer steps per rollout; the step's samples are split in order [1, or
    /// rollout-batch-size × n-samples ÷ --global-batch-size].
    #[arg(long)]
    pub num_steps_per_rollout: Option<usize>,
    /// Samples per optimizer step (slime's name): must divide rollout-batch-size ×
    /// n-samples; checked against --num-steps-per-rollout when both are set
    /// [rollout-batch-size × n-samples].
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// LR decay over the run: constant, linear, cosine [constant].
    #[arg(long, value_enum, hide_possible_values = true)]
    pub lr_decay_style: Option<DecayStyle>,
    /// Optimizer steps of linear LR warmup from 0 [0].
    #[arg(long)]
    pub lr_warmup_iters: Option<u64>,
    /// LR at the end of the decay [0].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Write each step's samples to this path, `{rollout_id}` replaced by the step
    /// (from 0), one JSON object per line, as slime.
    #[arg(long)]
    pub save_debug_rollout_data: Option<String>,
    /// Train from files written by --save-debug-rollout-data: no engine, no environment.
    #[arg(long)]
    pub load_debug_rollout_data: Option<String>,
    /// Run every step's rollouts and train nothing: the engines keep their first
    /// weights, no checkpoint is written (slime's flag; measures rollout alone).
    #[arg(
        long,
        conflicts_with = "load_debug_rollout_data",
        num_args = 0,
        default_missing_value = "true"
    )]
    pub debug_rollout_only: Option<bool>,
    /// Groups started at a time while the step's batch is short of
    /// --rollout-batch-size kept groups [--rollout-batch-size].
    #[arg(long)]
    pub over_sampling_batch_size: Option<usize>,
    /// Dynamic sampling: drop groups this filter rejects and generate more until the
    /// batch is full. check_reward_nonzero_std (slime's, also by its module path) drops
    /// groups whose rewards all agree [off].
    #[arg(long)]
    pub dynamic_sampling_filter_path: Option<String>,
    /// Asynchronous mode when ≥ 1: the next step's rollouts run while the trainer
    /// trains; samples more than this many weight versions behind are regenerated [0].
    #[arg(long)]
    pub max_weight_staleness: Option<u64>,
    /// Episodes that span a weight update go on with the new weights, each token's
    /// version kept (implies --max-weight-staleness 1 unless set).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub partial_rollout: Option<bool>,
    /// Evaluate after every N-th step (slime's flag; it counts rollouts), and once
    /// before the first step unless --skip-eval-before-train; needs --eval-prompt-data.
    /// Evaluation trains nothing [off].
    #[arg(long, value_name = "N")]
    pub eval_interval: Option<u64>,
    /// Evaluation sets: NAME PATH pairs, each PATH a tasks.jsonl (e.g. `driver
    /// prepare-tasks` on a test split); every task is evaluated, metrics eval/NAME/...
    /// (one PATH alone is named `aime`, as slime names it).
    #[arg(long, num_args = 1.., value_name = "NAME PATH")]
    pub eval_prompt_data: Option<Vec<String>>,
    /// Episodes per evaluation task [1].
    #[arg(long)]
    pub n_samples_per_eval_prompt: Option<usize>,
    /// Most tokens per generate call in evaluation [--max-response-len].
    #[arg(long)]
    pub eval_max_response_len: Option<usize>,
    /// Whole-episode token budget in evaluation [--context-len].
    #[arg(long)]
    pub eval_max_context_len: Option<usize>,
    /// Sampling temperature in evaluation; 0 is greedy [--temperature].
    #[arg(long)]
    pub eval_temperature: Option<f64>,
    /// Nucleus sampling in evaluation [--top-p].
    #[arg(long)]
    pub eval_top_p: Option<f64>,
    /// Top-k sampling in evaluation [--top-k].
    #[arg(long, allow_negative_numbers = true)]
    pub eval_top_k: Option<i64>,
    /// Do not evaluate before the first step (slime evaluates there by default).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub skip_eval_before_train: Option<bool>,
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

/// The cookbook's prompts per step.
const DEFAULT_ROLLOUT_BATCH_SIZE: usize = 32;
/// The cookbook's samples per prompt.
const DEFAULT_N_SAMPLES: usize = 16;

/// Values of `--recompute-granularity`. `selective` is Megatron's core-attention
/// recompute: SDPA's flash kernels never store the attention matrix and recompute it in
/// their backward pass anyway, so it recomputes no layer here.
pub const RECOMPUTE_GRANULARITIES: &[&str] = &["full", "selective"];
/// Values of `--recompute-method`.
pub const RECOMPUTE_METHODS: &[&str] = &["uniform", "block"];
/// Values of `--zero-stage`.
pub const ZERO_STAGES: &[u8] = &[2, 3];

impl TrainOverrides {
    /// `self` wins over `lower` key by key. The merge goes through the layers' serde
    /// form, so it knows every key without a list of them; it fails only on a path
    /// setting that is not valid UTF-8 (which no layer could spell in a file either).
    pub fn over(self, lower: TrainOverrides) -> Result<TrainOverrides, ConfigError> {
        let not_utf8 = |e: serde_json::Error| ConfigError::Parse {
            path: PathBuf::from("training settings"),
            message: format!("a setting cannot be read as text: {e}"),
        };
        let (upper, lower) = (
            serde_json::to_value(self).map_err(not_utf8)?,
            serde_json::to_value(lower).map_err(not_utf8)?,
        );
        let merged = match (upper, lower) {
            (serde_json::Value::Object(upper), serde_json::Value::Object(mut merged)) => {
                merged.extend(upper.into_iter().filter(|(_, value)| !value.is_null()));
                merged
            }
            // A struct serializes as a map; anything else would be a serde bug.
            (upper, _) => {
                return Err(ConfigError::Parse {
                    path: PathBuf::from("training settings"),
                    message: format!("settings did not serialize as a table: {upper}"),
                })
            }
        };
        serde_json::from_value(serde_json::Value::Object(merged)).map_err(not_utf8)
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
        checks::each(
            origin,
            &key,
            &positive_f,
            |v| v.is_finite() && v > 0.0,
            "must be a finite number > 0",
        )?;
        let unit = [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
            ("eps_clip", self.eps_clip),
            ("eps_clip_high", self.eps_clip_high),
            ("weight_decay", self.weight_decay),
        ];
        checks::each(
            origin,
            &key,
            &unit,
            |v| (0.0..1.0).contains(&v),
            "must be in [0, 1)",
        )?;
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
        checks::each(
            origin,
            &key,
            &at_least_one,
            |v| v != 0,
            "must be at least 1",
        )?;
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
            ("moe_aux_loss_coeff", self.moe_aux_loss_coeff),
        ];
        checks::each(
            origin,
            &key,
            &non_negative,
            |v| v.is_finite() && v >= 0.0,
            "must be a finite number >= 0",
        )?;
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
        self.eval_layer().validate(origin, &key)?;
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

    /// This layer's eval keys (crate::eval).
    fn eval_layer(&self) -> EvalLayer<'_> {
        EvalLayer {
            top_p: self.top_p,
            top_k: self.top_k,
            eval_interval: self.eval_interval,
            eval_prompt_data: self.eval_prompt_data.as_deref(),
            n_samples_per_eval_prompt: self.n_samples_per_eval_prompt,
            eval_max_response_len: self.eval_max_response_len,
            eval_max_context_len: self.eval_max_context_len,
            eval_temperature: self.eval_temperature,
            eval_top_p: self.eval_top_p,
            eval_top_k: self.eval_top_k,
            skip_eval_before_train: self.skip_eval_before_train,
        }
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

    /// Checks of the merged layers (flags over cluster.toml): `--eval-interval` needs
    /// `--eval-prompt-data` (as slime asserts); slime's
    /// `global_batch_size` must split the step's samples (rollout_batch_size ×
    /// n_samples) into whole optimizer steps, `num_steps_per_rollout` of them when that
    /// is set too.
    pub fn validate_merged(&self) -> Result<(), ConfigError> {
        self.eval_layer().validate_merged()?;
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
        let rollout = RolloutSampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(-1),
            max_response_len: self.max_response_len.unwrap_or(4096),
            context_len: self.context_len.unwrap_or(8192),
        };
        let eval = self.eval_layer().resolve(&rollout);
        TrainSettings {
            model: self
                .model
                .unwrap_or_else(|| PathBuf::from("assets/tiny-qwen3")),
            lr: self.lr.unwrap_or(1e-5),
            n_samples,
            rollout_batch_size,
            max_response_len: rollout.max_response_len,
            max_tokens_per_gpu: self.max_tokens_per_gpu.unwrap_or(8192),
            temperature: rollout.temperature,
            top_p: rollout.top_p,
            top_k: rollout.top_k,
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
            context_len: rollout.context_len,
            task_data: self.task_data,
            run_name: self.run_name,
            runs_dir: self.runs_dir.unwrap_or_else(|| PathBuf::from("runs")),
            wandb_project: self.wandb_project,
            wandb_run: self.wandb_run,
            algo: AlgoSettings {
                advantage_estimator: self.advantage_estimator.unwrap_or_default(),
                eps_clip_c: self.eps_clip_c,
                use_kl_loss: self.use_kl_loss.unwrap_or(false),
                kl_loss_coef: self.kl_loss_coef.unwrap_or(0.0),
                kl_loss_type: self.kl_loss_type.unwrap_or_default(),
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
                use_rollout_routing_replay: self.use_rollout_routing_replay.unwrap_or(false),
                use_tis: self.use_tis.unwrap_or(false),
                tis_clip: self.tis_clip.unwrap_or(2.0),
                tis_clip_low: self.tis_clip_low.unwrap_or(0.0),
                tis_mode: self.tis_mode.unwrap_or_default(),
                use_opsm: self.use_opsm.unwrap_or(false),
                opsm_delta: self.opsm_delta.unwrap_or(1e-4),
                calculate_per_token_loss: self.calculate_per_token_loss.unwrap_or(false),
                num_steps_per_rollout,
                lr_decay_style: self.lr_decay_style.unwrap_or_default(),
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
            eval,
        }
    }
}

mod resolved;

#[cfg(test)]
mod tests;
