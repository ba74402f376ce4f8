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
    ignored("--moe-aux-loss-coeff", true, ARCHITECTURE),
    ignored("--moe-router-dtype", true, ARCHITECTURE),
    // The cookbook's plug-ins, which Manta's episode loop implements.
    ignored("--custom-generate-function-path", true, EPISODE),
    ignored("--custom-rm-path", true, EPISODE),
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
        flag: "--rollout-top-p",
        accepts: |v| v.parse::<f64>().is_ok_and(|x| x == 1.0),
        instead: "episodes sample the whole distribution (top-p 1.0): drop the flag",
    },
    OneValue {
        flag: "--rollout-top-k",
        accepts: |v| v.parse::<i64>().is_ok_and(|k| k <= 0),
        instead: "episodes sample the whole distribution (top-k -1): drop the flag",
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
const OTHER_COMMANDS: &[&str] = &["generate", "prepare-tasks", "serve", "export", "help"];

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
