//! Two steps trained from `--load-debug-rollout-data` (no engine, no environment) match
//! an independent PyTorch transcription of slime's loss, AdamW and LR schedule
//! (actors/trainer/tests/py/slime_reference.py): per-step `train/*` metrics and the
//! final weights, within fp32 tolerance. The union is compared: a metric or tensor only
//! one side has fails the check, bar the metrics the script's ONE_SIDED names (with why).
//! Qwen3-MoE models (transformers' `Qwen3MoeForCausalLM`) are checked the same way, with
//! Megatron's load-balancing loss in the reference when `--moe-aux-loss-coeff` is set.

use crate::common;

use common::{debug_train_args, strings, workspace};
use std::process::Command;

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes a tiny HF Qwen3 and two debug rollout files, trains on them with `flags`
/// (name, value; `None` is a switch), and has the PyTorch reference check the result.
fn matches_pytorch(flags: &[(&str, Option<&str>)]) {
    matches_pytorch_for("assets/tiny-qwen3/config.json", &[], flags);
}

/// [`matches_pytorch`] for the model of `config` (under the workspace) with `make_args`
/// passed to the script's `make` (`--set KEY=JSON` config overrides, `--noise X`).
fn matches_pytorch_for(config: &str, make_args: &[&str], flags: &[(&str, Option<&str>)]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let script = workspace().join("actors/trainer/tests/py/slime_reference.py");
    run(
        Command::new(common::python())
            .arg(&script)
            .arg("make")
            .arg(out)
            .args([
                "--config",
                workspace().join(config).to_str().unwrap(),
                "--seed",
                "3",
            ])
            .args(make_args),
        "making the model and debug data",
    );
    let mut args = debug_train_args(out, 2, &out.join("ckpt"), 1, &out.join("runs"), "r");
    args.extend(strings(&["--temperature", "1.0", "--clip-grad", "1.0"]));
    let mut json = serde_json::Map::new();
    json.insert("num_rollout".into(), 2.into());
    json.insert("temperature".into(), 1.0.into());
    json.insert("clip_grad".into(), 1.0.into());
    for (name, value) in flags {
        args.push(format!("--{}", name.replace('_', "-")));
        let v = match value {
            Some(v) => {
                args.push(v.to_string());
                v.parse::<f64>()
                    .map(serde_json::Value::from)
                    .unwrap_or_else(|_| serde_json::Value::from(*v))
            }
            None => true.into(),
        };
        json.insert(name.to_string(), v);
    }
    std::fs::write(
        out.join("flags.json"),
        serde_json::Value::Object(json).to_string(),
    )
    .unwrap();
    run(
        Command::new(env!("CARGO_BIN_EXE_driver"))
            .current_dir(workspace())
            .args(&args)
            .env("RUST_LOG", "warn"),
        "driver --load-debug-rollout-data",
    );
    run(
        Command::new(common::python())
            .arg(&script)
            .arg("check")
            .arg(out)
            .args([
                "--run",
                out.join("runs/r").to_str().unwrap(),
                "--ckpt",
                out.join("ckpt/step_000002").to_str().unwrap(),
                "--flags",
                out.join("flags.json").to_str().unwrap(),
            ]),
        "the PyTorch reference check",
    );
}

#[test]
fn rollout_logprobs_dual_clip_tis_kl_entropy_cosine_lr_match_pytorch() {
    matches_pytorch(&[
        ("lr", Some("0.01")),
        ("min_lr", Some("0.002")),
        ("lr_decay_style", Some("cosine")),
        ("adam_eps", Some("0.001")),
        ("use_rollout_logprobs", None),
        ("eps_clip", Some("0.2")),
        ("eps_clip_high", Some("0.28")),
        ("eps_clip_c", Some("3.0")),
        ("use_kl_loss", None),
        ("kl_loss_coef", Some("0.1")),
        ("kl_loss_type", Some("low_var_kl")),
        ("entropy_coef", Some("0.01")),
        ("use_tis", None),
        ("tis_clip", Some("1.5")),
        ("tis_clip_low", Some("0.5")),
    ]);
}

#[test]
fn gspo_per_token_whitened_masked_tis_unbiased_k2_warmup_match_pytorch() {
    matches_pytorch(&[
        ("lr", Some("0.01")),
        ("lr_warmup_iters", Some("1")),
        ("adam_eps", Some("0.001")),
        ("weight_decay", Some("0.1")),
        ("advantage_estimator", Some("gspo")),
        ("use_rollout_logprobs", None),
        ("calculate_per_token_loss", None),
        ("normalize_advantages", None),
        ("use_kl_loss", None),
        ("kl_loss_coef", Some("0.2")),
        ("kl_loss_type", Some("k2")),
        ("use_unbiased_kl", None),
        ("use_tis", None),
        ("tis_mode", Some("mask")),
        ("tis_clip", Some("1.3")),
        ("tis_clip_low", Some("0.8")),
    ]);
}

#[test]
fn two_updates_per_rollout_opsm_linear_lr_match_pytorch() {
    matches_pytorch(&[
        ("lr", Some("0.01")),
        ("min_lr", Some("0.001")),
        ("lr_decay_style", Some("linear")),
        ("adam_eps", Some("0.001")),
        ("num_steps_per_rollout", Some("2")),
        ("eps_clip", Some("0.1")),
        ("use_kl_loss", None),
        ("kl_loss_coef", Some("0.05")),
        ("kl_loss_type", Some("k3")),
        ("use_tis", None),
        ("tis_clip", Some("1.4")),
        ("tis_clip_low", Some("0.6")),
        ("use_opsm", None),
        ("opsm_delta", Some("0.001")),
    ]);
}

#[test]
fn cispo_entropy_per_token_match_pytorch() {
    matches_pytorch(&[
        ("lr", Some("0.01")),
        ("adam_eps", Some("0.001")),
        ("advantage_estimator", Some("cispo")),
        ("use_rollout_logprobs", None),
        ("eps_clip", Some("0.5")),
        ("eps_clip_high", Some("0.1")),
        ("entropy_coef", Some("0.02")),
        ("calculate_per_token_loss", None),
    ]);
}

#[test]
fn reinforce_plus_plus_variants_match_pytorch() {
    for estimator in ["reinforce_plus_plus", "reinforce_plus_plus_baseline"] {
        matches_pytorch(&[
            ("lr", Some("0.01")),
            ("adam_eps", Some("0.001")),
            ("advantage_estimator", Some(estimator)),
            ("normalize_advantages", None),
            ("use_rollout_logprobs", None),
            ("use_kl_loss", None),
            ("kl_loss_coef", Some("0.1")),
            ("kl_loss_type", Some("k2")),
        ]);
    }
}

const TINY_MOE: &str = "assets/tiny-qwen3-moe/config.json";

/// Rollout log-probs are transformers' own (no noise), so the first step's
/// `train/train_rollout_logprob_abs_diff` is |Manta's log-probs - transformers'| (0 on
/// the reference side): renormalised top-k, every layer sparse.
#[test]
fn moe_logprobs_and_two_grpo_steps_match_transformers() {
    matches_pytorch_for(
        TINY_MOE,
        &["--noise", "0"],
        &[
            ("lr", Some("0.01")),
            ("adam_eps", Some("0.001")),
            ("use_kl_loss", None),
            ("kl_loss_coef", Some("0.1")),
            ("kl_loss_type", Some("low_var_kl")),
            ("entropy_coef", Some("0.01")),
        ],
    );
}

/// Raw top-k gate weights, a dense layer (1) between sparse ones, and Megatron's
/// load-balancing loss in the gradient.
#[test]
fn moe_dense_layer_raw_topk_aux_loss_match_transformers() {
    matches_pytorch_for(
        TINY_MOE,
        &[
            "--noise",
            "0",
            "--set",
            "num_hidden_layers=3",
            "--set",
            "mlp_only_layers=[1]",
            "--set",
            "norm_topk_prob=false",
        ],
        &[
            ("lr", Some("0.01")),
            ("adam_eps", Some("0.001")),
            ("moe_aux_loss_coeff", Some("0.5")),
            ("use_rollout_logprobs", None),
            ("use_tis", None),
            ("tis_clip", Some("1.5")),
        ],
    );
}

/// Every second layer sparse (`decoder_sparse_step` 2: layers 1 and 3), aux loss on,
/// per-token loss.
#[test]
fn moe_sparse_step_2_aux_loss_per_token_match_transformers() {
    matches_pytorch_for(
        TINY_MOE,
        &[
            "--set",
            "num_hidden_layers=4",
            "--set",
            "decoder_sparse_step=2",
        ],
        &[
            ("lr", Some("0.01")),
            ("adam_eps", Some("0.001")),
            ("moe_aux_loss_coeff", Some("0.2")),
            ("calculate_per_token_loss", None),
            ("use_kl_loss", None),
            ("kl_loss_coef", Some("0.05")),
            ("kl_loss_type", Some("k3")),
        ],
    );
}
