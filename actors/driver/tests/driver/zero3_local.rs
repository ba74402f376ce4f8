//! `--zero-stage 3` through the driver binary in local mode, with two CPU ranks
//! (`[trainer] data_parallel_ranks = 2`, threads over `ThreadCollective`):
//! - from debug rollout data (the same samples every run), ZeRO-3 takes the same steps as
//!   ZeRO-2: per-step loss metrics and the final weights (rank 0's checkpoint, written
//!   from layers gathered off the ranks) agree up to fp32 summation order;
//! - the default local job (native engine, built-in environment) trains and syncs
//!   verified weights to the engine, a layer at a time as every rank gathers it;
//! - `--zero-stage 3` with one rank, and stages other than 2 or 3, are refused by name;
//! - `--grad-reduce-in-bf16` with `--bf16` reaches the ranks (a bf16 gradient shard), and
//!   is refused by name with fp32 weights or one trainer.
//!
//! A driver that asked rank 0 alone for ZeRO-3 weights would wait in the gather
//! forever, so every run here has a deadline.

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{
    assert_success, assert_synced_to_the_checkpoint, cluster, debug_data, debug_train_args,
    driver_with_deadline, help_from, max_diff, plain, refused, sorted_weights, step, strings,
    verified_two_rank_job, SAME_STEPS_FLAGS,
};
use manta_telemetry::read_metrics;

/// How long one tiny-model run may take before it counts as hung (a gather only some
/// ranks joined).
const DEADLINE: Duration = Duration::from_secs(180);

/// Runs `driver ARGS` from the workspace with `env`, killed after [`DEADLINE`].
fn driver(args: &[String], env: &[(&str, &str)], dir: &Path) -> Output {
    driver_with_deadline(args, env, dir, DEADLINE)
}

/// Debug-data training flags, three steps, with [`SAME_STEPS_FLAGS`] (a KL term, a
/// large Adam eps so summation-order noise of near-zero gradients does not flip whole
/// Adam steps) and ZeRO stage `stage`.
fn debug_args(cluster: &Path, data: &Path, save: &Path, runs: &Path, stage: &str) -> Vec<String> {
    [
        strings(&["--cluster", cluster.to_str().unwrap()]),
        debug_train_args(data, 3, save, 0, runs, "r"),
        strings(&SAME_STEPS_FLAGS),
        strings(&["--zero-stage", stage]),
    ]
    .concat()
}

/// The log line `spawn_ranks` writes, asked for at info level: proof of which stage ran.
const RANKS_LOG: (&str, &str) = ("RUST_LOG", "warn,manta_driver=info");

#[test]
fn zero3_ranks_take_the_same_steps_as_zero2_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = debug_data(dir, 3, 5);
    let two = cluster(dir, "data_parallel_ranks = 2");

    let (save2, runs2) = (dir.join("ckpt-2"), dir.join("runs-2"));
    let out2 = assert_success(driver(
        &debug_args(&two, &data, &save2, &runs2, "2"),
        &[RANKS_LOG],
        dir,
    ));
    let (save3, runs3) = (dir.join("ckpt-3"), dir.join("runs-3"));
    let out3 = assert_success(driver(
        &debug_args(&two, &data, &save3, &runs3, "3"),
        &[RANKS_LOG],
        dir,
    ));
    let (log2, log3) = (plain(&out2.stderr), plain(&out3.stderr));
    assert!(log2.contains("zero_stage=2"), "ZeRO-2 ranks:\n{log2}");
    assert!(log3.contains("zero_stage=3"), "ZeRO-3 ranks:\n{log3}");

    // Both ranks saved their optimizer slice; rank 0 wrote the gathered weights.
    let last = save3.join("step_000003");
    for r in 0..2 {
        let shard = last.join(format!("optimizer.rank{r}-of-2.safetensors"));
        assert!(shard.is_file(), "{} missing", shard.display());
    }
    let m2 = read_metrics(&runs2.join("r/metrics.jsonl")).unwrap();
    let m3 = read_metrics(&runs3.join("r/metrics.jsonl")).unwrap();
    for s in 1..=3 {
        let (a, b) = (step(&m2, s), step(&m3, s));
        // The same per-element sums (rank order); only the global norm's fp64 sum runs
        // over other slices (ZeRO-3 pads each layer, ZeRO-2 the whole flat buffer).
        for key in [
            "train/loss",
            "train/pg_loss",
            "train/kl_loss",
            "train/grad_norm",
        ] {
            let (x, y) = (a[key], b[key]);
            assert!(
                (x - y).abs() <= 1e-6 * x.abs().max(1.0),
                "step {s} {key}: ZeRO-2 {x}, ZeRO-3 {y}"
            );
        }
        assert_eq!(a["train/tokens"], b["train/tokens"], "step {s}");
    }
    let start = sorted_weights(&data.join("model/model.safetensors"));
    let w2 = sorted_weights(&save2.join("step_000003/model.safetensors"));
    let w3 = sorted_weights(&last.join("model.safetensors"));
    assert!(max_diff(&start, &w3) > 1e-3, "training moved the weights");
    let d = max_diff(&w2, &w3);
    assert!(d < 1e-5, "ZeRO-3 weights differ from ZeRO-2's by {d}");
}

#[test]
fn zero3_local_job_trains_and_syncs_gathered_weights_to_the_engine() {
    // The default local job (native engine, built-in environment) with two CPU ranks at
    // ZeRO-3; every sync is verified: the engine's weights equal the trainer's bit for
    // bit, and the last sync equals rank 0's checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let (run, save, log) = verified_two_rank_job(
        dir.path(),
        "z3",
        &["--zero-stage", "3"],
        &[("RUST_LOG", "warn,manta_weight_sync=debug")],
        DEADLINE,
    );
    // The engine took each version a layer at a time as the ranks gathered it
    // (tests/zero3_weight_parts.rs shows the ranks never gather ahead of the reader).
    assert_eq!(
        log.matches("weights synced in parts").count(),
        2,
        "both syncs in parts:\n{log}"
    );
    // The engine took version 2 = the weights rank 0 saved from the gathered layers.
    let last = save.join("step_000002");
    for r in 0..2 {
        assert!(last
            .join(format!("optimizer.rank{r}-of-2.safetensors"))
            .is_file());
    }
    assert_synced_to_the_checkpoint(&run, &last);
}

/// The driver's stderr for a run with `[trainer] trainer` and `--zero-stage stage`,
/// refused before it starts.
fn refusal(trainer: &str, stage: &str) -> String {
    refused(trainer, &["--zero-stage", stage], DEADLINE)
}

#[test]
fn zero_stage_refusals_name_the_flag_and_help_explains_it() {
    let err = refusal("", "3");
    assert!(
        err.contains("--zero-stage 3") && err.contains("at least two") && err.contains("has 1"),
        "{err}"
    );
    for bad in ["1", "4"] {
        let err = refusal("data_parallel_ranks = 2", bad);
        assert!(
            err.contains("--zero-stage") && err.contains(&format!("invalid value {bad}")),
            "{err}"
        );
    }
    let err = refusal("data_parallel_ranks = 2", "three");
    assert!(err.contains("--zero-stage"), "{err}");

    let text = help_from("--zero-stage");
    assert!(
        text.contains("ZeRO stage") && text.contains("parameters"),
        "{text}"
    );
}

#[test]
fn grad_reduce_in_bf16_reaches_the_zero3_ranks_and_is_refused_where_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = debug_data(dir, 3, 5);
    let two = cluster(dir, "data_parallel_ranks = 2");
    let (save, runs) = (dir.join("ckpt"), dir.join("runs"));
    let args = [
        debug_args(&two, &data, &save, &runs, "3"),
        strings(&["--bf16", "--grad-reduce-in-bf16"]),
    ]
    .concat();
    let log = ("RUST_LOG", "warn,manta_driver=info,manta_trainer=info");
    let out = assert_success(driver(&args, &[log], dir));
    let log = plain(&out.stderr);
    assert!(
        log.contains("grad_reduce_in_bf16=true"),
        "the ranks' flag:\n{log}"
    );
    assert_eq!(
        log.matches("grad_kind=BFloat16").count(),
        2,
        "each rank's optimizer keeps a bf16 gradient shard:\n{log}"
    );
    let m = read_metrics(&runs.join("r/metrics.jsonl")).unwrap();
    for s in 1..=3 {
        let loss = step(&m, s)["train/loss"];
        assert!(loss.is_finite(), "step {s}: loss {loss}");
    }

    let err = refused(
        "data_parallel_ranks = 2",
        &["--grad-reduce-in-bf16"],
        DEADLINE,
    );
    assert!(
        err.contains("--grad-reduce-in-bf16") && err.contains("fp32"),
        "{err}"
    );
    let err = refused("", &["--bf16", "--grad-reduce-in-bf16"], DEADLINE);
    assert!(
        err.contains("--grad-reduce-in-bf16") && err.contains("one trainer"),
        "{err}"
    );
    let text = help_from("--grad-reduce-in-bf16");
    assert!(
        text.contains("half the gradient shard's memory") && text.contains("bf16 rounding"),
        "{text}"
    );
}
