//! `--load DIR` as Miles reads it, through the real binary: a directory without a
//! checkpoint starts the run fresh (and says so), the same directory given to `--save`
//! and `--load` then resumes from its latest checkpoint, and `--num-rollout` is the
//! run's total, so the resumed run trains only the steps after the checkpoint.

use crate::common;

use common::{assert_success, driver_run};
use std::path::Path;

fn run(ckpt: &Path, runs: &Path, name: &str, num_rollout: &str) -> String {
    let out = assert_success(driver_run(&[
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--num-rollout",
        num_rollout,
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--save",
        ckpt.to_str().unwrap(),
        "--load",
        ckpt.to_str().unwrap(),
        "--save-interval",
        "1",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        name,
    ]));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn steps(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect()
}

#[test]
fn load_of_an_empty_directory_starts_fresh_then_resumes_to_the_total() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("checkpoints");
    let runs = tmp.path().join("runs");
    // Missing directory: fresh.
    let first = run(&ckpt, &runs, "first", "2");
    assert!(
        first.contains("no checkpoint there yet; starting fresh"),
        "{first}"
    );
    assert_eq!(steps(&first).len(), 2, "{first}");
    assert!(ckpt.join("latest").is_file());
    // The same directory again, with a total of 3 steps: only step 3 is trained.
    let second = run(&ckpt, &runs, "second", "3");
    assert!(!second.contains("starting fresh"), "{second}");
    let trained = steps(&second);
    assert_eq!(trained.len(), 1, "{second}");
    assert!(trained[0].starts_with("step 3"), "{second}");
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert!(latest.trim().ends_with('3'), "latest = {latest}");

    // An existing but empty directory starts fresh too.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let third = run(&empty, &runs, "third", "1");
    assert!(third.contains("starting fresh"), "{third}");
    assert_eq!(steps(&third).len(), 1, "{third}");
}
