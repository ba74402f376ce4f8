//! Remote mode end to end: two real `worker` processes on loopback, the real `driver`
//! training 3 steps on them. One worker is SIGKILLed mid-run and restarted on the same
//! port: the run completes, the trained sample ids have no gap and no repeat, and the
//! restarted worker rejoins. Callers without the right token are refused. Over TLS, a
//! driver trusting the worker's CA trains; one without it, or trusting another CA, is
//! refused with an error that says why.

use crate::common;

use common::workers::{appending, spawn_listening, worker_command};
use common::{free_port, free_ports, verified_versions, workspace, Worker};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use manta_telemetry::read_metrics;

const TOKEN: &str = "e2e-cluster-token";

/// Starts a worker in an empty directory of its own, with no OpenReward settings in
/// its environment: everything but the model must come from the driver.
fn start_worker(port: u16, log: &Path) -> Worker {
    start_worker_with(port, log, &[])
}

/// [`start_worker`] with more command-line arguments; its stdout goes to `log` with the
/// extension `stdout`.
fn start_worker_with(port: u16, log: &Path, extra: &[&std::ffi::OsStr]) -> Worker {
    let cwd = log.with_extension("cwd");
    let stdout = std::fs::File::create(log.with_extension("stdout")).unwrap();
    let mut cmd = worker_command(&cwd, port, TOKEN);
    cmd.args(extra).stdout(stdout).stderr(appending(log));
    spawn_listening(&mut cmd, port)
}

#[test]
fn worker_cli_documents_itself_and_needs_a_token() {
    let help = Command::new(env!("CARGO_BIN_EXE_worker"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("--listen") && text.contains("--gpus"),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_worker"))
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .env_remove("MANTA_CLUSTER_TOKEN")
        .env_remove("MANTA_CLUSTER_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MANTA_CLUSTER_TOKEN"), "{err}");
    // The token may come from a file instead.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_worker"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("MANTA_CLUSTER_TOKEN")
        .env("MANTA_CLUSTER_TOKEN_FILE", &file)
        .stderr(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "worker never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = manta_runtime::WorkerClient::new(&format!("127.0.0.1:{port}"), TOKEN).unwrap();
        client.describe(Duration::from_secs(5)).await.unwrap();
        // Shutdown over gRPC stops the daemon.
        client.shutdown().await.unwrap();
    });
    let status = child.wait().unwrap();
    assert!(status.success());
}

#[test]
fn callers_without_the_token_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let _worker = start_worker(port, &tmp.path().join("worker.log"));
    let addr = format!("127.0.0.1:{port}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let wrong = manta_runtime::WorkerClient::new(&addr, "not-the-token").unwrap();
        let err = wrong
            .describe(Duration::from_secs(5))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&addr) && err.contains("wrong cluster token"),
            "{err}"
        );
        let mut bare =
            manta_proto::cluster::worker_client::WorkerClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
        let status = bare
            .describe(manta_proto::common::Empty {})
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(
            status.message().contains("missing cluster token"),
            "{status:?}"
        );
        let right = manta_runtime::WorkerClient::new(&addr, TOKEN).unwrap();
        assert!(right.describe(Duration::from_secs(5)).await.is_ok());
    });
}

/// A remote run on two real workers in which worker 1 is SIGKILLed as step 2's
/// rollouts start and restarted on the same port.
struct KilledWorkerRun {
    /// Kept for the run's files (the workers stopped when the run ended).
    _tmp: tempfile::TempDir,
    runs: PathBuf,
    save: PathBuf,
    logs: [PathBuf; 2],
    lines: Vec<String>,
    stderr: String,
}

/// Trains `steps` steps as run `run` with `cluster_lines` added under `[cluster]`,
/// `sections` (e.g. `[trainer]`) before `[rollout]`, `rollout_lines` under `[rollout]`
/// and `env` set for the driver; kills worker 1 after the first step and restarts it.
/// Fails the test if the driver fails.
fn train_through_a_killed_worker(
    steps: u64,
    run: &str,
    cluster_lines: &str,
    sections: &str,
    rollout_lines: &str,
    env: &[(&str, &str)],
) -> KilledWorkerRun {
    let tmp = tempfile::tempdir().unwrap();
    let ports = free_ports::<2>();
    let logs = [tmp.path().join("w0.log"), tmp.path().join("w1.log")];
    let _w0 = start_worker(ports[0], &logs[0]);
    let mut w1 = Some(start_worker(ports[1], &logs[1]));
    let ws = workspace();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\n{cluster_lines}\n{sections}\
             [rollout]\nengines = 1\nmax_concurrent_episodes = 16\n{rollout_lines}\n\
             [train]\nmodel = \"{}\"\nseed = 1\nlr = 0.003\nmax_response_len = 8\ncontext_len = 512\nmax_tokens_per_gpu = 8192\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{}\"\n\n[[nodes]]\naddress = \"127.0.0.1:{}\"\n",
            ws.join("train_config.yaml").display(),
            ws.join("assets/tiny-qwen3").display(),
            ports[0],
            ports[1]
        ),
    )
    .unwrap();
    let runs = tmp.path().join("runs");
    let save = tmp.path().join("ckpt");
    let driver_log = tmp.path().join("driver.log");
    let mut driver = Command::new(env!("CARGO_BIN_EXE_driver"));
    driver
        .current_dir(&ws)
        .args(["--cluster", cluster.to_str().unwrap()])
        .args(["--runs-dir", runs.to_str().unwrap()])
        .args(["--save", save.to_str().unwrap(), "--save-interval", "0"])
        .args(["--rollout-batch-size", "8", "--n-samples", "4"])
        .args(["--num-rollout", &steps.to_string(), "--run-name", run])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&driver_log).unwrap());
    let mut driver = driver.spawn().expect("driver starts");
    let stdout = driver.stdout.take().unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && lines.iter().all(|l: &String| !l.starts_with("step ")) {
            // Step 2's rollouts start now: kill worker 1 under them, then restart it.
            drop(w1.take());
            w1 = Some(start_worker(ports[1], &logs[1]));
        }
        lines.push(line);
    }
    let status = driver.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    assert!(
        status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{stderr}",
        lines.join("\n")
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("step ")).count(),
        steps as usize
    );
    KilledWorkerRun {
        _tmp: tmp,
        runs,
        save,
        logs,
        lines,
        stderr,
    }
}

#[test]
fn two_workers_train_through_a_killed_and_restarted_worker() {
    // Enough steps after the kill for the restarted worker to rejoin: a step of the tiny
    // model takes a fraction of a second, a worker's start and first heartbeat longer.
    const STEPS: u64 = 12;
    let r = train_through_a_killed_worker(STEPS, "remote", "", "", "", &[]);
    let stderr = &r.stderr;

    // Every sample id of every step trained exactly once.
    let (_, ids) = trained(&r.runs.join("remote"));
    assert_eq!(ids, (0..STEPS * 32).collect::<Vec<u64>>(), "{stderr}");

    // Weights reached the workers each step; the restarted worker came back.
    let rows = read_metrics(&r.runs.join("remote/metrics.jsonl")).unwrap();
    assert_eq!(rows[0].1["cluster/live_nodes"], 2.0);
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64);
        assert!(m["train/grad_norm"] > 0.0);
    }
    assert!(stderr.contains("node rejoined"), "{stderr}");
    // The kill really hit work in flight: the lost share was re-run elsewhere.
    assert!(
        stderr.contains("re-queueing its episodes on another node"),
        "{stderr}"
    );
    assert!(
        std::fs::read_to_string(&r.logs[1])
            .unwrap()
            .matches("weights applied")
            .count()
            >= 1
    );
    assert_eq!(
        std::fs::read_to_string(r.save.join("latest"))
            .unwrap()
            .trim(),
        format!("step_{STEPS:06}")
    );
}

/// `cluster.worker_weights = "store"`: the driver hosts one weight-update group (torch's
/// TCPStore: CPU engines) and every worker's engine joins it over gRPC each sync; every
/// sync is verified bit for bit (`MANTA_VERIFY_WEIGHT_SYNC`). Worker 1 is SIGKILLed
/// mid-run and restarted: the group is made again once it is back, and it goes live
/// only with the broadcast weights. No sample is lost or trained twice.
#[test]
fn weights_reach_workers_by_one_broadcast_group_rebuilt_when_a_worker_returns() {
    // More steps than the kill test: the returning worker must also meet a broadcast.
    const STEPS: u64 = 16;
    let r = train_through_a_killed_worker(
        STEPS,
        "bcast",
        "worker_weights = \"store\"\ndriver_address = \"127.0.0.1\"\n",
        "",
        "",
        &[("MANTA_VERIFY_WEIGHT_SYNC", "1")],
    );
    let stderr = &r.stderr;
    let (_, ids) = trained(&r.runs.join("bcast"));
    assert_eq!(ids, (0..STEPS * 32).collect::<Vec<u64>>(), "{stderr}");
    assert!(
        stderr.contains("weights to workers: one broadcast group"),
        "{stderr}"
    );
    // A group for both workers, and a new one once the killed worker is back (a sync
    // that meets the dead worker goes as gRPC chunks to the live one, or through a
    // group without it).
    let groups = stderr
        .matches("weight-update group made for the workers' engines")
        .count();
    assert!(groups >= 2, "{groups} groups made:\n{stderr}");
    assert!(
        stderr.contains("rejoined node waits for the next weight broadcast"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rejoined node live with the broadcast weights"),
        "{stderr}"
    );
    // Every sync was checked bit for bit against the trainer's weights (a difference
    // would have failed the run; the record has one line per engine).
    let (verified, versions): (_, std::collections::BTreeSet<u64>) =
        verified_versions(&r.runs.join("bcast/weight_sync.jsonl"));
    assert_eq!(versions, (1..=STEPS).collect(), "{verified}");
    let w0 = std::fs::read_to_string(&r.logs[0]).unwrap();
    assert!(
        w0.matches("weights received by broadcast").count() >= STEPS as usize / 2,
        "{w0}"
    );
    let rows = read_metrics(&r.runs.join("bcast/metrics.jsonl")).unwrap();
    assert_eq!(
        rows.last().unwrap().1["cluster/live_nodes"],
        2.0,
        "{}",
        r.lines.join("\n")
    );
}

/// The acceptance layout on CPUs: the trainer on worker 0, the only engine on worker 1,
/// `worker_weights = "store"`, no shared directory (each worker runs in its own). Worker
/// 0 roots the weight-update group and broadcasts its trainer's parameters itself; the
/// driver only names the members. Every sync is verified bit for bit against the
/// digests rank 0 sent. Worker 1 is SIGKILLed after the first step and restarted: it is
/// the only rollout node, so the trainer's worker feeds it at once through a new group,
/// and the run completes with every sample id trained once.
#[test]
fn the_trainers_worker_roots_the_broadcast_to_the_engines_worker() {
    const STEPS: u64 = 8;
    let r = train_through_a_killed_worker(
        STEPS,
        "rooted",
        "worker_weights = \"store\"\n",
        "[trainer]\nnode = 0\n\n",
        "nodes = [1]\n",
        &[("MANTA_VERIFY_WEIGHT_SYNC", "1")],
    );
    let stderr = &r.stderr;
    let (_, ids) = trained(&r.runs.join("rooted"));
    assert_eq!(ids, (0..STEPS * 32).collect::<Vec<u64>>(), "{stderr}");
    let trainer_worker = {
        let w0 = std::fs::read_to_string(&r.logs[0]).unwrap();
        assert!(w0.contains("trainer spawned"), "{w0}");
        w0
    };
    // The route line names the trainer's worker as rank 0, and why.
    let route = stderr
        .lines()
        .find(|l| l.contains("weight sync route") && l.contains("rollout-0-0"))
        .unwrap_or_else(|| panic!("no route line:\n{stderr}"));
    assert!(
        route.contains("TCPStore broadcast")
            && route.contains("the trainer on worker 127.0.0.1:")
            && route.contains("(rank 0)")
            && route.contains("cluster.worker_weights"),
        "{route}"
    );
    // A group for the engine, and a new one once its worker is back.
    let groups = trainer_worker
        .matches("weight-update group rooted at the trainer")
        .count();
    assert!(groups >= 2, "{groups} groups rooted:\n{trainer_worker}");
    assert!(
        stderr.contains("rejoined node live with the broadcast weights"),
        "{stderr}"
    );
    let w1 = std::fs::read_to_string(&r.logs[1]).unwrap();
    assert!(
        w1.matches("weights received by broadcast").count() >= STEPS as usize / 2,
        "{w1}"
    );
    // Every version was verified against the digests of what rank 0 sent — but for a
    // version synced while the only engine's worker was down (the kill can land after
    // step 2's rollouts): no engine held it, and the returning worker got it later.
    let (verified, versions): (_, std::collections::BTreeSet<u64>) =
        verified_versions(&r.runs.join("rooted/weight_sync.jsonl"));
    let missed = stderr.matches("reached no node (none is live)").count() as u64;
    assert!(missed <= 1, "{stderr}");
    assert!(
        versions.iter().all(|v| (1..=STEPS).contains(v)) && versions.len() as u64 == STEPS - missed,
        "{verified}"
    );
    let rows = read_metrics(&r.runs.join("rooted/metrics.jsonl")).unwrap();
    assert_eq!(rows.last().unwrap().1["cluster/live_nodes"], 1.0);
}

#[test]
fn unsatisfiable_placement_is_reported_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = workspace();
    let port = free_port();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\n\n[train]\nmodel = \"{}\"\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{port}\"\n",
            ws.join("train_config.yaml").display(),
            ws.join("assets/tiny-qwen3").display(),
        ),
    )
    .unwrap();
    let runs = tmp.path().join("runs");
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(&ws)
        .args([
            "--cluster",
            cluster.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "--run-name",
            "never",
        ])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("placement cannot be satisfied") && err.contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    assert!(!runs.join("never").exists(), "the run started anyway");
}

/// A cluster file with rollouts on node 0 and the trainer on node 1.
fn trainer_on_node_1(dir: &Path, ports: [u16; 2], on_failure: &str) -> PathBuf {
    let ws = workspace();
    let cluster = dir.join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\nlease_timeout_ms = 3000\n\n\
             [trainer]\nnode = 1\non_failure = \"{on_failure}\"\nrestart_timeout_s = 30\n\n\
             [rollout]\nengines = 1\nnodes = [0]\nmax_concurrent_episodes = 16\n\n\
             [train]\nmodel = \"{}\"\nseed = 1\nlr = 0.003\nmax_response_len = 8\ncontext_len = 512\nmax_tokens_per_gpu = 8192\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{}\"\n\n[[nodes]]\naddress = \"127.0.0.1:{}\"\n",
            ws.join("train_config.yaml").display(),
            ws.join("assets/tiny-qwen3").display(),
            ports[0],
            ports[1]
        ),
    )
    .unwrap();
    cluster
}

fn driver_command(
    cluster: &Path,
    runs: &Path,
    save: &Path,
    log: &Path,
    steps: u32,
    save_interval: u32,
) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_driver"));
    cmd.current_dir(workspace())
        .args([
            "--cluster",
            cluster.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "--save",
            save.to_str().unwrap(),
            "--save-interval",
            &save_interval.to_string(),
            "--rollout-batch-size",
            "8",
            "--n-samples",
            "4",
            "--num-rollout",
            &steps.to_string(),
            "--run-name",
            "remote",
        ])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap());
    cmd
}

/// Steps recorded in trained_ids.jsonl, and every id in them.
fn trained(run_dir: &Path) -> (Vec<u64>, Vec<u64>) {
    let text = std::fs::read_to_string(run_dir.join("trained_ids.jsonl")).unwrap_or_default();
    let mut steps = Vec::new();
    let mut ids = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        steps.push(v["step"].as_u64().unwrap());
        ids.extend(
            v["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap()),
        );
    }
    ids.sort_unstable();
    (steps, ids)
}

/// Waits until the checkpoint directory's `latest` names step 1.
fn wait_for_first_checkpoint(save: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(save.join("latest"))
        .map(|s| s.trim() != "step_000001")
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "no step-1 checkpoint");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Two workers with rollouts on node 0 and the trainer on node 1, and the paths of a
/// driver run against them.
struct TrainerCluster {
    /// Holds the run's files until the test ends.
    _tmp: tempfile::TempDir,
    ports: [u16; 2],
    logs: [PathBuf; 2],
    _w0: Worker,
    w1: Option<Worker>,
    cluster: PathBuf,
    runs: PathBuf,
    save: PathBuf,
    driver_log: PathBuf,
}

impl TrainerCluster {
    fn start(on_failure: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let ports = free_ports::<2>();
        let logs = [tmp.path().join("w0.log"), tmp.path().join("w1.log")];
        let _w0 = start_worker(ports[0], &logs[0]);
        let w1 = Some(start_worker(ports[1], &logs[1]));
        let cluster = trainer_on_node_1(tmp.path(), ports, on_failure);
        let (runs, save) = (tmp.path().join("runs"), tmp.path().join("ckpt"));
        let driver_log = tmp.path().join("driver.log");
        Self {
            _tmp: tmp,
            ports,
            logs,
            _w0,
            w1,
            cluster,
            runs,
            save,
            driver_log,
        }
    }

    /// Starts the driver for `steps` steps, saving every step; stdout is piped.
    fn driver(&self, steps: u32) -> Child {
        self.driver_saving_every(steps, 1)
    }

    /// Starts the driver for `steps` steps, saving every `save_interval` steps.
    fn driver_saving_every(&self, steps: u32, save_interval: u32) -> Child {
        driver_command(
            &self.cluster,
            &self.runs,
            &self.save,
            &self.driver_log,
            steps,
            save_interval,
        )
        .spawn()
        .expect("driver starts")
    }
}

#[test]
fn a_lost_trainer_restarts_from_its_last_checkpoint() {
    let mut c = TrainerCluster::start("restart");
    let (ports, logs, runs, save, driver_log) = (
        c.ports,
        c.logs.clone(),
        c.runs.clone(),
        c.save.clone(),
        c.driver_log.clone(),
    );
    let mut driver = c.driver(3);
    let mut lines = Vec::new();
    for line in BufReader::new(driver.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && lines.iter().all(|l: &String| !l.starts_with("step ")) {
            // Step 1 is trained and saved; kill the trainer's worker under step 2 and
            // bring the node back.
            wait_for_first_checkpoint(&save);
            drop(c.w1.take());
            c.w1 = Some(start_worker(ports[1], &logs[1]));
        }
        lines.push(line);
    }
    let status = driver.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    assert!(
        status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{stderr}",
        lines.join("\n")
    );
    assert!(
        stderr.contains("was lost") && stderr.contains("restarting the trainer from checkpoint"),
        "{stderr}"
    );
    assert!(stderr.contains("trainer re-created"), "{stderr}");
    // Each step's samples were trained exactly once in the surviving record.
    let (steps, ids) = trained(&runs.join("remote"));
    assert_eq!(steps, vec![1, 2, 3], "{stderr}");
    assert_eq!(ids, (0..96).collect::<Vec<u64>>());
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step_000003"
    );
    // The new trainer on the restarted worker did the later steps.
    let w1_log = std::fs::read_to_string(&logs[1]).unwrap();
    assert!(w1_log.matches("trainer spawned").count() >= 2, "{w1_log}");
    let rows = read_metrics(&runs.join("remote/metrics.jsonl")).unwrap();
    let (last_step, last) = rows.last().unwrap();
    assert_eq!((*last_step, last["weights/version"]), (3, 3.0));
}

/// The checkpoint is two steps old when the trainer is lost: the rewind re-runs a
/// step that metrics.jsonl and the TensorBoard file already hold, and both keep it once.
#[test]
fn a_rewind_past_a_logged_step_keeps_each_step_once_in_the_metrics() {
    let mut c = TrainerCluster::start("restart");
    let (ports, logs, runs, driver_log) = (
        c.ports,
        c.logs.clone(),
        c.runs.clone(),
        c.driver_log.clone(),
    );
    // Checkpoints after steps 2 (and the last); the trainer dies under step 4.
    let mut driver = c.driver_saving_every(4, 2);
    let mut lines = Vec::new();
    let mut killed = false;
    for line in BufReader::new(driver.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && line.contains(" 3/4 ") && !killed {
            killed = true;
            drop(c.w1.take());
            c.w1 = Some(start_worker(ports[1], &logs[1]));
        }
        lines.push(line);
    }
    let status = driver.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    assert!(
        status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{stderr}",
        lines.join("\n")
    );
    // Step 3 really was logged, then re-run after the restore of step 2.
    assert!(
        stderr.contains("restarting the trainer from checkpoint") && stderr.contains("step_000002"),
        "{stderr}"
    );
    assert_eq!(lines.iter().filter(|l| l.contains(" 3/4 ")).count(), 2);
    let steps: Vec<u64> = read_metrics(&runs.join("remote/metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4], "{stderr}");
    let events: Vec<PathBuf> = std::fs::read_dir(runs.join("remote"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        manta_telemetry::read_event_steps(&events[0]).unwrap(),
        vec![1, 2, 3, 4]
    );
    assert_eq!(trained(&runs.join("remote")).0, vec![1, 2, 3, 4]);
}

#[test]
fn a_lost_trainer_stops_the_run_when_configured_to() {
    let mut c = TrainerCluster::start("stop");
    let (ports, runs, save, driver_log) = (
        c.ports,
        c.runs.clone(),
        c.save.clone(),
        c.driver_log.clone(),
    );
    let mut driver = c.driver(3);
    for line in BufReader::new(driver.stdout.take().unwrap()).lines() {
        if line.unwrap().starts_with("step ") && c.w1.is_some() {
            wait_for_first_checkpoint(&save);
            drop(c.w1.take());
        }
    }
    let status = driver.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{}", ports[1]))
            && stderr.contains("on_failure = \"stop\"")
            && stderr.contains(&format!("--load {}", save.display())),
        "{stderr}"
    );
    // Nothing after the lost step was recorded as trained; the checkpoint is intact.
    let (steps, _) = trained(&runs.join("remote"));
    assert_eq!(steps, vec![1], "{stderr}");
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step_000001"
    );
}

/// Actors each worker reports hosting.
fn hosted(ports: [u16; 2]) -> Vec<Vec<String>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        for port in ports {
            let client =
                manta_runtime::WorkerClient::new(&format!("127.0.0.1:{port}"), TOKEN).unwrap();
            let reply = client.heartbeat(1, Duration::from_secs(5)).await.unwrap();
            out.push(reply.actors);
        }
        out
    })
}

/// Reads the driver's stdout up to its first `step` line; a driver that ends before it
/// fails the test with its log. The rest of stdout is drained on a thread so that the
/// driver never blocks on a full pipe.
fn wait_for_first_step(driver: &mut Child, driver_log: &Path) {
    let mut lines = BufReader::new(driver.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("step ") => break,
            Some(Ok(_)) => {}
            end => {
                let status = driver.wait().unwrap();
                let log = std::fs::read_to_string(driver_log).unwrap_or_default();
                panic!("the driver ended before its first step ({end:?}, {status}):\n{log}");
            }
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
}

fn interrupt(child: &Child) {
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -INT failed");
}

/// Ctrl-C once: the step ends, the checkpoint is written, and the actors on both
/// workers are stopped. Twice: the driver exits at once and still stops them.
#[test]
fn ctrl_c_stops_the_actors_on_every_worker() {
    for presses in [1, 2] {
        let c = TrainerCluster::start("stop");
        let (ports, driver_log) = (c.ports, c.driver_log.clone());
        let mut driver = c.driver(1000);
        // Wait for the first step: every actor is placed and busy.
        wait_for_first_step(&mut driver, &driver_log);
        let placed = hosted(ports);
        assert_eq!(
            placed,
            vec![
                vec!["rollout-0-0".to_string()],
                vec!["trainer-0".to_string()]
            ]
        );
        for press in 0..presses {
            interrupt(&driver);
            if press + 1 < presses {
                // Two SIGINTs sent before the first is handled merge into one: wait until
                // the driver has seen the first press.
                let deadline = Instant::now() + Duration::from_secs(60);
                while !std::fs::read_to_string(&driver_log)
                    .unwrap_or_default()
                    .contains("Ctrl-C: stopping after the current step")
                {
                    assert!(Instant::now() < deadline, "the driver never saw Ctrl-C");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let status = driver.wait().unwrap();
        let stderr = std::fs::read_to_string(&driver_log).unwrap();
        if presses == 1 {
            assert!(status.success(), "{stderr}");
            assert!(stderr.contains("stopped on request"), "{stderr}");
        } else {
            assert_eq!(status.code(), Some(130), "{stderr}");
            // Both actors, or the one left when the second press came while the run was
            // already stopping its trainer: either way the workers end with none (below).
            assert!(
                stderr.contains("stopped 2 remote actors")
                    || stderr.contains("stopped 1 remote actors"),
                "{stderr}"
            );
        }
        assert_eq!(
            hosted(ports),
            vec![Vec::<String>::new(), Vec::new()],
            "{stderr}"
        );
    }
}

/// A driver killed without Ctrl-C (SIGKILL) stops renewing its leases: each worker
/// stops the actors it placed, says why, and serves the next driver.
#[test]
fn a_killed_driver_leaves_no_actors_on_the_workers() {
    let c = TrainerCluster::start("stop");
    let mut driver = c.driver(1000);
    wait_for_first_step(&mut driver, &c.driver_log);
    assert_eq!(
        hosted(c.ports),
        vec![
            vec!["rollout-0-0".to_string()],
            vec!["trainer-0".to_string()]
        ]
    );
    driver.kill().unwrap();
    driver.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while hosted(c.ports) != vec![Vec::<String>::new(), Vec::new()] {
        assert!(
            Instant::now() < deadline,
            "actors still hosted: {:?}",
            hosted(c.ports)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for log in &c.logs {
        let text = std::fs::read_to_string(log).unwrap();
        assert!(text.contains("sent no heartbeat"), "{text}");
    }
    // The same workers serve a new driver.
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("driver.log");
    let out = driver_command(
        &c.cluster,
        &tmp.path().join("runs"),
        &tmp.path().join("ckpt"),
        &log,
        1,
        1,
    )
    .output()
    .unwrap();
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(out.status.success(), "{stderr}");
}

/// Workers run from empty directories (see `start_worker`): the driver ships the
/// train config, resolves its own relative paths (--config, --runs-dir, --save,
/// --load) and the trainer on a worker resumes from a relative `--load`.
#[test]
fn a_driver_with_relative_paths_trains_and_resumes_on_workers_elsewhere() {
    let c = TrainerCluster::start("stop");
    let cwd = c._tmp.path().join("driver-cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::copy(
        workspace().join("train_config.yaml"),
        cwd.join("my_config.yaml"),
    )
    .unwrap();
    let run = |steps: &str, load: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_driver"));
        cmd.current_dir(&cwd)
            .args(["--cluster", c.cluster.to_str().unwrap()])
            .args(["--config", "my_config.yaml", "--runs-dir", "runs"])
            .args(["--save", "ckpt", "--save-interval", "1"])
            .args(["--rollout-batch-size", "4", "--n-samples", "2"])
            .args(["--num-rollout", steps, "--run-name", "rel"])
            .env("MANTA_CLUSTER_TOKEN", TOKEN)
            .env("RUST_LOG", "info");
        if load {
            cmd.args(["--load", "ckpt"]);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        stderr
    };
    run("1", false);
    let stderr = run("2", true);
    assert!(stderr.contains("resumed"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(cwd.join("ckpt/latest"))
            .unwrap()
            .trim(),
        "step_000002"
    );
}

/// Bodies POSTed to `/v1/rollouts`, with their `x-api-key` header.
type Posts = std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>;

/// A plain-HTTP stand-in for OpenReward's upload API on a free port: records every
/// POST body and answers 200 (keep-alive, one thread per connection).
fn capture_uploads() -> (String, Posts) {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let posts: Posts = Default::default();
    let seen = posts.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                loop {
                    let (mut length, mut key) = (0usize, String::new());
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let header = line.trim_end();
                        if header.is_empty() {
                            break;
                        }
                        let (name, value) = header.split_once(':').unwrap_or((header, ""));
                        match name.to_ascii_lowercase().as_str() {
                            "content-length" => length = value.trim().parse().unwrap(),
                            "x-api-key" => key = value.trim().to_string(),
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    let json = serde_json::from_slice(&body).unwrap_or_default();
                    seen.lock().unwrap().push((key, json));
                    conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .unwrap();
                }
            });
        }
    });
    (url, posts)
}

/// Rollout actors on a worker upload their trajectories under train_config's
/// `openreward_run_name`, with the driver's key and API URL (the worker's environment
/// has neither), and the key never reaches a log.
#[test]
fn remote_rollouts_upload_their_trajectories() {
    const KEY: &str = "e2e-upload-key-5f2c";
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let worker_log = tmp.path().join("w.log");
    let _worker = start_worker(port, &worker_log);
    let (api, posts) = capture_uploads();
    let ws = workspace();
    let config = tmp.path().join("train_config.yaml");
    let yaml = std::fs::read_to_string(ws.join("train_config.yaml")).unwrap();
    std::fs::write(
        &config,
        yaml.replace(
            "openreward_run_name: manta-local",
            "openreward_run_name: e2e-remote-run",
        ),
    )
    .unwrap();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\n\n\
             [rollout]\nengines = 1\n\n\
             [train]\nmodel = \"{}\"\nmax_response_len = 8\ncontext_len = 512\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{port}\"\n",
            config.display(),
            ws.join("assets/tiny-qwen3").display(),
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(&ws)
        .args(["--cluster", cluster.to_str().unwrap()])
        .args(["--runs-dir", tmp.path().join("runs").to_str().unwrap()])
        .args(["--rollout-batch-size", "2", "--n-samples", "2"])
        .args(["--num-rollout", "1", "--run-name", "upload"])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("OPENREWARD_API_KEY", KEY)
        .env("OPENREWARD_API_URL", &api)
        .env_remove("MANTA_ROLLOUT_UPLOAD")
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The 4 episodes' rollout events arrive (the worker flushes when its actor stops).
    let rollout_events = || -> Vec<serde_json::Value> {
        posts
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(_, body)| body["events"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["eventType"] == "rollout")
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while rollout_events().len() < 4 {
        assert!(
            Instant::now() < deadline,
            "{} rollout events arrived",
            rollout_events().len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let events = rollout_events();
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events.iter().all(|e| e["runName"] == "e2e-remote-run"));
    assert!(posts.lock().unwrap().iter().all(|(key, _)| key == KEY));
    let worker = std::fs::read_to_string(&worker_log).unwrap();
    assert!(
        worker.contains("uploading trajectories to OpenReward"),
        "{worker}"
    );
    assert!(!worker.contains(KEY) && !stderr.contains(KEY));
}

/// A self-signed CA written to `dir/{name}.pem` (returned), with the issuer that signs
/// with it (certificates made with rcgen, as crates/runtime's TLS tests do).
fn make_ca(dir: &Path, name: &str) -> (PathBuf, rcgen::CertifiedIssuer<'static, rcgen::KeyPair>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca =
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let path = dir.join(format!("{name}.pem"));
    std::fs::write(&path, ca.pem()).unwrap();
    (path, ca)
}

/// A server certificate for `localhost` and 127.0.0.1 signed by `ca`, written to `dir`:
/// (certificate PEM, private key PEM).
fn make_server_cert(
    dir: &Path,
    ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
) -> (PathBuf, PathBuf) {
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca).unwrap();
    let (cert_path, key_path) = (dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    (cert_path, key_path)
}

/// Runs the driver to its end, killing it (and failing the test) if it is still running
/// after `limit`, a deadline that only stops a hang.
fn driver_output(cmd: &mut Command, limit: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("driver starts");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let stdout = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut buf).unwrap();
        buf
    });
    let stderr = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut buf).unwrap();
        buf
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the driver was still running after {limit:?}\nstderr:\n{}",
                String::from_utf8_lossy(&stderr.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// TLS end to end: a real `worker --tls-cert --tls-key` (certificate signed by a CA made
/// here) trains a step for a driver whose cluster.toml names that CA in `[cluster]
/// tls_ca`; a driver without `tls_ca`, and one trusting another CA, are refused before
/// the run starts, with an error that says what is wrong.
#[test]
fn a_tls_worker_trains_for_a_driver_trusting_its_ca_and_refuses_the_rest() {
    const LIMIT: Duration = Duration::from_secs(300);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    let (ca, issuer) = make_ca(&certs, "cluster-ca");
    let (other_ca, _) = make_ca(&certs, "other-ca");
    let (cert, key) = make_server_cert(&certs, &issuer);
    let port = free_port();
    let log = tmp.path().join("w.log");
    let _worker = start_worker_with(
        port,
        &log,
        &[
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
        ],
    );
    let ws = workspace();
    let runs = tmp.path().join("runs");
    let driver = |name: &str, tls_ca: Option<&Path>| {
        let cluster = tmp.path().join(format!("{name}.toml"));
        let tls = tls_ca
            .map(|p| format!("tls_ca = \"{}\"\n", p.display()))
            .unwrap_or_default();
        std::fs::write(
            &cluster,
            format!(
                "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\n{tls}\n\
                 [rollout]\nengines = 1\n\n\
                 [train]\nmodel = \"{}\"\nmax_response_len = 8\ncontext_len = 512\n\n\
                 [[nodes]]\naddress = \"127.0.0.1:{port}\"\n",
                ws.join("train_config.yaml").display(),
                ws.join("assets/tiny-qwen3").display(),
            ),
        )
        .unwrap();
        let out = driver_output(
            Command::new(env!("CARGO_BIN_EXE_driver"))
                .current_dir(&ws)
                .args(["--cluster", cluster.to_str().unwrap()])
                .args(["--runs-dir", runs.to_str().unwrap(), "--save-interval", "0"])
                .args(["--rollout-batch-size", "2", "--n-samples", "2"])
                .args(["--num-rollout", "1", "--run-name", name])
                .env("MANTA_CLUSTER_TOKEN", TOKEN)
                .env("RUST_LOG", "warn"),
            LIMIT,
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stdout, stderr)
    };
    let addr = format!("127.0.0.1:{port}");

    // Trusting the cluster CA: one step, its weights applied on the worker over TLS.
    let (ok, stdout, stderr) = driver("trusted", Some(&ca));
    assert!(
        ok,
        "driver with tls_ca failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        1,
        "{stdout}"
    );
    let rows = read_metrics(&runs.join("trusted/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1["weights/version"], 1.0);
    assert_eq!(rows[0].1["cluster/live_nodes"], 1.0);
    let served = std::fs::read_to_string(log.with_extension("stdout")).unwrap();
    assert!(
        served.contains(&format!("worker listening on {addr} (TLS)")),
        "{served}"
    );
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("weights applied"),
        "the worker never applied the step's weights"
    );

    // No tls_ca: plaintext against a TLS worker is refused, and the error says to set it.
    let (ok, _, stderr) = driver("plaintext", None);
    assert!(!ok, "a plaintext driver trained against a TLS worker");
    assert!(
        stderr.contains(&addr) && stderr.contains("TLS") && stderr.contains("cluster.tls_ca"),
        "{stderr}"
    );
    assert!(!runs.join("plaintext").exists(), "the run started anyway");

    // Trusting another CA: the worker's certificate is rejected, and the error says so.
    let (ok, _, stderr) = driver("untrusted", Some(&other_ca));
    assert!(
        !ok,
        "a driver trusting another CA trained against the worker"
    );
    assert!(
        stderr.contains(&addr)
            && stderr.contains("certificate")
            && (stderr.contains("UnknownIssuer") || stderr.contains("unknown issuer")),
        "{stderr}"
    );
    assert!(!runs.join("untrusted").exists(), "the run started anyway");
}
