//! `driver prepare-tasks`, the real binary: against Manta's built-in environments
//! (`url: builtin`) and against the real `openreward` SDK server with an environment
//! that refuses to list its tasks; then `driver --task-data` trains from the file.

use crate::common;

use common::sdk_server::SdkServer;
use common::{python, workspace};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use manta_driver::tasks::{read_tasks_jsonl, task_hash};
use serde_json::{json, Value};

/// Starts tests/py/SCRIPT (an `openreward` SDK server).
fn start_sdk_server(script: &str) -> SdkServer {
    SdkServer::start(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/py")
            .join(script),
        &[],
    )
}

fn driver(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("OPENREWARD_API_KEY")
        .output()
        .expect("driver runs");
    assert!(
        out.status.success(),
        "driver {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn prepare(config: &Path, output: &Path, extra: &[&str]) {
    let mut args = vec![
        "prepare-tasks",
        "--config",
        config.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    driver(&args);
}

/// One parsed line: (prompt, metadata).
fn read_lines(path: &Path) -> Vec<(String, Value)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let row: Value = serde_json::from_str(line).expect("each line is JSON");
            let obj = row.as_object().unwrap();
            assert_eq!(obj.len(), 3, "{line}");
            assert_eq!(row["label"], "", "{line}");
            let meta: Value = serde_json::from_str(row["metadata"].as_str().expect("string"))
                .expect("metadata is a JSON string");
            (row["prompt"].as_str().unwrap().to_string(), meta)
        })
        .collect()
}

/// Checks one line's schema and hash; returns (env, split, hash).
fn check_line(prompt: &str, meta: &Value, server_env: &str) -> (String, String, String) {
    let env = meta["env_name"].as_str().unwrap().to_string();
    let split = meta["split"].as_str().unwrap().to_string();
    let hash = meta["task_hash"].as_str().unwrap().to_string();
    assert_eq!(hash, task_hash(&meta["task_spec"]));
    assert_eq!(hash.len(), 16);
    assert!(hash.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(prompt, format!("[{env}:{split}:{hash}]"));
    let (owner, name) = env.split_once('/').unwrap();
    assert_eq!(meta["namespace"], owner);
    assert_eq!(meta["server_name"], name);
    assert_eq!(meta["deployment_name"], env.as_str());
    assert_eq!(meta["environment_name"], server_env);
    assert_eq!(meta.as_object().unwrap().len(), 8, "{meta}");
    (env, split, hash)
}

#[test]
fn builtin_environments_give_capped_seeded_cookbook_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("train_config.yaml");
    std::fs::write(
        &config,
        "environments:\n  manta/Digits:\n    url: builtin\n    variant: digits\n    splits: [train, test]\n    num_samples: 2\n  manta/Counter:\n    url: builtin\n    variant: counter\n    splits: [train]\n    num_samples: null\n",
    )
    .unwrap();
    let (a, b) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    prepare(&config, &a, &["--max-tasks", "5"]);
    prepare(&config, &b, &["--max-tasks", "5"]);
    let text = std::fs::read(&a).unwrap();
    assert_eq!(text, std::fs::read(&b).unwrap(), "seed 42: runs agree");

    // The cap is the cookbook's `num_samples or --max-tasks`: Digits keeps 2 per
    // split, Counter (num_samples null) 5. The order is checked against Python in
    // `sdk_server_rows_match_the_cookbook_rules`.
    let lines = read_lines(&a);
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (prompt, meta) in &lines {
        let server_env = if meta["env_name"] == "manta/Digits" {
            "digits"
        } else {
            "counter"
        };
        let (env, split, _) = check_line(prompt, meta, server_env);
        *counts.entry((env, split)).or_default() += 1;
    }
    let count = |env: &str, split: &str| counts[&(env.to_string(), split.to_string())];
    assert_eq!(
        (
            count("manta/Counter", "train"),
            count("manta/Digits", "train"),
            count("manta/Digits", "test")
        ),
        (5, 2, 2)
    );
    // Not the server's order: the rows are shuffled across environments.
    let envs: Vec<&str> = lines
        .iter()
        .map(|(_, m)| m["env_name"].as_str().unwrap())
        .collect();
    let mut grouped = envs.clone();
    grouped.sort();
    assert_ne!(envs, grouped, "rows are shuffled across environments");

    // Without --max-tasks, num_samples alone caps Digits; Counter keeps all 1000.
    let full = tmp.path().join("full.jsonl");
    prepare(&config, &full, &[]);
    let full_lines = read_lines(&full);
    let count = |env: &str, split: &str| {
        full_lines
            .iter()
            .filter(|(_, m)| m["env_name"] == env && m["split"] == split)
            .count()
    };
    assert_eq!(count("manta/Counter", "train"), 1000);
    assert_eq!(count("manta/Digits", "train"), 2);
    assert_eq!(count("manta/Digits", "test"), 2);

    // The driver's reader takes the file back.
    let tasks = read_tasks_jsonl(&a).unwrap();
    assert_eq!(tasks.len(), 9);
    for (t, (_, meta)) in tasks.iter().zip(&lines) {
        assert_eq!(t.environment, meta["env_name"].as_str().unwrap());
        assert_eq!(t.server_env, meta["environment_name"].as_str().unwrap());
        assert_eq!(t.task_spec, meta["task_spec"]);
    }
}

#[test]
fn task_data_from_prepare_tasks_trains_a_step() {
    let tmp = tempfile::tempdir().unwrap();
    let tasks = tmp.path().join("tasks.jsonl");
    // The repository's train_config.yaml: manta/Digits on the built-in server.
    prepare(
        &workspace().join("train_config.yaml"),
        &tasks,
        &["--max-tasks", "6"],
    );
    assert_eq!(read_lines(&tasks).len(), 6);
    let runs = tmp.path().join("runs");
    let out = driver(&[
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--task-data",
        tasks.to_str().unwrap(),
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "from-tasks",
        "--save",
        tmp.path().join("ckpt").to_str().unwrap(),
        "--save-interval",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("step ")).count(),
        1,
        "{stdout}"
    );
    let settings: Value = serde_json::from_str(
        &std::fs::read_to_string(runs.join("from-tasks/settings.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(settings["task_data"], tasks.to_str().unwrap());
    let rows = manta_telemetry::read_metrics(&runs.join("from-tasks/metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 1);
}

#[test]
fn sdk_server_that_refuses_listing_is_read_by_index() {
    let server = start_sdk_server("index_only_env.py");
    let base = server.base.clone();
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("train_config.yaml");
    std::fs::write(
        &config,
        format!(
            "environments:\n  Acme/IndexOnly:\n    url: {base}\n    splits: [train, test]\n    num_samples: 6\n"
        ),
    )
    .unwrap();
    let out = tmp.path().join("tasks.jsonl");
    prepare(&config, &out, &[]);
    let lines = read_lines(&out);
    let mut per_split: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (prompt, meta) in &lines {
        let (env, split, _) = check_line(prompt, meta, "indexonlyenv");
        assert_eq!(env, "Acme/IndexOnly");
        assert_eq!(meta["task_spec"]["split"], split.as_str());
        per_split
            .entry(split)
            .or_default()
            .push(meta["task_spec"]["n"].as_i64().unwrap());
    }
    // train: 9 tasks capped at 6; test: all 4; in the order of the cookbook's index
    // fallback (shuffled indices) and final shuffle, as Python computes it.
    let got: Vec<(String, i64)> = lines
        .iter()
        .map(|(_, m)| {
            (
                m["split"].as_str().unwrap().to_string(),
                m["task_spec"]["n"].as_i64().unwrap(),
            )
        })
        .collect();
    let expected = Command::new(python())
        .args([
            "-c",
            "import random, json\nrandom.seed(42)\nrows = []\n\
             for split, num in [('train', 9), ('test', 4)]:\n\
             \x20   idx = list(range(num)); random.shuffle(idx)\n\
             \x20   rows += [[split, i] for i in idx[:min(6, num)]]\n\
             random.shuffle(rows)\nprint(json.dumps(rows))",
        ])
        .output()
        .expect("python runs");
    let expected: Vec<(String, i64)> =
        serde_json::from_slice(&expected.stdout).expect("python prints the rows");
    assert_eq!(got, expected);
    assert_eq!(per_split["train"].len(), 6);
    assert_eq!(per_split["test"].len(), 4);
    assert_eq!(read_tasks_jsonl(&out).unwrap().len(), 10);
}

/// acceptance: prepare-tasks against two environments served by the real `openreward`
/// SDK writes the very bytes that the cookbook's rules (Python's `random`, `json.dumps`)
/// give for the same server, for several num_samples / --max-tasks / --seed settings;
/// the specs hold non-ASCII text and floats such as 1e-05 and 1e+16.
#[test]
fn sdk_server_rows_match_the_cookbook_rules() {
    let server = start_sdk_server("cookbook_envs.py");
    let base = server.base.clone();
    let tmp = tempfile::tempdir().unwrap();
    let reference =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/cookbook_prepare_tasks.py");
    /// (alpha num_samples, beta num_samples, --max-tasks, --seed)
    type Case = (Option<u64>, Option<u64>, Option<u64>, i64);
    let cases: [Case; 5] = [
        (None, None, None, 42),
        (Some(5), None, Some(3), 42),
        (None, Some(4), Some(9), 7),
        (Some(0), Some(2), Some(4), 123_456_789_012),
        (Some(30), None, None, -3),
    ];
    for (i, (alpha, beta, max_tasks, seed)) in cases.into_iter().enumerate() {
        let yaml_cap = |n: Option<u64>| n.map_or("null".to_string(), |n| n.to_string());
        let config = tmp.path().join(format!("config{i}.yaml"));
        // Beta first: the cookbook walks environments in the file's order.
        std::fs::write(
            &config,
            format!(
                "environments:\n  Acme/Beta:\n    url: {base}\n    variant: beta\n    splits: [train]\n    num_samples: {}\n  Acme/Alpha:\n    url: {base}\n    variant: alpha\n    splits: [test, train]\n    num_samples: {}\n",
                yaml_cap(beta),
                yaml_cap(alpha)
            ),
        )
        .unwrap();
        let ours = tmp.path().join(format!("ours{i}.jsonl"));
        let mut extra = vec!["--seed".to_string(), seed.to_string()];
        if let Some(m) = max_tasks {
            extra.extend(["--max-tasks".to_string(), m.to_string()]);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        prepare(&config, &ours, &extra);
        let theirs = tmp.path().join(format!("theirs{i}.jsonl"));
        let spec = json!({
            "seed": seed,
            "max_tasks": max_tasks,
            "environments": [
                ["Acme/Beta", "beta", ["train"], beta],
                ["Acme/Alpha", "alpha", ["test", "train"], alpha],
            ],
        });
        let out = Command::new(python())
            .arg(&reference)
            .args([base.as_str(), &spec.to_string(), theirs.to_str().unwrap()])
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "reference failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (ours_text, theirs_text) = (
            std::fs::read_to_string(&ours).unwrap(),
            std::fs::read_to_string(&theirs).unwrap(),
        );
        assert!(!theirs_text.is_empty());
        assert_eq!(ours_text, theirs_text, "case {i}: {spec}");
        // The specs exercise what json.dumps writes its own way.
        assert!(theirs_text.contains("1e-05") && theirs_text.contains("1e+16"));
        assert!(theirs_text.contains("\\\\u00e9"), "non-ASCII is escaped");
        assert_eq!(
            read_tasks_jsonl(&ours).unwrap().len(),
            theirs_text.lines().count()
        );
    }
}
