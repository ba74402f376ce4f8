//! Weights & Biases: the real `driver` logs each step through the real `wandb` package
//! (offline mode), and a missing Python or `wandb` never stops training.

use crate::common;

use common::workspace;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use manta_telemetry::read_metrics;

/// A few quick steps of the default local job, logging to W&B project `manta-test`.
fn driver(tmp: &Path, steps: &str, env: &[(&str, &Path)]) -> Output {
    let runs = tmp.join("runs");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_driver"));
    cmd.current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--runs-dir",
        ])
        .arg(&runs)
        .args(["--run-name", "wb", "--num-rollout", steps])
        .args(["--rollout-batch-size", "2", "--n-samples", "2"])
        .args(["--wandb-project", "manta-test", "--wandb-run", "e2e"])
        .env("RUST_LOG", "warn")
        .env("WANDB_MODE", "offline")
        .env("WANDB_DIR", tmp)
        .env("WANDB_CONFIG_DIR", tmp.join("wandb-config"))
        .env("WANDB_CACHE_DIR", tmp.join("wandb-cache"))
        .env("WANDB_DATA_DIR", tmp.join("wandb-data"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("driver runs");
    assert!(
        out.status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The offline run's .wandb files under `WANDB_DIR`.
fn wandb_files(wandb_dir: &Path) -> Vec<PathBuf> {
    let Ok(runs) = std::fs::read_dir(wandb_dir.join("wandb")) else {
        return Vec::new();
    };
    runs.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("offline-run-"))
        .flat_map(|e| std::fs::read_dir(e.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wandb"))
        .collect()
}

#[test]
fn each_step_reaches_wandb_with_the_values_in_metrics_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    driver(tmp.path(), "2", &[]);
    let files = wandb_files(tmp.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let out = Command::new(common::python())
        .arg(workspace().join("actors/driver/tests/py/read_wandb_offline.py"))
        .arg(&files[0])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(run["project"], "manta-test");
    assert_eq!(run["name"], "e2e");
    assert_eq!(run["config"]["n_samples"], 2, "{}", run["config"]);
    let history = run["history"].as_array().unwrap();
    let rows = read_metrics(&tmp.path().join("runs/wb/metrics.jsonl")).unwrap();
    assert_eq!(
        history
            .iter()
            .map(|h| h["_step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        rows.iter().map(|(step, _)| *step).collect::<Vec<_>>()
    );
    assert_eq!(rows.len(), 2);
    for ((step, metrics), logged) in rows.iter().zip(history) {
        for (name, value) in metrics {
            let got = logged[name]
                .as_f64()
                .unwrap_or_else(|| panic!("step {step}: {name} missing in W&B: {logged}"));
            assert!(
                (got - value).abs() <= 1e-12 * value.abs().max(1.0),
                "step {step} {name}: W&B {got}, metrics.jsonl {value}"
            );
        }
    }
}

#[test]
fn a_missing_wandb_or_python_is_a_warning_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    // A real Python without site-packages: `import wandb` fails.
    let bare = tmp.path().join("python-without-site");
    std::fs::write(
        &bare,
        format!("#!/bin/sh\nexec {} -S \"$@\"\n", common::python().display()),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&bare).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&bare, perms).unwrap();
    let out = driver(tmp.path(), "1", &[("MANTA_PYTHON", &bare)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot import wandb"), "{stderr}");
    assert!(
        stderr.contains("metrics are no longer sent to W&B"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("done: 1 steps"));

    let missing = tmp.path().join("no-such-python");
    let out = driver(tmp.path(), "1", &[("MANTA_PYTHON", &missing)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("W&B logging is off") && stderr.contains("no-such-python"),
        "{stderr}"
    );
    assert!(wandb_files(tmp.path()).is_empty());
}
