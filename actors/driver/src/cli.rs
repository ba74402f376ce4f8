//! The command line: run.sh's flag names, so a cookbook user's habits carry over.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};
use manta_config::TrainOverrides;

/// Manta's driver: runs GRPO training of an LLM on OpenReward environments.
///
/// With the default cluster.toml it trains a tiny model locally on the CPU against
/// Manta's built-in environments: no GPU, no network. Flags override cluster.toml's
/// `[train]` table, which overrides the OpenReward cookbook's defaults. slime's and
/// Miles' flag names work too (also after `--`, as run.sh passes them); flags Manta has
/// no use for are ignored with a warning (docs/migration.md).
#[derive(Debug, Parser)]
// `allow_negative_numbers`: `--lr -1` is a value (refused by validation), not a flag.
#[command(name = "driver", version, about, long_about = None, args_conflicts_with_subcommands = true, allow_negative_numbers = true, args_override_self = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub train: TrainArgs,
}

// Parsed once per process: the size gap between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train (the default when no subcommand is given).
    Train(TrainArgs),
    /// Generate from a checkpoint with the native engine: smoke-tests a model and makes
    /// parity with Hugging Face checkable from outside.
    Generate(GenerateArgs),
    /// Write tasks.jsonl from the environments of train_config.yaml as the cookbook's
    /// prepare_tasks.py does: the same rows in the same order for the same --seed.
    PrepareTasks(PrepareTasksArgs),
    /// Serve the native engine over SGLang's HTTP API (flags as SGLang's launch_server),
    /// for anything that launches and talks to an SGLang server.
    Serve(manta_serve::ServeArgs),
    /// Write a checkpoint as a Hugging Face model directory (model.safetensors,
    /// config.json, the tokenizer) that transformers' from_pretrained loads.
    ///
    /// Reads any Manta checkpoint — one trainer's, or data-parallel ranks' (ZeRO-2 or
    /// ZeRO-3: every rank's optimizer shard must be in the directory) — checks its files
    /// against each other (a missing or truncated file, or a shard of another run, is an
    /// error naming it), and writes OUT: model.safetensors, config.json, the tokenizer and
    /// generation files of --tokenizer-from, and manta_export.json (where it came from).
    /// OUT is written beside itself under a temporary name and renamed into place last, so
    /// a failed export leaves no half-written directory; an earlier export there is
    /// replaced, any other non-empty directory is refused.
    Export(ExportArgs),
    /// Ask a running driver what it is doing: nodes, GPUs, actors and their health, the
    /// step and its phase, episodes in flight, the weight version of each engine.
    Status(StatusArgs),
}

/// Options of `driver status`.
#[derive(Debug, Args, Clone)]
#[command(group(ArgGroup::new("target").required(true).args(["addr", "run_dir"])))]
pub struct StatusArgs {
    /// The driver's status address (its --status-addr, as written to RUN_DIR/status_addr).
    #[arg(long)]
    pub addr: Option<String>,
    /// A running run's directory (runs/NAME): its status_addr file names the address.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Print the JSON the driver answers instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// Options of `driver export`.
#[derive(Debug, Args, Clone)]
pub struct ExportArgs {
    /// The checkpoint: a `--save` directory (its `latest` checkpoint is exported) or one
    /// `step_NNNNNN` directory in it.
    #[arg(long)]
    pub load: PathBuf,
    /// The Hugging Face model directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Kind of the exported weights: auto (as the trainer computed, bit for bit: what
    /// the engines served), float32 (a bf16 run's fp32 master weights, gathered from the
    /// optimizer shards) or bfloat16 [auto].
    #[arg(long, default_value = "auto")]
    pub dtype: manta_trainer::export::ExportDtype,
    /// The model directory the run trained from (`--model`): its tokenizer and
    /// generation files are copied into OUT (a checkpoint holds none) [none copied].
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
}

/// Options of `driver prepare-tasks`.
#[derive(Debug, Args, Clone)]
pub struct PrepareTasksArgs {
    /// Environment settings (the cookbook's train_config.yaml). Environments with
    /// `url: builtin` are listed from Manta's built-in server, started for the run.
    #[arg(long, default_value = "train_config.yaml")]
    pub config: PathBuf,
    /// Where to write the tasks (one JSON object per line; replaced atomically).
    #[arg(long, default_value = "tasks.jsonl")]
    pub output: PathBuf,
    /// Most tasks per split of an environment whose `num_samples` is unset (the
    /// cookbook's `num_samples or --max-tasks`) [all].
    #[arg(long)]
    pub max_tasks: Option<u64>,
    /// Seed of Python's `random`, which picks and orders the tasks [42].
    #[arg(long, default_value_t = crate::tasks::TASK_SEED, allow_negative_numbers = true)]
    pub seed: i64,
}

/// Options of `driver generate`.
#[derive(Debug, Args, Clone)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_ids"])))]
pub struct GenerateArgs {
    /// Model directory in Hugging Face layout (config.json, model.safetensors, and the
    /// tokenizer files when --prompt is used). It must hold weights.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's tokenizer (no special tokens added).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids (e.g. 1,2,3); needs no tokenizer.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate; generation also stops at config.json's eos_token_id
    /// (the stop token is kept in the output).
    #[arg(long)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Print `{"output_ids": [...], "logprobs": [...]}` instead of the decoded text.
    #[arg(long)]
    pub json: bool,
    /// Seed for sampling.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Options of a training run.
#[derive(Debug, Args, Clone)]
pub struct TrainArgs {
    /// Cluster description: where actors run, engine kind, defaults for the flags below.
    #[arg(long, default_value = "cluster.toml")]
    pub cluster: PathBuf,
    /// Environment settings (the cookbook's train_config.yaml). Default: cluster.toml's
    /// `cluster.train_config`.
    #[arg(long)]
    pub config: Option<PathBuf>,
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
    /// slime's switch for packing micro-batches by --max-tokens-per-gpu, which Manta
    /// always does; accepted for run.sh.
    #[arg(long)]
    pub use_dynamic_batch_size: bool,
    /// Sampling temperature [1.0].
    #[arg(long, visible_alias = "rollout-temperature")]
    pub temperature: Option<f64>,
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
    #[arg(long)]
    pub grad_reduce_in_bf16: bool,
    /// bf16 weights and compute with fp32 master weights and AdamW state, as Megatron's
    /// `--bf16`; the same as cluster.toml's `[trainer] bf16 = true`, which it overrides.
    #[arg(long)]
    pub bf16: bool,
    /// Whole-episode token budget: prompt plus all turns [8192].
    #[arg(long, visible_alias = "max-total-len")]
    pub context_len: Option<usize>,
    /// tasks.jsonl to train from (from `prepare-tasks`); default: list tasks from the servers.
    #[arg(long, visible_alias = "prompt-data")]
    pub task_data: Option<PathBuf>,
    /// slime's switch for shuffling the prompts every epoch, which Manta always does
    /// (seeded by --seed); accepted for run.sh.
    #[arg(long)]
    pub rollout_shuffle: bool,
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
    /// slime's switch for W&B logging: needs --wandb-project (which alone turns W&B
    /// on in Manta).
    #[arg(long)]
    pub use_wandb: bool,
    /// How rewards become advantages, and the policy loss: grpo, gspo (sequence-level
    /// ratio), cispo, reinforce_plus_plus, reinforce_plus_plus_baseline [grpo].
    #[arg(long)]
    pub advantage_estimator: Option<String>,
    /// Dual-clip bound (> 1) on the loss of negative-advantage tokens [off].
    #[arg(long)]
    pub eps_clip_c: Option<f64>,
    /// Add a KL penalty to the frozen reference model to the loss.
    #[arg(long)]
    pub use_kl_loss: bool,
    /// Weight of the KL loss [0].
    #[arg(long)]
    pub kl_loss_coef: Option<f64>,
    /// KL estimator: k1, k2, k3, low_var_kl [k1].
    #[arg(long)]
    pub kl_loss_type: Option<String>,
    /// Weight the KL estimate by the importance ratio π/π_old.
    #[arg(long)]
    pub use_unbiased_kl: bool,
    /// Reference model directory for the KL loss [the initial model].
    #[arg(long)]
    pub ref_load: Option<PathBuf>,
    /// Entropy bonus coefficient [0].
    #[arg(long, allow_negative_numbers = true)]
    pub entropy_coef: Option<f64>,
    /// GRPO advantages: centre rewards within the group without dividing by the std.
    #[arg(long)]
    pub disable_grpo_std_normalization: bool,
    /// Whiten advantages over all trained tokens of the step.
    #[arg(long)]
    pub normalize_advantages: bool,
    /// π_old is the engine's log-probs instead of the trainer's.
    #[arg(long)]
    pub use_rollout_logprobs: bool,
    /// True on-policy (Miles' flag): the native engine runs the trainer's layer ops and both
    /// compute attention with one batch-invariant kernel, so
    /// train/train_rollout_logprob_abs_diff drops to ~0. CUDA bf16 only; decoding is slower.
    #[arg(long)]
    pub true_on_policy_mode: bool,
    /// Mixture-of-experts models: the weight of Megatron's per-layer load-balancing loss,
    /// added to the policy loss [0, as slime's and Miles' Qwen3-30B-A3B recipes set it].
    #[arg(long)]
    pub moe_aux_loss_coeff: Option<f64>,
    /// Truncated importance sampling of the loss by exp(train − rollout log-prob).
    #[arg(long)]
    pub use_tis: bool,
    /// Upper TIS bound [2.0].
    #[arg(long)]
    pub tis_clip: Option<f64>,
    /// Lower TIS bound [0].
    #[arg(long)]
    pub tis_clip_low: Option<f64>,
    /// truncate: clamp the TIS weight into the band; mask: zero tokens outside it
    /// (slime's icepop) [truncate].
    #[arg(long)]
    pub tis_mode: Option<String>,
    /// Off-policy sequence masking: drop negative-advantage samples whose mean
    /// log-ratio old/new exceeds --opsm-delta.
    #[arg(long)]
    pub use_opsm: bool,
    /// OPSM threshold [1e-4].
    #[arg(long)]
    pub opsm_delta: Option<f64>,
    /// Average the loss over all tokens of the step instead of per sample first.
    #[arg(long)]
    pub calculate_per_token_loss: bool,
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
    #[arg(long)]
    pub lr_decay_style: Option<String>,
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
    #[arg(long, conflicts_with = "load_debug_rollout_data")]
    pub debug_rollout_only: bool,
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
    #[arg(long)]
    pub partial_rollout: bool,
    /// With --save: after the run's final checkpoint, write it as a Hugging Face model
    /// directory to SAVE/hf (as `driver export`, tokenizer files from --model), replacing
    /// the export of an earlier run there. Checkpoints of earlier steps stay as they are
    /// (`driver export` writes any of them).
    #[arg(long)]
    pub save_hf: bool,
    /// Failure budget and checkpoint retention (crate::guard_flags).
    #[command(flatten)]
    pub guards: crate::guard_flags::GuardArgs,
    /// What SIGINT (Ctrl-C) or SIGTERM (scancel, kill, a pod deletion) does with the step
    /// in flight: finish-step runs it to its end; abandon-step drops it if it is still in
    /// its rollouts (they run again on resume), for jobs whose scheduler kills soon after
    /// SIGTERM. Either way the last finished step is checkpointed (with --save), the
    /// actors are stopped and the driver exits 0; a second signal exits at once (130).
    #[arg(long, value_enum, default_value = "finish-step")]
    pub on_stop: crate::signals::OnStop,
    /// Serve the run's status (GET /status, JSON) and Prometheus metrics (GET /metrics)
    /// here; port 0 picks a free one. The address is written to RUN_DIR/status_addr.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub status_addr: std::net::SocketAddr,
}

impl TrainArgs {
    /// The flags as the top configuration layer.
    pub fn overrides(&self) -> TrainOverrides {
        TrainOverrides {
            model: self.model.clone(),
            lr: self.lr,
            n_samples: self.n_samples,
            rollout_batch_size: self.rollout_batch_size,
            max_response_len: self.max_response_len,
            max_tokens_per_gpu: self.max_tokens_per_gpu,
            temperature: self.temperature,
            save: self.save.clone(),
            load: self.load.clone(),
            save_interval: self.save_interval,
            num_rollout: self.num_rollout,
            seed: self.seed,
            weight_decay: self.weight_decay,
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            adam_eps: self.adam_eps,
            eps_clip: self.eps_clip,
            eps_clip_high: self.eps_clip_high,
            clip_grad: self.clip_grad,
            gradient_checkpointing: self.gradient_checkpointing,
            recompute_granularity: self.recompute_granularity.clone(),
            recompute_method: self.recompute_method.clone(),
            recompute_num_layers: self.recompute_num_layers,
            zero_stage: self.zero_stage,
            context_parallel_size: self.context_parallel_size,
            grad_reduce_in_bf16: flag(self.grad_reduce_in_bf16),
            context_len: self.context_len,
            task_data: self.task_data.clone(),
            run_name: self.run_name.clone(),
            runs_dir: self.runs_dir.clone(),
            wandb_project: self.wandb_project.clone(),
            wandb_run: self.wandb_run.clone(),
            advantage_estimator: self.advantage_estimator.clone(),
            eps_clip_c: self.eps_clip_c,
            use_kl_loss: flag(self.use_kl_loss),
            kl_loss_coef: self.kl_loss_coef,
            kl_loss_type: self.kl_loss_type.clone(),
            use_unbiased_kl: flag(self.use_unbiased_kl),
            ref_load: self.ref_load.clone(),
            entropy_coef: self.entropy_coef,
            disable_grpo_std_normalization: flag(self.disable_grpo_std_normalization),
            normalize_advantages: flag(self.normalize_advantages),
            use_rollout_logprobs: flag(self.use_rollout_logprobs),
            true_on_policy_mode: flag(self.true_on_policy_mode),
            moe_aux_loss_coeff: self.moe_aux_loss_coeff,
            use_tis: flag(self.use_tis),
            tis_clip: self.tis_clip,
            tis_clip_low: self.tis_clip_low,
            tis_mode: self.tis_mode.clone(),
            use_opsm: flag(self.use_opsm),
            opsm_delta: self.opsm_delta,
            calculate_per_token_loss: flag(self.calculate_per_token_loss),
            num_steps_per_rollout: self.num_steps_per_rollout,
            global_batch_size: self.global_batch_size,
            lr_decay_style: self.lr_decay_style.clone(),
            lr_warmup_iters: self.lr_warmup_iters,
            min_lr: self.min_lr,
            save_debug_rollout_data: self.save_debug_rollout_data.clone(),
            load_debug_rollout_data: self.load_debug_rollout_data.clone(),
            debug_rollout_only: flag(self.debug_rollout_only),
            over_sampling_batch_size: self.over_sampling_batch_size,
            dynamic_sampling_filter_path: self.dynamic_sampling_filter_path.clone(),
            max_weight_staleness: self.max_weight_staleness,
            partial_rollout: flag(self.partial_rollout),
        }
    }
}

/// A store-true switch as a layer value: absent leaves the lower layer's choice.
fn flag(on: bool) -> Option<bool> {
    on.then_some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slime_loss_flags_reach_the_settings() {
        let cli = Cli::try_parse_from([
            "driver",
            "--advantage-estimator",
            "gspo",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",
            "--kl-loss-type",
            "low_var_kl",
            "--use-tis",
            "--tis-mode",
            "mask",
            "--entropy-coef",
            "-0.001",
            "--num-steps-per-rollout",
            "2",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "1e-7",
        ])
        .unwrap();
        let s = cli.train.overrides().resolve();
        assert_eq!(s.algo.advantage_estimator, "gspo");
        assert!(s.algo.use_kl_loss && s.algo.use_tis && !s.algo.use_opsm);
        assert_eq!(s.algo.kl_loss_type, "low_var_kl");
        assert_eq!(s.algo.tis_mode, "mask");
        assert_eq!(s.algo.entropy_coef, -0.001);
        assert_eq!(s.algo.num_steps_per_rollout, 2);
        assert_eq!(
            (s.algo.lr_decay_style.as_str(), s.algo.min_lr),
            ("cosine", 1e-7)
        );
    }

    #[test]
    fn true_on_policy_mode_reaches_the_trainer_and_engine_settings() {
        let cli = Cli::try_parse_from(["driver", "--true-on-policy-mode"]).unwrap();
        let s = cli.train.overrides().resolve();
        assert!(s.algo.true_on_policy_mode);
        assert!(crate::local::algo_options(&s).true_on_policy);
        let off = Cli::try_parse_from(["driver"]).unwrap();
        let s = off.train.overrides().resolve();
        assert!(!crate::local::algo_options(&s).true_on_policy);
    }

    #[test]
    fn grad_reduce_in_bf16_reaches_the_trainer() {
        let cli = Cli::try_parse_from(["driver", "--grad-reduce-in-bf16"]).unwrap();
        let s = cli.train.overrides().resolve();
        assert!(s.grad_reduce_in_bf16);
        assert!(crate::local::algo_options(&s).grad_reduce_in_bf16);
        let off = Cli::try_parse_from(["driver"]).unwrap().train.overrides();
        assert!(!crate::local::algo_options(&off.resolve()).grad_reduce_in_bf16);
    }

    #[test]
    fn megatron_recompute_and_bf16_flags_parse() {
        let cli = Cli::try_parse_from([
            "driver",
            "--bf16",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "30",
        ])
        .unwrap();
        assert!(cli.train.bf16);
        let flags = cli.train.overrides();
        flags
            .validate(std::path::Path::new("command line"), "--")
            .unwrap();
        let r = flags.resolve().recompute.unwrap();
        assert_eq!((r.method.as_str(), r.num_layers), ("block", 30));
        let cli = Cli::try_parse_from(["driver", "--recompute-method", "blocky"]).unwrap();
        let err = cli
            .train
            .overrides()
            .validate(std::path::Path::new("command line"), "--")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--recompute-method") && err.contains("blocky"),
            "{err}"
        );
        assert!(!Cli::try_parse_from(["driver"]).unwrap().train.bf16);
    }

    #[test]
    fn slime_sampling_flags_reach_the_settings() {
        let cli = Cli::try_parse_from([
            "driver",
            "--rollout-batch-size",
            "4",
            "--over-sampling-batch-size",
            "12",
            "--dynamic-sampling-filter-path",
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
            "--max-weight-staleness",
            "2",
            "--partial-rollout",
        ])
        .unwrap();
        let flags = cli.train.overrides();
        flags
            .validate(std::path::Path::new("command line"), "--")
            .unwrap();
        let s = flags.resolve().sampling;
        assert_eq!(s.over_sampling_batch_size, 12);
        assert_eq!(
            s.dynamic_sampling_filter.as_deref(),
            Some("check_reward_nonzero_std")
        );
        assert_eq!((s.max_weight_staleness, s.partial_rollout), (2, true));
    }
}
