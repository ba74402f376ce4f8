//! `[rollout] engine = "sglang"`: the rollout actor launches, health-checks, restarts and
//! stops an SGLang server process. SGLang itself cannot run here (no CUDA; see docs/engines.md, "SGLang engines"),
//! so `command` points at the real `driver serve` binary, Manta's SGLang-compatible
//! server, which the actor launches exactly as it would launch `sglang.launch_server`.
//!
//! The tiny model is copied into each test's temp dir so the engine's command line
//! (`--model-path <tmp>/model`) names that test alone: "no engine left" scans /proc for it.

use crate::common;

use common::Worker;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use manta_telemetry::read_metrics;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// A temp dir with a copy of the tiny model and a cluster.toml for the SGLang engine.
struct Setup {
    tmp: tempfile::TempDir,
}

impl Setup {
    /// `command`: the engine command as cluster.toml's TOML array text.
    fn new(command: &str, extra: &str) -> Self {
        Self::with_cluster(command, extra, "mode = \"local\"", "")
    }

    /// `mode` goes under `[cluster]`, `tail` at the end (e.g. `[[nodes]]`).
    fn with_cluster(command: &str, extra: &str, mode: &str, tail: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        std::fs::create_dir_all(&model).unwrap();
        for entry in std::fs::read_dir(workspace().join("assets/tiny-qwen3")).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
            }
        }
        let cluster = format!(
            "[cluster]\n{mode}\ntrain_config = {:?}\n\n\
             [rollout]\nengine = \"sglang\"\nengines = 1\ncommand = {command}\n\
             health_interval_ms = 500\n{extra}\n\n\
             [train]\nseed = 1\nlr = 0.003\ncontext_len = 512\ntemperature = 1.0\n\n{tail}",
            workspace().join("train_config.yaml").display().to_string()
        );
        std::fs::write(tmp.path().join("cluster.toml"), cluster).unwrap();
        Self { tmp }
    }

    /// `driver serve` as the engine command.
    fn driver_serve(extra: &str) -> Self {
        Self::new(
            &format!("[{:?}, \"serve\"]", env!("CARGO_BIN_EXE_driver")),
            extra,
        )
    }

    fn path(&self) -> &Path {
        self.tmp.path()
    }

    fn run_dir(&self) -> PathBuf {
        self.path().join("runs/t")
    }

    fn driver(&self, steps: u32) -> Command {
        self.driver_named(steps, "t")
    }

    fn driver_named(&self, steps: u32, run: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_driver"));
        c.current_dir(workspace())
            .args([
                "--cluster",
                self.path().join("cluster.toml").to_str().unwrap(),
            ])
            .args(["--model", self.path().join("model").to_str().unwrap()])
            .args(["--runs-dir", self.path().join("runs").to_str().unwrap()])
            .args(["--run-name", run, "--save-interval", "0"])
            .args(["--save", self.path().join("ckpt").to_str().unwrap()])
            .args(["--rollout-batch-size", "4", "--n-samples", "4"])
            .args(["--max-response-len", "32"])
            .args(["--num-rollout", &steps.to_string()])
            .env("RUST_LOG", "warn");
        c
    }

    /// Live processes whose command line mentions this test's temp dir (engines).
    fn engine_processes(&self) -> Vec<String> {
        // The driver's own `--model` must not match: engines get `--model-path`.
        let needle = format!("--model-path {}", self.path().join("model").display());
        processes_with(&needle)
    }

    /// Polls until no engine process is left; the message lists the survivors.
    fn assert_no_engine_left(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = self.engine_processes();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "engine processes left: {left:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// `pid: cmdline` of every live (non-zombie) process whose cmdline contains `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let zombie = std::fs::read_to_string(entry.path().join("stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(false);
        if cmd.contains(needle) && !zombie {
            out.push(format!("{name}: {cmd}"));
        }
    }
    out
}

fn describe(out: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every step trained all of its rollout_batch_size x n_samples episodes.
fn assert_every_episode_trained(run_dir: &Path, steps: u64, per_step: u64) {
    let text = std::fs::read_to_string(run_dir.join("trained_ids.jsonl")).unwrap();
    let mut ids: Vec<u64> = text
        .lines()
        .flat_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..steps * per_step).collect::<Vec<u64>>());
}

#[test]
fn three_steps_through_a_launched_driver_serve() {
    let s = Setup::driver_serve("");
    let out = s
        .driver(3)
        .env("RUST_LOG", "warn,manta_weight_sync=info")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        3,
        "{stdout}"
    );
    // The engine loaded each step's weights (through /update_weights_from_disk).
    let rows = read_metrics(&s.run_dir().join("metrics.jsonl")).unwrap();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64, "{}", describe(&out));
        assert_eq!(m["rollout/engine_restarts"], 0.0);
    }
    assert_every_episode_trained(&s.run_dir(), 3, 16);
    // The route the log names is the one taken: a file the server loads, not gRPC.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let route = stderr
        .lines()
        .find(|l| l.contains("weight sync route"))
        .unwrap_or_else(|| panic!("no route line: {}", describe(&out)));
    assert!(route.contains("safetensors file"), "{route}");
    // The engine's output went to its log, which names the command Manta built.
    let log = std::fs::read_to_string(s.run_dir().join("engines/0.log")).unwrap();
    assert!(log.contains("--- manta: starting"), "{log}");
    assert!(
        log.contains("--device cpu") && log.contains("--port"),
        "{log}"
    );
    s.assert_no_engine_left();
}

#[test]
fn a_killed_engine_is_restarted_and_no_episode_is_lost() {
    let s = Setup::driver_serve("");
    let driver_log = s.path().join("driver.log");
    let mut driver = s
        .driver(3)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&driver_log).unwrap())
        .spawn()
        .unwrap();
    let stdout = driver.stdout.take().unwrap();
    let pid_file = s.run_dir().join("engines/0.pid");
    let mut lines = Vec::new();
    let mut killed = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && killed.is_none() {
            // Step 2's rollouts start now: kill -9 the engine under them.
            let pid: i32 = std::fs::read_to_string(&pid_file)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let status = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status()
                .unwrap();
            assert!(status.success());
            killed = Some(pid);
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
    assert!(killed.is_some(), "no step line seen: {lines:?}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("step ")).count(), 3);
    assert_every_episode_trained(&s.run_dir(), 3, 16);
    assert!(stderr.contains("engine restarted"), "{stderr}");
    let rows = read_metrics(&s.run_dir().join("metrics.jsonl")).unwrap();
    let last = &rows.last().unwrap().1;
    assert!(last["rollout/engine_restarts"] >= 1.0, "{rows:?}");
    assert_eq!(last["weights/version"], 3.0);
    for (_, m) in &rows {
        assert_eq!(m["rollout/failed_count"], 0.0, "{stderr}");
    }
    // The new process was started into the same log, and it is not the killed one.
    let log = std::fs::read_to_string(s.run_dir().join("engines/0.log")).unwrap();
    assert!(log.matches("--- manta: starting").count() >= 2, "{log}");
    let new_pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(Some(new_pid), killed);
    s.assert_no_engine_left();
}

#[test]
fn an_engine_that_never_becomes_healthy_fails_the_run_with_its_log() {
    // A stand-in that writes a line and hangs without ever listening.
    let marker = format!("engine-never-ready-{}", std::process::id());
    let s = Setup::new(
        &format!("[\"sh\", \"-c\", \"echo {marker} >&2; exec sleep 1000\", \"sh\"]"),
        "health_timeout_s = 3",
    );
    let out = s.driver(1).output().unwrap();
    assert!(!out.status.success(), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("health_generate"), "{stderr}");
    assert!(stderr.contains(&marker), "the log's tail: {stderr}");
    assert!(stderr.contains("0.log"), "{stderr}");
    let left = processes_with(&marker);
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn an_interrupted_driver_stops_its_engine() {
    let s = Setup::driver_serve("");
    let mut driver: Child = s
        .driver(1000)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(driver.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("driver ended before a step").unwrap();
        if line.starts_with("step ") {
            break;
        }
    }
    assert!(
        !s.engine_processes().is_empty(),
        "the engine should be running"
    );
    // Ctrl-C: the driver stops after the step in progress and stops its actors.
    let pid = driver.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    for _ in lines {}
    driver.wait().unwrap();
    s.assert_no_engine_left();
}

#[test]
fn a_sigkilled_driver_leaves_no_engine() {
    let s = Setup::driver_serve("");
    let mut driver: Child = s
        .driver(1000)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = driver.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    // Wait for a trained step, so the engine is up and serving.
    loop {
        let line = lines.next().expect("driver ended before a step").unwrap();
        if line.starts_with("step ") {
            break;
        }
    }
    assert!(
        !s.engine_processes().is_empty(),
        "the engine should be running"
    );
    driver.kill().unwrap();
    driver.wait().unwrap();
    s.assert_no_engine_left();
}

const TOKEN: &str = "sglang-engine-test-token";

/// A `worker` daemon in a folder of its own; SIGKILLed when dropped.
fn start_worker(port: u16, cwd: &Path, log: &Path) -> Worker {
    std::fs::create_dir_all(cwd).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_worker"))
        .current_dir(cwd)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env_remove("MANTA_CLUSTER_TOKEN_FILE")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "worker on {port} never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    Worker(child)
}

/// Acceptance 2: the engine is launched by the worker's rollout actor; kill -9 of it
/// mid-run is survived the same way, and neither the driver's exit nor the worker's
/// SIGKILL leaves it behind.
#[test]
fn a_remote_workers_engine_is_launched_restarted_and_stopped() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = Setup::with_cluster(
        &format!("[{:?}, \"serve\"]", env!("CARGO_BIN_EXE_driver")),
        "",
        "mode = \"remote\"\nheartbeat_interval_ms = 200\ndead_after_ms = 3000",
        &format!("[[nodes]]\naddress = \"127.0.0.1:{port}\"\n"),
    );
    let worker_dir = s.path().join("worker");
    let worker_log = s.path().join("worker.log");
    let worker = start_worker(port, &worker_dir, &worker_log);
    let driver_log = s.path().join("driver.log");
    let mut driver = s
        .driver(3)
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&driver_log).unwrap())
        .spawn()
        .unwrap();
    let pid_file = worker_dir.join("runs/t/engines/rollout-0-0.pid");
    let stdout = driver.stdout.take().unwrap();
    let mut lines = Vec::new();
    let mut killed = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && killed.is_none() {
            let pid = std::fs::read_to_string(&pid_file)
                .unwrap()
                .trim()
                .to_string();
            assert!(Command::new("kill")
                .args(["-9", &pid])
                .status()
                .unwrap()
                .success());
            killed = Some(pid);
        }
        lines.push(line);
    }
    let status = driver.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    let wlog = std::fs::read_to_string(&worker_log).unwrap();
    assert!(
        status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{stderr}\nworker:\n{wlog}",
        lines.join("\n")
    );
    assert!(killed.is_some());
    assert_eq!(lines.iter().filter(|l| l.starts_with("step ")).count(), 3);
    assert_every_episode_trained(&s.run_dir(), 3, 16);
    assert!(wlog.contains("engine restarted"), "{wlog}");
    let rows = read_metrics(&s.run_dir().join("metrics.jsonl")).unwrap();
    let last = &rows.last().unwrap().1;
    assert!(last["rollout/engine_restarts"] >= 1.0, "{rows:?}");
    assert_eq!(last["weights/version"], 3.0);
    let log = std::fs::read_to_string(worker_dir.join("runs/t/engines/rollout-0-0.log")).unwrap();
    assert!(log.matches("--- manta: starting").count() >= 2, "{log}");
    // The driver stopped the worker's rollout actor, and with it the engine.
    s.assert_no_engine_left();

    // A second run, then the worker is SIGKILLed under it: its engine goes too.
    let mut driver = s
        .driver_named(1000, "t2")
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(driver.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("driver ended before a step").unwrap();
        if line.starts_with("step ") {
            break;
        }
    }
    assert!(
        !s.engine_processes().is_empty(),
        "the engine should be running"
    );
    drop(worker);
    s.assert_no_engine_left();
    let _ = driver.kill();
    let _ = driver.wait();
}
