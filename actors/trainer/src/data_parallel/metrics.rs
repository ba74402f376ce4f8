//! The step's loss metrics summed over the ranks. Each rank's metrics are weighted sums
//! with the global denominators ([`super`]), so their sum over the ranks is the global
//! value, as one rank on the whole batch reports it.

use std::collections::BTreeMap;

use super::{Collective, CollectiveError, ReduceOp};

/// Every metric name [`crate::loss::policy_objective`] can report. The ranks sum a fixed
/// vector over these names, so a rank that trained no token (and so has no metrics)
/// still takes part; a metric a rank has that no other rank has is still reported.
pub const METRIC_NAMES: &[&str] = &[
    "entropy_loss",
    "kl_loss",
    "loss",
    "ois",
    "opsm_clipfrac",
    "pg_clipfrac",
    "pg_loss",
    "ppo_kl",
    "tis",
    "tis_abs",
    "tis_clipfrac",
    "train_rollout_logprob_abs_diff",
];

/// Sums `counts` and `metrics` over the ranks, in place. A metric name outside
/// [`METRIC_NAMES`] is an error naming it (add it there).
pub fn all_reduce_metrics(
    comm: &dyn Collective,
    metrics: &mut BTreeMap<&'static str, f64>,
    counts: &mut [f64],
) -> Result<(), CollectiveError> {
    if let Some(unknown) = metrics.keys().find(|k| !METRIC_NAMES.contains(k)) {
        return Err(CollectiveError::Mismatch {
            op: "metrics",
            message: format!("metric {unknown:?} is not in data_parallel::metrics::METRIC_NAMES"),
        });
    }
    let mut values: Vec<f64> = counts.to_vec();
    for name in METRIC_NAMES {
        match metrics.get(name) {
            Some(v) => values.extend([*v, 1.0]),
            None => values.extend([0.0, 0.0]),
        }
    }
    comm.all_reduce_f64(&mut values, ReduceOp::Sum)?;
    counts.copy_from_slice(&values[..counts.len()]);
    metrics.clear();
    for (i, name) in METRIC_NAMES.iter().enumerate() {
        let at = counts.len() + 2 * i;
        if values[at + 1] > 0.0 {
            metrics.insert(name, values[at]);
        }
    }
    Ok(())
}
