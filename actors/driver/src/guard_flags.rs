//! Flags that decide when a run gives up and what its checkpoints keep: the failure
//! budget (crate::failure_budget) and `--keep-last` (crate::checkpoint_files). Kept out
//! of cli.rs's table of cookbook flags; flattened into `TrainArgs`.

use clap::Args;

/// Default of `--max-failed-episode-ratio`.
pub const DEFAULT_MAX_FAILED_EPISODE_RATIO: f64 = 0.5;
/// Default of `--max-failed-steps`.
pub const DEFAULT_MAX_FAILED_STEPS: u32 = 3;

/// When a run stops on failures, and how many checkpoints it keeps.
#[derive(Debug, Args, Clone, Default)]
pub struct GuardArgs {
    /// A step in which more than this share of the episodes failed (environment down,
    /// every episode refused), or that has no generated token to train on, is a failed
    /// step: nothing is trained, nothing recorded as trained, and the step is tried
    /// again after a backoff (1 s, 2 s, 4 s, … up to 60 s). 0 to 1 [0.5].
    #[arg(long, value_name = "FRACTION", allow_negative_numbers = true)]
    pub max_failed_episode_ratio: Option<f64>,
    /// Failed steps in a row the run rides out; one more stops it with a non-zero exit
    /// naming the cause [3].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_failed_steps: Option<i64>,
    /// Keep only the newest N checkpoints in --save (older step directories are
    /// deleted after each save; the one `latest` names is never deleted) [all].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub keep_last: Option<i64>,
}

/// The checked values of [`GuardArgs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Guards {
    pub max_failed_episode_ratio: f64,
    pub max_failed_steps: u32,
    pub keep_last: Option<usize>,
}

impl GuardArgs {
    /// The values with their defaults; an out-of-range one is an error naming its flag.
    pub fn resolve(&self) -> anyhow::Result<Guards> {
        let ratio = self
            .max_failed_episode_ratio
            .unwrap_or(DEFAULT_MAX_FAILED_EPISODE_RATIO);
        if !(0.0..=1.0).contains(&ratio) {
            anyhow::bail!("--max-failed-episode-ratio {ratio}: must be between 0 and 1");
        }
        let max_failed_steps = match self.max_failed_steps {
            None => DEFAULT_MAX_FAILED_STEPS,
            Some(n) => u32::try_from(n)
                .map_err(|_| anyhow::anyhow!("--max-failed-steps {n}: must be 0 or more"))?,
        };
        let keep_last = match self.keep_last {
            None => None,
            Some(n) if n >= 1 => Some(n as usize),
            Some(n) => anyhow::bail!(
                "--keep-last {n}: must be at least 1 (leave it out to keep every checkpoint)"
            ),
        };
        Ok(Guards {
            max_failed_episode_ratio: ratio,
            max_failed_steps,
            keep_last,
        })
    }
}

impl Default for Guards {
    fn default() -> Self {
        Self {
            max_failed_episode_ratio: DEFAULT_MAX_FAILED_EPISODE_RATIO,
            max_failed_steps: DEFAULT_MAX_FAILED_STEPS,
            keep_last: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_values_name_their_flag() {
        let bad = |args: GuardArgs| args.resolve().unwrap_err().to_string();
        assert!(bad(GuardArgs {
            max_failed_episode_ratio: Some(1.5),
            ..Default::default()
        })
        .contains("--max-failed-episode-ratio 1.5"));
        assert!(bad(GuardArgs {
            max_failed_steps: Some(-1),
            ..Default::default()
        })
        .contains("--max-failed-steps -1"));
        assert!(bad(GuardArgs {
            keep_last: Some(0),
            ..Default::default()
        })
        .contains("--keep-last 0"));
        assert_eq!(GuardArgs::default().resolve().unwrap(), Guards::default());
    }
}
