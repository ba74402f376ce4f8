//! slime's and Miles' command lines, read before clap sees them, so a cookbook run.sh
//! (its own flags, the flags it hands `train.py`/`train_async.py`, and `-- EXTRA_ARGS`)
//! starts a Manta run or fails once, naming every flag that stands in the way.
//!
//! Flags Manta has a setting for are clap's (spelt as slime spells them, or aliases).
//! The tables here hold the rest: flags with no use in Manta (placement comes from
//! cluster.toml, the model's shape from its config.json, ...) are dropped with one
//! warning naming them; flags accepted for one value only (`--optimizer adam`) are
//! checked; flags asking for something Manta does not build, and unknown flags, are all
//! listed in one error with what to do, instead of clap's first-error-wins (and its
//! "did you mean", which points `--use-wandb` at `--use-unbiased-kl`).

use std::collections::BTreeSet;
use std::ffi::OsString;

use clap::CommandFactory;

use crate::cli::Cli;

/// A flag Manta accepts and has no use for, and why.
pub struct Ignored {
    pub flag: &'static str,
    /// Whether the flag takes a value (`--tp 4`) or stands alone (`--colocate`).
    pub takes_value: bool,
    pub why: &'static str,
}

const PLACEMENT: &str = "placement and parallelism come from cluster.toml";
const BACKEND: &str = "Manta has no Megatron/FSDP backend or Python checkout to point at";
const ARCHITECTURE: &str = "the model's architecture comes from its config.json";
const EPISODE: &str = "the cookbook's generate and reward functions are built in";
const WANDB: &str = "W&B reads WANDB_API_KEY; runs are not grouped";

const fn ignored(flag: &'static str, takes_value: bool, why: &'static str) -> Ignored {
    Ignored {
        flag,
        takes_value,
        why,
    }
}

/// Flags accepted with a warning and otherwise ignored.
pub const IGNORED: &[Ignored] = &[
    // run.sh's own placement flags (Miles and slime versions).
    ignored("--actor-gpus", true, PLACEMENT),
    ignored("--rollout-gpus", true, PLACEMENT),
    ignored("--tp", true, PLACEMENT),
    ignored("--actor-nodes", true, PLACEMENT),
    ignored("--num-gpus", true, PLACEMENT),
    // slime's placement and parallelism.
    ignored("--actor-num-nodes", true, PLACEMENT),
    ignored("--actor-num-gpus-per-node", true, PLACEMENT),
    ignored("--rollout-num-gpus", true, PLACEMENT),
    ignored("--rollout-num-gpus-per-engine", true, PLACEMENT),
    ignored("--colocate", false, PLACEMENT),
    ignored("--tensor-model-parallel-size", true, PLACEMENT),
    ignored("--pipeline-model-parallel-size", true, PLACEMENT),
    ignored("--expert-model-parallel-size", true, PLACEMENT),
    ignored("--expert-tensor-parallel-size", true, PLACEMENT),
    ignored("--sglang-mem-fraction-static", true, PLACEMENT),
    // Backends and paths.
    ignored("--train-backend", true, BACKEND),
    ignored("--megatron-ckpt", true, BACKEND),
    ignored("--model-args", true, BACKEND),
    ignored("--megatron-path", true, BACKEND),
    ignored("--slime-path", true, BACKEND),
    ignored("--megatron-to-hf-mode", true, BACKEND),
    ignored("--attention-backend", true, BACKEND),
    ignored("--sglang-attention-backend", true, BACKEND),
    ignored("--attention-softmax-in-fp32", false, BACKEND),
    ignored("--accumulate-allreduce-grads-in-fp32", false, BACKEND),
    // Megatron's model arguments (slime's scripts/models/*.sh).
    ignored("--num-layers", true, ARCHITECTURE),
    ignored("--hidden-size", true, ARCHITECTURE),
    ignored("--ffn-hidden-size", true, ARCHITECTURE),
    ignored("--num-attention-heads", true, ARCHITECTURE),
    ignored("--group-query-attention", false, ARCHITECTURE),
    ignored("--num-query-groups", true, ARCHITECTURE),
    ignored("--kv-channels", true, ARCHITECTURE),
    ignored("--swiglu", false, ARCHITECTURE),
    ignored("--disable-bias-linear", false, ARCHITECTURE),
    ignored("--add-qkv-bias", false, ARCHITECTURE),
    ignored("--qk-layernorm", false, ARCHITECTURE),
    ignored("--normalization", true, ARCHITECTURE),
    ignored("--norm-epsilon", true, ARCHITECTURE),
    ignored("--position-embedding-type", true, ARCHITECTURE),
    ignored("--use-rotary-position-embeddings", false, ARCHITECTURE),
    ignored("--rotary-base", true, ARCHITECTURE),
    ignored("--vocab-size", true, ARCHITECTURE),
    ignored("--make-vocab-size-divisible-by", true, ARCHITECTURE),
    ignored("--untie-embeddings-and-output-weights", false, ARCHITECTURE),
    ignored("--seq-length", true, ARCHITECTURE),
    ignored("--max-position-embeddings", true, ARCHITECTURE),
    ignored("--num-experts", true, ARCHITECTURE),
    ignored("--moe-ffn-hidden-size", true, ARCHITECTURE),
    ignored("--moe-router-topk", true, ARCHITECTURE),
    ignored("--moe-grouped-gemm", false, ARCHITECTURE),
    ignored("--moe-token-dispatcher-type", true, ARCHITECTURE),
    ignored("--moe-router-score-function", true, ARCHITECTURE),
    ignored("--moe-router-load-balancing-type", true, ARCHITECTURE),
    ignored("--moe-router-dtype", true, ARCHITECTURE),
    ignored("--model-name", true, ARCHITECTURE),
    // The cookbook's plug-ins, which Manta's episode loop implements.
    ignored("--custom-generate-function-path", true, EPISODE),
    ignored("--custom-rm-path", true, EPISODE),
    ignored("--eval-function-path", true, EPISODE),
    ignored(
        "--log-passrate",
        false,
        "eval pass rates (eval/NAME-pass@k) are always logged",
    ),
    ignored("--wandb-key", true, WANDB),
    ignored("--wandb-group", true, WANDB),
];

/// A flag accepted for the values that mean what Manta does, and refused otherwise.
pub struct OneValue {
    pub flag: &'static str,
    pub accepts: fn(&str) -> bool,
    /// What Manta does instead, for the error.
    pub instead: &'static str,
}

fn is_zero(v: &str) -> bool {
    v.parse::<f64>().is_ok_and(|x| x == 0.0)
}

/// Flags whose value must be the one Manta implements.
pub const ONE_VALUE: &[OneValue] = &[
    OneValue {
        flag: "--input-key",
        accepts: |v| v == "prompt",
        instead: "tasks.jsonl is read in the cookbook's schema: its key is `prompt`",
    },
    OneValue {
        flag: "--label-key",
        accepts: |v| v == "label",
        instead: "tasks.jsonl is read in the cookbook's schema: its key is `label`",
    },
    OneValue {
        flag: "--metadata-key",
        accepts: |v| v == "metadata",
        instead: "tasks.jsonl is read in the cookbook's schema: its key is `metadata`",
    },
    OneValue {
        flag: "--optimizer",
        accepts: |v| v == "adam",
        instead: "Manta trains with AdamW: pass adam or drop the flag",
    },
    OneValue {
        flag: "--eval-input-key",
        accepts: |v| v == "prompt",
        instead: "eval tasks.jsonl files are read in the cookbook's schema: its key is `prompt`",
    },
    OneValue {
        flag: "--eval-label-key",
        accepts: |v| v == "label",
        instead: "eval tasks.jsonl files are read in the cookbook's schema: its key is `label`",
    },
    OneValue {
        flag: "--attention-dropout",
        accepts: is_zero,
        instead: "training runs without dropout: pass 0.0 or drop the flag",
    },
    OneValue {
        flag: "--hidden-dropout",
        accepts: is_zero,
        instead: "training runs without dropout: pass 0.0 or drop the flag",
    },
];

/// A flag asking for something Manta does not build, and what to do.
pub struct Unsupported {
    pub flag: &'static str,
    pub takes_value: bool,
    pub what_to_do: &'static str,
}

const MTP: &str = "multi-token-prediction training is not built: drop it";
const SPECULATIVE: &str = "speculative decoding is not built in Manta's engines: drop it";
const DETERMINISTIC: &str = "bitwise-deterministic runs are not built: drop it \
    (--true-on-policy-mode makes engine and trainer log-probs agree)";

const fn unsupported(
    flag: &'static str,
    takes_value: bool,
    what_to_do: &'static str,
) -> Unsupported {
    Unsupported {
        flag,
        takes_value,
        what_to_do,
    }
}

/// Flags refused (all of them in one error).
pub const UNSUPPORTED: &[Unsupported] = &[
    unsupported("--enable-mtp-training", false, MTP),
    unsupported("--mtp-num-layers", true, MTP),
    unsupported("--mtp-loss-scaling-factor", true, MTP),
    unsupported("--sglang-speculative-algorithm", true, SPECULATIVE),
    unsupported("--sglang-speculative-num-steps", true, SPECULATIVE),
    unsupported("--sglang-speculative-eagle-topk", true, SPECULATIVE),
    unsupported("--sglang-speculative-num-draft-tokens", true, SPECULATIVE),
    unsupported("--sglang-speculative-draft-model-path", true, SPECULATIVE),
    unsupported(
        "--sglang-enable-draft-weights-cpu-backup",
        false,
        SPECULATIVE,
    ),
    unsupported(
        "--eval-config",
        true,
        "evaluation sets come from --eval-prompt-data NAME PATH [NAME PATH ...]: \
         name each set and its tasks.jsonl there",
    ),
    unsupported(
        "--use-routing-replay",
        false,
        "routing replay of the trainer's own old-policy pass (R2) is not built: \
         --use-rollout-routing-replay replays the rollout's routing",
    ),
    unsupported("--deterministic-mode", false, DETERMINISTIC),
    unsupported(
        "--sglang-enable-deterministic-inference",
        false,
        DETERMINISTIC,
    ),
];

/// The command line clap should parse, and the flags dropped on the way.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    pub args: Vec<OsString>,
    /// Ignored flags as given, each once, in order, with the reason.
    pub ignored: Vec<(String, &'static str)>,
}

impl Translated {
    /// The one warning about ignored flags, or `None` when there were none.
    pub fn warning(&self) -> Option<String> {
        if self.ignored.is_empty() {
            return None;
        }
        let mut by_reason: Vec<(&'static str, Vec<&str>)> = Vec::new();
        for (flag, why) in &self.ignored {
            match by_reason.iter_mut().find(|(w, _)| w == why) {
                Some((_, flags)) => flags.push(flag),
                None => by_reason.push((why, vec![flag])),
            }
        }
        let parts: Vec<String> = by_reason
            .iter()
            .map(|(why, flags)| format!("{} ({why})", flags.join(" ")))
            .collect();
        Some(format!(
            "ignoring slime/Miles flags Manta has no use for: {}",
            parts.join("; ")
        ))
    }
}

/// Every flag of the command line that cannot run, each with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", render_refused(.0))]
pub struct Refused(pub Vec<(String, String)>);

fn render_refused(flags: &[(String, String)]) -> String {
    let mut out = format!(
        "{} flag{} cannot be used (docs/migration.md maps slime's flags to Manta's):",
        flags.len(),
        if flags.len() == 1 { "" } else { "s" }
    );
    for (flag, what) in flags {
        out.push_str(&format!("\n  {flag}: {what}"));
    }
    out
}

/// Subcommands whose own flags are clap's alone.
const OTHER_COMMANDS: &[&str] = &[
    "generate",
    "prepare-tasks",
    "serve",
    "export",
    "status",
    "help",
];

/// The long flags (and aliases) of a training run, as clap knows them.
fn training_flags() -> BTreeSet<String> {
    let command = Cli::command();
    let mut flags: BTreeSet<String> = ["--help", "--version"].map(String::from).into();
    for arg in command.get_arguments() {
        if let Some(long) = arg.get_long() {
            flags.insert(format!("--{long}"));
        }
        for alias in arg.get_all_aliases().into_iter().flatten() {
            flags.insert(format!("--{alias}"));
        }
    }
    flags
}

/// Rewrites a training command line (program name first): drops `--` (what follows is
/// parsed the same way, as run.sh hands it to slime), drops ignored flags, checks
/// one-value flags, and refuses unsupported and unknown flags, all of them at once.
/// Other subcommands pass through untouched.
pub fn translate<I, S>(argv: I) -> Result<Translated, Refused>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let first = argv.get(1).and_then(|a| a.to_str());
    if first.is_some_and(|c| OTHER_COMMANDS.contains(&c)) {
        return Ok(Translated {
            args: argv,
            ignored: Vec::new(),
        });
    }
    let known = training_flags();
    let mut out: Vec<OsString> = Vec::with_capacity(argv.len());
    let mut ignored_flags: Vec<(String, &'static str)> = Vec::new();
    let mut refused: Vec<(String, String)> = Vec::new();
    let mut seen_separator = false;
    let mut tokens = argv.into_iter().enumerate().peekable();
    while let Some((position, token)) = tokens.next() {
        let Some(text) = token.to_str().map(str::to_string) else {
            out.push(token);
            continue;
        };
        if position == 0 || !text.starts_with("--") {
            out.push(token);
            continue;
        }
        if text == "--" {
            if seen_separator {
                refused.push(("--".into(), "give `--` once, before slime's flags".into()));
            }
            seen_separator = true;
            continue;
        }
        let (flag, inline_value) = match text.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (text.clone(), None),
        };
        let take_value = |tokens: &mut std::iter::Peekable<_>| -> Option<String> {
            if inline_value.is_some() {
                return inline_value.clone();
            }
            next_value(tokens)
        };
        if known.contains(&flag) {
            out.push(token);
            continue;
        }
        if let Some(entry) = IGNORED.iter().find(|e| e.flag == flag) {
            if entry.takes_value {
                take_value(&mut tokens);
            }
            if !ignored_flags.iter().any(|(f, _)| *f == flag) {
                ignored_flags.push((flag, entry.why));
            }
            continue;
        }
        if let Some(entry) = ONE_VALUE.iter().find(|e| e.flag == flag) {
            match take_value(&mut tokens) {
                Some(v) if (entry.accepts)(&v) => {}
                Some(v) => refused.push((format!("{flag} {v}"), entry.instead.into())),
                None => refused.push((flag, format!("needs a value; {}", entry.instead))),
            }
            continue;
        }
        if let Some(entry) = UNSUPPORTED.iter().find(|e| e.flag == flag) {
            if entry.takes_value {
                take_value(&mut tokens);
            }
            refused.push((flag, entry.what_to_do.into()));
            continue;
        }
        // Unknown: skip what looks like its value, so it is not read as another flag's.
        take_value(&mut tokens);
        refused.push((
            flag,
            "not a Manta flag nor a slime flag Manta knows (driver --help lists Manta's)".into(),
        ));
    }
    if !refused.is_empty() {
        return Err(Refused(refused));
    }
    Ok(Translated {
        args: out,
        ignored: ignored_flags,
    })
}

/// The next token when it is a value (not a flag); negative numbers are values.
fn next_value<I>(tokens: &mut std::iter::Peekable<I>) -> Option<String>
where
    I: Iterator<Item = (usize, OsString)>,
{
    let is_value = tokens.peek().is_some_and(|(_, t)| {
        let t = t.to_string_lossy();
        !t.starts_with("--")
    });
    if is_value {
        tokens.next().map(|(_, t)| t.to_string_lossy().into_owned())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use manta_config::TrainSettings;

    /// Translates and parses a training command line.
    fn parse(args: &[&str]) -> (crate::cli::TrainArgs, TrainSettings, Translated) {
        let mut argv = vec!["driver"];
        argv.extend_from_slice(args);
        let translated = translate(argv).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let cli = Cli::try_parse_from(&translated.args).unwrap_or_else(|e| panic!("{e}"));
        let flags = cli.train.overrides();
        flags
            .validate(std::path::Path::new("command line"), "--")
            .unwrap();
        flags.validate_merged().unwrap();
        let settings = flags.resolve();
        (cli.train, settings, translated)
    }

    fn refused(args: &[&str]) -> Vec<String> {
        let mut argv = vec!["driver"];
        argv.extend_from_slice(args);
        translate(argv)
            .expect_err("refused")
            .0
            .into_iter()
            .map(|(flag, _)| flag)
            .collect()
    }

    /// What the Miles cookbook run.sh hands train_async.py, with its defaults, then
    /// its README's `-- EXTRA_ARGS` example.
    const MILES_RUN_SH: &[&str] = &[
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "4",
        "--rollout-num-gpus",
        "4",
        "--rollout-num-gpus-per-engine",
        "4",
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        "/models/Qwen3-4B",
        "--save",
        "/ckpt/",
        "--load",
        "/ckpt/",
        "--save-interval",
        "10",
        "--optimizer",
        "adam",
        "--lr",
        "1e-5",
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.0",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.999",
        "--adam-eps",
        "1e-8",
        "--advantage-estimator",
        "grpo",
        "--prompt-data",
        "/data/tasks.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-shuffle",
        "--custom-generate-function-path",
        "generate.generate",
        "--n-samples-per-prompt",
        "16",
        "--rollout-batch-size",
        "32",
        "--num-steps-per-rollout",
        "1",
        "--global-batch-size",
        "512",
        "--rollout-max-response-len",
        "4096",
        "--rollout-temperature",
        "0.8",
        "--num-rollout",
        "3000",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "8192",
        "--gradient-checkpointing",
        "--sglang-mem-fraction-static",
        "0.8",
        "--use-wandb",
        "--wandb-project",
        "miles-openreward",
        "--wandb-run-name",
        "miles-rl-openreward-1",
        "--wandb-key",
        "secret",
        "--wandb-group",
        "miles-openreward",
        "--",
        "--context-parallel-size",
        "2",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
    ];

    #[test]
    fn miles_run_sh_reaches_the_settings_with_slime_meanings() {
        let (args, s, translated) = parse(MILES_RUN_SH);
        assert_eq!(s.model, std::path::PathBuf::from("/models/Qwen3-4B"));
        assert_eq!(s.save.as_deref(), Some(std::path::Path::new("/ckpt/")));
        assert_eq!(s.load.as_deref(), Some(std::path::Path::new("/ckpt/")));
        assert_eq!((s.save_interval, s.num_rollout), (10, 3000));
        assert_eq!((s.lr, s.weight_decay), (1e-5, 0.0));
        assert_eq!((s.adam_beta1, s.adam_beta2, s.adam_eps), (0.9, 0.999, 1e-8));
        assert_eq!(s.algo.lr_decay_style, manta_core::algo::DecayStyle::Cosine);
        assert_eq!(
            s.algo.advantage_estimator,
            manta_core::algo::AdvantageEstimator::Grpo
        );
        assert_eq!(
            s.task_data.as_deref(),
            Some(std::path::Path::new("/data/tasks.jsonl"))
        );
        assert_eq!((s.n_samples, s.rollout_batch_size), (16, 32));
        assert_eq!(s.algo.num_steps_per_rollout, 1);
        assert_eq!((s.max_response_len, s.temperature), (4096, 0.8));
        assert_eq!(s.max_tokens_per_gpu, 8192);
        assert!(s.recompute.is_some(), "bare --gradient-checkpointing is on");
        assert_eq!(s.wandb_project.as_deref(), Some("miles-openreward"));
        assert_eq!(s.wandb_run.as_deref(), Some("miles-rl-openreward-1"));
        assert!(args.use_wandb && args.use_dynamic_batch_size && args.rollout_shuffle);
        // After `--`: parsed the same way.
        assert_eq!(s.context_parallel_size, 2);
        assert!(s.algo.use_kl_loss);
        assert_eq!(s.algo.kl_loss_coef, 0.01);
        let warning = translated.warning().expect("one warning");
        for flag in [
            "--actor-num-nodes",
            "--actor-num-gpus-per-node",
            "--rollout-num-gpus",
            "--rollout-num-gpus-per-engine",
            "--train-backend",
            "--custom-generate-function-path",
            "--sglang-mem-fraction-static",
            "--wandb-key",
            "--wandb-group",
        ] {
            assert!(warning.contains(flag), "{flag} not in {warning}");
        }
        assert!(!warning.contains("secret"), "values stay out: {warning}");
    }

    #[test]
    fn slime_run_sh_with_megatron_flags_runs_with_one_warning() {
        let (_, s, translated) = parse(&[
            "--actor-num-nodes",
            "1",
            "--actor-num-gpus-per-node",
            "4",
            "--rollout-num-gpus",
            "4",
            "--colocate",
            "--rollout-num-gpus-per-engine",
            "4",
            "--num-layers",
            "48",
            "--hidden-size",
            "2048",
            "--swiglu",
            "--qk-layernorm",
            "--hf-checkpoint",
            "/models/Qwen3-4B",
            "--load",
            "/megatron/ckpt",
            "--save",
            "/ckpt",
            "--eps-clip",
            "0.2",
            "--tensor-model-parallel-size",
            "4",
            "--pipeline-model-parallel-size",
            "1",
            "--context-parallel-size",
            "1",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0.0",
            "--accumulate-allreduce-grads-in-fp32",
            "--attention-softmax-in-fp32",
            "--attention-backend",
            "flash",
            "--model-name",
            "qwen3-30b-a3b",
        ]);
        assert_eq!(s.eps_clip, 0.2);
        assert_eq!(s.recompute.map(|r| r.num_layers), Some(1));
        let warning = translated.warning().unwrap();
        assert_eq!(warning.lines().count(), 1, "{warning}");
        assert!(
            warning.contains("--swiglu") && warning.contains("config.json"),
            "{warning}"
        );
        assert!(
            warning.contains("--tensor-model-parallel-size") && warning.contains("cluster.toml")
        );
    }

    #[test]
    fn run_sh_own_flags_are_accepted() {
        let (_, s, translated) = parse(&[
            "--model",
            "/m",
            "--lr",
            "5e-6",
            "--n-samples",
            "8",
            "--rollout-batch-size",
            "16",
            "--max-response-len",
            "1024",
            "--max-total-len",
            "4096",
            "--max-tokens-per-gpu",
            "4096",
            "--temperature",
            "1.0",
            "--num-rollout",
            "5",
            "--task-data",
            "t.jsonl",
            "--config",
            "c.yaml",
            "--wandb-project",
            "p",
            "--wandb-run",
            "r",
            "--actor-gpus",
            "4",
            "--rollout-gpus",
            "4",
            "--tp",
            "4",
            "--actor-nodes",
            "1",
            "--train-backend",
            "megatron",
            "--megatron-ckpt",
            "/x",
            "--model-args",
            "m.sh",
            "--megatron-path",
            "/mp",
            "--slime-path",
            "/sp",
            "--num-gpus",
            "4",
        ]);
        assert_eq!(
            (s.n_samples, s.rollout_batch_size, s.context_len),
            (8, 16, 4096)
        );
        assert_eq!(s.wandb_run.as_deref(), Some("r"));
        assert_eq!(translated.ignored.len(), 10);
    }

    #[test]
    fn every_refused_flag_is_named_in_one_error() {
        let mut argv = vec!["driver", "--lr", "1e-5"];
        argv.extend([
            "--enable-mtp-training",
            "--mtp-num-layers",
            "1",
            "--mtp-loss-scaling-factor",
            "0.2",
            "--sglang-speculative-algorithm",
            "EAGLE",
            "--sglang-speculative-num-steps",
            "3",
            "--sglang-speculative-eagle-topk",
            "1",
            "--sglang-speculative-num-draft-tokens",
            "4",
            "--sglang-speculative-draft-model-path",
            "/d",
            "--sglang-enable-draft-weights-cpu-backup",
            "--deterministic-mode",
            "--sglang-enable-deterministic-inference",
            "--optimizer",
            "sgd",
            "--input-key",
            "question",
            "--eval-config",
            "eval.yaml",
            "--use-wandbx",
            "--",
            "--not-a-flag",
            "3",
        ]);
        let err = translate(argv).unwrap_err();
        let names: Vec<&str> = err.0.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            names,
            [
                "--enable-mtp-training",
                "--mtp-num-layers",
                "--mtp-loss-scaling-factor",
                "--sglang-speculative-algorithm",
                "--sglang-speculative-num-steps",
                "--sglang-speculative-eagle-topk",
                "--sglang-speculative-num-draft-tokens",
                "--sglang-speculative-draft-model-path",
                "--sglang-enable-draft-weights-cpu-backup",
                "--deterministic-mode",
                "--sglang-enable-deterministic-inference",
                "--optimizer sgd",
                "--input-key question",
                "--eval-config",
                "--use-wandbx",
                "--not-a-flag",
            ]
        );
        let text = err.to_string();
        assert!(text.starts_with("16 flags cannot be used"), "{text}");
        assert!(
            text.contains("AdamW") && text.contains("multi-token"),
            "{text}"
        );
        // No clap "did you mean" misdirection.
        assert!(!text.contains("--use-unbiased-kl"), "{text}");
    }

    #[test]
    fn one_value_flags_accept_their_value_and_inline_values_work() {
        let (_, _, t) = parse(&[
            "--optimizer=adam",
            "--rollout-top-p",
            "1.0",
            "--rollout-top-k",
            "-1",
            "--metadata-key",
            "metadata",
            "--tp=2",
        ]);
        assert_eq!(t.ignored.len(), 1);
        assert_eq!(refused(&["--eval-input-key", "q"]), ["--eval-input-key q"]);
    }

    #[test]
    fn rollout_top_p_and_top_k_have_slime_meanings_and_eval_falls_back_to_them() {
        let (_, s, _) = parse(&[
            "--rollout-top-p",
            "0.9",
            "--rollout-top-k",
            "20",
            "--eval-interval",
            "2",
            "--eval-prompt-data",
            "math",
            "m.jsonl",
            "code",
            "c.jsonl",
            "--n-samples-per-eval-prompt",
            "4",
            "--eval-temperature",
            "0",
            "--skip-eval-before-train",
            "--log-passrate",
        ]);
        assert_eq!((s.top_p, s.top_k), (0.9, 20));
        let e = &s.eval;
        assert_eq!((e.top_p, e.top_k, e.temperature), (0.9, 20, 0.0));
        assert_eq!(
            (e.interval, e.n_samples, e.skip_before_train),
            (Some(2), 4, true)
        );
        let names: Vec<&str> = e.datasets.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["math", "code"]);
    }

    #[test]
    fn global_batch_size_derives_and_is_checked() {
        let (_, s, _) = parse(&[
            "--rollout-batch-size",
            "4",
            "--n-samples",
            "4",
            "--global-batch-size",
            "8",
        ]);
        assert_eq!(s.algo.num_steps_per_rollout, 2);
        for bad in [
            &[
                "--rollout-batch-size",
                "4",
                "--n-samples",
                "4",
                "--global-batch-size",
                "5",
            ][..],
            &[
                "--rollout-batch-size",
                "4",
                "--n-samples",
                "4",
                "--global-batch-size",
                "8",
                "--num-steps-per-rollout",
                "1",
            ],
        ] {
            let mut argv = vec!["driver"];
            argv.extend_from_slice(bad);
            let cli = Cli::try_parse_from(argv).unwrap();
            let err = cli
                .train
                .overrides()
                .validate_merged()
                .unwrap_err()
                .to_string();
            assert!(err.contains("--global-batch-size"), "{err}");
        }
    }

    #[test]
    fn later_flags_win_as_in_argparse_and_other_commands_pass_through() {
        let (_, s, _) = parse(&["--lr", "1e-5", "--", "--lr", "2e-5"]);
        assert_eq!(s.lr, 2e-5);
        let (_, s, _) = parse(&["--gradient-checkpointing", "false"]);
        assert!(s.recompute.is_none());
        let t = translate(["driver", "prepare-tasks", "--tp", "4"]).unwrap();
        assert_eq!(t.args.len(), 4);
    }
}
