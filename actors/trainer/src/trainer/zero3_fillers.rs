//! ZeRO-3's filler passes: a rank with fewer micro-batches than its peers joins their layer gathers.

use manta_model::Attention;
use tch::Kind;

use crate::data_parallel::zero::OUTER_BUCKET;
use crate::profile::{self, Phase};

use super::packing::filler_input;
use super::*;

impl Trainer {
    /// ZeRO-3: how many filler passes this rank adds to its `own` so that every rank
    /// makes as many (0 without ZeRO-3).
    pub(super) fn zero3_fillers(&self, own: usize) -> Result<usize, TrainerError> {
        let Some(zero) = self.optimizer.zero3() else {
            return Ok(0);
        };
        let mut most = [own as f64];
        zero.collective()
            .all_reduce_f64(&mut most, crate::data_parallel::ReduceOp::Max)?;
        Ok(most[0] as usize - own)
    }

    /// ZeRO-3: a pass over two tokens that adds nothing (no loss, zero gradients) but
    /// makes the same gathers and reduce-scatters as a real micro-batch, for a rank
    /// that has run out of its own; `backward` as a training micro-batch, else as a
    /// log-prob pass.
    pub(super) fn zero3_filler_pass(&mut self, backward: bool) -> Result<(), TrainerError> {
        profile::scoped(Phase::Filler, || self.run_zero3_filler_pass(backward))
    }

    /// [`Trainer::zero3_filler_pass`]'s pass.
    pub(super) fn run_zero3_filler_pass(&mut self, backward: bool) -> Result<(), TrainerError> {
        let (ids, positions) = filler_input(self.opts.device);
        let attention = Attention::Causal { key_mask: None };
        let Some(zero) = self.optimizer.zero3_mut() else {
            return Ok(());
        };
        zero.gather_bucket(OUTER_BUCKET)?;
        let mut pass = zero.layer_pass();
        let ran = if backward {
            tch::with_grad(|| {
                self.model
                    .forward_backward_hooked(&ids, &positions, &attention, &mut pass, |h| {
                        h.sum(Kind::Float) * 0.0
                    })
            })
        } else {
            tch::no_grad(|| {
                self.model
                    .forward_hidden_hooked(&ids, &positions, &attention, &mut pass)
            })
        };
        let ended = pass.finish();
        let _ = ran?;
        ended?;
        if backward {
            zero.reduce_bucket(OUTER_BUCKET)?;
        } else {
            zero.release_bucket(OUTER_BUCKET);
        }
        Ok(())
    }
}
