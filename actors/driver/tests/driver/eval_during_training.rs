//! Evaluation during training (slime's `--eval-interval`), the real binary against an
//! environment served by the real `openreward` SDK: with `--eval-interval 2` a 4-step
//! run evaluates every held-out task before training and after steps 2 and 4, reports
//! `eval/` metrics at exactly those steps, and never trains on a held-out task.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::sdk_server::SdkServer;
use common::workspace;
use manta_telemetry::read_metrics;
use serde_json::Value;

/// A train_config.yaml for the SDK environment listing `split`.
fn config(dir: &Path, base: &str, split: &str) -> PathBuf {
    let path = dir.join(format!("train_config_{split}.yaml"));
    std::fs::write(
        &path,
        format!(
            "environments:\n  Acme/EvalEnv:\n    url: {base}\n    splits: [{split}]\n    \
             max_turns: 1\nsystem_prompt_template: \"Use a tool.{{tools}}\"\n"
        ),
    )
    .unwrap();
    path
}

/// The (split, count) runs of the episode log, in order.
fn split_runs(log: &[(String, i64)]) -> Vec<(String, usize)> {
    let mut runs: Vec<(String, usize)> = Vec::new();
    for (split, _) in log {
        match runs.last_mut() {
            Some((s, n)) if s == split => *n += 1,
            _ => runs.push((split.clone(), 1)),
        }
    }
    runs
}

/// acceptance 3: a CPU run with `--eval-interval 2` against an SDK-served environment
/// evaluates every test task before training and after steps 2 and 4, reports `eval/`
/// metrics exactly there, and never trains on a test task.
#[test]
fn eval_interval_evaluates_every_test_task_and_never_trains_on_them() {
    let tmp = tempfile::tempdir().unwrap();
    let log_path = tmp.path().join("episodes.jsonl");
    let server = SdkServer::start(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/eval_env.py"),
        &[log_path.to_str().unwrap()],
    );
    let base = server.base.clone();
    let (train_tasks, test_tasks) = (
        tmp.path().join("train.jsonl"),
        tmp.path().join("test.jsonl"),
    );
    for (split, out) in [("train", &train_tasks), ("test", &test_tasks)] {
        common::driver_ok(&[
            "prepare-tasks",
            "--config",
            config(tmp.path(), &base, split).to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
    }
    // Prepared episodes' prompts are not logged: start the log from here.
    let _ = std::fs::remove_file(&log_path);
    let runs = tmp.path().join("runs");
    let debug = tmp.path().join("debug/rollout_{rollout_id}.jsonl");
    let out = common::driver_ok(&[
        "--cluster",
        "cluster.toml",
        "--train-settings",
        "configs/local-tiny.toml",
        "--config",
        config(tmp.path(), &base, "train").to_str().unwrap(),
        "--prompt-data",
        train_tasks.to_str().unwrap(),
        "--num-rollout",
        "4",
        "--rollout-batch-size",
        "2",
        "--n-samples",
        "2",
        "--context-len",
        "2048",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "heldout",
        test_tasks.to_str().unwrap(),
        "--n-samples-per-eval-prompt",
        "2",
        "--eval-top-k",
        "50",
        "--rollout-top-p",
        "0.95",
        "--save-debug-rollout-data",
        debug.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--run-name",
        "eval",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let run_dir = runs.join("eval");

    // The environment saw, in order: every test task twice (before training), two
    // steps of 2 × 2 training episodes, the test tasks again, two more steps, and the
    // test tasks a third time.
    let log: Vec<(String, i64)> = std::fs::read_to_string(&log_path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["split"].as_str().unwrap().to_string(),
                v["id"].as_i64().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(String, usize)> = [
        ("test", 6),
        ("train", 8),
        ("test", 6),
        ("train", 8),
        ("test", 6),
    ]
    .iter()
    .map(|(s, n)| (s.to_string(), *n))
    .collect();
    assert_eq!(split_runs(&log), expected, "{stdout}");
    let mut per_eval: BTreeMap<i64, usize> = BTreeMap::new();
    for (split, id) in &log {
        if split == "test" {
            *per_eval.entry(*id).or_default() += 1;
        }
    }
    assert_eq!(
        per_eval,
        BTreeMap::from([(100, 6), (101, 6), (102, 6)]),
        "each test task, 2 samples, 3 evaluations"
    );

    // eval/ metrics at steps 0, 2 and 4 only, in their own rows; training rows 1..=4.
    let rows = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let eval_steps: Vec<u64> = rows
        .iter()
        .filter(|(_, m)| m.contains_key("eval/heldout"))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(eval_steps, [0, 2, 4]);
    for (step, m) in rows.iter().filter(|(_, m)| m.contains_key("eval/heldout")) {
        assert_eq!(m["eval/heldout/samples"], 6.0, "step {step}: {m:?}");
        assert_eq!(m["eval/heldout/failed_count"], 0.0, "step {step}");
        for key in [
            "eval/heldout-pass@1",
            "eval/heldout-pass@2",
            "eval/heldout/truncated_ratio",
            "eval/heldout/response_len/mean",
            "perf/eval_time",
        ] {
            assert!(m.contains_key(key), "step {step}: no {key} in {m:?}");
        }
        assert!(
            !m.keys()
                .any(|k| k.starts_with("rollout/") || k.starts_with("train/")),
            "an evaluation row holds no training metric: {m:?}"
        );
    }
    let train_steps: Vec<u64> = rows
        .iter()
        .filter(|(_, m)| m.contains_key("train/loss"))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(train_steps, [1, 2, 3, 4]);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("eval ")).count(),
        3,
        "{stdout}"
    );

    // Trained samples: 2 × 2 a step, every one a training task's episode.
    let tokenizer =
        manta_tokenizer::Tokenizer::from_dir(&workspace().join("assets/tiny-qwen3")).unwrap();
    for rollout in 0..4 {
        let path = tmp.path().join(format!("debug/rollout_{rollout}.jsonl"));
        let samples: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(samples.len(), 4, "{}", path.display());
        for s in &samples {
            let tokens: Vec<u32> = serde_json::from_value(s["tokens"].clone()).unwrap();
            let prompt_len = tokens.len() - s["response_length"].as_u64().unwrap() as usize;
            let text = tokenizer.decode(&tokens[..prompt_len], false).unwrap();
            assert!(text.contains("TRAINTASK"), "{text}");
            assert!(
                !text.contains("EVALTASK"),
                "trained on an eval task: {text}"
            );
        }
    }
    let trained: Vec<Value> = std::fs::read_to_string(run_dir.join("trained_ids.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(trained.len(), 4);
    for row in &trained {
        let ids = row["ids"].as_array().unwrap();
        assert_eq!(ids.len(), 4, "{row}");
        assert!(ids.iter().all(|id| id.as_u64().unwrap() < 1 << 62), "{row}");
    }

    // TensorBoard holds the evaluations too (step 0 has nothing else).
    let events = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out")
        })
        .expect("a TensorBoard event file");
    let steps = manta_telemetry::tensorboard::read_event_steps(&events).unwrap();
    assert!(steps.contains(&0), "{steps:?}");

    // The resolved settings name where each came from.
    let settings = std::fs::read_to_string(run_dir.join("settings.txt")).unwrap();
    let line = |key: &str| {
        settings
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("no {key} in {settings}"))
            .to_string()
    };
    assert!(
        line("eval_interval").ends_with("(flag --eval-interval)"),
        "{settings}"
    );
    assert!(
        line("top_p").contains("0.95") && line("top_p").ends_with("(slime flag --rollout-top-p)")
    );
    assert!(
        line("task_data").ends_with("(slime flag --prompt-data)"),
        "{settings}"
    );
    assert!(
        line("lr").contains("0.003") && line("lr").ends_with("(configs/local-tiny.toml [train])")
    );
    assert!(line("eval_top_p").contains("0.95") && line("eval_top_p").ends_with("(default)"));
    assert!(line("adam_beta2").contains("0.999") && line("adam_beta2").ends_with("(default)"));
}
