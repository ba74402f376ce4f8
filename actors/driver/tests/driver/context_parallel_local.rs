//! `--context-parallel-size 2` through the driver binary in local mode, with two CPU
//! ranks (`[trainer] data_parallel_ranks = 2`, threads over `ThreadCollective`) as one
//! context-parallel group:
//! - from debug rollout data, three steps equal one trainer's (no data parallelism) on
//!   the same samples: per-step loss metrics within 1e-6 relative, token counts exactly,
//!   the final weights within 1e-5 (fp32 summation order only). A driver that gave each
//!   rank a data-parallel share instead of the whole batch would train on other tokens;
//! - a resume (`--load`) of the CP ranks from step 2 ends at step 3's weights;
//! - the default local job (native engine) trains and syncs verified weights;
//! - sizes the driver cannot run are refused by name, and `--help` explains the flag.

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

/// How long one tiny-model run may take before it counts as hung (a collective only
/// some ranks joined, e.g. ranks sent different batches).
const DEADLINE: Duration = Duration::from_secs(180);

/// Runs `driver ARGS` from the workspace with `env`, killed after [`DEADLINE`].
fn driver(args: &[String], env: &[(&str, &str)], dir: &Path) -> Output {
    driver_with_deadline(args, env, dir, DEADLINE)
}

/// Debug-data training flags, three steps, with [`SAME_STEPS_FLAGS`] (a KL term, a
/// large Adam eps so summation-order noise of near-zero gradients does not flip whole
/// Adam steps), then `extra`.
fn debug_args(
    cluster: &Path,
    data: &Path,
    save: &Path,
    runs: &Path,
    extra: &[&str],
) -> Vec<String> {
    [
        strings(&["--cluster", cluster.to_str().unwrap()]),
        debug_train_args(data, 3, save, 0, runs, "r"),
        strings(&SAME_STEPS_FLAGS),
        strings(extra),
    ]
    .concat()
}

/// The log line `spawn_ranks` writes, asked for at info level: proof that the ranks ran
/// as a context-parallel group.
const RANKS_LOG: (&str, &str) = ("RUST_LOG", "warn,manta_driver=info");

const CP2: &[&str] = &["--context-parallel-size", "2"];

#[test]
fn context_parallel_ranks_take_the_same_steps_as_one_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = debug_data(dir, 3, 5);
    let one = cluster(dir, "");
    let (save1, runs1) = (dir.join("ckpt-1"), dir.join("runs-1"));
    assert_success(driver(
        &debug_args(&one, &data, &save1, &runs1, &[]),
        &[RANKS_LOG],
        dir,
    ));
    let two_dir = dir.join("two");
    std::fs::create_dir_all(&two_dir).unwrap();
    let two = cluster(&two_dir, "data_parallel_ranks = 2");
    let (save2, runs2) = (dir.join("ckpt-cp"), dir.join("runs-cp"));
    let mut args = debug_args(&two, &data, &save2, &runs2, CP2);
    // A checkpoint every step, for the resume below.
    let at = args.iter().position(|a| a == "--save-interval").unwrap();
    args[at + 1] = "1".into();
    let out2 = assert_success(driver(&args, &[RANKS_LOG], dir));
    let log2 = plain(&out2.stderr);
    assert!(
        log2.contains("context_parallel_size=2"),
        "context-parallel ranks:\n{log2}"
    );

    let m1 = read_metrics(&runs1.join("r/metrics.jsonl")).unwrap();
    let m2 = read_metrics(&runs2.join("r/metrics.jsonl")).unwrap();
    for s in 1..=3 {
        let (a, b) = (step(&m1, s), step(&m2, s));
        for key in [
            "train/loss",
            "train/pg_loss",
            "train/kl_loss",
            "train/grad_norm",
        ] {
            let (x, y) = (a[key], b[key]);
            assert!(
                (x - y).abs() <= 1e-6 * x.abs().max(1.0),
                "step {s} {key}: one trainer {x}, context parallel {y}"
            );
        }
        // Rank 0 alone counts the tokens: the same as one trainer, not twice as many.
        assert_eq!(a["train/tokens"], b["train/tokens"], "step {s}");
    }
    let start = sorted_weights(&data.join("model/model.safetensors"));
    let w1 = sorted_weights(&save1.join("step_000003/model.safetensors"));
    let last = save2.join("step_000003");
    let w2 = sorted_weights(&last.join("model.safetensors"));
    assert!(max_diff(&start, &w2) > 1e-3, "training moved the weights");
    let d = max_diff(&w1, &w2);
    assert!(
        d < 1e-5,
        "context-parallel weights differ from one trainer's by {d}"
    );
    for r in 0..2 {
        let shard = last.join(format!("optimizer.rank{r}-of-2.safetensors"));
        assert!(shard.is_file(), "{} missing", shard.display());
    }

    // Resume: the CP ranks restore step 2's checkpoint (weights, each rank's optimizer
    // shard) and take step 3 again, landing on the uninterrupted run's weights.
    let resume = dir.join("ckpt-resume");
    std::fs::create_dir_all(&resume).unwrap();
    copy_dir(&save2.join("step_000002"), &resume.join("step_000002"));
    std::fs::write(resume.join("latest"), "step_000002").unwrap();
    let runs3 = dir.join("runs-resume");
    let mut args = debug_args(&two, &data, &resume, &runs3, CP2);
    args.extend(strings(&["--load", resume.to_str().unwrap()]));
    assert_success(driver(&args, &[], dir));
    let m3 = read_metrics(&runs3.join("r/metrics.jsonl")).unwrap();
    assert_eq!(m3.iter().map(|r| r.0).collect::<Vec<_>>(), vec![3]);
    let w3 = sorted_weights(&resume.join("step_000003/model.safetensors"));
    for key in ["train/loss", "train/grad_norm"] {
        assert_eq!(
            step(&m2, 3)[key],
            step(&m3, 3)[key],
            "step 3 {key}: resumed"
        );
    }
    for ((n, x), (_, y)) in w2.iter().zip(&w3) {
        assert!(
            x.equal(y),
            "{n} differs after resuming the context-parallel ranks"
        );
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn context_parallel_local_job_trains_and_syncs_weights_to_the_engine() {
    // The default local job (native engine, built-in environment) with two CPU ranks as
    // one CP group; every sync is verified (engine weights equal the trainer's bit for
    // bit), and the last sync equals rank 0's checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let (run, save, log) = verified_two_rank_job(
        dir.path(),
        "cp",
        &["--context-parallel-size", "2"],
        &[RANKS_LOG],
        DEADLINE,
    );
    assert!(log.contains("context_parallel_size=2"), "{log}");
    assert_synced_to_the_checkpoint(&run, &save.join("step_000002"));
}

/// The driver's stderr for a run refused before it starts.
fn refusal(trainer: &str, extra: &[&str]) -> String {
    refused(trainer, extra, DEADLINE)
}

#[test]
fn context_parallel_refusals_name_the_flag_and_help_explains_it() {
    let two = "data_parallel_ranks = 2";
    let err = refusal(two, &["--context-parallel-size", "0"]);
    assert!(
        err.contains("--context-parallel-size") && err.contains('0'),
        "{err}"
    );
    let err = refusal("", CP2);
    assert!(
        err.contains("--context-parallel-size 2") && err.contains("has 1"),
        "{err}"
    );
    let err = refusal(two, &["--context-parallel-size", "3"]);
    assert!(
        err.contains("--context-parallel-size 3") && err.contains("has 2"),
        "{err}"
    );
    let err = refusal(two, &["--context-parallel-size", "2", "--zero-stage", "3"]);
    assert!(
        err.contains("--context-parallel-size 2") && err.contains("--zero-stage 3"),
        "{err}"
    );
    let err = refusal(
        two,
        &["--context-parallel-size", "2", "--true-on-policy-mode"],
    );
    assert!(
        err.contains("--context-parallel-size 2") && err.contains("--true-on-policy-mode"),
        "{err}"
    );

    let text = help_from("--context-parallel-size");
    assert!(
        text.contains("Context parallelism") && text.contains("same whole batch"),
        "{text}"
    );
}
