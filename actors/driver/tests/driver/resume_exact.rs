//! Exact resume: a run that dies after saving step 3 and is resumed with `--load`
//! reaches the same step-4 loss and weights as a run that was never interrupted. Trained
//! from debug rollout data, so only trainer state (weights, AdamW moments, step count,
//! LR schedule position) decides the outcome.

use crate::common;

use common::{debug_data, debug_train_args, driver_run, sorted_weights, strings};
use std::path::Path;

use manta_telemetry::read_metrics;

fn args(data: &Path, save: &Path, runs: &Path, load: Option<&Path>) -> Vec<String> {
    let mut a = debug_train_args(data, 4, save, 1, runs, "r");
    a.extend(strings(&[
        "--lr",
        "0.01",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "0.001",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.1",
        "--use-rollout-logprobs",
    ]));
    if let Some(dir) = load {
        a.push("--load".into());
        a.push(dir.to_str().unwrap().into());
    }
    a
}

#[test]
fn stop_after_step_3_then_load_equals_the_uninterrupted_step_4() {
    let dir = tempfile::tempdir().unwrap();
    let data = debug_data(dir.path(), 4, 11);

    // Uninterrupted: 4 steps.
    let (save_a, runs_a) = (dir.path().join("ckpt-a"), dir.path().join("runs-a"));
    let out = driver_run(&args(&data, &save_a, &runs_a, None));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Interrupted: step 4's data is missing, so the run dies in step 4 after saving step 3.
    let partial = dir.path().join("partial");
    std::fs::create_dir_all(&partial).unwrap();
    std::os::unix::fs::symlink(data.join("model"), partial.join("model")).unwrap();
    for k in 0..3 {
        let f = format!("debug_{k}.jsonl");
        std::fs::copy(data.join(&f), partial.join(&f)).unwrap();
    }
    let (save_b, runs_b) = (dir.path().join("ckpt-b"), dir.path().join("runs-b"));
    let out = driver_run(&args(&partial, &save_b, &runs_b, None));
    assert!(!out.status.success(), "the run should die in step 4");
    let latest = std::fs::read_to_string(save_b.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step_000003");

    // Resumed with the full data.
    let out = driver_run(&args(&data, &save_b, &runs_b, Some(&save_b)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let a = read_metrics(&runs_a.join("r/metrics.jsonl")).unwrap();
    let b = read_metrics(&runs_b.join("r/metrics.jsonl")).unwrap();
    let step4 = |m: &[(u64, std::collections::BTreeMap<String, f64>)]| {
        m.iter()
            .find(|(s, _)| *s == 4)
            .expect("step 4 recorded")
            .1
            .clone()
    };
    let (a4, b4) = (step4(&a), step4(&b));
    for key in [
        "train/loss",
        "train/pg_loss",
        "train/kl_loss",
        "train/grad_norm",
        "train/lr",
    ] {
        assert_eq!(
            a4[key], b4[key],
            "{key}: uninterrupted {} vs resumed {}",
            a4[key], b4[key]
        );
    }
    let wa = sorted_weights(&save_a.join("step_000004/model.safetensors"));
    let wb = sorted_weights(&save_b.join("step_000004/model.safetensors"));
    assert_eq!(wa.len(), wb.len());
    for ((na, ta), (nb, tb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs after resume");
    }
}
