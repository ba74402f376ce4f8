//! The step loop's sources of groups, end to end in local mode (the real `driver`
//! binary, the tiny model, Manta's built-in environments): dynamic sampling drops
//! groups whose rewards all agree and still fills the batch, groups left over by
//! over-sampling are trained in later steps, and asynchronous mode trains on groups
//! started during the previous step within the staleness bound, episodes that span a
//! weight update going on with the new weights (partial rollouts).

use crate::common;

use common::workspace;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use manta_telemetry::read_metrics;

/// Runs `driver` on the default cluster.toml (tiny model, CPU) and returns stdout.
fn driver(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--save-interval",
            "0",
        ])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs");
    assert!(
        out.status.success(),
        "driver {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn trained_ids(run_dir: &Path) -> Vec<(u64, Vec<u64>)> {
    std::fs::read_to_string(run_dir.join("trained_ids.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap())
                .collect();
            (v["step"].as_u64().unwrap(), ids)
        })
        .collect()
}

#[test]
fn dynamic_sampling_drops_zero_std_groups_and_still_fills_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    // manta/Flat is digits with every reward clamped to 0: each of its groups has zero
    // spread, so dynamic sampling must never train on one.
    let config = tmp.path().join("flat.yaml");
    std::fs::write(
        &config,
        "environments:\n\
         \x20 manta/Digits:\n    url: builtin\n    variant: digits\n    max_turns: 1\n\
         \x20 manta/Flat:\n    url: builtin\n    variant: digits\n    max_turns: 1\n    min_reward: 0.0\n    max_reward: 0.0\n\
         system_prompt_template: \"Follow the instruction.{tools}\"\n",
    )
    .unwrap();
    let runs = tmp.path().join("runs");
    let debug = tmp.path().join("debug/rollout_{rollout_id}.jsonl");
    let stdout = driver(&[
        "--config",
        config.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "dyn",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--n-samples",
        "4",
        "--over-sampling-batch-size",
        "6",
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--save-debug-rollout-data",
        debug.to_str().unwrap(),
    ]);
    // The progress line splits the step's time and reports both throughputs.
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for line in &lines {
        for part in ["(rollout ", "train ", "sync ", "tok/s rollout "] {
            assert!(line.contains(part), "{line}");
        }
    }
    for step in 0..3u64 {
        let path = debug
            .to_str()
            .unwrap()
            .replace("{rollout_id}", &step.to_string());
        let mut groups: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            groups
                .entry(v["group_index"].as_u64().unwrap())
                .or_default()
                .push(v["reward"].as_f64().unwrap());
        }
        assert_eq!(groups.len(), 4, "step {step}: a full batch of groups");
        for (g, rewards) in &groups {
            assert_eq!(rewards.len(), 4, "step {step} group {g}");
            let spread = rewards.iter().cloned().fold(f64::MIN, f64::max)
                - rewards.iter().cloned().fold(f64::MAX, f64::min);
            assert!(
                spread > 1e-6,
                "step {step} trained zero-std group {g}: {rewards:?}"
            );
        }
    }
    let rows = read_metrics(&runs.join("dyn/metrics.jsonl")).unwrap();
    let dropped: f64 = rows
        .iter()
        .map(|(_, m)| m["rollout/dynamic_filter/drop_count"])
        .sum();
    let zero_std: f64 = rows.iter().map(|(_, m)| m["rollout/zero_std/count"]).sum();
    assert!(dropped >= 1.0, "no manta/Flat group was ever dropped");
    assert_eq!(zero_std, dropped, "every zero-std group was dropped");
    for (step, ids) in trained_ids(&runs.join("dyn")) {
        assert_eq!(ids.len(), 16, "step {step}");
    }
}

#[test]
fn groups_left_over_by_over_sampling_are_trained_in_later_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    // 6 groups start in step 1, which keeps 2: with staleness 2 the other 4 feed steps
    // 2 and 3 without any new group being started.
    driver(&[
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "carry",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--over-sampling-batch-size",
        "6",
        "--max-weight-staleness",
        "2",
    ]);
    let rows = read_metrics(&runs.join("carry/metrics.jsonl")).unwrap();
    let launched: Vec<f64> = rows
        .iter()
        .map(|(_, m)| m["rollout/groups/launched"])
        .collect();
    assert_eq!(launched, vec![6.0, 0.0, 0.0]);
    assert_eq!(rows[1].1["rollout/groups/carried"], 4.0);
    assert_eq!(rows[1].1["rollout/groups/prefetched"], 2.0);
    assert_eq!(rows[2].1["rollout/groups/carried"], 2.0);
    for (step, m) in &rows {
        assert!(m["rollout/weight_staleness/max"] <= 2.0, "step {step}");
    }
    // Every started group was trained exactly once: sample ids 0..12, none lost.
    let all: BTreeSet<u64> = trained_ids(&runs.join("carry"))
        .into_iter()
        .flat_map(|(_, ids)| ids)
        .collect();
    assert_eq!(all, (0..12).collect());
}

#[test]
fn async_mode_overlaps_training_within_the_staleness_bound() {
    let tmp = tempfile::tempdir().unwrap();
    // Only the multi-turn counter, with long turns: each episode generates hundreds of
    // tokens over several turns, far longer than a training step of the tiny model, so
    // the groups started during a step are still running when its weights are published
    // (with configs/multiturn.yaml, short single-turn digits groups often finished first).
    let config = tmp.path().join("counter.yaml");
    std::fs::write(
        &config,
        "environments:\n\
         \x20 manta/Counter:\n    url: builtin\n    variant: counter\n    splits: [train]\n    \
         nonterminal_reward: 0.0\n    reward_reduction: sum\n    max_turns: 6\n\
         system_prompt_template: \"You are an agent that acts through tools.{tools}\"\n\
         thinking: false\n",
    )
    .unwrap();
    let runs = tmp.path().join("runs");
    let stdout = driver(&[
        "--config",
        config.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "async",
        "--num-rollout",
        "4",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--max-weight-staleness",
        "1",
        "--partial-rollout",
        "--max-response-len",
        "256",
        "--context-len",
        "2048",
    ]);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        4,
        "{stdout}"
    );
    let rows = read_metrics(&runs.join("async/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 4);
    for (step, m) in &rows {
        // Trained on weights at most one version behind the trainer's.
        assert!(
            m["rollout/weight_staleness/max"] <= 1.0,
            "step {step}: {m:?}"
        );
        assert_eq!(m["rollout/groups/regenerated"], 0.0, "step {step}");
        let wait = m["perf/wait_time_ratio"];
        assert!((0.0..=1.0).contains(&wait), "step {step}: {wait}");
        assert_eq!(m["weights/version"], *step as f64);
        if *step > 1 {
            // Every group this step trained on was started while the previous one ran.
            assert_eq!(m["rollout/groups/prefetched"], 2.0, "step {step}");
        }
    }
    // Partial rollouts happened: some trained sample has tokens of two weight versions
    // (an episode ran on across a weight update instead of being regenerated).
    let partial: Vec<f64> = rows
        .iter()
        .map(|(_, m)| m["rollout/partial_samples"])
        .collect();
    assert!(
        partial.iter().any(|&p| p > 0.0),
        "no step trained a partial rollout: {partial:?}"
    );
    let ids: Vec<u64> = trained_ids(&runs.join("async"))
        .into_iter()
        .flat_map(|(_, ids)| ids)
        .collect();
    let unique: BTreeSet<u64> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a sample was trained twice");
    assert_eq!(ids.len(), 16);
}
