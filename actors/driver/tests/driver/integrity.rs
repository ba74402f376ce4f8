//! A run never lies and never mixes: the real `driver` binary, tried as a clumsy or
//! hostile user would. Two runs of one command (the second refused, the first
//! untouched), a path as a run name, a `--save` that cannot be written, a context too
//! short for the prompts, a tampered checkpoint, the real `openreward` SDK server
//! killed for good mid-run, and a server that accepts connections and never answers.

use crate::common;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use common::sdk_server::SdkServer;
use common::{assert_success, debug_data, debug_train_args, driver_run, workspace};
use manta_telemetry::read_metrics;

/// The default local job (built-in environment) as `run` under `dir`, `steps` steps of
/// 2 × 2 episodes, saving into `dir/ckpt` at the end.
fn local_args(dir: &Path, run: &str, steps: u32) -> Vec<String> {
    common::strings(&[
        "--runs-dir",
        dir.join("runs").to_str().unwrap(),
        "--run-name",
        run,
        "--save",
        dir.join("ckpt").to_str().unwrap(),
        "--save-interval",
        "0",
        "--num-rollout",
        &steps.to_string(),
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
    ])
}

fn spawn_driver(args: &[String], dir: &Path, tag: &str, env: &[(&str, &str)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(dir.join(format!("{tag}.stdout"))).unwrap())
        .stderr(std::fs::File::create(dir.join(format!("{tag}.stderr"))).unwrap())
        .spawn()
        .expect("driver starts")
}

/// Waits for `child` at most `limit` (killing it then, failing the test).
fn wait_output(mut child: Child, dir: &Path, tag: &str, limit: Duration) -> Output {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{tag} still running after {limit:?}\nstderr:\n{}",
                std::fs::read_to_string(dir.join(format!("{tag}.stderr"))).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(dir.join(format!("{tag}.stdout"))).unwrap(),
        stderr: std::fs::read(dir.join(format!("{tag}.stderr"))).unwrap(),
    }
}

fn text(bytes: &[u8]) -> String {
    common::plain(bytes)
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn metric_steps(run_dir: &Path) -> Vec<u64> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

#[test]
fn the_same_command_twice_runs_once() {
    let tmp = tempfile::tempdir().unwrap();
    let args = local_args(tmp.path(), "twice", 150);
    let first = spawn_driver(&args, tmp.path(), "first", &[]);
    let lock = tmp.path().join("runs/twice/.manta.lock");
    wait_until(
        "the first run holds its directory",
        Duration::from_secs(60),
        || std::fs::read_to_string(&lock).is_ok_and(|t| t.contains(&first.id().to_string())),
    );
    let second = spawn_driver(&args, tmp.path(), "second", &[]);
    let second = wait_output(second, tmp.path(), "second", Duration::from_secs(60));
    let mut first = first;
    let still_running = first.try_wait().unwrap().is_none();
    let err = text(&second.stderr);
    assert!(
        !second.status.success(),
        "the second run was not refused:\n{err}"
    );
    assert!(
        err.contains("in use by another run") && err.contains(&format!("pid {}", first.id())),
        "{err}"
    );
    assert!(
        !text(&second.stdout).contains("step "),
        "the refused run trained"
    );
    assert!(
        still_running,
        "the first run ended before the second was tried"
    );
    let first = assert_success(wait_output(
        first,
        tmp.path(),
        "first",
        Duration::from_secs(300),
    ));
    assert!(text(&first.stdout).contains("done: 150 steps"));
    let run_dir = tmp.path().join("runs/twice");
    assert_eq!(metric_steps(&run_dir), (1..=150).collect::<Vec<_>>());
    let trained = std::fs::read_to_string(run_dir.join("trained_ids.jsonl")).unwrap();
    assert_eq!(trained.lines().count(), 150);
    assert!(!tmp.path().join("runs/twice-2").exists());
    // Released at the end: the next run of the command starts (in twice-2).
    let again = driver_run(&local_args(tmp.path(), "twice", 1));
    assert_success(again);
}

#[test]
fn a_stale_lock_of_a_dead_process_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dead = Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let run_dir = tmp.path().join("runs/stale");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(
        run_dir.join(".manta.lock"),
        format!("{{\"pid\":{pid},\"host\":\"{}\",\"since\":1}}", host.trim()),
    )
    .unwrap();
    let child = spawn_driver(
        &local_args(tmp.path(), "stale", 1),
        tmp.path(),
        "stale",
        &[],
    );
    let out = assert_success(wait_output(
        child,
        tmp.path(),
        "stale",
        Duration::from_secs(120),
    ));
    let log = text(&out.stderr);
    assert!(
        log.contains(&format!("taking over the lock of pid {pid}")),
        "{log}"
    );
}

#[test]
fn a_path_as_run_name_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("a/runs");
    let out = driver_run(&[
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "../x",
        "--num-rollout",
        "1",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--run-name \"../x\""), "{err}");
    assert!(!tmp.path().join("a/x").exists(), "wrote outside --runs-dir");
}

#[test]
fn an_unwritable_save_is_refused_before_step_1() {
    let tmp = tempfile::tempdir().unwrap();
    // A regular file where a directory is expected: refused whoever runs the test
    // (root ignores a read-only mode).
    let file = tmp.path().join("occupied");
    std::fs::write(&file, "not a directory").unwrap();
    let mut args = local_args(tmp.path(), "ro", 2);
    let at = args.iter().position(|a| a == "--save").unwrap();
    args[at + 1] = file.join("ckpt").display().to_string();
    let out = driver_run(&args);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--save directory") && err.contains("occupied/ckpt"),
        "{err}"
    );
    assert_eq!(err.matches("os error").count(), 1, "the cause once: {err}");
    assert!(!text(&out.stdout).contains("step "), "it trained first");
    assert!(!tmp.path().join("runs/ro/metrics.jsonl").exists());
}

#[test]
fn a_context_too_short_for_the_prompts_is_refused_with_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = local_args(tmp.path(), "ctx", 3);
    args.extend(common::strings(&["--context-len", "4"]));
    let out = driver_run(&args);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--context-len 4") && err.contains("raise --context-len above"),
        "{err}"
    );
    let trained = tmp.path().join("runs/ctx/trained_ids.jsonl");
    assert!(
        std::fs::read_to_string(&trained)
            .unwrap_or_default()
            .is_empty(),
        "samples recorded as trained"
    );
    assert!(
        !tmp.path().join("ckpt/latest").exists(),
        "a checkpoint of nothing"
    );
}

#[test]
fn a_tampered_checkpoint_is_refused_by_load_and_export() {
    let tmp = tempfile::tempdir().unwrap();
    let data = debug_data(tmp.path(), 4, 3);
    let (save, runs) = (tmp.path().join("ckpt"), tmp.path().join("runs"));
    let args = debug_train_args(&data, 4, &save, 2, &runs, "t");
    assert_success(driver_run(&args));
    let (two, four) = (save.join("step_000002"), save.join("step_000004"));
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "step_000004"
    );
    // Untouched, both accept it.
    let out_dir = tmp.path().join("hf");
    let export = |out: &Path| {
        driver_run(&[
            "export",
            "--load",
            save.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
    };
    assert_success(export(&out_dir));
    std::fs::copy(
        two.join("optimizer.safetensors"),
        four.join("optimizer.safetensors"),
    )
    .unwrap();
    let named = |err: &str| {
        err.contains("step_000004/optimizer.safetensors")
            && err.contains("copied from another checkpoint")
    };
    let out = export(&tmp.path().join("hf2"));
    let err = text(&out.stderr);
    assert!(!out.status.success() && named(&err), "export: {err}");
    assert!(!tmp.path().join("hf2").exists());
    let mut resume = debug_train_args(&data, 5, &save, 2, &runs, "t");
    resume.extend(common::strings(&["--load", save.to_str().unwrap()]));
    let out = driver_run(&resume);
    let err = text(&out.stderr);
    assert!(!out.status.success() && named(&err), "--load: {err}");
}

#[test]
fn a_resume_without_run_flags_continues_the_recorded_run_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = debug_data(tmp.path(), 3, 5);
    let (save, runs) = (tmp.path().join("ckpt"), tmp.path().join("elsewhere/runs"));
    assert_success(driver_run(&debug_train_args(
        &data, 2, &save, 1, &runs, "hist",
    )));
    // Resume naming only the checkpoint (not --runs-dir or --run-name).
    let mut args = debug_train_args(&data, 3, &save, 1, &runs, "hist");
    let strip = |args: &mut Vec<String>, flag: &str| {
        let at = args.iter().position(|a| a == flag).unwrap();
        args.drain(at..at + 2);
    };
    strip(&mut args, "--runs-dir");
    strip(&mut args, "--run-name");
    args.extend(common::strings(&["--load", save.to_str().unwrap()]));
    let out = assert_success(driver_run(&args));
    assert!(
        text(&out.stdout).contains(runs.join("hist").to_str().unwrap()),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(metric_steps(&runs.join("hist")), vec![1, 2, 3]);
}

fn start_sdk_server() -> SdkServer {
    SdkServer::start(&workspace().join("tests/envs/serve_episode_envs.py"), &[])
}

/// A cluster.toml and train_config.yaml in `dir` whose one environment is at `url`.
fn cluster_for(dir: &Path, url: &str, variant: &str) -> PathBuf {
    let config = dir.join("train_config.yaml");
    std::fs::write(
        &config,
        format!(
            "environments:\n  Test/Env:\n    splits: [train]\n    url: \"{url}\"\n    variant: \
             {variant}\n    max_turns: 1\nsecrets: {{}}\nsystem_prompt_template: \"Use a tool.{{tools}}\"\n\
             thinking: false\nopenreward_run_name: manta-integrity\n"
        ),
    )
    .unwrap();
    // The shipped cluster.toml with the tiny local example's [train] settings.
    let text = (std::fs::read_to_string(workspace().join("cluster.toml")).unwrap()
        + &std::fs::read_to_string(workspace().join("configs/local-tiny.toml")).unwrap())
        .replace(
            "train_config = \"train_config.yaml\"",
            &format!("train_config = {:?}", config.display().to_string()),
        );
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn an_environment_killed_for_good_ends_the_run_loudly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = start_sdk_server();
    let cluster = cluster_for(tmp.path(), &server.base, "singlestep");
    let mut args = local_args(tmp.path(), "down", 40);
    args.extend(common::strings(&[
        "--cluster",
        cluster.to_str().unwrap(),
        "--max-failed-steps",
        "2",
    ]));
    let child = spawn_driver(&args, tmp.path(), "down", &[]);
    let metrics = tmp.path().join("runs/down/metrics.jsonl");
    wait_until("two steps trained", Duration::from_secs(120), || {
        std::fs::read_to_string(&metrics).is_ok_and(|t| t.lines().count() >= 2)
    });
    server.kill();
    let killed_at = Instant::now();
    let out = wait_output(child, tmp.path(), "down", Duration::from_secs(180));
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "a dead environment ended in success:\n{err}"
    );
    assert!(
        err.contains("failed 3 times in a row (--max-failed-steps 2)")
            && err.contains("environment unreachable"),
        "{err}"
    );
    // Budget: 3 tries of one step, each episode's requests retried 4 times (≤ 10 s),
    // 1 s + 2 s of backoff between them.
    assert!(killed_at.elapsed() < Duration::from_secs(120));
    let trained = metric_steps(&tmp.path().join("runs/down"));
    assert!(trained.len() < 40, "{trained:?}");
    assert_eq!(trained, (1..=trained.len() as u64).collect::<Vec<_>>());
    let ids = std::fs::read_to_string(tmp.path().join("runs/down/trained_ids.jsonl")).unwrap();
    assert_eq!(
        ids.lines().count(),
        trained.len(),
        "failed steps recorded as trained"
    );
}

#[test]
fn a_server_that_never_answers_is_a_named_timeout() {
    // A stand-in on purpose: the point is a peer that accepts and stays silent, which
    // no real environment server does on request.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let _silent = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            let mut s = stream.try_clone().unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while s.read(&mut buf).is_ok_and(|n| n > 0) {}
            });
            held.push(stream);
        }
    });
    let tmp = tempfile::tempdir().unwrap();
    let cluster = cluster_for(tmp.path(), &url, "silent");
    let mut args = local_args(tmp.path(), "silent", 2);
    args.extend(common::strings(&["--cluster", cluster.to_str().unwrap()]));
    let started = Instant::now();
    let child = spawn_driver(
        &args,
        tmp.path(),
        "silent",
        &[("MANTA_ENV_REQUEST_TIMEOUT_S", "1")],
    );
    let out = wait_output(child, tmp.path(), "silent", Duration::from_secs(90));
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("listing tasks of Test/Env split train")
            && err.contains("/silent/tasks: no answer within 1 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn keep_last_keeps_the_newest_checkpoints_each_with_its_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let data = debug_data(tmp.path(), 4, 7);
    let (save, runs) = (tmp.path().join("ckpt"), tmp.path().join("runs"));
    // A failed save's leftovers from an earlier crash go when the run starts.
    std::fs::create_dir_all(save.join("step_000009.tmp")).unwrap();
    let mut args = debug_train_args(&data, 4, &save, 1, &runs, "k");
    args.extend(common::strings(&["--keep-last", "2"]));
    assert_success(driver_run(&args));
    let mut steps: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step_"))
        .collect();
    steps.sort();
    assert_eq!(steps, ["step_000003", "step_000004"]);
    for s in &steps {
        let manifest: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(save.join(s).join("manifest.json")).unwrap(),
        )
        .unwrap();
        assert!(manifest["files"]["model.safetensors"]["sha256"].is_string());
    }
    let out = driver_run(&{
        let mut a = debug_train_args(&data, 1, &save, 1, &runs, "k0");
        a.extend(common::strings(&["--keep-last", "0"]));
        a
    });
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--keep-last 0"),
        "{}",
        text(&out.stderr)
    );
}
