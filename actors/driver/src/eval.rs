//! Evaluation during training, as slime's `--eval-interval`: before the first step
//! (unless `--skip-eval-before-train`) and after every N-th step, every task of each
//! `--eval-prompt-data` set runs `--n-samples-per-eval-prompt` episodes on the run's
//! engines, with the eval sampling settings and the weights of the step just trained.
//!
//! Its samples go nowhere but into `eval/<name>/...` metrics: they are never trained
//! on, never judged against the staleness bound, and never count in the failure budget.
//! The step loop waits for it, as slime's does; in asynchronous mode the next step's
//! groups go on generating on the same engines meanwhile.

use std::time::Instant;

use anyhow::Context;
use futures::future::join_all;
use manta_config::{EvalSettings, TrainConfig};
use manta_core::{Sample, SampleStatus};
use manta_rollout::{EpisodeRequest, GenerationSettings, TaskRef};
use manta_telemetry::StepMetrics;

use crate::rollouts::Rollouts;
use crate::tasks::read_tasks_jsonl;

/// Evaluation sample ids start here, far above any training sample's, so logs,
/// traces and uploads never confuse the two.
pub const EVAL_SAMPLE_ID_BASE: u64 = 1 << 62;

/// One `--eval-prompt-data` set, read.
pub struct EvalSet {
    pub name: String,
    pub tasks: Vec<TaskRef>,
}

/// Runs the evaluations of a run.
pub struct Evaluator {
    rollouts: Rollouts,
    settings: EvalSettings,
    sets: Vec<EvalSet>,
    generation: GenerationSettings,
    /// Evaluation groups started so far (their ids follow from it).
    groups: u64,
}

/// Reads every set's tasks.jsonl; a task of an environment `train` does not configure
/// is an error naming the file.
pub fn load_sets(settings: &EvalSettings, train: &TrainConfig) -> anyhow::Result<Vec<EvalSet>> {
    let mut sets = Vec::new();
    for dataset in &settings.datasets {
        let tasks = read_tasks_jsonl(&dataset.path)
            .with_context(|| format!("--eval-prompt-data {}", dataset.name))?;
        if let Some(t) = tasks
            .iter()
            .find(|t| !train.environments.contains_key(&t.environment))
        {
            anyhow::bail!(
                "--eval-prompt-data {} {}: task {} names environment {}, which {} does not \
                 configure",
                dataset.name,
                dataset.path.display(),
                t.task_hash,
                t.environment,
                train.path.display()
            );
        }
        sets.push(EvalSet {
            name: dataset.name.clone(),
            tasks,
        });
    }
    Ok(sets)
}

impl Evaluator {
    pub fn new(rollouts: Rollouts, settings: EvalSettings, sets: Vec<EvalSet>) -> Self {
        let generation = GenerationSettings {
            temperature: settings.temperature,
            top_p: settings.top_p,
            top_k: settings.top_k,
            max_response_len: settings.max_response_len,
            context_len: settings.context_len,
            // Nothing updates the weights while an evaluation runs.
            partial_rollout: false,
            // Evaluation trains nothing: no routing to replay.
            return_routed_experts: false,
        };
        Self {
            rollouts,
            settings,
            sets,
            generation,
            groups: 0,
        }
    }

    /// Whether an evaluation follows step `step` (0: before the first step).
    pub fn due(&self, step: u64) -> bool {
        self.settings.after_step(step)
    }

    /// Evaluates every task of every set and returns the `eval/` metrics (and
    /// `perf/eval_time`). A rollout actor's failure is an error; failed episodes are
    /// counted (`eval/<name>/failed_count`) and left out of the reward mean.
    pub async fn evaluate(&mut self, step: u64) -> anyhow::Result<StepMetrics> {
        let started = Instant::now();
        let n = self.settings.n_samples;
        let mut metrics = StepMetrics::new();
        for set in &self.sets {
            let mut calls = Vec::with_capacity(set.tasks.len());
            for task in &set.tasks {
                let group = self.groups;
                self.groups += 1;
                let requests: Vec<EpisodeRequest> = (0..n)
                    .map(|i| EpisodeRequest {
                        sample_id: EVAL_SAMPLE_ID_BASE + group * n as u64 + i as u64,
                        // Only groups a call sends together share this; it picks the
                        // engine the group starts on.
                        group_index: group as u32,
                        index: i as u32,
                        task: task.clone(),
                    })
                    .collect();
                // One call per group, as training sends them: balanced over engines.
                calls.push(self.rollouts.run_episodes(requests, self.generation));
            }
            let mut groups: Vec<Vec<Sample>> = Vec::with_capacity(calls.len());
            for result in join_all(calls).await {
                groups.push(result.with_context(|| {
                    format!(
                        "evaluating {} after step {step}: a rollout actor failed",
                        set.name
                    )
                })?);
            }
            metrics.extend(set_metrics(&set.name, &groups, n));
        }
        metrics.insert("perf/eval_time".into(), started.elapsed().as_secs_f64());
        Ok(metrics)
    }

    /// `eval NAME reward R (S samples) ...`: one line per evaluation for the console.
    pub fn summary(&self, step: u64, m: &StepMetrics) -> String {
        let sets: Vec<String> = self
            .sets
            .iter()
            .map(|set| {
                let get = |k: &str| m.get(&format!("eval/{}{k}", set.name)).copied();
                format!(
                    "{} reward {:.3} pass@1 {:.3} ({} tasks × {})",
                    set.name,
                    get("").unwrap_or(f64::NAN),
                    get("-pass@1").unwrap_or(f64::NAN),
                    set.tasks.len(),
                    self.settings.n_samples
                )
            })
            .collect();
        format!(
            "eval  {step:>5}  {}  time {:.2}s",
            sets.join("; "),
            m.get("perf/eval_time").copied().unwrap_or(f64::NAN)
        )
    }
}

/// slime's eval metrics of one set: `eval/<name>` (mean reward), response lengths,
/// truncation, pass@k for k = 1, 2, 4, … ≤ n (a sample passes with reward 1; a failed
/// episode does not), and the episode counts.
fn set_metrics(name: &str, groups: &[Vec<Sample>], n: usize) -> StepMetrics {
    let all: Vec<&Sample> = groups.iter().flatten().collect();
    let ok: Vec<&Sample> = all
        .iter()
        .copied()
        .filter(|s| s.status != SampleStatus::Failed)
        .collect();
    let mut m = StepMetrics::new();
    let key = |suffix: &str| format!("eval/{name}{suffix}");
    m.insert(key("/samples"), ok.len() as f64);
    m.insert(key("/failed_count"), (all.len() - ok.len()) as f64);
    if ok.is_empty() {
        // Nothing to report a reward of: the counts say why.
        return m;
    }
    let count = ok.len() as f64;
    m.insert(key(""), ok.iter().map(|s| s.reward).sum::<f64>() / count);
    let mut lengths: Vec<f64> = ok.iter().map(|s| s.response_length as f64).collect();
    lengths.sort_by(f64::total_cmp);
    m.insert(
        key("/response_len/mean"),
        lengths.iter().sum::<f64>() / count,
    );
    m.insert(key("/response_len/median"), median(&lengths));
    m.insert(key("/response_len/max"), lengths[lengths.len() - 1]);
    m.insert(key("/response_len/min"), lengths[0]);
    let truncated = ok
        .iter()
        .filter(|s| s.status == SampleStatus::Truncated)
        .count();
    m.insert(key("/truncated_ratio"), truncated as f64 / count);
    let mut k = 1;
    while k <= n {
        let estimates: Vec<f64> = groups
            .iter()
            .map(|g| {
                let correct = g
                    .iter()
                    .filter(|s| s.status != SampleStatus::Failed && s.reward == 1.0)
                    .count();
                pass_at_k(n, correct, k)
            })
            .collect();
        m.insert(
            key(&format!("-pass@{k}")),
            estimates.iter().sum::<f64>() / estimates.len().max(1) as f64,
        );
        k *= 2;
    }
    m
}

/// The median of sorted values (numpy's: the mean of the middle two for an even count).
fn median(sorted: &[f64]) -> f64 {
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// The unbiased pass@k of a task with `c` of `n` samples correct:
/// 1 − C(n − c, k) / C(n, k).
fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if n - c < k {
        return 1.0;
    }
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(reward: f64, len: usize, status: SampleStatus) -> Sample {
        Sample {
            id: 0,
            group_index: 0,
            index: 0,
            tokens: vec![1; len + 1],
            response_length: len,
            loss_mask: vec![1; len],
            rollout_log_probs: vec![-1.0; len],
            reward,
            status,
            weight_version: 0,
            metadata: Default::default(),
            routed_experts: None,
        }
    }

    #[test]
    fn pass_at_k_is_the_unbiased_estimator() {
        // n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 − C(3,2)/C(4,2) = 1 − 3/6.
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
        assert_eq!(pass_at_k(4, 3, 2), 1.0);
    }

    #[test]
    fn set_metrics_follow_slime_and_leave_failures_out_of_the_mean() {
        use SampleStatus::*;
        let groups = vec![
            vec![sample(1.0, 4, Completed), sample(0.0, 8, Truncated)],
            vec![sample(0.5, 2, Completed), sample(9.0, 1, Failed)],
        ];
        let m = set_metrics("test", &groups, 2);
        assert_eq!(m["eval/test"], 0.5);
        assert_eq!(m["eval/test/samples"], 3.0);
        assert_eq!(m["eval/test/failed_count"], 1.0);
        assert_eq!(m["eval/test/response_len/mean"], 14.0 / 3.0);
        assert_eq!(m["eval/test/response_len/median"], 4.0);
        assert_eq!(
            (
                m["eval/test/response_len/max"],
                m["eval/test/response_len/min"]
            ),
            (8.0, 2.0)
        );
        assert_eq!(m["eval/test/truncated_ratio"], 1.0 / 3.0);
        // Group 1 has one pass in two, group 2 none: pass@1 = (1/2 + 0) / 2.
        assert_eq!(m["eval/test-pass@1"], 0.25);
        assert_eq!(m["eval/test-pass@2"], 0.5);
        assert!(!m.contains_key("eval/test-pass@4"));
        let failed = set_metrics("x", &[vec![sample(1.0, 1, Failed)]], 1);
        assert!(!failed.contains_key("eval/x"));
        assert_eq!(failed["eval/x/failed_count"], 1.0);
    }
}
