//! Data-parallel trainer ranks on worker daemons (`[trainer] ranks`): two real `worker`
//! processes, each in a working directory of its own, host one CPU rank each (ZeRO-2
//! over rank 0's TCPStore, the group opened on rank 0's worker and carried to rank 1's
//! over gRPC). Trained from debug rollout data (the same batches every run), for three
//! steps:
//! - both ranks' weights are bit-identical, and bit-identical to local mode's two
//!   thread ranks (`[trainer] data_parallel_ranks = 2`) on the same batches: the store
//!   group combines in rank order with the thread group's tensor ops, and each rank
//!   computes its share exactly as a thread rank does, so nothing differs but the
//!   transport;
//! - each worker keeps its own ranks' part of every checkpoint under its own directory
//!   (weights, state, its optimizer shard; not the other rank's), the driver only
//!   `latest` and `ranks.json`;
//! - a run that dies after a checkpoint resumes both ranks from their workers' disks
//!   exactly; a placement that would look for a shard on the other node is refused;
//! - a rank's worker killed mid-run stops the run (`on_failure = "stop"`), or, with
//!   `"restart"`, the whole group is re-created from the last checkpoint once the worker
//!   is back and the run finishes by itself with an uninterrupted run's bits;
//! - a bad placement is refused naming the file, the key and the value.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::workers::{log_of, start_worker_in};
use common::{
    assert_success, debug_data, debug_train_args, driver_with_deadline, free_ports, sorted_weights,
    step, strings, verified_versions, workspace, Metrics, Worker, LOSSES, SAME_STEPS_FLAGS,
};
use manta_telemetry::read_metrics;

const TOKEN: &str = "dp-workers-token";
const DEADLINE: Duration = Duration::from_secs(600);

/// The flags of every run: three steps of 2 groups × 3 samples, a checkpoint each step.
fn args(cluster: &Path, data: &Path, save: &Path, runs: &Path, run: &str) -> Vec<String> {
    [
        strings(&["--cluster", cluster.to_str().unwrap()]),
        debug_train_args(data, 3, save, 1, runs, run),
        strings(&SAME_STEPS_FLAGS),
    ]
    .concat()
}

/// A remote-mode cluster.toml in `dir` with two worker nodes and `trainer` as its
/// `[trainer]` section.
fn remote_cluster(dir: &Path, name: &str, ports: [u16; 2], trainer: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = {:?}\n\n[trainer]\n{trainer}\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{}\"\n\n[[nodes]]\naddress = \"127.0.0.1:{}\"\n",
            workspace().join("train_config.yaml").display().to_string(),
            ports[0],
            ports[1]
        ),
    )
    .unwrap();
    path
}

/// [`remote_cluster`] whose nodes are found dead fast: a heartbeat every 100 ms, dead
/// after 600 ms without one (cluster keys, inserted into `[cluster]`).
fn fast_failure_cluster(dir: &Path, name: &str, ports: [u16; 2], trainer: &str) -> PathBuf {
    let path = remote_cluster(dir, name, ports, trainer);
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "mode = \"remote\"\n",
        "mode = \"remote\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\n",
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A remote-mode cluster.toml (`engines.toml` in `dir`) with a rank on each of the two
/// workers, rank 0's worker feeding one engine on worker B by store broadcast.
/// `recover`: nodes found dead fast and a lost rank re-created (`on_failure =
/// "restart"`); else a lost rank stops the run.
fn engine_cluster(dir: &Path, ports: [u16; 2], recover: bool) -> PathBuf {
    let ws = workspace();
    let (fast, on_failure) = if recover {
        (
            "heartbeat_interval_ms = 100\ndead_after_ms = 600\n",
            "restart",
        )
    } else {
        ("", "stop")
    };
    let path = dir.join("engines.toml");
    std::fs::write(
        &path,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = {:?}\nworker_weights = \"store\"\n{fast}\n\
             [trainer]\nranks = [{{ node = 0 }}, {{ node = 1 }}]\non_failure = \"{on_failure}\"\n\n\
             [rollout]\nnodes = [1]\nengines = 1\nmax_concurrent_episodes = 16\n\n\
             [train]\nmodel = {:?}\nseed = 1\nlr = 0.003\nmax_response_len = 8\n\
             context_len = 512\nmax_tokens_per_gpu = 8192\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{}\"\n\n[[nodes]]\naddress = \"127.0.0.1:{}\"\n",
            ws.join("train_config.yaml").display().to_string(),
            ws.join("assets/tiny-qwen3").display().to_string(),
            ports[0],
            ports[1]
        ),
    )
    .unwrap();
    path
}

fn run_driver(dir: &Path, args: &[String]) -> std::process::Output {
    driver_with_deadline(args, &[("MANTA_CLUSTER_TOKEN", TOKEN)], dir, DEADLINE)
}

fn worker_logs(cwds: &[PathBuf]) -> String {
    cwds.iter()
        .map(|c| std::fs::read_to_string(log_of(c)).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// Runs `args` with `--load save` and fails the test, with the driver's stderr and the
/// logs of the workers in `cwds`, unless it succeeds.
fn resume(dir: &Path, mut args: Vec<String>, save: &Path, cwds: &[PathBuf]) {
    args.extend(["--load".to_string(), save.display().to_string()]);
    let out = run_driver(dir, &args);
    assert!(
        out.status.success(),
        "resume failed\nstderr:\n{}\nworkers:\n{}",
        String::from_utf8_lossy(&out.stderr),
        worker_logs(cwds)
    );
}

fn metrics(runs: &Path, run: &str) -> Metrics {
    read_metrics(&runs.join(run).join("metrics.jsonl")).unwrap()
}

/// Asserts two sorted weight sets are the same bits, naming the first tensor that is not.
fn assert_bit_identical(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert!(ta.equal(tb), "{what}: {na} differs");
    }
}

struct Cluster {
    workers: [Worker; 2],
    cwds: [PathBuf; 2],
    ports: [u16; 2],
}

fn two_workers(dir: &Path) -> Cluster {
    let ports = free_ports::<2>();
    let cwds = [dir.join("worker-a"), dir.join("worker-b")];
    let workers = [
        start_worker_in(&cwds[0], ports[0], TOKEN),
        start_worker_in(&cwds[1], ports[1], TOKEN),
    ];
    Cluster {
        workers,
        cwds,
        ports,
    }
}

#[test]
fn ranks_on_two_workers_equal_local_ranks_and_resume_from_their_own_disks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data = debug_data(dir, 3, 5);

    // Local mode: two thread ranks in the driver.
    let local = common::cluster(dir, "data_parallel_ranks = 2");
    let (save_local, runs_local) = (dir.join("ckpt-local"), dir.join("runs-local"));
    assert_success(run_driver(
        dir,
        &args(&local, &data, &save_local, &runs_local, "local"),
    ));

    // Remote mode: rank 0 on worker A, rank 1 on worker B.
    let c = two_workers(dir);
    let two = remote_cluster(
        dir,
        "two.toml",
        c.ports,
        "ranks = [{ node = 0 }, { node = 1 }]\non_failure = \"stop\"",
    );
    let (save, runs) = (dir.join("ckpt-remote"), dir.join("runs-remote"));
    let out = run_driver(dir, &args(&two, &data, &save, &runs, "remote"));
    assert!(
        out.status.success(),
        "driver failed\nstderr:\n{}\nworkers:\n{}",
        String::from_utf8_lossy(&out.stderr),
        worker_logs(&c.cwds)
    );

    // Each worker holds its own ranks' part of the checkpoint, in its own directory.
    let on = |w: usize, run: &str| c.cwds[w].join("manta-checkpoints").join(run);
    let last = |w: usize| on(w, "remote").join("step_000003");
    for (w, mine, other) in [(0, 0, 1), (1, 1, 0)] {
        for f in [
            "model.safetensors".to_string(),
            "trainer_state.json".to_string(),
            format!("optimizer.rank{mine}-of-2.safetensors"),
        ] {
            assert!(last(w).join(&f).is_file(), "worker {w}: {f} missing");
        }
        let theirs = last(w).join(format!("optimizer.rank{other}-of-2.safetensors"));
        assert!(
            !theirs.exists(),
            "{} should be on the other worker",
            theirs.display()
        );
    }
    // The driver keeps where they are, not the tensors.
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step_000003"
    );
    let manifest = std::fs::read_to_string(save.join("step_000003/ranks.json")).unwrap();
    assert!(
        manifest.contains(&format!("127.0.0.1:{}", c.ports[1])),
        "{manifest}"
    );
    assert!(!save.join("step_000003/model.safetensors").exists());

    // Both ranks hold the same bits, and the same bits as local mode's two ranks.
    let a = sorted_weights(&last(0).join("model.safetensors"));
    let b = sorted_weights(&last(1).join("model.safetensors"));
    assert_bit_identical(&a, &b, "rank 0 (worker A) vs rank 1 (worker B)");
    let start = sorted_weights(&data.join("model/model.safetensors"));
    assert!(
        common::max_diff(&start, &a) > 1e-3,
        "training moved the weights"
    );
    let l = sorted_weights(&save_local.join("step_000003/model.safetensors"));
    assert_bit_identical(&a, &l, "ranks on workers vs local thread ranks");
    let (mr, ml) = (metrics(&runs, "remote"), metrics(&runs_local, "local"));
    for s in 1..=3 {
        for key in LOSSES {
            assert_eq!(step(&mr, s)[key], step(&ml, s)[key], "step {s} {key}");
        }
    }

    // Dies in step 3 (its data is missing) after saving step 2, then resumes both ranks
    // from their own workers' copies of step 2.
    let partial = dir.join("partial");
    std::fs::create_dir_all(&partial).unwrap();
    std::os::unix::fs::symlink(data.join("model"), partial.join("model")).unwrap();
    for k in 0..2 {
        let f = format!("debug_{k}.jsonl");
        std::fs::copy(data.join(&f), partial.join(&f)).unwrap();
    }
    let (save3, runs3) = (dir.join("ckpt-3"), dir.join("runs-3"));
    let out = run_driver(dir, &args(&two, &partial, &save3, &runs3, "resumed"));
    assert!(!out.status.success(), "the run should die in step 3");
    assert_eq!(
        std::fs::read_to_string(save3.join("latest"))
            .unwrap()
            .trim(),
        "step_000002"
    );
    assert!(on(1, "resumed")
        .join("step_000002/optimizer.rank1-of-2.safetensors")
        .is_file());

    // Swapped nodes would look for each shard on the other worker: refused by name.
    let swapped = remote_cluster(
        dir,
        "swapped.toml",
        c.ports,
        "ranks = [{ node = 1 }, { node = 0 }]\non_failure = \"stop\"",
    );
    let mut load = args(&swapped, &data, &save3, &runs3, "resumed");
    load.extend(["--load".to_string(), save3.display().to_string()]);
    let out = run_driver(dir, &load);
    assert!(!out.status.success(), "swapped ranks must not resume");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 0 saved its part on the worker at")
            && err.contains(&format!("127.0.0.1:{}", c.ports[0])),
        "{err}"
    );

    resume(
        dir,
        args(&two, &data, &save3, &runs3, "resumed"),
        &save3,
        &c.cwds,
    );
    let resumed = sorted_weights(&on(0, "resumed").join("step_000003/model.safetensors"));
    assert_bit_identical(&a, &resumed, "uninterrupted vs resumed");
    let m3 = metrics(&runs3, "resumed");
    for key in LOSSES {
        assert_eq!(step(&mr, 3)[key], step(&m3, 3)[key], "step 3 {key}");
    }
}

#[test]
fn a_bad_rank_placement_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // No worker is needed: the file is refused before any node is reached.
    let bad = remote_cluster(
        dir,
        "bad.toml",
        [1, 2],
        "ranks = [{ node = 0 }, { node = 2 }]",
    );
    let out = run_driver(
        dir,
        &args(
            &bad,
            &dir.join("data"),
            &dir.join("ckpt"),
            &dir.join("runs"),
            "bad",
        ),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml")
            && err.contains("`trainer.ranks[1].node`")
            && err.contains("invalid value 2")
            && err.contains("there are 2 [[nodes]]"),
        "{err}"
    );
}

/// Rank 0 on worker A, rank 1 and the only engine on worker B, `worker_weights =
/// "store"`: rank 0's worker roots the weight-update group and broadcasts its trainer's
/// parameters (every rank holds the same under ZeRO-2) into the engine on B, and every
/// sync is verified bit for bit (`MANTA_VERIFY_WEIGHT_SYNC`). Real rollouts on the
/// tiny model, two steps.
#[test]
fn rank_0s_worker_roots_the_weight_sync_to_the_engines() {
    const STEPS: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let c = two_workers(dir);
    let cluster = engine_cluster(dir, c.ports, false);
    let runs = dir.join("runs");
    let args: Vec<String> = [
        "--cluster",
        cluster.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--rollout-batch-size",
        "4",
        "--n-samples",
        "4",
        "--num-rollout",
        &STEPS.to_string(),
        "--run-name",
        "synced",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = driver_with_deadline(
        &args,
        &[
            ("MANTA_CLUSTER_TOKEN", TOKEN),
            ("MANTA_VERIFY_WEIGHT_SYNC", "1"),
            ("RUST_LOG", "info"),
        ],
        dir,
        DEADLINE,
    );
    let stderr = common::plain(&out.stderr);
    assert!(
        out.status.success(),
        "driver failed\nstderr:\n{stderr}\nworkers:\n{}",
        worker_logs(&c.cwds)
    );
    // The route names rank 0's worker (A) as the root of the engine's group.
    let route = stderr
        .lines()
        .find(|l| l.contains("weight sync route") && l.contains("rollout-0-0"))
        .unwrap_or_else(|| panic!("no route line:\n{stderr}"));
    assert!(
        route.contains("TCPStore broadcast")
            && route.contains(&format!("the trainer on worker 127.0.0.1:{}", c.ports[0]))
            && route.contains("(rank 0)"),
        "{route}"
    );
    let a = std::fs::read_to_string(log_of(&c.cwds[0])).unwrap();
    assert!(
        a.contains("weight-update group rooted at the trainer"),
        "{a}"
    );
    let b = std::fs::read_to_string(log_of(&c.cwds[1])).unwrap();
    assert!(b.contains("weights received by broadcast"), "{b}");
    // Both syncs verified against what rank 0 sent; both steps trained by two ranks.
    let (verified, versions): (_, Vec<u64>) =
        verified_versions(&runs.join("synced/weight_sync.jsonl"));
    assert!((1..=STEPS).all(|s| versions.contains(&s)), "{verified}");
    let rows = metrics(&runs, "synced");
    assert_eq!(rows.len() as u64, STEPS);
    for (s, m) in &rows {
        assert_eq!(m["weights/version"], *s as f64);
        // A step whose groups all scored alike has zero advantages and so a zero gradient
        // (the tiny model's 4 × 4 often does): that it trained shows in its tokens.
        let norm = m["train/grad_norm"];
        assert!(
            norm.is_finite() && norm >= 0.0,
            "step {s}: grad norm {norm}"
        );
        assert!(m["train/tokens"] > 0.0, "step {s} trained no tokens");
    }
    assert!(a.contains("trainer spawned") && b.contains("trainer spawned"));
}

/// Worker B (rank 1) is SIGKILLed mid-run under `on_failure = "stop"`: the driver stops
/// at once — rank 0 would wait for rank 1 in a collective, so it is not awaited — saying
/// how to resume. Worker B started again in the same directory, the
/// run resumes from the checkpoint each worker kept and ends with the same bits as a run
/// that was never interrupted.
#[test]
fn a_killed_rank_stops_the_run_and_it_resumes_from_the_workers_disks() {
    const STEPS: &str = "6";
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data = debug_data(dir, 6, 11);
    let mut c = two_workers(dir);
    let cluster = fast_failure_cluster(
        dir,
        "killed.toml",
        c.ports,
        "ranks = [{ node = 0 }, { node = 1 }]\non_failure = \"stop\"",
    );
    let with_steps = |mut a: Vec<String>| {
        let i = a.iter().position(|s| s == "--num-rollout").unwrap();
        a[i + 1] = STEPS.into();
        a
    };

    // Uninterrupted, for reference.
    let (save, runs) = (dir.join("ckpt-whole"), dir.join("runs-whole"));
    assert_success(run_driver(
        dir,
        &with_steps(args(&cluster, &data, &save, &runs, "whole")),
    ));
    let whole =
        sorted_weights(&c.cwds[0].join("manta-checkpoints/whole/step_000006/model.safetensors"));

    // Killed once step 2's checkpoint is there.
    let (save, runs) = (dir.join("ckpt-killed"), dir.join("runs-killed"));
    let argv = with_steps(args(&cluster, &data, &save, &runs, "killed"));
    let driver = {
        let argv = argv.clone();
        let dir = dir.to_path_buf();
        std::thread::spawn(move || run_driver(&dir, &argv))
    };
    let started = std::time::Instant::now();
    while std::fs::read_to_string(save.join("latest")).map_or(true, |l| l.trim() < "step_000002") {
        assert!(started.elapsed() < DEADLINE, "no checkpoint of step 2");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.workers[1].0.kill();
    let _ = c.workers[1].0.wait();
    let killed_at = std::time::Instant::now();
    let out = driver.join().unwrap();
    let stderr = common::plain(&out.stderr);
    if out.status.success() {
        // The kill came after the last step: nothing to recover; the test says so.
        panic!("the run finished before worker B was killed\n{stderr}");
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(60),
        "the driver took {:?} to stop",
        killed_at.elapsed()
    );
    assert!(
        stderr.contains("on_failure = \"stop\": the run stops here")
            && stderr.contains(&format!("--load {}", save.display())),
        "{stderr}"
    );

    // Worker B back in its directory; the run resumes from both workers' copies.
    c.workers[1] = start_worker_in(&c.cwds[1], c.ports[1], TOKEN);
    resume(dir, argv, &save, &c.cwds);
    let resumed =
        sorted_weights(&c.cwds[1].join("manta-checkpoints/killed/step_000006/model.safetensors"));
    assert_bit_identical(&whole, &resumed, "uninterrupted vs killed and resumed");
}

/// Worker B (rank 1) is SIGKILLed after step 2's checkpoint under `on_failure =
/// "restart"` and started again in its directory on its port: the driver stops rank 0
/// (ending its wait for rank 1), waits for B, opens a new store group, re-creates both
/// ranks from the checkpoint each worker kept and re-runs the steps after it, so the run
/// finishes by itself with the bits of an uninterrupted run, every sample trained once,
/// and a log line naming the lost rank and the step the run resumes at.
#[test]
fn a_killed_rank_is_recreated_with_its_group_and_the_run_goes_on() {
    a_killed_worker_is_recovered(1);
}

/// As above with worker A killed: rank 0 and the store the group met at go with it, and
/// the new group's store is opened on A once it is back.
#[test]
fn a_killed_rank_0_and_its_store_are_recreated() {
    a_killed_worker_is_recovered(0);
}

/// Kills worker `killed` (hosting rank `killed`) of a six-step run after step 2's
/// checkpoint, starts it again on its port in its directory, and checks the recovered run
/// against an uninterrupted one.
fn a_killed_worker_is_recovered(killed: usize) {
    const STEPS: u64 = 6;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data = debug_data(dir, STEPS as usize, 11);
    let mut c = two_workers(dir);
    let cluster = fast_failure_cluster(
        dir,
        "restart.toml",
        c.ports,
        "ranks = [{ node = 0 }, { node = 1 }]\non_failure = \"restart\"\nrestart_timeout_s = 120",
    );
    let argv = |save: &Path, runs: &Path, run: &str| {
        let mut a = args(&cluster, &data, save, runs, run);
        let i = a.iter().position(|s| s == "--num-rollout").unwrap();
        a[i + 1] = STEPS.to_string();
        a
    };
    let trained = |runs: &Path, run: &str| -> Vec<(u64, Vec<u64>)> {
        std::fs::read_to_string(runs.join(run).join("trained_ids.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let ids = v["ids"].as_array().unwrap();
                let ids = ids.iter().map(|i| i.as_u64().unwrap()).collect();
                (v["step"].as_u64().unwrap(), ids)
            })
            .collect()
    };
    let final_weights = |cwd: &Path, run: &str| {
        sorted_weights(&cwd.join(format!(
            "manta-checkpoints/{run}/step_{STEPS:06}/model.safetensors"
        )))
    };

    // Uninterrupted, for reference.
    let (save, runs) = (dir.join("ckpt-whole"), dir.join("runs-whole"));
    assert_success(run_driver(dir, &argv(&save, &runs, "whole")));
    let whole = final_weights(&c.cwds[0], "whole");
    let whole_ids = trained(&runs, "whole");

    // The worker killed once step 2's checkpoint is there, and back after the driver has
    // seen it go (dead_after_ms = 600).
    let (save, runs) = (dir.join("ckpt-restart"), dir.join("runs-restart"));
    let driver = {
        let (argv, dir) = (argv(&save, &runs, "restart"), dir.to_path_buf());
        std::thread::spawn(move || run_driver(&dir, &argv))
    };
    let started = std::time::Instant::now();
    while std::fs::read_to_string(save.join("latest")).map_or(true, |l| l.trim() < "step_000002") {
        assert!(started.elapsed() < DEADLINE, "no checkpoint of step 2");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.workers[killed].0.kill();
    let _ = c.workers[killed].0.wait();
    std::thread::sleep(Duration::from_millis(1500));
    c.workers[killed] = start_worker_in(&c.cwds[killed], c.ports[killed], TOKEN);
    let out = driver.join().unwrap();
    let stderr = common::plain(&out.stderr);
    assert!(
        out.status.success(),
        "the run did not recover\nstderr:\n{stderr}\nworkers:\n{}",
        worker_logs(&c.cwds)
    );
    if !stderr.contains("was lost") {
        panic!("the run finished before worker {killed}'s loss was seen\n{stderr}");
    }
    // One line names the lost rank, the checkpoint and the step the run goes on from.
    let line = stderr
        .lines()
        .find(|l| l.contains("was lost") && l.contains("restarting the trainer from checkpoint"))
        .unwrap_or_else(|| panic!("no recovery line\n{stderr}"));
    assert!(
        line.contains(&format!("127.0.0.1:{}", c.ports[killed]))
            && line.contains(&format!("data-parallel rank {killed} of 2"))
            && line.contains("the run resumes at step"),
        "{line}"
    );
    // Resumed from the checkpoint, not from the start: the steps up to it ran once.
    let resumed_at: u64 = line
        .split("the run resumes at step ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step to resume at: {line}"));
    assert!(resumed_at >= 3, "{line}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for s in 1..=STEPS {
        let runs = stdout.matches(&format!("step {s:>5}/{STEPS} ")).count();
        let expected = if s < resumed_at { 1..=1 } else { 1..=2 };
        assert!(
            expected.contains(&runs),
            "step {s} ran {runs} times\n{stdout}"
        );
    }
    // The worker never killed hosted its rank for the reference run, this run, and the
    // re-created group.
    let kept = std::fs::read_to_string(log_of(&c.cwds[1 - killed])).unwrap();
    assert_eq!(kept.matches("trainer spawned").count(), 3, "{kept}");

    // The same bits on both workers as the uninterrupted run's.
    for cwd in &c.cwds {
        let recovered = final_weights(cwd, "restart");
        assert_bit_identical(&whole, &recovered, "uninterrupted vs recovered");
    }
    // Every step recorded once, each sample trained exactly once, as in the reference.
    let ids = trained(&runs, "restart");
    let steps: Vec<u64> = ids.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{stderr}");
    assert_eq!(ids, whole_ids);
    let mut all: Vec<u64> = ids.iter().flat_map(|(_, i)| i.iter().copied()).collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a sample was trained twice");
    let rows = metrics(&runs, "restart");
    let steps: Vec<u64> = rows.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
}

/// The default loop (an engine on worker B fed by store broadcast rooted at rank 0's
/// worker): worker A, with rank 0 and the broadcast's root, is SIGKILLed after step 2's
/// checkpoint and started again. The ranks are re-created, the weight-update group is
/// rooted anew at the new rank 0 (its re-creation retires the old group) and the engine
/// takes the restored weights; the run finishes by itself, every sync after the loss
/// verified bit for bit, every step recorded once and no sample trained twice.
#[test]
fn a_killed_weight_root_rank_is_recreated_and_the_engines_follow() {
    const STEPS: u64 = 4;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut c = two_workers(dir);
    let cluster = engine_cluster(dir, c.ports, true);
    let (runs, save) = (dir.join("runs"), dir.join("ckpt"));
    let args = strings(&[
        "--cluster",
        cluster.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "1",
        "--rollout-batch-size",
        "4",
        "--n-samples",
        "4",
        "--num-rollout",
        &STEPS.to_string(),
        "--run-name",
        "root",
    ]);
    let driver = {
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            driver_with_deadline(
                &args,
                &[
                    ("MANTA_CLUSTER_TOKEN", TOKEN),
                    ("MANTA_VERIFY_WEIGHT_SYNC", "1"),
                ],
                &dir,
                DEADLINE,
            )
        })
    };
    let started = std::time::Instant::now();
    while std::fs::read_to_string(save.join("latest")).map_or(true, |l| l.trim() < "step_000002") {
        assert!(started.elapsed() < DEADLINE, "no checkpoint of step 2");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.workers[0].0.kill();
    let _ = c.workers[0].0.wait();
    std::thread::sleep(Duration::from_millis(1500));
    c.workers[0] = start_worker_in(&c.cwds[0], c.ports[0], TOKEN);
    let out = driver.join().unwrap();
    let stderr = common::plain(&out.stderr);
    assert!(
        out.status.success(),
        "the run did not recover\nstderr:\n{stderr}\nworkers:\n{}",
        worker_logs(&c.cwds)
    );
    if !stderr.contains("data-parallel rank 0 of 2") {
        panic!("the run finished before worker A's loss was seen\n{stderr}");
    }
    // Every step once in the records, no sample twice.
    let rows = metrics(&runs, "root");
    let steps: Vec<u64> = rows.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{stderr}");
    let text = std::fs::read_to_string(runs.join("root/trained_ids.jsonl")).unwrap();
    let mut ids = Vec::new();
    let mut recorded = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        recorded.push(v["step"].as_u64().unwrap());
        ids.extend(
            v["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap()),
        );
    }
    assert_eq!(recorded, (1..=STEPS).collect::<Vec<_>>());
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), n, "a sample was trained twice");
    // The engine took the last version from the re-created rank 0, verified bit for bit.
    let (verified, versions): (_, Vec<u64>) =
        verified_versions(&runs.join("root/weight_sync.jsonl"));
    assert!(versions.contains(&STEPS), "{verified}");
    let a = std::fs::read_to_string(log_of(&c.cwds[0])).unwrap();
    assert!(
        a.contains("weight-update group rooted at the trainer"),
        "{a}"
    );
}
