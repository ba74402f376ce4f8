//! End to end in local mode: the real `driver` binary trains the tiny model for 3
//! steps against the built-in environment server, then resumes for a 4th.

use crate::common;

use common::{driver_ok as driver, workspace};
use std::path::Path;
use std::process::Command;

use manta_telemetry::read_metrics;

/// Tensors of a safetensors file by name.
fn read_weights(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(path).expect("readable weights");
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// Reads the run's event file with TensorBoard's own EventAccumulator (PyPI `tensorboard`).
fn tensorboard_has_reward_for_steps(run_dir: &Path, steps: &[i64]) {
    let python = std::env::var("MANTA_PYTHON")
        .unwrap_or_else(|_| workspace().join(".venv/bin/python").display().to_string());
    let script = "import sys, json\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
acc = EventAccumulator(sys.argv[1]); acc.Reload()\n\
print(json.dumps([[e.step, e.value] for e in acc.Scalars('rollout/raw_reward')]))\n";
    let out = Command::new(python)
        .args(["-c", script, run_dir.to_str().unwrap()])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(i64, f64)> =
        serde_json::from_slice(&out.stdout).expect("json from EventAccumulator");
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), steps);
    let jsonl = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    for ((_, tb), (_, m)) in rows.iter().zip(&jsonl) {
        assert!((tb - m["rollout/raw_reward"]).abs() < 1e-6);
    }
}

#[test]
fn three_local_steps_train_and_sync_then_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let save = tmp.path().join("ckpt");
    let common = [
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "0",
        "--rollout-batch-size",
        "4",
        "--n-samples",
        "4",
    ];
    let mut args = common.to_vec();
    args.extend(["--num-rollout", "3", "--run-name", "first"]);
    let out = driver(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        3,
        "{stdout}"
    );

    // Every step wrote its metrics, and the engine acknowledged weight version = step.
    let rows = read_metrics(&runs.join("first/metrics.jsonl")).unwrap();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (step, m) in &rows {
        assert_eq!(
            m["weights/version"], *step as f64,
            "engine version after step {step}"
        );
        assert!(m["train/grad_norm"] > 0.0, "step {step} had no gradient");
        for key in [
            "rollout/raw_reward",
            "train/loss",
            "perf/step_time",
            "rollout/response_len/mean",
        ] {
            assert!(m.contains_key(key), "missing {key}");
        }
    }
    assert!(runs.join("first/curves.png").is_file());
    tensorboard_has_reward_for_steps(&runs.join("first"), &[1, 2, 3]);

    // The checkpoint's weights differ from the random init the run started from.
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step_000003");
    let trained = read_weights(&save.join("step_000003/model.safetensors"));
    let init = {
        let opts = manta_trainer::TrainerOptions {
            model_dir: workspace().join("assets/tiny-qwen3"),
            seed: 1,
            device: tch::Device::Cpu,
            adam: manta_trainer::optimizer::AdamWConfig {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            clip: manta_trainer::loss::ClipRange {
                eps_clip: 0.2,
                eps_clip_high: 0.2,
            },
            clip_grad: 1.0,
            temperature: 1.0,
            max_tokens_per_gpu: 4096,
            use_rollout_logprobs: false,
            logprob_chunk: 64,
            recompute: None,
            layout: Default::default(),
            bf16: None,
            algo: Default::default(),
        };
        manta_trainer::Trainer::new(opts).unwrap().export_weights()
    };
    let names: Vec<&String> = trained.iter().map(|(n, _)| n).collect();
    assert_eq!(names, init.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let changed = trained
        .iter()
        .zip(&init)
        .filter(|((_, a), (_, b))| a.size() == b.size() && !a.allclose(b, 0.0, 0.0, false))
        .count();
    assert_eq!(
        changed,
        trained.len(),
        "every tensor should have moved after 3 AdamW steps"
    );

    // Resume: --load picks up at step 4 and the engine gets version 4.
    let mut args = common.to_vec();
    args.extend([
        "--num-rollout",
        "4",
        "--run-name",
        "resumed",
        "--load",
        save.to_str().unwrap(),
    ]);
    driver(&args);
    let rows = read_metrics(&runs.join("resumed/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, 4);
    assert_eq!(rows[0].1["weights/version"], 4.0);
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step_000004"
    );
}

#[test]
fn config_errors_name_file_key_and_value() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(&cluster, "[rollout]\nmax_batch_size = 0\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            cluster.to_str().unwrap(),
            "--config",
            "train_config.yaml",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cluster.toml")
            && err.contains("rollout.max_batch_size")
            && err.contains(" 0"),
        "{err}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--n-samples",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--n-samples") && err.contains("at least 1"),
        "{err}"
    );

    let bad = tmp.path().join("train_config.yaml");
    std::fs::write(
        &bad,
        "environments:\n  manta/Digits:\n    url: builtin\n    max_turn: 2\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--config",
            bad.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("train_config.yaml") && err.contains("max_turn"),
        "{err}"
    );
}

/// Steps recorded in a run's JSONL file, in file order.
fn steps_in(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_second_run_with_the_same_name_does_not_mix_with_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let save = tmp.path().join("ckpt");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--runs-dir",
            runs.to_str().unwrap(),
            "--rollout-batch-size",
            "2",
            "--n-samples",
            "2",
            "--run-name",
            "same",
            "--save-interval",
            "0",
        ];
        args.extend(extra);
        String::from_utf8_lossy(&driver(&args).stdout).into_owned()
    };
    let ckpt = save.to_str().unwrap();
    run(&["--num-rollout", "2", "--save", ckpt]);
    let second = run(&["--num-rollout", "2"]);
    assert!(second.contains("runs/same-2"), "{second}");
    for dir in ["same", "same-2"] {
        let dir = runs.join(dir);
        assert_eq!(steps_in(&dir.join("metrics.jsonl")), [1, 2]);
        assert_eq!(steps_in(&dir.join("trained_ids.jsonl")), [1, 2]);
        assert!(dir.join("curves.png").is_file());
    }

    // A crash after an unsaved step 3 left its records behind; resuming from the step-2
    // checkpoint continues the first run's directory and trains step 3 once.
    let first = runs.join("same");
    for file in ["metrics.jsonl", "trained_ids.jsonl"] {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(first.join(file))
            .unwrap();
        std::io::Write::write_all(
            &mut f,
            b"{\"step\":3,\"rollout/raw_reward\":99.0,\"ids\":[]}\n",
        )
        .unwrap();
    }
    let resumed = run(&["--num-rollout", "3", "--load", ckpt, "--save", ckpt]);
    assert!(resumed.contains("resuming into"), "{resumed}");
    assert_eq!(steps_in(&first.join("metrics.jsonl")), [1, 2, 3]);
    assert_eq!(steps_in(&first.join("trained_ids.jsonl")), [1, 2, 3]);
    let rows = read_metrics(&first.join("metrics.jsonl")).unwrap();
    assert_ne!(rows[2].1["rollout/raw_reward"], 99.0);
    assert_eq!(rows[2].1["weights/version"], 3.0);
    assert!(!runs.join("same-3").exists());
}

/// `[rollout] colocate = true`: the in-process engine frees its KV cache for every
/// training step and gets it back before the weight sync; training goes on as usual.
#[test]
fn colocated_engines_release_their_kv_cache_for_each_training_step() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = workspace().canonicalize().unwrap();
    // The shipped cluster.toml with the tiny local example's [train] settings.
    let cluster = (std::fs::read_to_string(ws.join("cluster.toml")).unwrap()
        + &std::fs::read_to_string(ws.join("configs/local-tiny.toml")).unwrap())
        .replace(
            "train_config = \"train_config.yaml\"",
            &format!("train_config = {:?}", ws.join("train_config.yaml")),
        )
        .replace(
            "model = \"assets/tiny-qwen3\"",
            &format!("model = {:?}", ws.join("assets/tiny-qwen3")),
        )
        .replacen("[rollout]\n", "[rollout]\ncolocate = true\n", 1);
    let path = tmp.path().join("colocated.toml");
    std::fs::write(&path, cluster).unwrap();
    let runs = tmp.path().join("runs");
    driver(&[
        "--cluster",
        path.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "colocated",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--save-interval",
        "0",
    ]);
    let metrics = std::fs::read_to_string(runs.join("colocated/metrics.jsonl")).unwrap();
    let released: Vec<f64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["rollout/kv_released_engines"].as_f64().unwrap_or(0.0)
        })
        .collect();
    assert_eq!(released, [1.0, 1.0, 1.0], "{metrics}");
}
