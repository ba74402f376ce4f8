//! Data-parallel trainer ranks in local mode (`[trainer] data_parallel_ranks`), run by
//! the driver binary from debug rollout data (no engine; the same samples every run):
//! two CPU ranks (threads over `ThreadCollective`, ZeRO-2) take the same steps as one
//! trainer — per-step loss metrics and final weights agree up to summation order — and
//! a two-rank run that dies after a checkpoint resumes every rank from it exactly.
//! Bad rank settings stop the driver with an error naming the key.
//!
//! NCCL ranks (`[trainer] gpus = [0, 1]`) need GPUs; here only their clear refusal
//! without CUDA is checked.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    assert_success, debug_data, debug_train_args, driver_run, sorted_weights, step, strings,
    workspace, Metrics, LOSSES, SAME_STEPS_FLAGS,
};
use manta_telemetry::read_metrics;

/// A cluster.toml in `dir` with `trainer` as its `[trainer]` section.
fn cluster(dir: &Path, name: &str, trainer: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[cluster]\ntrain_config = {:?}\n\n[trainer]\n{trainer}\n",
        workspace().join("train_config.yaml").display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn args(cluster: &Path, data: &Path, save: &Path, runs: &Path, load: bool) -> Vec<String> {
    let mut a = [
        strings(&["--cluster", cluster.to_str().unwrap()]),
        debug_train_args(data, 3, save, 1, runs, "r"),
        strings(&SAME_STEPS_FLAGS),
    ]
    .concat();
    if load {
        a.push("--load".into());
        a.push(save.to_str().unwrap().into());
    }
    a
}

fn metrics(runs: &Path) -> Metrics {
    read_metrics(&runs.join("r/metrics.jsonl")).unwrap()
}

type Weights = Vec<(String, tch::Tensor)>;

/// Runs one trainer and two ranks on the same data with `extra` flags; checks that
/// they agree step by step and in their final weights. Returns the two ranks' metrics,
/// final weights and the data.
fn one_and_two_ranks_agree(dir: &Path, extra: &[&str]) -> (Metrics, Weights, PathBuf, PathBuf) {
    let data = debug_data(dir, 3, 5);
    let one = cluster(dir, "one.toml", "");
    let two = cluster(dir, "two.toml", "data_parallel_ranks = 2");
    let with_extra = |mut a: Vec<String>| {
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    let (save1, runs1) = (dir.join("ckpt-1"), dir.join("runs-1"));
    assert_success(driver_run(&with_extra(args(
        &one, &data, &save1, &runs1, false,
    ))));
    let (save2, runs2) = (dir.join("ckpt-2"), dir.join("runs-2"));
    assert_success(driver_run(&with_extra(args(
        &two, &data, &save2, &runs2, false,
    ))));

    // Two ranks ran: each saved its ZeRO optimizer shard into the checkpoint.
    let last = save2.join("step_000003");
    for r in 0..2 {
        let shard = last.join(format!("optimizer.rank{r}-of-2.safetensors"));
        assert!(shard.is_file(), "{} missing", shard.display());
    }
    let (m1, m2) = (metrics(&runs1), metrics(&runs2));
    for s in 1..=3 {
        let (a, b) = (step(&m1, s), step(&m2, s));
        // fp32 sums in another order: ~1e-7 apart on losses of ~0.1 and norms of ~2.
        for key in LOSSES {
            let (x, y) = (a[key], b[key]);
            assert!(
                (x - y).abs() <= 1e-6 * x.abs().max(1.0),
                "step {s} {key}: one rank {x}, two ranks {y}"
            );
        }
        assert_eq!(a["train/tokens"], b["train/tokens"], "step {s}");
    }
    let start = sorted_weights(&data.join("model/model.safetensors"));
    let w1 = sorted_weights(&save1.join("step_000003/model.safetensors"));
    let w2 = sorted_weights(&last.join("model.safetensors"));
    assert_eq!(w1.len(), w2.len());
    let diff = |a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]| {
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
    };
    assert!(diff(&start, &w1) > 1e-3, "training moved the weights");
    let d = diff(&w1, &w2);
    assert!(d < 1e-5, "two ranks' weights differ from one rank's by {d}");

    (m2, w2, data, two)
}

#[test]
fn two_cpu_ranks_equal_one_trainer_and_resume_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (m2, w2, data, two) = one_and_two_ranks_agree(dir.path(), &[]);

    // Two ranks die in step 3 (its data is missing) after saving step 2, then resume.
    let partial = dir.path().join("partial");
    std::fs::create_dir_all(&partial).unwrap();
    std::os::unix::fs::symlink(data.join("model"), partial.join("model")).unwrap();
    for k in 0..2 {
        let f = format!("debug_{k}.jsonl");
        std::fs::copy(data.join(&f), partial.join(&f)).unwrap();
    }
    let (save3, runs3) = (dir.path().join("ckpt-3"), dir.path().join("runs-3"));
    let out = driver_run(&args(&two, &partial, &save3, &runs3, false));
    assert!(!out.status.success(), "the run should die in step 3");
    let latest = std::fs::read_to_string(save3.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step_000002");
    assert_success(driver_run(&args(&two, &data, &save3, &runs3, true)));
    let m3 = metrics(&runs3);
    let (a, b) = (step(&m2, 3), step(&m3, 3));
    for key in LOSSES {
        assert_eq!(a[key], b[key], "step 3 {key}: uninterrupted vs resumed");
    }
    let w3 = sorted_weights(&save3.join("step_000003/model.safetensors"));
    for ((n, x), (_, y)) in w2.iter().zip(&w3) {
        assert!(x.equal(y), "{n} differs after resuming both ranks");
    }

    // Another rank count cannot take the two ranks' optimizer shards.
    let three = cluster(dir.path(), "three.toml", "data_parallel_ranks = 3");
    let runs4 = dir.path().join("runs-4");
    let out = driver_run(&args(&three, &data, &save3, &runs4, true));
    assert!(
        !out.status.success(),
        "3 ranks should refuse a 2-rank checkpoint"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("saved by 2 data-parallel ranks") && err.contains("this run has 3 ranks"),
        "{err}"
    );
}

#[test]
fn two_ranks_split_each_optimizer_step_as_one_trainer_does() {
    // Two optimizer steps per rollout on 6 samples: one trainer takes samples 0..3 then
    // 3..6; rank 0 gets [0 | 3] and rank 1 [1, 2 | 4, 5].
    let dir = tempfile::tempdir().unwrap();
    one_and_two_ranks_agree(dir.path(), &["--num-steps-per-rollout", "2"]);
}

#[test]
fn local_mode_with_two_ranks_trains_and_syncs_rank_0s_weights_to_the_engine() {
    // The default local job (native engine, built-in environment) with two CPU ranks;
    // every sync is verified: the engine's weights equal the trainer's bit for bit.
    let dir = tempfile::tempdir().unwrap();
    // The shipped cluster.toml with the tiny local example's [train] settings.
    let text = std::fs::read_to_string(workspace().join("cluster.toml")).unwrap()
        + &std::fs::read_to_string(workspace().join("configs/local-tiny.toml")).unwrap();
    let train_config = workspace().join("train_config.yaml");
    let text = text.replace(
        "train_config = \"train_config.yaml\"",
        &format!("train_config = {:?}", train_config.display().to_string()),
    ) + "\n[trainer]\ndata_parallel_ranks = 2\n";
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, text).unwrap();
    let (runs, save) = (dir.path().join("runs"), dir.path().join("ckpt"));
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(["--cluster", path.to_str().unwrap()])
        .args(["--runs-dir", runs.to_str().unwrap(), "--run-name", "dp"])
        .args(["--save", save.to_str().unwrap(), "--save-interval", "0"])
        .args([
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples",
            "2",
        ])
        .env("RUST_LOG", "warn")
        .env("MANTA_VERIFY_WEIGHT_SYNC", "1")
        .output()
        .expect("driver runs");
    assert_success(out);
    let rows = read_metrics(&runs.join("dp/metrics.jsonl")).unwrap();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2]);
    for (step, m) in &rows {
        assert_eq!(
            m["weights/version"], *step as f64,
            "engine version after step {step}"
        );
        // A step whose groups all agree on their rewards has zero advantages and so a
        // zero gradient (sampling decides); the debug-data tests above check the maths.
        assert!(
            m["train/grad_norm"].is_finite(),
            "step {step}: grad_norm {}",
            m["train/grad_norm"]
        );
    }
    let verified = std::fs::read_to_string(runs.join("dp/weight_sync.jsonl")).unwrap();
    assert_eq!(
        verified.lines().count(),
        2,
        "one verified sync per step: {verified}"
    );
    let last = save.join("step_000002");
    for r in 0..2 {
        assert!(last
            .join(format!("optimizer.rank{r}-of-2.safetensors"))
            .is_file());
    }
}

fn config_error(trainer: &str, debug_data: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = cluster(dir.path(), "cluster.toml", trainer);
    let mut a = vec![
        "--cluster".to_string(),
        path.to_str().unwrap().into(),
        "--model".into(),
        "assets/tiny-qwen3".into(),
        "--num-rollout".into(),
        "1".into(),
        "--runs-dir".into(),
        dir.path().join("runs").to_str().unwrap().into(),
    ];
    if debug_data {
        a.push("--load-debug-rollout-data".into());
        a.push(
            dir.path()
                .join("none_{rollout_id}.jsonl")
                .to_str()
                .unwrap()
                .into(),
        );
    }
    let out = driver_run(&a);
    assert!(
        !out.status.success(),
        "[trainer] {trainer} should be refused"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_rank_settings_are_refused_naming_the_key() {
    let err = config_error("data_parallel_ranks = 0", true);
    assert!(
        err.contains("trainer.data_parallel_ranks") && err.contains("must be at least 1"),
        "{err}"
    );
    let err = config_error("gpus = [0, 1]\ndata_parallel_ranks = 3", true);
    assert!(
        err.contains("trainer.data_parallel_ranks") && err.contains("one rank per GPU (2)"),
        "{err}"
    );
    if !tch::Cuda::is_available() {
        // NCCL ranks need the GPUs they name; without CUDA the driver says so.
        let err = config_error("gpus = [0, 1]", false);
        assert!(
            err.contains("trainer.gpus") && err.contains("CUDA is not available"),
            "{err}"
        );
    }
}
