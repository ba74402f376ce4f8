//! Weight sync end to end, checked bit for bit against the trainer's checkpoints.
//!
//! With `MANTA_VERIFY_WEIGHT_SYNC=1` the driver reads every engine's weights back after
//! each sync and records their SHA-256 per tensor in `runs/<run>/weight_sync.jsonl`.
//! The tests compare those records with the trainer's checkpoint of the same step
//! (`--save-interval 1`), hashed here from the safetensors file's raw bytes, so the
//! comparison does not go through Manta's own tensor code.
//!
//! - Remote: the trainer and an engine on worker 0, an engine on worker 1, each worker
//!   in a directory of its own; weights move as 4 KiB gRPC chunks (many per tensor) and
//!   no weights directory exists anywhere. Worker 1 is killed mid-run and restarted in a
//!   fresh directory: it rejoins and gets the current weights, read back bit for bit
//!   before it gets work; every sample of every step was generated with the weights of
//!   the step before (version = step − 1).
//! - Local: two in-process engines take the trainer's tensors each step.

use crate::common;

use common::workers::{appending, spawn_listening, worker_command};
use common::{free_ports, workspace, Worker};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use manta_telemetry::read_metrics;
use sha2::{Digest, Sha256};

const TOKEN: &str = "weight-sync-e2e-token";
/// Small chunks, so every tensor of the tiny model but the norms spans several.
const CHUNK: &str = "4096";

/// A worker whose working directory is `cwd` (created empty), logging to `log`.
fn start_worker(port: u16, cwd: &Path, log: &Path) -> Worker {
    let mut cmd = worker_command(cwd, port, TOKEN);
    cmd.env("MANTA_WEIGHT_CHUNK_BYTES", CHUNK)
        .stdout(Stdio::null())
        .stderr(appending(log));
    spawn_listening(&mut cmd, port)
}

/// SHA-256 of each tensor's bytes in a checkpoint's model.safetensors.
fn checkpoint_digests(step_dir: &Path) -> BTreeMap<String, String> {
    let bytes = std::fs::read(step_dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{}: {e}", step_dir.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, hex::encode(Sha256::digest(view.data()))))
        .collect()
}

/// The log without its colour escapes.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One line of weight_sync.jsonl.
struct Record {
    version: u64,
    node: String,
    actor: String,
    engine_version: u64,
    tensors: BTreeMap<String, String>,
}

fn records(run_dir: &Path) -> Vec<Record> {
    let text = std::fs::read_to_string(run_dir.join("weight_sync.jsonl"))
        .expect("the driver wrote weight_sync.jsonl (MANTA_VERIFY_WEIGHT_SYNC=1)");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Record {
                version: v["version"].as_u64().unwrap(),
                node: v["node"].as_str().unwrap().to_string(),
                actor: v["actor"].as_str().unwrap().to_string(),
                engine_version: v["engine_version"].as_u64().unwrap(),
                tensors: v["tensors"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, h)| (k.clone(), h.as_str().unwrap().to_string()))
                    .collect(),
            }
        })
        .collect()
}

/// Every record equals the checkpoint of its version, tensor by tensor; returns the
/// (node, actor) pairs seen per version.
fn check_records_against_checkpoints(
    run_dir: &Path,
    save: &Path,
    steps: u64,
) -> BTreeMap<u64, Vec<(String, String)>> {
    let mut seen: BTreeMap<u64, Vec<(String, String)>> = BTreeMap::new();
    let mut checkpoints = BTreeMap::new();
    for r in records(run_dir) {
        assert!(
            r.version >= 1 && r.version <= steps,
            "version {}",
            r.version
        );
        assert_eq!(r.engine_version, r.version, "{} on {}", r.actor, r.node);
        let want = checkpoints
            .entry(r.version)
            .or_insert_with(|| checkpoint_digests(&save.join(format!("step_{:06}", r.version))));
        assert!(!want.is_empty());
        assert_eq!(
            &r.tensors, want,
            "engine {} on {} after version {} differs from the trainer's checkpoint",
            r.actor, r.node, r.version
        );
        seen.entry(r.version).or_default().push((r.node, r.actor));
    }
    seen
}

/// Every saved sample of step k+1 (file k) was generated with weights version k.
fn check_sample_versions(samples: &Path, steps: u64) {
    for k in 0..steps {
        let file = samples.join(format!("rollout_{k}.jsonl"));
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let versions: Vec<serde_json::Value> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["weight_versions"].clone()
            })
            .collect();
        assert!(!versions.is_empty());
        for v in versions {
            assert_eq!(v, serde_json::json!([k.to_string()]), "{file:?}");
        }
    }
}

/// Sends `sig` (e.g. "-STOP") to process `pid` with kill(1).
fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {sig} {pid}");
}

fn driver(cluster: &Path, runs: &Path, save: &Path, samples: &Path, steps: u64) -> Command {
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
            "1",
            "--rollout-batch-size",
            "4",
            "--n-samples",
            "4",
            "--num-rollout",
            &steps.to_string(),
            "--run-name",
            "sync",
            "--save-debug-rollout-data",
            samples.join("rollout_{rollout_id}.jsonl").to_str().unwrap(),
        ])
        .env("MANTA_CLUSTER_TOKEN", TOKEN)
        .env("MANTA_VERIFY_WEIGHT_SYNC", "1")
        .env("MANTA_WEIGHT_CHUNK_BYTES", CHUNK)
        .env("RUST_LOG", "info");
    cmd
}

#[test]
fn remote_engines_get_the_trainers_weights_over_grpc_bit_for_bit() {
    const STEPS: u64 = 12;
    let tmp = tempfile::tempdir().unwrap();
    let ports = free_ports::<2>();
    let logs = [tmp.path().join("w0.log"), tmp.path().join("w1.log")];
    let _w0 = start_worker(ports[0], &tmp.path().join("w0"), &logs[0]);
    let mut w1 = Some(start_worker(ports[1], &tmp.path().join("w1"), &logs[1]));
    let ws = workspace();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 600\nlease_timeout_ms = 20000\n\n\
             [trainer]\nnode = 0\n\n\
             [rollout]\nengines = 1\nnodes = [0, 1]\nmax_concurrent_episodes = 16\n\n\
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
    let samples = tmp.path().join("samples");
    let driver_log = tmp.path().join("driver.log");
    let mut child = driver(&cluster, &runs, &save, &samples, STEPS)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&driver_log).unwrap())
        .spawn()
        .expect("driver starts");
    let stdout = child.stdout.take().unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.starts_with("step ") && lines.iter().all(|l: &String| !l.starts_with("step ")) {
            // Step 2 starts: kill worker 1, restart it in a new, empty directory. The
            // driver is stopped meanwhile, so the steps after it leave the restarted
            // worker time to rejoin however fast they run.
            signal(child.id(), "-STOP");
            drop(w1.take());
            w1 = Some(start_worker(
                ports[1],
                &tmp.path().join("w1-again"),
                &logs[1],
            ));
            signal(child.id(), "-CONT");
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    let stderr = std::fs::read_to_string(&driver_log).unwrap();
    assert!(
        status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{stderr}",
        lines.join("\n")
    );
    let run_dir = runs.join("sync");
    let seen = check_records_against_checkpoints(&run_dir, &save, STEPS);
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        (1..=STEPS).collect::<Vec<_>>()
    );
    // Both nodes' engines were verified, the restarted one included.
    let node1 = format!("127.0.0.1:{}", ports[1]);
    assert!(seen[&STEPS].iter().any(|(n, _)| *n == node1), "{seen:?}");
    assert!(seen[&1].len() == 2, "{seen:?}");
    check_sample_versions(&samples, STEPS);
    // The restart was answered with a fresh sync over gRPC, read back bit for bit
    // before the node got work (a restarted engine starts at version 0).
    let plain = strip_ansi(&stderr);
    let rejoin = plain
        .lines()
        .find(|l| l.contains("rejoined node verified bit for bit"))
        .unwrap_or_else(|| panic!("no verified rejoin sync\n{plain}"));
    let version: u64 = rejoin
        .split(" version=")
        .nth(1)
        .and_then(|v| v.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no version in {rejoin:?}"));
    assert!(version >= 1, "{rejoin}");
    let w1_log = std::fs::read_to_string(&logs[1]).unwrap();
    assert!(w1_log.matches("weights staged").count() >= 2, "{w1_log}");
    assert!(w1_log.matches("weights applied").count() >= 2, "{w1_log}");
    // No weights on disk anywhere but the checkpoints.
    assert!(!run_dir.join("weights").exists());
    for dir in ["w0", "w1", "w1-again"] {
        let entries: Vec<_> = std::fs::read_dir(tmp.path().join(dir)).unwrap().collect();
        assert!(entries.is_empty(), "{dir} has {entries:?}");
    }
    let rows = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64);
        assert!(m["perf/update_weights_time"] > 0.0);
        assert!(m["perf/pause_to_resume_time"] > 0.0);
        assert!(m["perf/pause_to_resume_time"] <= m["perf/update_weights_time"]);
    }
}

#[test]
fn in_process_engines_get_the_trainers_weights_bit_for_bit() {
    const STEPS: u64 = 3;
    let tmp = tempfile::tempdir().unwrap();
    let ws = workspace();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"local\"\ntrain_config = \"{}\"\n\n\
             [rollout]\nengines = 2\nmax_concurrent_episodes = 16\n\n\
             [train]\nmodel = \"{}\"\nseed = 1\nlr = 0.003\nmax_response_len = 8\ncontext_len = 512\nmax_tokens_per_gpu = 8192\n",
            ws.join("train_config.yaml").display(),
            ws.join("assets/tiny-qwen3").display(),
        ),
    )
    .unwrap();
    let runs = tmp.path().join("runs");
    let save = tmp.path().join("ckpt");
    let samples = tmp.path().join("samples");
    let out = driver(&cluster, &runs, &save, &samples, STEPS)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "driver failed\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run_dir = runs.join("sync");
    let seen = check_records_against_checkpoints(&run_dir, &save, STEPS);
    for v in 1..=STEPS {
        let mut engines: Vec<&str> = seen[&v].iter().map(|(_, a)| a.as_str()).collect();
        engines.sort_unstable();
        assert_eq!(engines, ["rollout-0", "rollout-1"], "version {v}");
    }
    check_sample_versions(&samples, STEPS);
    let rows = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), STEPS as usize);
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64);
        assert!(m["perf/pause_to_resume_time"] > 0.0);
    }
}
