//! Where a run's tasks come from: tasks.jsonl (the cookbook's schema) or listed
//! from each environment's server; and the order they are drawn in.

use std::path::Path;

use manta_core::pyjson;

use crate::py_random::PyRandom;

/// The cookbook's default `--seed`.
pub const TASK_SEED: i64 = 42;
use manta_rollout::TaskRef;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The cookbook's task hash: first 16 hex digits of sha256 of the spec JSON (sorted keys).
pub fn task_hash(task_spec: &Value) -> String {
    let digest = Sha256::digest(pyjson::dumps_sorted(task_spec).as_bytes());
    hex::encode(digest)[..16].to_string()
}

/// The cookbook's choice of tasks (prepare_tasks.py): one Python `random` seeded once,
/// each split's tasks shuffled and cut to the cap, all rows shuffled once at the end.
pub struct CookbookSelection {
    rng: PyRandom,
}

impl CookbookSelection {
    /// `random.seed(seed)`.
    pub fn new(seed: i64) -> Self {
        Self {
            rng: PyRandom::new(i128::from(seed)),
        }
    }

    /// One split: `random.shuffle(tasks)` then `tasks[:cap]`.
    pub fn split<T>(&mut self, mut tasks: Vec<T>, cap: Option<u64>) -> Vec<T> {
        self.rng.shuffle(&mut tasks);
        if let Some(cap) = cap {
            tasks.truncate(usize::try_from(cap).unwrap_or(usize::MAX));
        }
        tasks
    }

    /// The closing `random.shuffle(rows)`.
    pub fn finish<T>(&mut self, rows: &mut [T]) {
        self.rng.shuffle(rows);
    }
}

/// The cap of one environment's splits: Python's `num_samples or max_tasks` (an unset
/// or zero `num_samples` defers to `--max-tasks`).
pub fn cookbook_cap(num_samples: Option<u64>, max_tasks: Option<u64>) -> Option<u64> {
    num_samples.filter(|n| *n != 0).or(max_tasks)
}

/// A seeded shuffle of Manta's own (the per-epoch order of a run's tasks), then a cap.
pub fn shuffle_and_cap<T>(mut items: Vec<T>, seed: u64, cap: Option<u64>) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    items.shuffle(&mut rng);
    if let Some(cap) = cap {
        items.truncate(cap as usize);
    }
    items
}

#[derive(Deserialize)]
struct TaskLine {
    metadata: String,
}

#[derive(Deserialize)]
struct TaskMetadata {
    env_name: String,
    split: String,
    task_spec: Value,
    #[serde(default)]
    task_hash: Option<String>,
    /// The environment's name on its server.
    #[serde(default)]
    environment_name: Option<String>,
}

/// Reads tasks.jsonl; a bad line is an error naming the file and line number.
pub fn read_tasks_jsonl(path: &Path) -> anyhow::Result<Vec<TaskRef>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let mut tasks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let row: TaskLine =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
        let meta: TaskMetadata = serde_json::from_str(&row.metadata).map_err(|e| {
            anyhow::anyhow!("{}: key `metadata` is not the expected JSON: {e}", at())
        })?;
        let hash = meta.task_hash.unwrap_or_else(|| task_hash(&meta.task_spec));
        tasks.push(TaskRef {
            environment: meta.env_name,
            split: meta.split,
            task_spec: meta.task_spec,
            task_hash: hash,
            server_env: meta.environment_name.unwrap_or_default(),
        });
    }
    if tasks.is_empty() {
        anyhow::bail!("{} holds no tasks", path.display());
    }
    Ok(tasks)
}

/// Draws prompts in epochs: each epoch is a fresh seeded shuffle, so the position in
/// the stream (step × batch size) fully determines what comes next — resuming at a
/// step reproduces the same tasks.
pub struct TaskSampler {
    tasks: Vec<TaskRef>,
    seed: u64,
}

impl TaskSampler {
    pub fn new(tasks: Vec<TaskRef>, seed: u64) -> Self {
        Self { tasks, seed }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// `count` tasks starting at stream position `start`.
    pub fn draw(&self, start: u64, count: usize) -> Vec<TaskRef> {
        let n = self.tasks.len() as u64;
        let mut out = Vec::with_capacity(count);
        let mut cached: Option<(u64, Vec<usize>)> = None;
        for pos in start..start + count as u64 {
            let epoch = pos / n;
            if cached.as_ref().map(|c| c.0) != Some(epoch) {
                let order = shuffle_and_cap(
                    (0..self.tasks.len()).collect(),
                    self.seed.wrapping_add(epoch),
                    None,
                );
                cached = Some((epoch, order));
            }
            if let Some((_, order)) = &cached {
                out.push(self.tasks[order[(pos % n) as usize]].clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hash_is_sha256_of_python_json_with_sorted_keys() {
        // python3 -c 'import json,hashlib;print(hashlib.sha256(json.dumps({"target":7,"id":"a"},sort_keys=True).encode()).hexdigest()[:16])'
        assert_eq!(
            task_hash(&json!({"target": 7, "id": "a"})),
            "602a9d545de5cd1b"
        );
    }

    #[test]
    fn sampler_is_deterministic_and_covers_each_epoch() {
        let tasks: Vec<TaskRef> = (0..5)
            .map(|i| TaskRef {
                environment: "a/b".into(),
                split: "train".into(),
                task_spec: json!({"i": i}),
                task_hash: i.to_string(),
                server_env: "b".into(),
            })
            .collect();
        let s = TaskSampler::new(tasks, 3);
        let first: Vec<String> = s.draw(0, 5).into_iter().map(|t| t.task_hash).collect();
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, vec!["0", "1", "2", "3", "4"]);
        // Drawing in pieces gives the same stream as drawing at once.
        let whole: Vec<String> = s.draw(3, 6).into_iter().map(|t| t.task_hash).collect();
        let mut pieces: Vec<String> = s.draw(3, 2).into_iter().map(|t| t.task_hash).collect();
        pieces.extend(s.draw(5, 4).into_iter().map(|t| t.task_hash));
        assert_eq!(whole, pieces);
    }

    #[test]
    fn bad_jsonl_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tasks.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"x\", \"label\": \"\", \"metadata\": \"{}\"}\n",
        )
        .unwrap();
        let err = read_tasks_jsonl(&p).unwrap_err().to_string();
        assert!(
            err.contains("tasks.jsonl:1") && err.contains("metadata"),
            "{err}"
        );
    }
}
