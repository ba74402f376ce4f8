//! The command line: run.sh's flag names, so a cookbook user's habits carry over.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};
use manta_config::TrainOverrides;

/// Manta's driver: runs GRPO training of an LLM on OpenReward environments.
///
/// With the default cluster.toml it trains a tiny model locally on the CPU against
/// Manta's built-in environments: no GPU, no network. Flags override cluster.toml's
/// `[train]` table, which overrides the OpenReward cookbook's defaults.
#[derive(Debug, Parser)]
#[command(name = "driver", version, about, long_about = None, args_conflicts_with_subcommands = true)]
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
    /// Write tasks.jsonl from the environments of train_config.yaml, like the cookbook's
    /// prepare_tasks.py: every configured split, shuffled with seed 42, capped per split.
    PrepareTasks(PrepareTasksArgs),
    /// Serve the native engine over SGLang's HTTP API (flags as SGLang's launch_server),
    /// for anything that launches and talks to an SGLang server.
    Serve(crate::serve::ServeArgs),
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
    /// Most tasks per split; the smaller of this and the environment's `num_samples`
    /// applies [all].
    #[arg(long)]
    pub max_tasks: Option<u64>,
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
    /// Model directory in Hugging Face layout (config.json, tokenizer.json, weights).
    /// Without weights, the model is randomly initialised from --seed.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Learning rate [cookbook: 1e-5].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Samples per prompt: the GRPO group size [16].
    #[arg(long)]
    pub n_samples: Option<usize>,
    /// Prompts per step [32].
    #[arg(long)]
    pub rollout_batch_size: Option<usize>,
    /// Most tokens per generate call [4096].
    #[arg(long)]
    pub max_response_len: Option<usize>,
    /// Training tokens per micro-batch per GPU [8192].
    #[arg(long)]
    pub max_tokens_per_gpu: Option<usize>,
    /// Sampling temperature [1.0].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Directory for checkpoints (HF weights + optimizer + trainer state).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from the latest checkpoint in this directory.
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
    /// Recompute each layer in backward instead of keeping activations [true].
    #[arg(long, value_name = "BOOL")]
    pub gradient_checkpointing: Option<bool>,
    /// Whole-episode token budget: prompt plus all turns [8192].
    #[arg(long)]
    pub context_len: Option<usize>,
    /// tasks.jsonl to train from (from `prepare-tasks`); default: list tasks from the servers.
    #[arg(long)]
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
    #[arg(long)]
    pub wandb_run: Option<String>,
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
            context_len: self.context_len,
            task_data: self.task_data.clone(),
            run_name: self.run_name.clone(),
            runs_dir: self.runs_dir.clone(),
            wandb_project: self.wandb_project.clone(),
            wandb_run: self.wandb_run.clone(),
        }
    }
}
