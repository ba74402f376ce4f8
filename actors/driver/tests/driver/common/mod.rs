//! What the driver's integration tests share: where the workspace is (they run the
//! `driver` binary from it, so `cluster.toml` and `assets/` resolve), and a checked run.
#![allow(dead_code)] // each test binary uses its own subset

pub mod sdk_server;
pub mod serve;
pub mod workers;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python with torch, transformers and the `openreward` SDK: $MANTA_PYTHON (the
/// Makefile sets it), else the repository's .venv.
pub fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv/bin/python"))
}

/// Runs `driver ARGS` from the workspace (RUST_LOG=warn), whatever its outcome.
pub fn driver_run<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs")
}

/// Fails the test, with both output streams, unless the process succeeded.
pub fn assert_success(out: Output) -> Output {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `driver ARGS` from the workspace (RUST_LOG=warn) and fails the test, with both
/// output streams, if it does not succeed.
pub fn driver_ok(args: &[&str]) -> Output {
    let out = driver_run(args);
    assert!(
        out.status.success(),
        "driver {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Writes `steps` rollouts of debug rollout data (2 groups × 3 samples each, from
/// `seed`) and a random tiny model into `dir/data` with the PyTorch transcription of
/// slime's formulas (actors/trainer/tests/py/slime_reference.py); returns `dir/data`.
pub fn debug_data(dir: &Path, steps: usize, seed: u64) -> PathBuf {
    let data = dir.join("data");
    let python = std::env::var("MANTA_PYTHON")
        .unwrap_or_else(|_| workspace().join(".venv/bin/python").display().to_string());
    let made = Command::new(python)
        .arg(workspace().join("actors/trainer/tests/py/slime_reference.py"))
        .args(["make", data.to_str().unwrap()])
        .args(["--steps", &steps.to_string(), "--seed", &seed.to_string()])
        .arg("--config")
        .arg(workspace().join("assets/tiny-qwen3/config.json"))
        .output()
        .expect("run slime_reference.py (set MANTA_PYTHON)");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    data
}

/// Flags that train `num_rollout` steps from the debug rollout data in `data` (see
/// [`debug_data`]: its `model` and `debug_{rollout_id}.jsonl` files), 2 groups × 3
/// samples a step, checkpointing into `save` every `save_interval` steps and logging
/// run `run` under `runs`. Optimizer and loss flags are the caller's.
pub fn debug_train_args(
    data: &Path,
    num_rollout: u32,
    save: &Path,
    save_interval: u32,
    runs: &Path,
    run: &str,
) -> Vec<String> {
    strings(&[
        "--model",
        data.join("model").to_str().unwrap(),
        "--load-debug-rollout-data",
        data.join("debug_{rollout_id}.jsonl").to_str().unwrap(),
        "--num-rollout",
        &num_rollout.to_string(),
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "3",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        &save_interval.to_string(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        run,
    ])
}

/// The loss and optimizer flags of runs whose ranks must take the same steps as one
/// trainer: lr 0.01 and a KL term. Adam's step is about lr × sign(g) where |g| ≫ eps:
/// with a tiny eps the summation-order noise of near-zero gradients flips whole steps
/// (as it would between two micro-batch splits of one trainer), hence eps 1e-4.
pub const SAME_STEPS_FLAGS: [&str; 8] = [
    "--lr",
    "0.01",
    "--adam-eps",
    "1e-4",
    "--use-kl-loss",
    "--kl-loss-coef",
    "0.1",
    "--use-rollout-logprobs",
];

/// The per-step loss metrics that runs taking the same steps agree on.
pub const LOSSES: [&str; 5] = [
    "train/loss",
    "train/pg_loss",
    "train/kl_loss",
    "train/grad_norm",
    "train/ppo_kl",
];

/// A safetensors file's tensors, sorted by name.
pub fn sorted_weights(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(path).expect("readable weights");
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// A free TCP port on the loopback interface (for a worker to listen on).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port()
}

/// `N` distinct free ports: the listeners are held until all are picked, so two calls of
/// [`free_port`] in a row cannot hand out the same port twice.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("its address").port())
}

/// A `worker` process, killed and reaped when the test lets go of it.
pub struct Worker(pub std::process::Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `driver ARGS` from the workspace with `env` (RUST_LOG=warn), its output in
/// `dir`, killed after `deadline`: a run of ranks that waits in a collective only some
/// of them joined fails the test instead of hanging it.
pub fn driver_with_deadline(
    args: &[String],
    env: &[(&str, &str)],
    dir: &Path,
    deadline: Duration,
) -> Output {
    let (out_path, err_path) = (dir.join("driver.stdout"), dir.join("driver.stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::from(File::create(&out_path).unwrap()))
        .stderr(Stdio::from(File::create(&err_path).unwrap()))
        .spawn()
        .expect("driver starts");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "driver {args:?} still running after {deadline:?} (a collective only some \
                 ranks joined?)\nstderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Output {
        status,
        stdout: std::fs::read(&out_path).unwrap(),
        stderr: std::fs::read(&err_path).unwrap(),
    }
}

/// A cluster.toml in `dir` with `trainer` as its `[trainer]` section.
pub fn cluster(dir: &Path, trainer: &str) -> PathBuf {
    let path = dir.join("cluster.toml");
    let text = format!(
        "[cluster]\ntrain_config = {:?}\n\n[trainer]\n{trainer}\n",
        workspace().join("train_config.yaml").display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `driver ARGS` in a fresh directory with `[trainer] trainer` (the tiny model, one
/// rollout, then `extra`), which must fail before `deadline`: its stderr.
pub fn refused(trainer: &str, extra: &[&str], deadline: Duration) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = cluster(dir.path(), trainer);
    let runs = dir.path().join("runs");
    let args = [
        strings(&["--cluster", path.to_str().unwrap()]),
        strings(&["--model", "assets/tiny-qwen3", "--num-rollout", "1"]),
        strings(&["--runs-dir", runs.to_str().unwrap()]),
        strings(extra),
    ]
    .concat();
    let out = driver_with_deadline(&args, &[], dir.path(), deadline);
    assert!(
        !out.status.success(),
        "{extra:?} with [trainer] {trainer:?} should be refused"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// What `driver --help` says from `flag` on (600 bytes at most).
pub fn help_from(flag: &str) -> String {
    let help = Command::new(env!("CARGO_BIN_EXE_driver"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let at = help
        .find(flag)
        .unwrap_or_else(|| panic!("--help lists {flag}"));
    help[at..(at + 600).min(help.len())].to_string()
}

/// `a` as owned strings (argument lists).
pub fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A run's metrics by step.
pub type Metrics = Vec<(u64, BTreeMap<String, f64>)>;

/// Step `s`'s metrics.
pub fn step(m: &Metrics, s: u64) -> &BTreeMap<String, f64> {
    &m.iter().find(|(k, _)| *k == s).expect("step recorded").1
}

/// Largest absolute difference between two sorted weight sets with the same names.
pub fn max_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta.to_kind(tch::Kind::Double) - tb.to_kind(tch::Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// The versions a verified run's `weight_sync.jsonl` at `path` records, one a line,
/// each checked to be the version its engine held; with the file's text (for messages).
pub fn verified_versions<C: FromIterator<u64>>(path: &Path) -> (String, C) {
    let verified = std::fs::read_to_string(path).unwrap();
    let versions = verified
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["engine_version"], v["version"], "{l}");
            v["version"].as_u64().unwrap()
        })
        .collect();
    (verified, versions)
}

/// The default local job (cluster.toml: native engine, built-in environment) with two
/// CPU ranks, two steps of 2 × 2 episodes, every sync verified, saved only at the end,
/// plus `extra` flags; run as `run` under `dir` with `env`, killed after `deadline`.
/// Returns the run's directory, the save directory and the driver's plain stderr.
pub fn verified_two_rank_job(
    dir: &Path,
    run: &str,
    extra: &[&str],
    env: &[(&str, &str)],
    deadline: Duration,
) -> (PathBuf, PathBuf, String) {
    // The shipped cluster.toml with the tiny local example's [train] settings.
    let text = std::fs::read_to_string(workspace().join("cluster.toml")).unwrap()
        + &std::fs::read_to_string(workspace().join("configs/local-tiny.toml")).unwrap();
    let train_config = workspace().join("train_config.yaml");
    let text = text.replace(
        "train_config = \"train_config.yaml\"",
        &format!("train_config = {:?}", train_config.display().to_string()),
    ) + "\n[trainer]\ndata_parallel_ranks = 2\n";
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).unwrap();
    let (runs, save) = (dir.join("runs"), dir.join("ckpt"));
    let mut args = strings(&[
        "--cluster",
        path.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        run,
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "0",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
    ]);
    args.extend(strings(extra));
    let mut env = env.to_vec();
    env.push(("MANTA_VERIFY_WEIGHT_SYNC", "1"));
    let out = assert_success(driver_with_deadline(&args, &env, dir, deadline));
    (runs.join(run), save, plain(&out.stderr))
}

/// Checks a two-step [`verified_two_rank_job`]: each step recorded with the engine at
/// that step's version and a finite gradient norm, one verified sync per step, and the
/// engine's last version equal, tensor by tensor, to the weights saved in `checkpoint`.
pub fn assert_synced_to_the_checkpoint(run: &Path, checkpoint: &Path) {
    let rows = manta_telemetry::read_metrics(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2]);
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64, "engine version");
        assert!(m["train/grad_norm"].is_finite(), "step {step}");
    }
    let verified = std::fs::read_to_string(run.join("weight_sync.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = verified
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "one verified sync per step: {verified}");
    let saved = sorted_weights(&checkpoint.join("model.safetensors"));
    let digests = manta_hosting::weights::digest_tensors(&saved).unwrap();
    assert_eq!(lines[1]["version"], 2);
    let engine = lines[1]["tensors"].as_object().expect("tensor digests");
    assert!(!engine.is_empty());
    for (name, sha) in engine {
        let mine = digests
            .iter()
            .find(|d| &d.name == name)
            .unwrap_or_else(|| panic!("{name}: in the engine, not in the checkpoint"));
        assert_eq!(
            Some(mine.sha256.as_str()),
            sha.as_str(),
            "{name}: engine vs checkpoint"
        );
    }
}

/// Log text without its ANSI colour codes.
pub fn plain(log: &[u8]) -> String {
    let text = String::from_utf8_lossy(log);
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip `ESC [ ... m`.
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
