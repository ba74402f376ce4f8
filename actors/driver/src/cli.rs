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
    /// Every training setting: flags here, keys of `[train]` tables.
    #[command(flatten)]
    pub settings: TrainOverrides,
    /// slime's switch for packing micro-batches by --max-tokens-per-gpu, which Manta
    /// always does; accepted for run.sh.
    #[arg(long)]
    pub use_dynamic_batch_size: bool,
    /// bf16 weights and compute with fp32 master weights and AdamW state, as Megatron's
    /// `--bf16`; the same as cluster.toml's `[trainer] bf16 = true`, which it overrides.
    #[arg(long)]
    pub bf16: bool,
    /// slime's switch for shuffling the prompts every epoch, which Manta always does
    /// (seeded by --seed); accepted for run.sh.
    #[arg(long)]
    pub rollout_shuffle: bool,
    /// slime's switch for W&B logging: needs --wandb-project (which alone turns W&B
    /// on in Manta).
    #[arg(long)]
    pub use_wandb: bool,
    /// With --save: after the run's final checkpoint, write it as a Hugging Face model
    /// directory to SAVE/hf (as `driver export`, tokenizer files from --model), replacing
    /// the export of an earlier run there. Checkpoints of earlier steps stay as they are
    /// (`driver export` writes any of them).
    #[arg(long)]
    pub save_hf: bool,
    /// Training settings file: a `[train]` table with cluster.toml's `[train]` keys
    /// (configs/local-tiny.toml holds the tiny local model's); the flags win over it,
    /// and it wins over cluster.toml's `[train]`.
    #[arg(long, value_name = "FILE")]
    pub train_settings: Option<PathBuf>,
    /// Where each flag of the command line was spelt (setting key → flag as given), for
    /// the resolved-settings listing; filled by the binary from its arguments.
    #[arg(skip)]
    pub spellings: std::collections::BTreeMap<String, String>,
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
        self.settings.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_core::algo::{AdvantageEstimator, DecayStyle, KlType, TisMode};

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
        assert_eq!(s.algo.advantage_estimator, AdvantageEstimator::Gspo);
        assert!(s.algo.use_kl_loss && s.algo.use_tis && !s.algo.use_opsm);
        assert_eq!(s.algo.kl_loss_type, KlType::LowVarKl);
        assert_eq!(s.algo.tis_mode, TisMode::Mask);
        assert_eq!(s.algo.entropy_coef, -0.001);
        assert_eq!(s.algo.num_steps_per_rollout, 2);
        assert_eq!(
            (s.algo.lr_decay_style, s.algo.min_lr),
            (DecayStyle::Cosine, 1e-7)
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

    /// The training command's flags are the settings ([`TrainOverrides`], each also a
    /// `[train]` key) plus the few that only make sense on a command line. A new flag
    /// added to [`TrainArgs`] itself fails here until it is either a setting (a field of
    /// `TrainOverrides`, so cluster.toml can set it too) or listed below with why not.
    #[test]
    fn training_flags_are_settings_or_named_command_line_only() {
        use clap::CommandFactory;
        const COMMAND_LINE_ONLY: &[&str] = &[
            // Which files to read: they cannot live inside those files.
            "cluster",
            "config",
            "train-settings",
            // slime's switches for what Manta always does, accepted for run.sh.
            "use-dynamic-batch-size",
            "rollout-shuffle",
            "use-wandb",
            // Overrides of cluster.toml's [trainer] bf16, which is where it is set.
            "bf16",
            // What this process does around the run, not how it trains.
            "save-hf",
            "on-stop",
            "status-addr",
            "max-failed-episode-ratio",
            "max-failed-steps",
            "keep-last",
        ];
        let settings: std::collections::BTreeSet<String> =
            match serde_json::to_value(TrainOverrides::default()) {
                Ok(serde_json::Value::Object(map)) => {
                    map.keys().map(|k| k.replace('_', "-")).collect()
                }
                other => panic!("TrainOverrides serialized as {other:?}"),
            };
        let command = Cli::command();
        let mut unexplained = Vec::new();
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if !settings.contains(long) && !COMMAND_LINE_ONLY.contains(&long) {
                unexplained.push(long.to_string());
            }
        }
        assert!(
            unexplained.is_empty(),
            "flags that are neither settings nor command-line-only: {unexplained:?}"
        );
        for long in COMMAND_LINE_ONLY {
            assert!(
                command.get_arguments().any(|a| a.get_long() == Some(long)),
                "--{long} is listed as command-line-only but is no flag"
            );
            assert!(!settings.contains(*long), "--{long} is a setting too");
        }
    }
}
