//! The trainer's weights for weight sync and export: whole, or gathered a group at a time.

use tch::Kind;

use crate::data_parallel::{PrefetchStats, ShardBytes, ZeroAdamW};

use super::*;

impl Trainer {
    /// The optimizer's fp32 master weights by HF name (empty in an fp32 run), for
    /// checking that the bf16 weights follow them. In data parallel this gathers the
    /// shards (every rank must call it) and panics if the group fails; see
    /// [`Trainer::try_master_weights`].
    pub fn master_weights(&self) -> NamedTensors {
        self.try_master_weights()
            .unwrap_or_else(|e| panic!("gathering the master weights: {e}"))
    }

    /// [`Trainer::master_weights`], with a failed data-parallel group as an error.
    pub fn try_master_weights(&self) -> Result<NamedTensors, TrainerError> {
        Ok(self.optimizer.master_weights()?)
    }

    /// (rank, world size) of this trainer's data-parallel group; (0, 1) alone.
    pub fn data_parallel_rank(&self) -> (usize, usize) {
        self.optimizer
            .collective()
            .map_or((0, 1), |c| (c.rank(), c.world_size()))
    }

    /// Handles to the current weights by HF name. They alias the trainer's parameters:
    /// read them before the next step (weight sync runs between steps). ZeRO-3: full
    /// copies gathered from the ranks (every rank must call it; panics if the group
    /// fails, see [`Trainer::visit_weights`] for a layer at a time).
    pub fn export_weights(&self) -> NamedTensors {
        self.try_export_weights()
            .unwrap_or_else(|e| panic!("gathering the ZeRO-3 weights: {e}"))
    }

    /// [`Trainer::export_weights`], with a failed ZeRO-3 gather as an error (the
    /// driver's ranks answer weight sync through it).
    pub fn try_export_weights(&self) -> Result<NamedTensors, TrainerError> {
        if let Some(zero) = self.optimizer.zero3() {
            let mut named = NamedTensors::new();
            zero.visit_buckets::<TrainerError>(|views| {
                named.extend(views);
                Ok(())
            })?;
            named.sort_by(|a, b| a.0.cmp(&b.0));
            return Ok(named);
        }
        let mut named: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.detach()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(named)
    }

    /// The current weights by HF name, a shard group at a time (ZeRO-3: one decoder
    /// layer, or the embedding, final norm and head, gathered from the ranks — every rank
    /// must call it), so a reader (weight sync, HF export) never needs the whole model
    /// on the device beside its shards. Without ZeRO-3, one call with every weight.
    pub fn visit_weights(
        &self,
        visit: impl FnMut(NamedTensors) -> Result<(), TrainerError>,
    ) -> Result<(), TrainerError> {
        match self.optimizer.zero3() {
            Some(zero) => zero.visit_buckets(visit),
            None => {
                let mut visit = visit;
                visit(self.export_weights())
            }
        }
    }

    /// The groups [`Trainer::visit_weights`] hands out, in order, as (name, shape, kind):
    /// known without gathering anything (ZeRO-3: one per shard group; else one group of
    /// every weight, sorted by name).
    pub fn weight_groups(&self) -> Vec<Vec<(String, Vec<i64>, Kind)>> {
        if let Some(zero) = self.optimizer.zero3() {
            return zero.bucket_shapes();
        }
        let mut all: Vec<(String, Vec<i64>, Kind)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.size(), t.kind()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        vec![all]
    }

    /// ZeRO-3: the bytes this rank's parameters hold now (only its slices, which live
    /// in the optimizer, at rest: 0); `None` without ZeRO-3.
    pub fn zero3_parameter_bytes(&self) -> Option<usize> {
        self.optimizer.zero3().map(ZeroAdamW::parameter_bytes)
    }

    /// ZeRO-3: how this rank's layer prefetches went so far (all zero with
    /// `MANTA_ZERO3_PREFETCH` off); `None` without ZeRO-3.
    pub fn zero3_prefetch_stats(&self) -> Option<PrefetchStats> {
        self.optimizer.zero3().map(ZeroAdamW::prefetch_stats)
    }

    /// Bytes of this data-parallel rank's sharded optimizer state now, by what holds
    /// them, and the reduced gradients' kind; `None` for one trainer.
    pub fn shard_bytes(&self) -> Option<(ShardBytes, Kind)> {
        self.optimizer
            .sharded()
            .map(|o| (o.shard_bytes(), o.grad_kind()))
    }
}
