//! Building a trainer: one rank alone, ZeRO-2 or ZeRO-3 over a group, or context parallel.

use std::collections::BTreeMap;

use manta_model::{CausalLm, ModelConfig};
use tch::{nn, Tensor};
use tracing::info;

use crate::batch::MicroBatchLayout;
use crate::context_parallel::CpLocal;
use crate::data_parallel::{RankOptimizer, ZeroAdamW};
use crate::optimizer::AdamW;

use crate::data_parallel::Collective;

use super::memory_check::check_memory;
use super::packing::Packed;
use super::*;

impl Trainer {
    /// Builds the model from `model_dir/config.json` and loads its weights, or draws
    /// random ones from `seed` when the directory has none.
    pub fn new(opts: TrainerOptions) -> Result<Self, TrainerError> {
        Self::build(opts, None)
    }

    /// A data-parallel rank of `comm`'s group (crate::data_parallel): every rank starts
    /// from rank 0's weights, keeps the optimizer state of its shard only (ZeRO-2,
    /// gradients reduced in buckets of `bucket_numel` elements) and ends each step with
    /// the same weights as the others. A group of one is exactly [`Trainer::new`].
    pub fn new_data_parallel(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, TrainerError> {
        Self::build(opts, Some((comm, Sharding::Zero2 { bucket_numel })))
    }

    /// A ZeRO-3 rank (`--zero-stage 3`): as [`Trainer::new_data_parallel`], and the
    /// bf16 (or fp32) parameters are sharded too — one shard group per decoder layer
    /// and one for the embedding, final norm and LM head. A layer's parameters are
    /// all-gathered just before its forward and again before its backward (or kept from
    /// one to the other for layers not recomputed), its gradients reduce-scattered into
    /// this rank's fp32 slice as soon as its backward ends; the embedding, norm and head
    /// are gathered for a whole micro-batch. Unless `MANTA_ZERO3_PREFETCH` is off, the
    /// next layer's all-gather and each layer's reduce-scatter run on a side stream while
    /// the decoder computes (crate::data_parallel::prefetch), with the same results. At
    /// rest a rank holds only its slices.
    /// Every rank runs as many micro-batches (a rank with fewer fills in with passes of
    /// two tokens and no loss), so their collectives pair up. Refused with one rank.
    pub fn new_zero3(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
    ) -> Result<Self, TrainerError> {
        if comm.world_size() < 2 {
            return Err(TrainerError::Config(format!(
                "--zero-stage 3 shards the parameters over the data-parallel ranks and needs \
                 at least two; this group has {}",
                comm.world_size()
            )));
        }
        Self::build(opts, Some((comm, Sharding::Zero3)))
    }

    /// A rank of a context-parallel group (`--context-parallel-size`, crate
    /// `context_parallel`): every rank gets the same batch and holds a share of each
    /// packed micro-batch's tokens; weights are replicated, gradients summed over the
    /// group (ZeRO-2 over it, buckets of `bucket_numel`). The whole group is one CP
    /// group (data parallel × context parallel is not built). Refused with fewer than two
    /// ranks, the padded layout and true on-policy mode (whose kernels it does not use).
    pub fn new_context_parallel(
        opts: TrainerOptions,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, TrainerError> {
        let size = comm.world_size();
        let refuse = |why: String| {
            Err(TrainerError::Config(format!(
                "--context-parallel-size {size}: {why}"
            )))
        };
        if size < 2 {
            return refuse("a context-parallel group needs at least two ranks".into());
        }
        if opts.layout != MicroBatchLayout::Packed {
            return refuse(
                "context parallelism splits packed rows; the padded layout is not supported".into(),
            );
        }
        if opts.algo.true_on_policy {
            return refuse("true on-policy mode's batch-invariant attention is not built for context parallelism".into());
        }
        let mut trainer = Self::build(opts, Some((comm, Sharding::Zero2 { bucket_numel })))?;
        trainer.context_parallel = true;
        Ok(trainer)
    }

    /// This micro-batch as this context-parallel rank holds it (None without CP).
    pub(super) fn cp_local(&self, packed: &Packed) -> Result<Option<CpLocal>, TrainerError> {
        let Some(comm) = self
            .optimizer
            .collective()
            .filter(|_| self.context_parallel)
        else {
            return Ok(None);
        };
        CpLocal::new(
            &packed.lengths,
            &packed.input,
            &packed.positions,
            &packed.gather,
            comm,
            self.opts.device,
        )
        .map(Some)
    }

    pub(super) fn build(
        opts: TrainerOptions,
        group: Option<(Box<dyn Collective>, Sharding)>,
    ) -> Result<Self, TrainerError> {
        let cfg = ModelConfig::from_file(&opts.model_dir.join("config.json"))?;
        let bf16 = opts.bf16.unwrap_or(opts.device.is_cuda());
        let ranks = group.as_ref().map_or(1, |(comm, _)| comm.world_size());
        let zero_stage = match &group {
            Some((_, Sharding::Zero3)) => 3,
            _ => 2,
        };
        let grad_reduce_in_bf16 = opts.algo.grad_reduce_in_bf16;
        if grad_reduce_in_bf16 && (ranks < 2 || !bf16) {
            let why = if ranks < 2 {
                format!(
                    "it reduces gradients over data-parallel ranks, and this trainer has {ranks} \
                     ([trainer] gpus with two or more GPUs, or data_parallel_ranks = N)"
                )
            } else {
                "it reduces bf16 gradients, and this trainer's weights are fp32 (--bf16 or \
                 [trainer] bf16 = true)"
                    .to_string()
            };
            return Err(TrainerError::Config(format!(
                "--grad-reduce-in-bf16 (or [train] grad_reduce_in_bf16): {why}; or drop the flag"
            )));
        }
        check_memory(&cfg, &opts, bf16, ranks, zero_stage)?;
        // Seeding and drawing the initial weights hold a process-wide lock: data-parallel
        // ranks in one process are built at once, and libtorch's generators (the CPU's,
        // and `manual_seed` reseeds every GPU's) are shared, so another rank reseeding in
        // the middle of rank 0's draws would make its random init differ run to run (and
        // from ranks in separate processes).
        let (mut vs, mut model) = {
            let _init = RANDOM_INIT.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(opts.seed as i64);
            let vs = nn::VarStore::new(opts.device);
            let model = CausalLm::new(&vs.root(), &cfg);
            (vs, model)
        };
        model.set_recompute(opts.recompute)?;
        model.set_moe_aux_loss_coeff(opts.algo.moe_aux_loss_coeff);
        if opts.algo.use_rollout_routing_replay && cfg.moe().is_none() {
            return Err(TrainerError::Config(format!(
                "--use-rollout-routing-replay needs a mixture-of-experts model; {} is {} \
                 (dense): drop the flag",
                opts.model_dir.display(),
                cfg.model_type
            )));
        }
        if has_weights(&opts.model_dir) {
            manta_model::load_weights(&mut vs, &opts.model_dir)?;
            info!(dir = %opts.model_dir.display(), "trainer loaded weights");
        } else {
            info!(dir = %opts.model_dir.display(), seed = opts.seed, "no weights in model directory: random init");
        }
        if bf16 {
            // The optimizer keeps fp32 masters of these (AdamW::new).
            vs.bfloat16();
        }
        info!(bf16, device = ?opts.device, "trainer precision");
        if opts.algo.true_on_policy {
            model.set_invariant_attention(true).map_err(|e| {
                TrainerError::Config(format!("true on-policy mode (--true-on-policy-mode): {e}"))
            })?;
            info!("true on-policy mode: attention through the batch-invariant kernel");
        }
        // Before the reference copy: data parallel starts every rank from rank 0's weights.
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        let mut optimizer = match group {
            Some((comm, Sharding::Zero3)) => {
                RankOptimizer::Sharded(Box::new(ZeroAdamW::new_stage3(
                    params,
                    opts.adam,
                    comm,
                    cfg.num_hidden_layers as usize,
                    grad_reduce_in_bf16,
                )?))
            }
            Some((comm, Sharding::Zero2 { bucket_numel })) if comm.world_size() > 1 => {
                RankOptimizer::Sharded(Box::new(ZeroAdamW::new(
                    params,
                    opts.adam,
                    comm,
                    bucket_numel,
                    grad_reduce_in_bf16,
                )?))
            }
            _ => RankOptimizer::Whole(AdamW::new(params, opts.adam)),
        };
        let reference = if opts.algo.loss.use_kl_loss {
            let mut ref_vs = nn::VarStore::new(opts.device);
            let mut ref_model = CausalLm::new(&ref_vs.root(), &cfg);
            ref_model.set_gradient_checkpointing(false);
            if bf16 {
                ref_vs.bfloat16();
            }
            match &opts.algo.ref_load {
                Some(dir) => manta_model::load_weights(&mut ref_vs, dir)?,
                None => ref_vs.copy(&vs)?,
            }
            ref_vs.freeze();
            Some((ref_vs, ref_model))
        } else {
            None
        };
        // ZeRO-3: the reference (a whole model, as in ZeRO-2) has copied rank 0's weights;
        // from here on a rank holds only its slices.
        if let Some(zero) = optimizer.zero3_mut() {
            zero.release_all();
        }
        Ok(Self {
            vs,
            model,
            optimizer,
            opts,
            reference,
            inject_oom_tokens: fault::inject_oom_tokens(),
            context_parallel: false,
            checkpoint_owner: None,
            steps_begun: 0,
        })
    }
}
