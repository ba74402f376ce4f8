//! When a step has failed and when the run gives up, so a dead environment or a context
//! too short for the prompts ends the run loudly instead of "training" on nothing.
//!
//! - A step fails when more than `--max-failed-episode-ratio` of its episodes failed, or
//!   when it has no generated token to train on. A failed step trains nothing and is
//!   not recorded as trained; it is tried again after a backoff (1 s, 2 s, 4 s, … 60 s).
//! - More than `--max-failed-steps` failed steps in a row end the run with an error
//!   naming the cause: the environment unreachable, every episode refused, …
//! - Prompts that leave no room to generate under `--context-len` end it at once, with
//!   the numbers: retrying cannot help.

use std::time::Duration;

use manta_core::{Sample, SampleStatus};

use crate::guard_flags::Guards;

/// Longest wait between two tries of a failed step.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Why a step trained nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct StepFailure {
    pub cause: String,
    /// Trying again cannot help (the settings are wrong): stop now.
    pub fatal: bool,
}

/// What a step's judge needs to know.
#[derive(Debug, Clone, Copy)]
pub struct StepChecks {
    pub max_failed_episode_ratio: f64,
    /// `--context-len`: the whole episode's token budget.
    pub context_len: usize,
}

/// Whether the step whose episodes are `samples` failed, and why.
pub fn judge_step(samples: &[Sample], checks: StepChecks) -> Option<StepFailure> {
    let failed: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.status == SampleStatus::Failed)
        .collect();
    if samples.is_empty() {
        return Some(StepFailure {
            cause: "the step collected no episode".into(),
            fatal: false,
        });
    }
    let ratio = failed.len() as f64 / samples.len() as f64;
    if ratio > checks.max_failed_episode_ratio {
        return Some(StepFailure {
            cause: format!(
                "{} of {} episodes failed (more than --max-failed-episode-ratio {}): {}",
                failed.len(),
                samples.len(),
                checks.max_failed_episode_ratio,
                failure_cause(&failed)
            ),
            fatal: false,
        });
    }
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.status != SampleStatus::Failed)
        .collect();
    let trained_tokens: usize = ok
        .iter()
        .map(|s| s.loss_mask.iter().filter(|&&m| m == 1).count())
        .sum();
    if trained_tokens > 0 {
        return None;
    }
    let prompts: Vec<usize> = ok
        .iter()
        .map(|s| s.tokens.len().saturating_sub(s.response_length))
        .collect();
    let (shortest, longest) = (
        prompts.iter().copied().min().unwrap_or(0),
        prompts.iter().copied().max().unwrap_or(0),
    );
    if shortest >= checks.context_len {
        return Some(StepFailure {
            cause: format!(
                "--context-len {} leaves no room to generate: the prompts of this step are \
                 {shortest} to {longest} tokens; raise --context-len above {longest}",
                checks.context_len
            ),
            fatal: true,
        });
    }
    Some(StepFailure {
        cause: format!(
            "no generated token to train on in {} episodes (prompts of {shortest} to \
             {longest} tokens under --context-len {})",
            ok.len(),
            checks.context_len
        ),
        fatal: false,
    })
}

/// One line for why episodes failed: the kind of failure and the first error.
pub fn failure_cause(failed: &[&Sample]) -> String {
    let errors: Vec<&str> = failed
        .iter()
        .filter_map(|s| s.metadata.error.as_deref())
        .collect();
    let Some(first) = errors.first() else {
        return "the episodes reported no error".into();
    };
    let unreachable = errors.iter().filter(|e| is_unreachable(e)).count();
    let refused = errors.iter().filter(|e| is_refusal(e)).count();
    let kind = if unreachable == errors.len() {
        "environment unreachable"
    } else if refused == errors.len() {
        "every episode refused by the environment"
    } else if unreachable > 0 {
        "environment unreachable for some episodes"
    } else {
        "episodes failed"
    };
    format!("{kind} (first error: {first})")
}

/// Connection refused, reset or timed out: nothing answered.
fn is_unreachable(error: &str) -> bool {
    [
        "request failed",
        "error sending request",
        "Connection refused",
        "connection refused",
        "no answer within",
        "timed out",
        "event stream interrupted",
        "HTTP 502",
        "HTTP 503",
        "HTTP 504",
    ]
    .iter()
    .any(|p| error.contains(p))
}

/// The server answered and said no (HTTP 4xx).
fn is_refusal(error: &str) -> bool {
    (400..500).any(|status| error.contains(&format!("HTTP {status}")))
}

/// Failed steps in a row, against `--max-failed-steps`.
#[derive(Debug, Clone)]
pub struct FailureBudget {
    max_failed_steps: u32,
    in_a_row: u32,
}

impl FailureBudget {
    pub fn new(guards: &Guards) -> Self {
        Self {
            max_failed_steps: guards.max_failed_steps,
            in_a_row: 0,
        }
    }

    /// A step trained: the count starts again.
    pub fn succeeded(&mut self) {
        self.in_a_row = 0;
    }

    /// Step `step` failed: the wait before trying it again, or the run's error once the
    /// budget is spent (or at once for a fatal failure).
    pub fn failed(&mut self, step: u64, failure: &StepFailure) -> Result<Duration, String> {
        self.in_a_row += 1;
        if failure.fatal {
            return Err(format!("step {step}: {}", failure.cause));
        }
        if self.in_a_row > self.max_failed_steps {
            return Err(format!(
                "step {step} failed {} times in a row (--max-failed-steps {}): {}",
                self.in_a_row, self.max_failed_steps, failure.cause
            ));
        }
        let backoff = Duration::from_secs(1u64 << (self.in_a_row - 1).min(6));
        Ok(backoff.min(MAX_BACKOFF))
    }

    /// Failed steps since the last trained one.
    pub fn in_a_row(&self) -> u32 {
        self.in_a_row
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use manta_core::EpisodeMetadata;

    fn sample(status: SampleStatus, prompt: usize, generated: usize, error: &str) -> Sample {
        Sample {
            id: 0,
            group_index: 0,
            index: 0,
            tokens: vec![1; prompt + generated],
            response_length: generated,
            loss_mask: vec![1; generated],
            rollout_log_probs: vec![-1.0; generated],
            reward: 0.0,
            status,
            weight_version: 0,
            metadata: EpisodeMetadata {
                error: (!error.is_empty()).then(|| error.to_string()),
                ..Default::default()
            },
            routed_experts: None,
        }
    }

    const CHECKS: StepChecks = StepChecks {
        max_failed_episode_ratio: 0.5,
        context_len: 16,
    };

    #[test]
    fn a_step_fails_past_the_ratio_naming_the_kind_of_failure() {
        let ok = sample(SampleStatus::Completed, 4, 2, "");
        let down = sample(
            SampleStatus::Failed,
            0,
            0,
            "http://127.0.0.1:9/create_session: request failed: connection refused",
        );
        let refused = sample(
            SampleStatus::Failed,
            0,
            0,
            "http://h/create: HTTP 422: bad task",
        );
        assert_eq!(judge_step(&[ok.clone(), down.clone()], CHECKS), None);
        let f = judge_step(&[ok.clone(), down.clone(), down.clone()], CHECKS).unwrap();
        assert!(
            f.cause.contains("2 of 3 episodes failed")
                && f.cause.contains("environment unreachable"),
            "{}",
            f.cause
        );
        assert!(!f.fatal);
        let f = judge_step(&[refused.clone(), refused], CHECKS).unwrap();
        assert!(f.cause.contains("every episode refused"), "{}", f.cause);
    }

    #[test]
    fn zero_trained_tokens_is_a_failed_step_and_a_too_short_context_is_fatal() {
        let empty = sample(SampleStatus::Truncated, 20, 0, "");
        let f = judge_step(&[empty.clone(), empty], CHECKS).unwrap();
        assert!(f.fatal, "{}", f.cause);
        assert!(
            f.cause.contains("--context-len 16") && f.cause.contains("20 to 20 tokens"),
            "{}",
            f.cause
        );
        let short = sample(SampleStatus::Completed, 4, 0, "");
        let f = judge_step(&[short], CHECKS).unwrap();
        assert!(
            !f.fatal && f.cause.contains("no generated token"),
            "{}",
            f.cause
        );
    }

    #[test]
    fn the_budget_backs_off_then_stops() {
        let mut b = FailureBudget::new(&Guards {
            max_failed_steps: 2,
            ..Guards::default()
        });
        let f = StepFailure {
            cause: "environment unreachable".into(),
            fatal: false,
        };
        assert_eq!(b.failed(3, &f), Ok(Duration::from_secs(1)));
        assert_eq!(b.failed(3, &f), Ok(Duration::from_secs(2)));
        let err = b.failed(3, &f).unwrap_err();
        assert!(
            err.contains("3 times in a row") && err.contains("--max-failed-steps 2"),
            "{err}"
        );
        b.succeeded();
        assert_eq!(b.in_a_row(), 0);
    }
}
