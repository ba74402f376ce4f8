//! One synchronous training step: rollouts → advantages → GRPO step → weight sync
//! (crate::weight_sync).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use manta_core::advantage::is_zero_std;
use manta_core::{group_advantages, whiten_over_tokens, AdvantageOptions, Sample, SampleStatus};
use manta_telemetry::StepMetrics;
use manta_trainer::loss::AdvantageEstimator;
use manta_trainer::TrainBatch;
use tracing::warn;

use crate::rollouts::Rollouts;
use crate::trainer_handle::TrainerHandle;
use manta_weight_sync::WeightSync;

/// The actors a step talks to.
pub struct StepActors {
    pub trainer: TrainerHandle,
    /// The rollout actors, in this process or on workers (one handle either way).
    pub rollouts: Rollouts,
    /// Moves the trainer's weights into every engine (one call, any placement).
    pub weights: WeightSync,
    /// `--debug-rollout-only`: steps end after their rollouts (no training, no sync).
    pub rollout_only: bool,
}

/// How a step turns rewards into advantages (slime's `--advantage-estimator`,
/// `--disable-grpo-std-normalization`, `--normalize-advantages`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AdvantageSpec {
    pub estimator: AdvantageEstimator,
    /// Leave GRPO-family advantages as reward minus the group mean; when false (the
    /// default) they are also divided by the group's std (+1e-6).
    pub disable_std_normalization: bool,
    /// Whiten the advantages over the step's trained tokens afterwards.
    pub normalize_advantages: bool,
}

impl AdvantageSpec {
    /// From resolved settings.
    pub fn from_settings(algo: &manta_config::AlgoSettings) -> anyhow::Result<Self> {
        Ok(Self {
            estimator: algo.advantage_estimator,
            disable_std_normalization: algo.disable_grpo_std_normalization,
            normalize_advantages: algo.normalize_advantages,
        })
    }
}

/// What a step produced.
pub struct StepOutcome {
    pub metrics: StepMetrics,
    /// Sample ids trained on, in order (for accounting and tests).
    pub trained_ids: Vec<u64>,
    /// Set when the step trained nothing (crate::failure_budget): too many failed
    /// episodes, or no generated token.
    pub failed: Option<crate::failure_budget::StepFailure>,
}

/// Runs step `step` (1-based) on the groups `queue` collects for the trainer's weight
/// `version` (`n_samples` per group).
// Each argument is one of the step's inputs; a struct of them would only rename them.
#[allow(clippy::too_many_arguments)]
pub async fn run_step(
    actors: &StepActors,
    step: u64,
    queue: &mut crate::sampling::GroupQueue,
    version: u64,
    n_samples: usize,
    advantages: AdvantageSpec,
    save_debug: Option<&str>,
    checks: crate::failure_budget::StepChecks,
) -> anyhow::Result<StepOutcome> {
    let started = Instant::now();
    let mut collected = queue.collect(step, version, &actors.weights).await?;
    let samples = std::mem::take(&mut collected.samples);
    if let Some(template) = save_debug {
        crate::debug_data::save(template, step - 1, &samples, n_samples)
            .context("--save-debug-rollout-data")?;
    }
    let rollout_time = started.elapsed().as_secs_f64();

    let mut m = rollout_metrics(&samples);
    if let Some(failed) = crate::failure_budget::judge_step(&samples, checks) {
        m.extend(collected.metrics);
        record_step_time(&mut m, started, rollout_time);
        return Ok(StepOutcome {
            metrics: m,
            trained_ids: Vec::new(),
            failed: Some(failed),
        });
    }
    let (batch, trained_ids, zero_std) = build_batch(samples, n_samples, advantages);
    m.insert(
        "rollout/zero_std/count".into(),
        (zero_std + collected.dropped) as f64,
    );
    m.extend(collected.metrics);

    if actors.rollout_only {
        record_step_time(&mut m, started, rollout_time);
        return Ok(StepOutcome {
            metrics: m,
            trained_ids: Vec::new(),
            failed: None,
        });
    }
    let train_started = Instant::now();
    crate::status::set_phase(crate::status::Phase::Train);
    let released = actors.rollouts.release_memory().await;
    m.insert("rollout/kv_released_engines".into(), released.len() as f64);
    if batch.samples.is_empty() {
        warn!(
            step,
            "no sample to train on (all episodes failed); skipping the optimizer step"
        );
    } else {
        let tokens: usize = batch.samples.iter().map(|s| s.tokens.len()).sum();
        let train = actors
            .trainer
            .train_step(step, batch)
            .await
            .context("training step")?;
        m.extend(train);
        let train_time = train_started.elapsed().as_secs_f64();
        m.insert("perf/train_time".into(), train_time);
        m.insert(
            "perf/tokens_per_gpu_per_sec".into(),
            tokens as f64 / train_time.max(1e-9),
        );
    }
    actors.rollouts.resume_memory(&released).await?;
    crate::status::set_phase(crate::status::Phase::WeightSync);
    let synced = actors.weights.sync(step).await?;
    synced.record(&mut m);
    if let Some(live) = actors.rollouts.live_nodes() {
        m.insert("cluster/live_nodes".into(), live as f64);
    }
    record_step_time(&mut m, started, rollout_time);
    Ok(StepOutcome {
        metrics: m,
        trained_ids,
        failed: None,
    })
}

/// `perf/step_time` (since `started`), `perf/rollout_time` and their ratio.
fn record_step_time(m: &mut StepMetrics, started: Instant, rollout_time: f64) {
    let step_time = started.elapsed().as_secs_f64();
    m.insert("perf/rollout_time".into(), rollout_time);
    m.insert("perf/step_time".into(), step_time);
    m.insert(
        "perf/wait_time_ratio".into(),
        rollout_time / step_time.max(1e-9),
    );
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// `rollout/*` metrics over the episodes that did not fail, plus the failure count.
fn rollout_metrics(samples: &[Sample]) -> StepMetrics {
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.status != SampleStatus::Failed)
        .collect();
    let mut m = BTreeMap::new();
    m.insert(
        "rollout/raw_reward".into(),
        mean(ok.iter().map(|s| s.reward)),
    );
    m.insert(
        "rollout/response_len/mean".into(),
        mean(ok.iter().map(|s| s.response_length as f64)),
    );
    m.insert(
        "rollout/truncated_ratio".into(),
        mean(
            ok.iter()
                .map(|s| (s.status == SampleStatus::Truncated) as u8 as f64),
        ),
    );
    m.insert(
        "rollout/num_turns/mean".into(),
        mean(ok.iter().map(|s| s.metadata.num_turns as f64)),
    );
    // Share of prompt tokens the engines' prefix caches held: first turns (the group's
    // shared prompt) and later turns (the episode's own history).
    let cache: Vec<_> = ok.iter().map(|s| s.metadata.prefix_cache).collect();
    let rate = |cached: u64, prompt: u64| (prompt > 0).then(|| cached as f64 / prompt as f64);
    if let Some(r) = rate(
        cache.iter().map(|c| c.first_turn_cached).sum(),
        cache.iter().map(|c| c.first_turn_prompt).sum(),
    ) {
        m.insert("rollout/prefix_cache_hit_rate/first_turn".into(), r);
    }
    if let Some(r) = rate(
        cache.iter().map(|c| c.later_turns_cached).sum(),
        cache.iter().map(|c| c.later_turns_prompt).sum(),
    ) {
        m.insert("rollout/prefix_cache_hit_rate/later_turns".into(), r);
    }
    m.insert(
        "rollout/failed_tool_calls/mean".into(),
        mean(ok.iter().map(|s| s.metadata.num_failed_tool_calls as f64)),
    );
    m.insert(
        "rollout/failed_count".into(),
        (samples.len() - ok.len()) as f64,
    );
    // Cumulative restarts of the most-restarted engine process that served this step
    // (episodes report their engine's count, so this works on remote workers too).
    m.insert(
        "rollout/engine_restarts".into(),
        samples
            .iter()
            .map(|s| s.metadata.engine_restarts)
            .max()
            .unwrap_or(0) as f64,
    );
    m
}

/// Drops failed samples, computes each group's advantages over its remaining samples
/// (as slime's estimators), and returns the batch, the trained ids and how many groups
/// had zero reward spread.
fn build_batch(
    samples: Vec<Sample>,
    n_samples: usize,
    spec: AdvantageSpec,
) -> (TrainBatch, Vec<u64>, usize) {
    let mut groups: BTreeMap<u32, Vec<Sample>> = BTreeMap::new();
    for s in samples {
        if s.status != SampleStatus::Failed {
            groups.entry(s.group_index).or_default().push(s);
        }
    }
    let grpo_family = matches!(
        spec.estimator,
        AdvantageEstimator::Grpo | AdvantageEstimator::Gspo | AdvantageEstimator::Cispo
    );
    let opts = AdvantageOptions {
        normalize_std: grpo_family && !spec.disable_std_normalization && n_samples > 1,
        ..Default::default()
    };
    let mut batch = TrainBatch {
        samples: Vec::new(),
        advantages: Vec::new(),
        global_samples: 0,
    };
    let mut zero_std = 0;
    for (_, mut group) in groups {
        group.sort_by_key(|s| s.index);
        let rewards: Vec<f64> = group.iter().map(|s| s.reward).collect();
        if is_zero_std(&rewards) {
            zero_std += 1;
        }
        if spec.estimator == AdvantageEstimator::ReinforcePlusPlus {
            // REINFORCE++ (γ = 1, no KL reward penalty): every token's return is the reward.
            batch.advantages.extend(rewards);
        } else {
            batch.advantages.extend(group_advantages(&rewards, opts));
        }
        batch.samples.extend(group);
    }
    if spec.normalize_advantages {
        let tokens: Vec<usize> = batch
            .samples
            .iter()
            .map(|s| s.loss_mask.iter().filter(|&&m| m == 1).count())
            .collect();
        whiten_over_tokens(&mut batch.advantages, &tokens);
    }
    batch.global_samples = batch.samples.len();
    let ids = batch.samples.iter().map(|s| s.id).collect();
    (batch, ids, zero_std)
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_core::EpisodeMetadata;

    fn sample(id: u64, group: u32, index: u32, reward: f64, status: SampleStatus) -> Sample {
        Sample {
            id,
            group_index: group,
            index,
            tokens: vec![1, 2],
            response_length: 1,
            loss_mask: vec![1],
            rollout_log_probs: vec![-1.0],
            reward,
            status,
            weight_version: 0,
            metadata: EpisodeMetadata::default(),
            routed_experts: None,
        }
    }

    #[test]
    fn failed_samples_are_dropped_and_groups_normalized_alone() {
        let samples = vec![
            sample(3, 1, 1, 0.0, SampleStatus::Completed),
            sample(0, 0, 0, 1.0, SampleStatus::Completed),
            sample(1, 0, 1, 0.0, SampleStatus::Failed),
            sample(2, 1, 0, 1.0, SampleStatus::Truncated),
            sample(4, 0, 2, 1.0, SampleStatus::Completed),
        ];
        let m = rollout_metrics(&samples);
        assert_eq!(m["rollout/failed_count"], 1.0);
        assert_eq!(m["rollout/raw_reward"], 0.75);
        let (batch, ids, zero_std) = build_batch(samples, 3, AdvantageSpec::default());
        assert_eq!(ids, vec![0, 4, 2, 3]);
        assert_eq!(zero_std, 1); // group 0's surviving rewards agree
        assert_eq!(batch.advantages[0], 0.0);
        assert!(batch.advantages[2] > 0.0 && batch.advantages[3] < 0.0);
        assert_eq!(batch.global_samples, 4);
    }

    #[test]
    fn prefix_cache_hit_rates_pool_tokens_over_successful_episodes() {
        use manta_core::PrefixCacheUse;
        let with_cache = |id, status, first: (u64, u64), later: (u64, u64)| {
            let mut s = sample(id, 0, id as u32, 0.0, status);
            s.metadata.prefix_cache = PrefixCacheUse {
                first_turn_prompt: first.0,
                first_turn_cached: first.1,
                later_turns_prompt: later.0,
                later_turns_cached: later.1,
            };
            s
        };
        let m = rollout_metrics(&[
            with_cache(0, SampleStatus::Completed, (100, 0), (300, 280)),
            with_cache(1, SampleStatus::Completed, (100, 96), (100, 100)),
            with_cache(2, SampleStatus::Failed, (100, 0), (100, 0)),
        ]);
        assert_eq!(m["rollout/prefix_cache_hit_rate/first_turn"], 0.48);
        assert_eq!(m["rollout/prefix_cache_hit_rate/later_turns"], 0.95);
        // Single-turn episodes have no later turns: no rate rather than a made-up 0.
        let m = rollout_metrics(&[with_cache(0, SampleStatus::Completed, (10, 5), (0, 0))]);
        assert!(!m.contains_key("rollout/prefix_cache_hit_rate/later_turns"));
    }

    #[test]
    fn estimators_shape_advantages_by_hand() {
        let group = || {
            vec![
                sample(0, 0, 0, 1.0, SampleStatus::Completed),
                sample(1, 0, 1, 0.0, SampleStatus::Completed),
                sample(2, 0, 2, 0.5, SampleStatus::Completed),
            ]
        };
        let spec = |estimator, disable_std_normalization, normalize_advantages| AdvantageSpec {
            estimator,
            disable_std_normalization,
            normalize_advantages,
        };
        // rewards 1, 0, .5: mean .5, unbiased std .5
        let (b, _, _) = build_batch(group(), 3, spec(AdvantageEstimator::Gspo, false, false));
        let want = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0];
        for (g, w) in b.advantages.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{:?}", b.advantages);
        }
        let (b, _, _) = build_batch(group(), 3, spec(AdvantageEstimator::Grpo, true, false));
        assert_eq!(b.advantages, vec![0.5, -0.5, 0.0]);
        let (b, _, _) = build_batch(
            group(),
            3,
            spec(AdvantageEstimator::ReinforcePlusPlusBaseline, false, false),
        );
        assert_eq!(b.advantages, vec![0.5, -0.5, 0.0]);
        let (b, _, _) = build_batch(
            group(),
            3,
            spec(AdvantageEstimator::ReinforcePlusPlus, false, false),
        );
        assert_eq!(b.advantages, vec![1.0, 0.0, 0.5]);
        // whitened over one token each: mean .5, Bessel var .25 → (r - .5)/sqrt(.25 + 1e-8)
        let (b, _, _) = build_batch(
            group(),
            3,
            spec(AdvantageEstimator::ReinforcePlusPlus, false, true),
        );
        let s = (0.25f64 + 1e-8).sqrt();
        let want = [0.5 / s, -0.5 / s, 0.0];
        for (g, w) in b.advantages.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{:?}", b.advantages);
        }
    }
}
