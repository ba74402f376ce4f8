//! Stopping a run as schedulers and people do: SIGTERM (scancel, kill, a pod deletion)
//! and SIGINT (Ctrl-C) to the real `driver` binary during a local run of the tiny model
//! on the built-in environment, and SIGTERM to a real `worker` in a remote run. While
//! the run goes, `driver status` and the Prometheus endpoint answer with its facts.

use crate::common;

use common::sdk_server::SdkServer;
use common::workers::{spawn_listening, worker_command};
use common::{free_ports, workspace, Worker};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TOKEN: &str = "stop-signals-token";

/// A local driver run of 1000 steps (never reached) as `run` under `dir`, saving only
/// when it ends; stdout piped, stderr to `dir/driver.stderr`.
fn local_driver(dir: &Path, run: &str, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--run-name",
            run,
        ])
        .args(["--runs-dir", dir.join("runs").to_str().unwrap()])
        .args(["--save", dir.join("ckpt").to_str().unwrap()])
        .args(["--save-interval", "0", "--num-rollout", "1000"])
        .args(["--rollout-batch-size", "2", "--n-samples", "2"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("driver.stderr")).unwrap())
        .spawn()
        .expect("driver starts")
}

/// The driver's stdout lines as they come, on a thread (so the driver never blocks).
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for the `n`-th step line; the lines seen so far.
fn wait_for_steps(lines: &mpsc::Receiver<String>, n: usize, log: &Path) -> Vec<String> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    while seen
        .iter()
        .filter(|l: &&String| l.starts_with("step "))
        .count()
        < n
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(e) => panic!(
                "no step {n} ({e}); stdout:\n{}\nstderr:\n{}",
                seen.join("\n"),
                std::fs::read_to_string(log).unwrap_or_default()
            ),
        }
    }
    seen
}

fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name} {pid} failed");
}

/// Waits for `child` to end, at most `limit`.
fn wait_at_most(child: &mut Child, limit: Duration, log: &Path) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "still running after {limit:?}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` holds `needle`.
fn wait_for_text(path: &Path, needle: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(needle)
    {
        assert!(
            Instant::now() < deadline,
            "{} never said {needle:?}:\n{}",
            path.display(),
            std::fs::read_to_string(path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Steps of trained_ids.jsonl in order, and every id in them, sorted.
fn trained(run_dir: &Path) -> (Vec<u64>, Vec<u64>) {
    let text = std::fs::read_to_string(run_dir.join("trained_ids.jsonl")).unwrap_or_default();
    let (mut steps, mut ids) = (Vec::new(), Vec::new());
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

/// `GET path` on `addr` over plain HTTP/1.1: the status code and body.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        tcp,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    tcp.read_to_string(&mut reply).unwrap();
    let code = reply
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = reply.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (code, body.to_string())
}

/// The value of the sample line `name` (with its labels) in Prometheus text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// SIGTERM during a step: the step finishes, its checkpoint is written, the driver
/// exits 0; `--load` then runs the next step and every sample is trained once. While it
/// runs, `driver status` and `/metrics` tell the step, phase, node and engine version;
/// driver.log holds the step lines and the curves PNG exists after the first step.
#[test]
fn sigterm_mid_step_checkpoints_the_finished_step_and_load_resumes_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let log = dir.join("driver.stderr");
    let run_dir = dir.join("runs/r");
    let mut driver = local_driver(dir, "r", &[]);
    let lines = lines_of(&mut driver);
    let seen = wait_for_steps(&lines, 2, &log);
    let step_line = seen.iter().find(|l| l.starts_with("step ")).unwrap();
    assert!(
        step_line.contains("elapsed ") && step_line.contains("eta "),
        "{step_line}"
    );

    // Asked during the run: the status summary and the metrics.
    let addr = std::fs::read_to_string(run_dir.join("status_addr")).unwrap();
    let addr = addr.trim();
    let status = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["status", "--run-dir", run_dir.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&status.stderr)
    );
    for needle in [
        "local mode",
        "step ",
        "phase ",
        "episodes in flight",
        "healthy",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
    assert!(text.contains("rollout-0  weight version"), "{text}");
    let json = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["status", "--addr", addr, "--json"])
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(s["steps_done"].as_u64().unwrap() >= 2, "{s}");
    assert!(s["step"].as_u64().unwrap() >= 3, "{s}");
    assert_eq!(s["nodes"][0]["address"], "local", "{s}");
    assert!(
        s["nodes"][0]["actors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "trainer"),
        "{s}"
    );
    let version = s["engines"][0]["weight_version"].as_u64().unwrap();
    assert!(version >= 2, "{s}");
    assert!(s["last_step_metrics"]["train/loss"].is_number(), "{s}");
    let (code, metrics) = http_get(addr, "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert!(sample(&metrics, "manta_step").unwrap() >= 3.0, "{metrics}");
    assert_eq!(
        sample(&metrics, "manta_node_up{node=\"local\"}"),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        sample(
            &metrics,
            "manta_engine_weight_version{engine=\"rollout-0\"}"
        )
        .unwrap()
            >= 2.0,
        "{metrics}"
    );
    assert!(
        metrics.contains("manta_step_metric{name=\"train/loss\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("# TYPE manta_phase gauge"), "{metrics}");
    assert!(
        run_dir.join("curves.png").is_file(),
        "no curves.png after step 1"
    );

    signal(driver.id(), "TERM");
    let status = wait_at_most(&mut driver, Duration::from_secs(120), &log);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        status.success(),
        "SIGTERM should end the run with 0 ({status}):\n{stderr}"
    );
    assert!(
        stderr.contains("SIGTERM: stopping after the current step"),
        "{stderr}"
    );
    let (steps, ids) = trained(&run_dir);
    let last = *steps.last().unwrap();
    assert_eq!(steps, (1..=last).collect::<Vec<_>>());
    assert!((2..1000).contains(&last));
    let latest = std::fs::read_to_string(dir.join("ckpt/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step_{last:06}"), "{stderr}");
    assert_eq!(ids, (0..last * 4).collect::<Vec<_>>());
    let driver_log = std::fs::read_to_string(run_dir.join("driver.log")).unwrap();
    for s in 1..=last {
        assert!(
            driver_log.contains(&format!("step {s:>5}/1000")),
            "step {s} not in driver.log:\n{driver_log}"
        );
    }
    assert!(driver_log.contains("SIGTERM"), "{driver_log}");
    assert!(driver_log.contains("saving checkpoint"), "{driver_log}");

    // Resume: the next step, then two more; each sample once across both runs.
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            "cluster.toml",
            "--train-settings",
            "configs/local-tiny.toml",
            "--run-name",
            "r",
        ])
        .args(["--runs-dir", dir.join("runs").to_str().unwrap()])
        .args(["--save", dir.join("ckpt").to_str().unwrap()])
        .args(["--load", dir.join("ckpt").to_str().unwrap()])
        .args([
            "--save-interval",
            "0",
            "--num-rollout",
            &(last + 2).to_string(),
        ])
        .args(["--rollout-batch-size", "2", "--n-samples", "2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = stdout.lines().find(|l| l.starts_with("step ")).unwrap();
    assert!(
        first.starts_with(&format!("step {:>5}/", last + 1)),
        "resumed at {first}"
    );
    let (steps, ids) = trained(&run_dir);
    assert_eq!(steps, (1..=last + 2).collect::<Vec<_>>());
    assert_eq!(ids, (0..(last + 2) * 4).collect::<Vec<_>>());
}

/// `--on-stop abandon-step`: SIGTERM while a step collects its rollouts drops that step;
/// the checkpoint holds the last finished one and nothing of the dropped one is recorded.
#[test]
fn abandon_step_drops_the_step_in_its_rollouts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let log = dir.join("driver.stderr");
    let mut driver = local_driver(dir, "r", &["--on-stop", "abandon-step"]);
    let lines = lines_of(&mut driver);
    wait_for_steps(&lines, 1, &log);
    signal(driver.id(), "TERM");
    let status = wait_at_most(&mut driver, Duration::from_secs(120), &log);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{stderr}");
    let (steps, _) = trained(&dir.join("runs/r"));
    let last = *steps.last().unwrap();
    let latest = std::fs::read_to_string(dir.join("ckpt/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step_{last:06}"), "{stderr}");
    // The signal lands in step last+1's rollouts (most of a step) or its training.
    if stderr.contains("abandoned during its rollouts") {
        let metrics = manta_telemetry::read_metrics(&dir.join("runs/r/metrics.jsonl")).unwrap();
        assert_eq!(metrics.last().unwrap().0, last);
    }
}

/// A second SIGINT while a step's rollouts run exits at once with 130, without the
/// libtorch assertion that `exit` used to trigger from the engine thread: ten runs of ten.
#[test]
fn a_second_ctrl_c_during_a_rollout_exits_130_without_a_panic_ten_of_ten() {
    for attempt in 0..10 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = dir.join("driver.stderr");
        // Long generations keep each step in its rollouts most of the time.
        let mut driver = local_driver(dir, "r", &["--max-response-len", "64"]);
        let lines = lines_of(&mut driver);
        wait_for_steps(&lines, 1, &log);
        signal(driver.id(), "INT");
        wait_for_text(
            &log,
            "Ctrl-C: stopping after the current step",
            Duration::from_secs(60),
        );
        signal(driver.id(), "INT");
        let status = wait_at_most(&mut driver, Duration::from_secs(30), &log);
        let stderr = std::fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(130), "attempt {attempt}:\n{stderr}");
        for bad in [
            "INTERNAL ASSERT",
            "panicked",
            "terminate called",
            "core dumped",
        ] {
            assert!(!stderr.contains(bad), "attempt {attempt}: {bad}:\n{stderr}");
        }
    }
}

/// Two workers listening on `ports`, each in its own directory under `dir`.
fn start_workers(dir: &Path, ports: [u16; 2], metrics: u16) -> [Worker; 2] {
    std::array::from_fn(|i| {
        let cwd = dir.join(format!("w{i}"));
        let log = std::fs::File::create(dir.join(format!("w{i}.log"))).unwrap();
        let mut cmd = worker_command(&cwd, ports[i], TOKEN);
        if i == 0 {
            cmd.args(["--metrics-addr", &format!("127.0.0.1:{metrics}")]);
        }
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        spawn_listening(&mut cmd, ports[i])
    })
}

fn remote_cluster(dir: &Path, ports: [u16; 2], train_config: &Path) -> PathBuf {
    let ws = workspace();
    let path = dir.join("cluster.toml");
    std::fs::write(
        &path,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\n\n\
             [rollout]\nengines = 1\nmax_concurrent_episodes = 16\n\n\
             [train]\nmodel = \"{}\"\nseed = 1\nlr = 0.003\nmax_response_len = 8\ncontext_len = 512\nmax_tokens_per_gpu = 8192\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{}\"\n\n[[nodes]]\naddress = \"127.0.0.1:{}\"\n",
            train_config.display(),
            ws.join("assets/tiny-qwen3").display(),
            ports[0],
            ports[1]
        ),
    )
    .unwrap();
    path
}

/// The train_config.yaml of the gated SDK environment (tests/py/gated_env.py) at `base`.
fn gated_train_config(dir: &Path, base: &str) -> PathBuf {
    let path = dir.join("train_config.yaml");
    std::fs::write(
        &path,
        format!(
            "environments:\n  Test/Gated:\n    url: \"{base}\"\n    variant: gated\n    \
             splits: [train]\n    max_turns: 1\nsecrets: {{}}\n\
             system_prompt_template: \"Answer.{{tools}}\"\nthinking: false\n\
             openreward_run_name: manta-stop-signals\n"
        ),
    )
    .unwrap();
    path
}

/// Lines in `path` (0 while it does not exist).
fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

/// SIGTERM to a worker mid-run: it stops its actors and exits 0; the driver re-queues the
/// episodes that worker held on the other node (as for a lost node), runs the next steps
/// there and trains every sample once. The environment (served by the real `openreward`
/// SDK) holds step 2's episodes in flight until the worker is gone, so the worker surely
/// holds some when the signal lands. `driver status` names both nodes and their actors
/// before, and a worker's /metrics answers.
#[test]
fn a_worker_given_sigterm_leaves_and_its_episodes_run_elsewhere() {
    const STEPS: u64 = 6;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let [p0, p1, pm] = free_ports::<3>();
    // Step 1's 32 episodes pass; step 2's wait in the environment while this file exists.
    let (prompts, budget) = (dir.join("prompts.log"), dir.join("budget"));
    std::fs::write(&budget, "32").unwrap();
    let env = SdkServer::start(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/gated_env.py"),
        &[prompts.to_str().unwrap(), budget.to_str().unwrap()],
    );
    let mut workers = start_workers(dir, [p0, p1], pm);
    let cluster = remote_cluster(dir, [p0, p1], &gated_train_config(dir, &env.base));
    let log = dir.join("driver.stderr");
    let run_dir = dir.join("runs/remote");
    let mut driver = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(["--cluster", cluster.to_str().unwrap()])
        .args(["--runs-dir", dir.join("runs").to_str().unwrap()])
        .args([
            "--save",
            dir.join("ckpt").to_str().unwrap(),
            "--save-interval",
            "0",
        ])
        .args(["--rollout-batch-size", "8", "--n-samples", "4"])
        .args(["--num-rollout", &STEPS.to_string(), "--run-name", "remote"])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut driver);
    wait_for_steps(&lines, 1, &log);

    let status = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["status", "--run-dir", run_dir.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(&status.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&status.stderr)));
    assert_eq!(s["mode"], "remote", "{s}");
    let nodes = s["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{s}");
    for (node, port) in nodes.iter().zip([p0, p1]) {
        assert_eq!(node["address"], format!("127.0.0.1:{port}"), "{s}");
        assert_eq!(node["healthy"], true, "{s}");
        assert!(!node["actors"].as_array().unwrap().is_empty(), "{s}");
    }
    assert_eq!(s["engines"].as_array().unwrap().len(), 2, "{s}");
    let (code, metrics) = http_get(&format!("127.0.0.1:{pm}"), "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert_eq!(sample(&metrics, "manta_worker_up"), Some(1.0), "{metrics}");
    assert!(
        metrics.contains("manta_actor_up{actor=\"rollout-0-0\"} 1"),
        "{metrics}"
    );

    // Step 2's rollouts have reached the environment, which holds them: every group is
    // placed and none can finish, so worker 1 holds unfinished episodes. SIGTERM it.
    let deadline = Instant::now() + Duration::from_secs(120);
    while line_count(&prompts) <= 32 {
        assert!(Instant::now() < deadline, "step 2's episodes never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    signal(workers[1].0.id(), "TERM");
    let w1 = wait_at_most(
        &mut workers[1].0,
        Duration::from_secs(60),
        &dir.join("w1.log"),
    );
    let w1_log = std::fs::read_to_string(dir.join("w1.log")).unwrap();
    assert!(w1.success(), "worker 1 ended with {w1}:\n{w1_log}");
    assert!(
        w1_log.contains("SIGTERM: stopping the hosted actors"),
        "{w1_log}"
    );
    std::fs::remove_file(&budget).unwrap();

    let status = wait_at_most(&mut driver, Duration::from_secs(240), &log);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{stderr}");
    // Its episodes were re-queued on worker 0 and ran there.
    let requeued = stderr
        .lines()
        .find(|l| l.contains("unfinished episodes ran again elsewhere"))
        .unwrap_or_else(|| panic!("no re-queue of worker 1's episodes:\n{stderr}"));
    assert!(requeued.contains(&format!("127.0.0.1:{p1}")), "{requeued}");
    assert!(!requeued.contains(" 0 unfinished"), "{requeued}");
    // Its going away is not mistaken for a TLS mismatch.
    assert!(!stderr.contains("cluster.tls_ca"), "{stderr}");
    let (steps, ids) = trained(&run_dir);
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{stderr}");
    assert_eq!(ids, (0..STEPS * 32).collect::<Vec<_>>(), "{stderr}");
    // The steps after it ran on the node that stayed.
    let rows = manta_telemetry::read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(rows[0].1["cluster/live_nodes"], 2.0, "{stderr}");
    assert_eq!(
        rows.last().unwrap().1["cluster/live_nodes"],
        1.0,
        "{stderr}"
    );
}
