//! `--save-debug-rollout-data` on a real local run (native engine, built-in environment)
//! writes slime's per-step sample files; `--load-debug-rollout-data` trains from them with
//! no engine: its rewards are the saved ones.

use crate::common;

use common::workspace;
use std::process::Command;

use manta_telemetry::read_metrics;

fn driver(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs");
    assert!(
        out.status.success(),
        "driver {args:?} failed\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn saved_debug_rollouts_are_slime_files_that_train_without_an_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let template = tmp.path().join("debug/rollout_{rollout_id}.jsonl");
    let common = [
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "3",
        "--num-rollout",
        "2",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--run-name",
        "live",
        "--save-debug-rollout-data",
        template.to_str().unwrap(),
    ]);
    driver(&args);
    let mut rewards = Vec::new();
    for k in 0..2 {
        let path = tmp.path().join(format!("debug/rollout_{k}.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 6, "{path:?}");
        for r in &rows {
            for key in [
                "group_index",
                "index",
                "tokens",
                "response_length",
                "loss_mask",
                "rollout_log_probs",
                "reward",
                "status",
            ] {
                assert!(r.get(key).is_some(), "{key} missing in {r}");
            }
            let n = r["response_length"].as_u64().unwrap() as usize;
            assert_eq!(r["loss_mask"].as_array().unwrap().len(), n);
            assert_eq!(r["rollout_log_probs"].as_array().unwrap().len(), n);
        }
        rewards.push(
            rows.iter()
                .map(|r| r["reward"].as_f64().unwrap())
                .sum::<f64>()
                / 6.0,
        );
    }
    let live = read_metrics(&runs.join("live/metrics.jsonl")).unwrap();

    let mut args = common.to_vec();
    args.extend([
        "--run-name",
        "replay",
        "--load-debug-rollout-data",
        template.to_str().unwrap(),
    ]);
    driver(&args);
    let replay = read_metrics(&runs.join("replay/metrics.jsonl")).unwrap();
    assert_eq!(replay.len(), 2);
    for (k, ((_, l), (_, r))) in live.iter().zip(&replay).enumerate() {
        assert!((l["rollout/raw_reward"] - rewards[k]).abs() < 1e-9);
        assert!((r["rollout/raw_reward"] - rewards[k]).abs() < 1e-9);
        // Step 1 starts from the same weights: the same loss on the same samples.
        if k == 0 {
            assert!(
                (l["train/loss"] - r["train/loss"]).abs() < 1e-6,
                "{l:?} vs {r:?}"
            );
        }
    }
}

#[test]
fn debug_rollout_only_runs_rollouts_and_trains_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let template = tmp.path().join("debug/rollout_{rollout_id}.jsonl");
    let ckpt = tmp.path().join("ckpt");
    let out = driver(&[
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "rollout-only",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--num-rollout",
        "2",
        "--save",
        ckpt.to_str().unwrap(),
        "--save-interval",
        "1",
        "--save-debug-rollout-data",
        template.to_str().unwrap(),
        "--debug-rollout-only",
    ]);
    let rows = read_metrics(&runs.join("rollout-only/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 2);
    for (step, m) in &rows {
        assert!(m.contains_key("rollout/raw_reward"), "step {step}: {m:?}");
        assert!(m.contains_key("perf/rollout_time"), "step {step}: {m:?}");
        for trained in ["train/loss", "perf/train_time", "perf/update_weights_time"] {
            assert!(!m.contains_key(trained), "step {step} has {trained}: {m:?}");
        }
    }
    // The engines kept their first weights: step 2's samples come from version 0.
    let step2 = std::fs::read_to_string(tmp.path().join("debug/rollout_1.jsonl")).unwrap();
    for line in step2.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(row["weight_versions"], serde_json::json!(["0"]), "{row}");
    }
    assert!(!ckpt.exists(), "no checkpoint is written without training");
    assert!(String::from_utf8_lossy(&out.stdout).contains("step     2/2"));
}

#[test]
fn replaying_more_groups_than_were_saved_names_the_file_and_group() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let template = tmp.path().join("debug/rollout_{rollout_id}.jsonl");
    let base = |run: &'static str, batch: &'static str| {
        vec![
            "--cluster".to_string(),
            "cluster.toml".into(),
            "--runs-dir".into(),
            runs.to_str().unwrap().into(),
            "--run-name".into(),
            run.into(),
            "--rollout-batch-size".into(),
            batch.into(),
            "--n-samples".into(),
            "2".into(),
            "--num-rollout".into(),
            "1".into(),
        ]
    };
    let mut save = base("live", "2");
    save.extend([
        "--save-debug-rollout-data".into(),
        template.to_str().unwrap().into(),
    ]);
    driver(&save.iter().map(String::as_str).collect::<Vec<_>>());
    // Three groups a step from a file of two.
    let mut replay = base("replay", "3");
    replay.extend([
        "--load-debug-rollout-data".into(),
        template.to_str().unwrap().into(),
    ]);
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(&replay)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs");
    assert!(!out.status.success(), "a short file must fail the run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rollout_0.jsonl") && err.contains("group 2"),
        "{err}"
    );
}

/// A dump in slime's numbering (`group_index` and `index` counted across the run: the
/// second rollout's groups are 2 and 3, its samples 4..7) trains: samples are read by
/// their position in each file, as slime's loader reads them.
#[test]
fn a_dump_in_slimes_run_wide_numbering_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("slime_{rollout_id}.jsonl");
    let (groups, n) = (2u32, 2u32);
    for rollout in 0..2u32 {
        let mut text = String::new();
        for g in 0..groups {
            let group_index = rollout * groups + g;
            for i in 0..n {
                let row = serde_json::json!({
                    "group_index": group_index,
                    "index": group_index * n + i,
                    "tokens": [10, 11, 12, 40 + i, 50 + g],
                    "response_length": 2,
                    "loss_mask": [1, 1],
                    "rollout_log_probs": [-0.5, -0.7],
                    "reward": f64::from(i),
                    "status": "completed",
                });
                text.push_str(&format!("{row}\n"));
            }
        }
        let path = template
            .to_str()
            .unwrap()
            .replace("{rollout_id}", &rollout.to_string());
        std::fs::write(path, text).unwrap();
    }
    let runs = tmp.path().join("runs");
    let out = driver(&[
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "slime-dump",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--num-rollout",
        "2",
        "--load-debug-rollout-data",
        template.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("step     2/2"), "{stdout}");
    let rows = manta_telemetry::read_metrics(&runs.join("slime-dump/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 2);
}
