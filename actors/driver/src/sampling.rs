//! Where a step's groups come from: slime's over-sampling (`--over-sampling-batch-size`)
//! and dynamic sampling (`--dynamic-sampling-filter-path`), groups carried from one step
//! to the next, and asynchronous mode's weight-staleness bound
//! (`--max-weight-staleness`, `--partial-rollout`).
//!
//! Every group runs as its own task through [`Rollouts::run_episodes`], so local and
//! remote rollouts take the same path, and a group keeps running when the step that
//! started it has what it needs: it finishes into the next step instead of being lost.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::Context;
use manta_config::{SamplingSettings, TrainSettings};
use manta_core::advantage::is_zero_std;
use manta_core::{Sample, SampleStatus};
use manta_rollout::{EpisodeRequest, GenerationSettings, TaskRef};
use manta_telemetry::StepMetrics;
use manta_weight_sync::WeightSync;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::rollouts::Rollouts;
use crate::tasks::TaskSampler;

/// Groups the filter may drop in one step, per group of the batch, before the step
/// gives up (every group's rewards agreeing means there is nothing left to learn).
const MAX_DROPPED_PER_GROUP: usize = 20;

/// A group's episodes as they came back.
struct FinishedGroup {
    /// Run-wide group number: sample ids are `seq × n_samples + index`.
    seq: u64,
    task: TaskRef,
    /// The step that was collecting when the group started (an earlier step's for a
    /// carried or prefetched group).
    launched_for: u64,
    started: Instant,
    finished: Instant,
    samples: Result<Vec<Sample>, String>,
}

/// What one step got from the queue.
pub struct StepRollouts {
    /// The kept groups' samples, group by group in launch order, `group_index`
    /// renumbered 0..rollout_batch_size.
    pub samples: Vec<Sample>,
    /// `rollout/*` sampling counts and staleness, `perf/rollout_tokens_per_sec`.
    pub metrics: StepMetrics,
    /// Seconds the step waited for its groups (`perf/rollout_time`).
    pub wait_s: f64,
    /// Groups the dynamic-sampling filter dropped (they count in `rollout/zero_std/count`).
    pub dropped: usize,
}

/// Why a finished group is not trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// The dynamic-sampling filter rejected it: its task is used up (as in slime).
    Drop,
    /// Too old for the staleness bound, or interrupted by a weight update without
    /// `--partial-rollout` (versions mixed, or aborted): its task runs again with the
    /// current weights.
    Regenerate,
}

/// Judges a finished group against the trainer's weight `version`.
pub fn judge(group: &[Sample], version: u64, opts: &SamplingSettings) -> Verdict {
    let ok: Vec<&Sample> = group
        .iter()
        .filter(|s| s.status != SampleStatus::Failed)
        .collect();
    if ok.is_empty() {
        // Every episode failed: kept, so the failures show in `rollout/failed_count`
        // and the step goes on without them, as without dynamic sampling.
        return Verdict::Keep;
    }
    for s in &ok {
        // Aborted: a weight update cut it short (a partial rollout would have gone on).
        if s.status == SampleStatus::Aborted {
            return Verdict::Regenerate;
        }
        let oldest = s.weight_version;
        let newest = newest_version(s);
        if version.saturating_sub(oldest) > opts.max_weight_staleness {
            return Verdict::Regenerate;
        }
        if newest != oldest && !opts.partial_rollout {
            return Verdict::Regenerate;
        }
    }
    if opts.dynamic_sampling_filter.is_some() {
        // check_reward_nonzero_std: the only filter Manta implements (validated).
        let rewards: Vec<f64> = ok.iter().map(|s| s.reward).collect();
        if is_zero_std(&rewards) {
            return Verdict::Drop;
        }
    }
    Verdict::Keep
}

/// Whether a successful sample of the group began on weights older than `version`.
fn older_than(group: &[Sample], version: u64) -> bool {
    group
        .iter()
        .any(|s| s.status != SampleStatus::Failed && s.weight_version < version)
}

/// The newest weight version among a sample's tokens.
fn newest_version(s: &Sample) -> u64 {
    s.metadata
        .weight_versions
        .iter()
        .copied()
        .max()
        .unwrap_or(s.weight_version)
        .max(s.weight_version)
}

/// The run's source of groups: tasks to start (regenerated ones first), groups in
/// flight, and groups that finished after their step was already full.
pub struct GroupQueue {
    rollouts: Rollouts,
    sampler: TaskSampler,
    opts: SamplingSettings,
    rollout_batch_size: usize,
    n_samples: usize,
    generation: GenerationSettings,
    /// No groups are prefetched for steps after it.
    last_step: u64,
    /// Position of the next task in the sampler's stream.
    next_task: u64,
    next_group: u64,
    /// Tasks to run again before new ones are drawn.
    retry: VecDeque<TaskRef>,
    /// Finished groups not judged yet (they finished after their step was full).
    ready: VecDeque<FinishedGroup>,
    in_flight: usize,
    /// The groups' tasks, aborted when the queue goes (a run's end, a rewind), so no
    /// rollout handle outlives the run.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Results of groups started before the last rewind are ignored.
    epoch: u64,
    tx: mpsc::UnboundedSender<(u64, FinishedGroup)>,
    rx: mpsc::UnboundedReceiver<(u64, FinishedGroup)>,
}

impl GroupQueue {
    /// A queue for a run with `settings` whose first step is `first_step` (1 on a fresh
    /// run): the task stream and the sample ids start where `first_step - 1` full steps
    /// left them.
    pub fn new(
        rollouts: Rollouts,
        sampler: TaskSampler,
        settings: &TrainSettings,
        first_step: u64,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let rollout_batch_size = settings.rollout_batch_size;
        let start = (first_step - 1) * rollout_batch_size as u64;
        Self {
            rollouts,
            sampler,
            opts: settings.sampling.clone(),
            rollout_batch_size,
            n_samples: settings.n_samples,
            generation: GenerationSettings {
                temperature: settings.temperature,
                top_p: settings.top_p,
                top_k: settings.top_k,
                max_response_len: settings.max_response_len,
                context_len: settings.context_len,
                partial_rollout: settings.sampling.partial_rollout,
                return_routed_experts: settings.algo.use_rollout_routing_replay,
            },
            last_step: settings.num_rollout as u64,
            next_task: start,
            next_group: start,
            retry: VecDeque::new(),
            ready: VecDeque::new(),
            in_flight: 0,
            tasks: Vec::new(),
            epoch: 0,
            tx,
            rx,
        }
    }

    /// Whether the next step's groups start before this step trains.
    pub fn overlaps(&self) -> bool {
        self.opts.max_weight_staleness > 0
    }

    /// Starts `count` groups: regenerated tasks first, then the sampler's next ones.
    fn launch(&mut self, count: usize, step: u64) {
        let from_retry = count.min(self.retry.len());
        let mut tasks: Vec<TaskRef> = self.retry.drain(..from_retry).collect();
        let fresh = count - from_retry;
        if fresh > 0 {
            tasks.extend(self.sampler.draw(self.next_task, fresh));
            self.next_task += fresh as u64;
        }
        self.tasks.retain(|t| !t.is_finished());
        for task in tasks {
            let seq = self.next_group;
            self.next_group += 1;
            let n = self.n_samples as u64;
            let requests: Vec<EpisodeRequest> = (0..n)
                .map(|i| EpisodeRequest {
                    sample_id: seq * n + i,
                    group_index: seq as u32,
                    index: i as u32,
                    task: task.clone(),
                })
                .collect();
            let rollouts = self.rollouts.clone();
            let generation = self.generation;
            let tx = self.tx.clone();
            let epoch = self.epoch;
            let handle = tokio::spawn(
                async move {
                    let started = Instant::now();
                    let samples = rollouts
                        .run_episodes(requests, generation)
                        .await
                        .map_err(|e| format!("{e:#}"));
                    let _ = tx.send((
                        epoch,
                        FinishedGroup {
                            seq,
                            task,
                            launched_for: step,
                            started,
                            finished: Instant::now(),
                            samples,
                        },
                    ));
                }
                // Episode spans hang off the step that started the group.
                .instrument_current(),
            );
            self.tasks.push(handle);
            self.in_flight += 1;
        }
    }

    /// Starts groups, `over_sampling_batch_size` at a time, while kept plus running
    /// groups are short of the batch.
    fn top_up(&mut self, kept: usize, step: u64) {
        while kept + self.in_flight + self.ready.len() < self.rollout_batch_size {
            self.launch(self.opts.over_sampling_batch_size, step);
        }
    }

    /// Collects `rollout_batch_size` kept groups for `step`, judged against the
    /// trainer's weight `version`. In asynchronous mode it then starts the next step's
    /// groups, so they generate while this step trains. A group regenerated for old
    /// weights first has `weights` re-feed any engine that lost the last sync's weights
    /// (a restarted server), so its task does not come back stale again.
    pub async fn collect(
        &mut self,
        step: u64,
        version: u64,
        weights: &WeightSync,
    ) -> anyhow::Result<StepRollouts> {
        let started = Instant::now();
        let carried = self.in_flight + self.ready.len();
        let launched_before = self.next_group;
        let mut kept: Vec<FinishedGroup> = Vec::new();
        let (mut dropped, mut regenerated) = (0usize, 0usize);
        let mut pending: VecDeque<FinishedGroup> = std::mem::take(&mut self.ready);
        while kept.len() < self.rollout_batch_size {
            let group = match pending.pop_front() {
                Some(g) => g,
                None => {
                    self.top_up(kept.len(), step);
                    let (epoch, group) = self
                        .rx
                        .recv()
                        .await
                        .context("the rollout queue's channel closed")?;
                    if epoch != self.epoch {
                        continue;
                    }
                    self.in_flight -= 1;
                    group
                }
            };
            let samples = match &group.samples {
                Ok(s) => s,
                Err(e) => anyhow::bail!("a rollout actor failed: {e}"),
            };
            match judge(samples, version, &self.opts) {
                Verdict::Keep => kept.push(group),
                Verdict::Drop => {
                    dropped += 1;
                    if dropped > MAX_DROPPED_PER_GROUP * self.rollout_batch_size {
                        anyhow::bail!(
                            "dynamic sampling dropped {dropped} groups in step {step} and kept {} \
                             of {}: nearly every group's rewards agree (--dynamic-sampling-filter-path \
                             {})",
                            kept.len(),
                            self.rollout_batch_size,
                            self.opts.dynamic_sampling_filter.as_deref().unwrap_or_default()
                        );
                    }
                }
                Verdict::Regenerate => {
                    regenerated += 1;
                    if older_than(samples, version) {
                        let fed = weights
                            .refresh_lagging()
                            .await
                            .context("re-sending weights to an engine that lost them")?;
                        if !fed.is_empty() {
                            warn!(step, version, engines = ?fed, "engines had lost the current weights (restarted); they have them again");
                        }
                    }
                    self.retry.push_back(group.task);
                }
            }
        }
        // Judged next step, against the weights of then.
        self.ready.extend(pending);
        let wait_s = started.elapsed().as_secs_f64();
        if self.overlaps() && step < self.last_step {
            self.top_up(0, step);
        }
        kept.sort_by_key(|g| g.seq);
        let mut metrics = StepMetrics::new();
        let prefetched = kept.iter().filter(|g| g.launched_for < step).count();
        let span = kept
            .iter()
            .map(|g| g.started)
            .min()
            .zip(kept.iter().map(|g| g.finished).max())
            .map(|(a, b)| b.duration_since(a).as_secs_f64())
            .unwrap_or(0.0);
        let mut samples = Vec::with_capacity(self.rollout_batch_size * self.n_samples);
        for (k, group) in kept.into_iter().enumerate() {
            for mut s in group.samples.unwrap_or_default() {
                s.group_index = k as u32;
                samples.push(s);
            }
        }
        let ok: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.status != SampleStatus::Failed)
            .collect();
        let generated: usize = ok.iter().map(|s| s.generated_tokens()).sum();
        let staleness: Vec<f64> = ok
            .iter()
            .map(|s| version.saturating_sub(s.weight_version) as f64)
            .collect();
        let partial = ok
            .iter()
            .filter(|s| newest_version(s) != s.weight_version)
            .count();
        metrics.insert(
            "rollout/groups/launched".into(),
            (self.next_group - launched_before) as f64,
        );
        metrics.insert("rollout/groups/carried".into(), carried as f64);
        metrics.insert("rollout/groups/prefetched".into(), prefetched as f64);
        metrics.insert("rollout/groups/regenerated".into(), regenerated as f64);
        metrics.insert("rollout/dynamic_filter/drop_count".into(), dropped as f64);
        metrics.insert(
            "rollout/weight_staleness/max".into(),
            staleness.iter().copied().fold(0.0, f64::max),
        );
        metrics.insert(
            "rollout/weight_staleness/mean".into(),
            staleness.iter().sum::<f64>() / staleness.len().max(1) as f64,
        );
        metrics.insert("rollout/partial_samples".into(), partial as f64);
        metrics.insert(
            "perf/rollout_tokens_per_sec".into(),
            generated as f64 / span.max(1e-9),
        );
        debug!(
            step,
            kept = self.rollout_batch_size,
            dropped,
            regenerated,
            carried,
            in_flight = self.in_flight,
            "step's groups collected"
        );
        Ok(StepRollouts {
            samples,
            metrics,
            wait_s,
            dropped,
        })
    }

    /// Forgets everything after `step` (a restarted trainer goes on from there): groups
    /// in flight are ignored when they finish, and the task stream restarts where
    /// `step` full steps left it.
    pub fn rewind(&mut self, step: u64) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        self.epoch += 1;
        self.in_flight = 0;
        self.ready.clear();
        self.retry.clear();
        self.next_task = step * self.rollout_batch_size as u64;
        self.next_group = self.next_task;
    }
}

impl Drop for GroupQueue {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Runs a spawned future in the caller's span.
trait InstrumentCurrent: Sized {
    fn instrument_current(self) -> tracing::instrument::Instrumented<Self>;
}

impl<F: std::future::Future> InstrumentCurrent for F {
    fn instrument_current(self) -> tracing::instrument::Instrumented<Self> {
        tracing::Instrument::instrument(self, tracing::Span::current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_core::EpisodeMetadata;

    fn sample(reward: f64, oldest: u64, versions: &[u64]) -> Sample {
        Sample {
            id: 0,
            group_index: 0,
            index: 0,
            tokens: vec![1, 2],
            response_length: 1,
            loss_mask: vec![1],
            rollout_log_probs: vec![-1.0],
            reward,
            status: SampleStatus::Completed,
            weight_version: oldest,
            metadata: EpisodeMetadata {
                weight_versions: versions.to_vec(),
                ..Default::default()
            },
            routed_experts: None,
        }
    }

    fn opts(filter: bool, staleness: u64, partial: bool) -> SamplingSettings {
        SamplingSettings {
            over_sampling_batch_size: 1,
            dynamic_sampling_filter: filter.then(|| "check_reward_nonzero_std".into()),
            max_weight_staleness: staleness,
            partial_rollout: partial,
        }
    }

    #[test]
    fn zero_std_groups_drop_only_with_the_filter() {
        let agree = [sample(1.0, 3, &[3]), sample(1.0, 3, &[3])];
        let spread = [sample(1.0, 3, &[3]), sample(0.0, 3, &[3])];
        assert_eq!(judge(&agree, 3, &opts(true, 0, false)), Verdict::Drop);
        assert_eq!(judge(&agree, 3, &opts(false, 0, false)), Verdict::Keep);
        assert_eq!(judge(&spread, 3, &opts(true, 0, false)), Verdict::Keep);
        // A failed sample's reward does not count; a group of failures is kept (the
        // step leaves them out and counts them).
        let mut with_failed = spread.to_vec();
        with_failed[1].status = SampleStatus::Failed;
        assert_eq!(judge(&with_failed, 3, &opts(true, 0, false)), Verdict::Drop);
        with_failed[0].status = SampleStatus::Failed;
        assert_eq!(judge(&with_failed, 3, &opts(true, 0, false)), Verdict::Keep);
    }

    #[test]
    fn staleness_and_interrupted_episodes_regenerate() {
        let spread = |oldest, versions: &[u64]| {
            [sample(1.0, oldest, versions), sample(0.0, oldest, versions)]
        };
        // Synchronous: only the trainer's own version is trained on.
        assert_eq!(
            judge(&spread(2, &[2]), 3, &opts(true, 0, false)),
            Verdict::Regenerate
        );
        assert_eq!(
            judge(&spread(2, &[2]), 3, &opts(true, 1, false)),
            Verdict::Keep
        );
        assert_eq!(
            judge(&spread(1, &[1]), 3, &opts(true, 1, false)),
            Verdict::Regenerate
        );
        // Spanning a weight update: kept only as a partial rollout, still bounded.
        assert_eq!(
            judge(&spread(2, &[2, 3]), 3, &opts(false, 1, false)),
            Verdict::Regenerate
        );
        assert_eq!(
            judge(&spread(2, &[2, 3]), 3, &opts(false, 1, true)),
            Verdict::Keep
        );
        assert_eq!(
            judge(&spread(1, &[1, 3]), 3, &opts(false, 1, true)),
            Verdict::Regenerate
        );
    }
}
