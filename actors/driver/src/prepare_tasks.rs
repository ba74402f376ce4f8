//! `driver prepare-tasks`: the cookbook's prepare_tasks.py, row for row. Python's
//! `random` is seeded once with `--seed`; every configured split of every environment
//! (in train_config.yaml's order) is listed, shuffled and cut to `num_samples or
//! --max-tasks`; the rows are shuffled once more and written as `json.dumps` writes
//! them, in the cookbook's schema (which `--task-data` reads).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use manta_config::TrainConfig;
use manta_core::pyjson;
use serde_json::{json, Value};

use crate::cli::PrepareTasksArgs;
use crate::local::{environment_clients, start_builtin_server};
use crate::tasks::{cookbook_cap, task_hash, CookbookSelection};

/// What a run of `prepare-tasks` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareSummary {
    /// Lines written.
    pub tasks: usize,
    /// Tasks written per (`Owner/Name`, split), in file order.
    pub per_split: Vec<(String, String, usize)>,
}

/// The tasks.jsonl line of one task.
fn task_line(
    env_name: &str,
    server_env: &str,
    split: &str,
    spec: &Value,
) -> anyhow::Result<String> {
    let hash = task_hash(spec);
    let (namespace, server_name) = match env_name.split_once('/') {
        Some((owner, name)) => (Some(owner), name),
        None => (None, env_name),
    };
    // Key order and text as the cookbook's `json.dumps` of its dicts.
    let metadata = pyjson::dumps_default(&json!({
        "env_name": env_name,
        "deployment_name": env_name,
        "server_name": server_name,
        "environment_name": server_env,
        "namespace": namespace,
        "split": split,
        "task_spec": spec,
        "task_hash": hash,
    }));
    Ok(pyjson::dumps_default(&json!({
        "prompt": format!("[{env_name}:{split}:{hash}]"),
        "label": "",
        "metadata": metadata,
    })))
}

/// Lists, shuffles, caps and writes the tasks of `args.config` to `args.output`.
pub async fn prepare_tasks(args: &PrepareTasksArgs) -> anyhow::Result<PrepareSummary> {
    let train = TrainConfig::from_file(&args.config)?;
    let server = start_builtin_server(&train).await?;
    let result = collect(
        &train,
        server.as_ref().map(|s| s.base_url()),
        args.max_tasks,
        args.seed,
    )
    .await;
    if let Some(server) = server {
        server.shutdown().await;
    }
    let (lines, per_split) = result?;
    write_atomically(&args.output, &lines)?;
    Ok(PrepareSummary {
        tasks: lines.len(),
        per_split,
    })
}

type Collected = (Vec<String>, Vec<(String, String, usize)>);

async fn collect(
    train: &TrainConfig,
    builtin_url: Option<String>,
    max_tasks: Option<u64>,
    seed: i64,
) -> anyhow::Result<Collected> {
    let clients = environment_clients(train, builtin_url.as_deref())?;
    let total_splits: usize = train.environments.values().map(|e| e.splits.len()).sum();
    let bar = ProgressBar::new(total_splits as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} splits {wide_msg}")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    let mut selection = CookbookSelection::new(seed);
    let mut lines = Vec::new();
    let mut per_split = Vec::new();
    for (name, env) in &train.environments {
        let (client, _) = &clients[name];
        let cap = cookbook_cap(env.num_samples, max_tasks);
        for split in &env.splits {
            bar.set_message(format!("{name}:{split}"));
            let listed = client
                .list_tasks(split)
                .await
                .with_context(|| format!("listing tasks of {name} split {split}"))?;
            let found = listed.tasks.len();
            // The index fallback of the client lists in index order, so shuffling its
            // result draws the same numbers as the cookbook's shuffled index list.
            let chosen = selection.split(listed.tasks, cap);
            for spec in &chosen {
                lines.push(task_line(name, &listed.env_name, split, spec)?);
            }
            bar.println(format!("{name}:{split}: {} of {found} tasks", chosen.len()));
            per_split.push((name.clone(), split.clone(), chosen.len()));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    selection.finish(&mut lines);
    if lines.is_empty() {
        anyhow::bail!(
            "no tasks: the environments of {} listed none",
            train.path.display()
        );
    }
    Ok((lines, per_split))
}

/// Writes next to `path` and renames over it, so readers never see half a file.
fn write_atomically(path: &Path, lines: &[String]) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .with_context(|| format!("--output {} names no file", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        for line in lines {
            f.write_all(line.as_bytes())?;
            f.write_all(b"\n")?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("writing {}: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::read_tasks_jsonl;
    use serde_json::json;

    #[test]
    fn line_has_the_cookbook_schema_and_reads_back() {
        let spec = json!({"target": 7, "id": "a"});
        let line = task_line("manta/Digits", "digits", "train", &spec).unwrap();
        let row: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(row["prompt"], "[manta/Digits:train:602a9d545de5cd1b]");
        assert_eq!(row["label"], "");
        let meta: Value = serde_json::from_str(row["metadata"].as_str().unwrap()).unwrap();
        assert_eq!(
            meta,
            json!({
                "env_name": "manta/Digits", "deployment_name": "manta/Digits",
                "server_name": "Digits", "environment_name": "digits", "namespace": "manta",
                "split": "train", "task_spec": spec, "task_hash": "602a9d545de5cd1b"
            })
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        write_atomically(&path, &[line]).unwrap();
        let tasks = read_tasks_jsonl(&path).unwrap();
        assert_eq!(tasks.len(), 1);
        assert_eq!(
            (
                tasks[0].environment.as_str(),
                tasks[0].server_env.as_str(),
                tasks[0].task_hash.as_str()
            ),
            ("manta/Digits", "digits", "602a9d545de5cd1b")
        );
        assert_eq!(tasks[0].task_spec, spec);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn unwritable_output_is_named() {
        let err = write_atomically(Path::new("/nonexistent-dir/t.jsonl"), &["x".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent-dir/t.jsonl"), "{err}");
    }
}
