//! Context parallelism in the trainer (`Trainer::new_context_parallel`): every rank of
//! the group gets the same batch and holds one packed row's tokens split as
//! `manta_model::CpRow` says. A rank scores the trained tokens whose predicting hidden
//! state it holds; the per-token log-probs and entropies are then assembled in full on
//! every rank (each position filled by its one owner, the others' values summed in by an
//! all-reduce, so the values are exact), with autograd through this rank's own positions
//! only. The loss and its metrics are therefore computed on the whole micro-batch exactly
//! as one rank computes them — per-sample means and sequence-level terms included — and
//! each rank's gradients are its tokens' share, summed over the group by ZeRO-2's
//! reduce-scatter. Only rank 0 reports the (identical) metrics, so their sum over the
//! group is one rank's.

use manta_model::{CausalLm, CpGroup, CpRow};
use tch::{Device, Kind, Tensor};

use crate::data_parallel::{Collective, CollectiveError, ReduceOp};
use crate::error::TrainerError;
use crate::profile::{self, Phase};

/// A [`Collective`] seen as the model's CP group.
pub(crate) struct CpComm<'a>(pub &'a dyn Collective);

impl CpGroup for CpComm<'_> {
    type Error = CollectiveError;

    fn cp_rank(&self) -> usize {
        self.0.rank()
    }

    fn cp_size(&self) -> usize {
        self.0.world_size()
    }

    fn cp_all_gather(&self, local: &Tensor) -> Result<Tensor, CollectiveError> {
        profile::scoped(Phase::CpAllGather, || {
            let n = local.numel() as i64 * self.0.world_size() as i64;
            let mut out = Tensor::empty([n], (local.kind(), local.device()));
            self.0.all_gather(local, &mut out)?;
            Ok(out)
        })
    }

    fn cp_reduce_scatter(&self, full: &Tensor) -> Result<Tensor, CollectiveError> {
        profile::scoped(Phase::CpReduceScatter, || {
            let n = full.numel() as i64 / self.0.world_size() as i64;
            let mut out = Tensor::empty([n], (full.kind(), full.device()));
            self.0.reduce_scatter(full, &mut out, ReduceOp::Sum)?;
            Ok(out)
        })
    }
}

/// One packed micro-batch as this rank holds it.
pub(crate) struct CpLocal {
    pub row: CpRow,
    pub input: Tensor,
    pub positions: Tensor,
    /// Local hidden-state index of each trained token this rank scores.
    pub own_at: Tensor,
    /// Those tokens' indices among the micro-batch's trained tokens.
    pub own: Tensor,
    /// [trained tokens] bool: this rank scores the token.
    own_mask: Tensor,
    trained: i64,
}

impl CpLocal {
    /// `gather`: each trained token's predicting position in the row (`Packed::gather`).
    pub fn new(
        lengths: &[i64],
        input: &Tensor,
        positions: &Tensor,
        gather: &Tensor,
        comm: &dyn Collective,
        device: Device,
    ) -> Result<Self, TrainerError> {
        let row = CpRow::new(lengths, comm.rank(), comm.world_size(), device)
            .map_err(|e| TrainerError::Config(e.to_string()))?;
        let gather: Vec<i64> = Vec::try_from(&gather.to_device(Device::Cpu))
            .map_err(|e| TrainerError::Batch(format!("context parallel: trained tokens: {e}")))?;
        let (mut own_at, mut own, mut mask) = (Vec::new(), Vec::new(), vec![false; gather.len()]);
        for (j, &p) in gather.iter().enumerate() {
            if let Some(l) = row.local_index(p) {
                own_at.push(l);
                own.push(j as i64);
                mask[j] = true;
            }
        }
        Ok(CpLocal {
            input: row.take(input),
            positions: row.take(positions),
            own_at: Tensor::from_slice(&own_at).to(device),
            own: Tensor::from_slice(&own).to(device),
            own_mask: Tensor::from_slice(&mask).to(device),
            trained: gather.len() as i64,
            row,
        })
    }

    /// Whether this rank scores no trained token.
    pub fn owns_none(&self) -> bool {
        self.own.numel() == 0
    }

    /// The micro-batch's whole per-token vector from this rank's `local` values (its
    /// own tokens, in order): exact (one owner per position), differentiable through
    /// this rank's positions only. Every rank calls it together.
    pub fn full(&self, local: &Tensor, comm: &dyn Collective) -> Result<Tensor, CollectiveError> {
        let device = self.own_mask.device();
        let zeros = Tensor::zeros([self.trained], (Kind::Float, device));
        let placed = if self.owns_none() {
            zeros
        } else {
            zeros.index_copy(0, &self.own, &local.to_kind(Kind::Float))
        };
        let mut all = placed.detach().copy();
        profile::scoped(Phase::CpAllReduce, || {
            comm.all_reduce(&mut all, ReduceOp::Sum)
        })?;
        Ok(placed.where_self(&self.own_mask, &all))
    }

    /// The whole micro-batch's trained-token log-probs under `model`, no autograd.
    pub fn logprobs(
        &self,
        model: &CausalLm,
        targets: &Tensor,
        comm: &dyn Collective,
        temperature: f64,
        chunk: i64,
    ) -> Result<Tensor, CollectiveError> {
        tch::no_grad(|| {
            let cp = CpComm(comm);
            let hidden = model.forward_hidden_cp(&self.input, &self.positions, &self.row, &cp)?;
            let local = if self.owns_none() {
                Tensor::zeros([0], (Kind::Float, targets.device()))
            } else {
                let selected = hidden
                    .view([self.row.local_len(), -1])
                    .index_select(0, &self.own_at);
                let targets = targets.index_select(0, &self.own);
                manta_model::token_logprobs(model, &selected, &targets, temperature, chunk).0
            };
            self.full(&local, comm)
        })
    }
}
