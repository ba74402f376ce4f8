//! `--load-debug-rollout-data`: samples come from the files `--save-debug-rollout-data`
//! wrote instead of from engines, behind the same handle as rollouts, so the step loop
//! and the group queue run unchanged. Group `seq` of the run is group `seq % B` of
//! rollout `seq / B`'s file (B = `--rollout-batch-size`), and sample `i` of group `g`
//! is the file's sample at position `g × N + i` (N = `--n-samples`), as slime's loader
//! reads it: the numbers in the file (slime's run-wide `group_index` and `index`) are
//! not looked up, so slime's dumps and Manta's train alike, in the saved order.

use std::sync::{Mutex, PoisonError};

use anyhow::Context;
use manta_core::Sample;
use manta_rollout::{EpisodeRequest, GenerationSettings};

use super::{RolloutBackend, Rollouts};
use crate::debug_data;

/// Saved rollouts, read a file at a time.
pub struct SavedRollouts {
    template: String,
    groups_per_rollout: u64,
    n_samples: u64,
    /// The last file read: its rollout id and samples.
    last: Mutex<Option<(u64, Vec<Sample>)>>,
}

impl Rollouts {
    /// Samples from the files of `template` (`{rollout_id}` replaced by the step from 0),
    /// `groups_per_rollout` groups of `n_samples` each.
    pub fn saved(template: String, groups_per_rollout: usize, n_samples: usize) -> Self {
        Self::new(SavedRollouts {
            template,
            groups_per_rollout: groups_per_rollout.max(1) as u64,
            n_samples: n_samples.max(1) as u64,
            last: Mutex::new(None),
        })
    }
}

impl SavedRollouts {
    /// The saved sample `index` of group `group` of rollout `rollout`.
    fn sample(&self, rollout: u64, group: u64, index: u32) -> anyhow::Result<Sample> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.as_ref().is_none_or(|(id, _)| *id != rollout) {
            let samples = debug_data::load(&self.template, rollout, 0)?;
            *last = Some((rollout, samples));
        }
        let samples = last.as_ref().map(|(_, s)| s.as_slice()).unwrap_or_default();
        let position = group * self.n_samples + u64::from(index);
        usize::try_from(position)
            .ok()
            .and_then(|p| samples.get(p))
            .cloned()
            .with_context(|| {
                format!(
                    "--load-debug-rollout-data: {} holds {} samples, so no sample {index} of \
                     group {group} (position {position}: each rollout needs \
                     --rollout-batch-size {} groups of --n-samples {}, in order)",
                    debug_data::path_for(&self.template, rollout).display(),
                    samples.len(),
                    self.groups_per_rollout,
                    self.n_samples
                )
            })
    }
}

#[async_trait::async_trait]
impl RolloutBackend for SavedRollouts {
    async fn run_episodes(
        &self,
        requests: Vec<EpisodeRequest>,
        _generation: GenerationSettings,
    ) -> anyhow::Result<Vec<Sample>> {
        requests
            .iter()
            .map(|r| {
                let seq = u64::from(r.group_index);
                let (rollout, group) =
                    (seq / self.groups_per_rollout, seq % self.groups_per_rollout);
                let mut s = self.sample(rollout, group, r.index)?;
                s.id = r.sample_id;
                s.group_index = r.group_index;
                s.index = r.index;
                Ok(s)
            })
            .collect()
    }
}
