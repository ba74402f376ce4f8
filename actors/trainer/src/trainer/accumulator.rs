//! Metric and token sums over the micro-batches of one optimizer step.

use std::collections::BTreeMap;

use crate::data_parallel::metrics::all_reduce_metrics;
use crate::data_parallel::{Collective, CollectiveError};

#[derive(Default)]
pub(super) struct Accumulator {
    /// Weighted metric sums over the micro-batches of one optimizer step.
    pub(super) metrics: BTreeMap<&'static str, f64>,
    pub(super) tokens: usize,
    /// Samples skipped because they did not fit in memory even alone.
    pub(super) oom_skipped: usize,
    /// Micro-batches split in halves after running out of memory.
    pub(super) oom_splits: usize,
    /// Token-layer pairs whose experts differ between rollout and training, and the
    /// pairs compared (samples carrying routed experts only).
    pub(super) routing_mismatched: f64,
    pub(super) routing_pairs: f64,
}

impl Accumulator {
    /// Sums the ranks' accumulators (data parallel): every rank then reports the step's
    /// global metrics.
    pub(super) fn all_reduce(&mut self, comm: &dyn Collective) -> Result<(), CollectiveError> {
        let mut counts = [
            self.tokens as f64,
            self.oom_skipped as f64,
            self.oom_splits as f64,
            self.routing_mismatched,
            self.routing_pairs,
        ];
        all_reduce_metrics(comm, &mut self.metrics, &mut counts)?;
        self.tokens = counts[0] as usize;
        self.oom_skipped = counts[1] as usize;
        self.oom_splits = counts[2] as usize;
        self.routing_mismatched = counts[3];
        self.routing_pairs = counts[4];
        Ok(())
    }

    pub(super) fn merge(&mut self, other: Accumulator) {
        for (k, v) in other.metrics {
            *self.metrics.entry(k).or_default() += v;
        }
        self.tokens += other.tokens;
        self.oom_skipped += other.oom_skipped;
        self.oom_splits += other.oom_splits;
        self.routing_mismatched += other.routing_mismatched;
        self.routing_pairs += other.routing_pairs;
    }

    /// `train/routing_mismatch`: the fraction of compared token-layer pairs whose
    /// experts differ between rollout and training (`None`: nothing compared).
    pub(super) fn routing_mismatch(&self) -> Option<f64> {
        (self.routing_pairs > 0.0).then(|| self.routing_mismatched / self.routing_pairs)
    }
}
