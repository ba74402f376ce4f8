//! ZeRO-2 AdamW: each rank keeps the fp32 master weights and AdamW moments of its shard
//! of the flattened parameters only ([`FlatLayout`]). A step reduce-scatters the
//! gradients bucket by bucket (summed: the loss weights already divide by global counts,
//! see [`super`]), clips by the global norm (an all-reduce of the shards' squared norms),
//! updates the shard with the same AdamW as the unsharded optimizer, and all-gathers the
//! updated shards into every rank's parameters, so all ranks stay identical.
//!
//! Per parameter over N ranks a rank keeps the fp32 master (4 B / N), the moments
//! (8 B / N) and the reduced gradient (4 B / N, or 2 B / N with `--grad-reduce-in-bf16`).
//! ZeRO-2 with bf16 weights also keeps the updated bf16 shard it all-gathers (2 B / N);
//! ZeRO-3 rounds a shard group's slice of the master when it gathers it instead, the same
//! bits the shard would have held.

use std::collections::BTreeMap;

use manta_cuda::adamw::{clear_grad, fused_adamw_bf16_grad, AdamWStep, Bf16GradShard};
use tch::{Kind, Tensor};

use super::super::{Collective, CollectiveError, FlatLayout, ReduceOp};
use super::flat::{
    check_one_kind, flat_bucket, grad_kind, stage3_groups, sum_of_squares, update_slice,
};
use super::in_flight::Prefetch;
use crate::optimizer::AdamWConfig;
use crate::profile::{self, Phase};
use manta_model::NamedTensors;

/// Default bucket size: 64 Mi elements (256 MiB of fp32 gradients staged at a time).
pub const DEFAULT_BUCKET_NUMEL: usize = 1 << 26;

/// The shard file's record of the ZeRO stage that wrote it.
pub const ZERO_STAGE_KEY: &str = "zero_stage";

/// The shard file's record of ZeRO-2's bucket size (shards written before it was
/// recorded used [`DEFAULT_BUCKET_NUMEL`]).
pub const BUCKET_NUMEL_KEY: &str = "bucket_numel";

/// The sharded optimizer of one data-parallel rank.
pub struct ZeroAdamW {
    pub config: AdamWConfig,
    pub(super) comm: Box<dyn Collective>,
    pub(super) layout: FlatLayout,
    /// The model's parameters in layout order (handles to the model's tensors).
    pub(super) params: Vec<Tensor>,
    /// The parameters' kind (one for all: fp32, or bf16 with `--bf16`).
    pub(super) kind: Kind,
    /// This rank's fp32 masters and moments, `[shard_numel]`.
    pub(super) master: Tensor,
    pub(super) exp_avg: Tensor,
    pub(super) exp_avg_sq: Tensor,
    /// This rank's reduced gradients, `[shard_numel]`, in `grad_kind`.
    pub(super) grad: Tensor,
    /// fp32, or the parameters' bf16 with `--grad-reduce-in-bf16` (reduce-scattered and
    /// accumulated in bf16, widened a bucket at a time by the update).
    pub(super) grad_kind: Kind,
    /// The clip scale not yet applied to a bf16 `grad`: it is applied in fp32 as each
    /// bucket is widened, so clipping adds no bf16 rounding.
    pub(super) pending_scale: Option<f64>,
    /// ZeRO-2 with bf16 weights: the updated shard in the parameters' kind, which the
    /// all-gather sends. `None` where it would only be the master: fp32 weights (the
    /// master is the shard) and ZeRO-3 (each gather rounds its slice of the master).
    pub(super) param_shard: Option<Tensor>,
    /// Whether `grad` holds this step's reduced gradients.
    pub(super) reduced: bool,
    /// ZeRO-3: the parameters hold no values at rest (only this rank's slice of the
    /// masters); a bucket is one decoder layer (or the embedding, final norm and head),
    /// gathered before use and reduce-scattered into `grad` (accumulating over
    /// micro-batches) as soon as its backward is done.
    pub(super) stage3: bool,
    /// ZeRO-2's bucket size (0 under ZeRO-3), recorded in the shard file so a reader of
    /// the shards alone (the HF export) can lay them out again.
    pub(super) bucket_numel: usize,
    pub(super) step: u64,
    /// ZeRO-3's layer prefetch and overlapped reduce-scatters ([`super::prefetch`]).
    pub(super) prefetch: Prefetch,
}

/// Bytes of a rank's sharded optimizer state ([`ZeroAdamW::shard_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardBytes {
    pub master: usize,
    pub moments: usize,
    /// The reduced-gradient shard (bf16 with `--grad-reduce-in-bf16`).
    pub gradients: usize,
    /// ZeRO-2's bf16 parameter shard (0 under ZeRO-3 and with fp32 weights).
    pub parameters: usize,
}

impl ZeroAdamW {
    /// Shards `params` (the model's trainable variables; every rank passes the same
    /// names and shapes) over `comm`'s ranks, after making every rank's values rank 0's.
    /// `grad_reduce_in_bf16`: see [`ZeroAdamW::grad_kind`] (bf16 weights only).
    pub fn new(
        params: BTreeMap<String, Tensor>,
        config: AdamWConfig,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
        grad_reduce_in_bf16: bool,
    ) -> Result<Self, CollectiveError> {
        let kind = check_one_kind(&params)?;
        // 0 marks ZeRO-3 below; a bucket of at most one element lays out the same.
        let bucket_numel = bucket_numel.max(1);
        let shapes: Vec<(String, Vec<i64>)> =
            params.iter().map(|(k, t)| (k.clone(), t.size())).collect();
        let layout = FlatLayout::new(&shapes, comm.world_size(), bucket_numel);
        let params: Vec<Tensor> = params.into_values().collect();
        let grad_kind = grad_kind(kind, grad_reduce_in_bf16)?;
        Self::with_layout(
            layout,
            params,
            (kind, grad_kind),
            config,
            comm,
            bucket_numel,
        )
    }

    /// ZeRO-3: as [`ZeroAdamW::new`], with one bucket per decoder layer of the
    /// `layers` the names `model.layers.<i>.*` number, and one ([`OUTER_BUCKET`]) for
    /// every other parameter. The parameters keep their (rank 0's) values until
    /// [`ZeroAdamW::release_all`], so a caller can copy them first (the KL reference).
    pub fn new_stage3(
        params: BTreeMap<String, Tensor>,
        config: AdamWConfig,
        comm: Box<dyn Collective>,
        layers: usize,
        grad_reduce_in_bf16: bool,
    ) -> Result<Self, CollectiveError> {
        let kind = check_one_kind(&params)?;
        let grad_kind = grad_kind(kind, grad_reduce_in_bf16)?;
        let groups = stage3_groups(params.into_iter().collect(), layers)?;
        let shapes: Vec<Vec<(String, Vec<i64>)>> = groups
            .iter()
            .map(|g| g.iter().map(|(k, t)| (k.clone(), t.size())).collect())
            .collect();
        let layout = FlatLayout::grouped(&shapes, comm.world_size());
        let params = groups.into_iter().flatten().map(|(_, t)| t).collect();
        Self::with_layout(layout, params, (kind, grad_kind), config, comm, 0)
    }

    /// `bucket_numel`: ZeRO-2's bucket size; 0 for ZeRO-3 (a bucket per layer).
    /// `kinds`: the parameters' kind and the reduced gradients'.
    pub(super) fn with_layout(
        layout: FlatLayout,
        params: Vec<Tensor>,
        (kind, grad_kind): (Kind, Kind),
        config: AdamWConfig,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, CollectiveError> {
        let stage3 = bucket_numel == 0;
        let device = comm.device();
        let (rank, world) = (comm.rank(), comm.world_size());
        let shard_numel = layout.shard_numel as i64;
        let zeros = |kind| Tensor::zeros([shard_numel], (kind, device));
        // ZeRO-3 allocates the moments and the gradient shard only once the whole
        // weights it is built from are released (`release_all`): beside them they would
        // add 12 bytes a parameter over the ranks to the build's peak (8B over two
        // ranks: 76 GiB instead of 30.5).
        let state = |kind| {
            if stage3 {
                Tensor::empty([0], (kind, device))
            } else {
                zeros(kind)
            }
        };
        let master = zeros(Kind::Float);
        let prefetch = Prefetch::new(stage3, comm.as_ref())?;
        let mut me = Self {
            config,
            layout,
            kind,
            exp_avg: state(Kind::Float),
            exp_avg_sq: state(Kind::Float),
            grad: state(grad_kind),
            grad_kind,
            pending_scale: None,
            param_shard: (kind != Kind::Float && !stage3).then(|| zeros(kind)),
            master,
            params,
            comm,
            reduced: false,
            stage3,
            bucket_numel,
            step: 0,
            prefetch,
        };
        // Rank 0's weights everywhere, then each rank's master shard from them.
        tch::no_grad(|| -> Result<(), CollectiveError> {
            for b in 0..me.layout.buckets.len() {
                let mut flat =
                    flat_bucket(&me.layout, b, (kind, device), |i| me.params[i].detach());
                me.comm.broadcast(&mut flat, 0)?;
                me.scatter_into_params(b, &flat);
                let bucket = &me.layout.buckets[b];
                let mine = flat.narrow(0, (rank * bucket.shard) as i64, bucket.shard as i64);
                me.master
                    .narrow(0, bucket.shard_offset as i64, bucket.shard as i64)
                    .copy_(&mine.to_kind(Kind::Float));
            }
            Ok(())
        })?;
        if let Some(shard) = &mut me.param_shard {
            tch::no_grad(|| shard.copy_(&me.master));
        }
        tracing::info!(
            rank,
            world,
            buckets = me.layout.buckets.len(),
            shard_elements = me.layout.shard_numel,
            stage = if stage3 { 3 } else { 2 },
            grad_kind = ?grad_kind,
            prefetch = me.prefetch.enabled,
            side_stream = me.prefetch.side.is_some(),
            "ZeRO optimizer"
        );
        Ok(me)
    }

    pub fn collective(&self) -> &dyn Collective {
        self.comm.as_ref()
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Copies bucket `b`'s flat values into the model's parameters.
    pub(super) fn scatter_into_params(&mut self, b: usize, flat: &Tensor) {
        let bucket = &self.layout.buckets[b];
        for i in bucket.params.clone() {
            let slot = &self.layout.params[i];
            let src = flat
                .narrow(0, slot.offset as i64, slot.numel as i64)
                .view(slot.shape.as_slice());
            self.params[i].copy_(&src);
        }
    }

    /// Sums every rank's gradients and leaves this rank's shard of the sum in `grad`
    /// (in [`ZeroAdamW::grad_kind`]), bucket by bucket, dropping the parameters' own
    /// gradients. Parameters without a gradient count as zero. ZeRO-3 reduced each
    /// bucket as its backward ended ([`ZeroAdamW::reduce_bucket`]): nothing is left to do.
    pub fn reduce_gradients(&mut self) -> Result<(), CollectiveError> {
        self.allocate_state();
        if self.stage3 {
            debug_assert!(self.prefetch.reducing.is_none(), "a pass left a reduction");
            self.reduced = true;
            return Ok(());
        }
        profile::scoped(Phase::GradReduce, || {
            tch::no_grad(|| {
                for b in 0..self.layout.buckets.len() {
                    let flat = self.take_bucket_grads(b)?;
                    let bucket = &self.layout.buckets[b];
                    let mut out =
                        self.grad
                            .narrow(0, bucket.shard_offset as i64, bucket.shard as i64);
                    self.comm.reduce_scatter(&flat, &mut out, ReduceOp::Sum)?;
                }
                Ok::<(), CollectiveError>(())
            })
        })?;
        self.reduced = true;
        Ok(())
    }

    /// The global gradient's L2 norm (reduces the gradients first if not done yet).
    pub fn grad_norm(&mut self) -> Result<f64, CollectiveError> {
        self.allocate_state();
        if !self.reduced {
            self.reduce_gradients()?;
        }
        let local = tch::no_grad(|| sum_of_squares(&self.grad));
        let mut total = [local];
        self.comm.all_reduce_f64(&mut total, ReduceOp::Sum)?;
        Ok(total[0].sqrt())
    }

    /// As [`AdamW::clip_grad_norm`], on the reduced global gradient. A bf16 gradient
    /// shard keeps its values; the scale is applied in fp32 by [`ZeroAdamW::step`].
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, CollectiveError> {
        let norm = self.grad_norm()?;
        if norm.is_finite() && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            if self.grad_kind == Kind::Float {
                tch::no_grad(|| {
                    let _ = self.grad.g_mul_scalar_(scale);
                });
            } else {
                self.pending_scale = Some(scale);
            }
        }
        Ok(norm)
    }

    /// One AdamW update of this rank's shard, then the all-gather of every rank's
    /// updated shard into the parameters.
    pub fn step(&mut self) -> Result<(), CollectiveError> {
        self.allocate_state();
        if !self.reduced {
            self.reduce_gradients()?;
        }
        self.step += 1;
        let c = self.config;
        let step = AdamWStep {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
        };
        if self.grad_kind == Kind::Float {
            // The whole shard at once (its fp32 gradient needs no widening). Without a
            // bf16 shard the kernel's refresh of the parameter copies the master onto
            // itself, which ATen skips.
            let param = self.param_shard.as_ref().unwrap_or(&self.master);
            let (master, m, v) = (&self.master, &self.exp_avg, &self.exp_avg_sq);
            update_slice(param, &self.grad, master, m, v, step, c);
        } else if !self.fused_bf16_grad_update(step) {
            // A bucket at a time: each widening to fp32 (clip scale applied there) is one
            // bucket's, not the shard's.
            for bucket in &self.layout.buckets {
                let (at, len) = (bucket.shard_offset as i64, bucket.shard as i64);
                let slice = |t: &Tensor| t.narrow(0, at, len);
                let grad = tch::no_grad(|| {
                    let mut g = slice(&self.grad).to_kind(Kind::Float);
                    if let Some(scale) = self.pending_scale {
                        let _ = g.g_mul_scalar_(scale);
                    }
                    g
                });
                let master = slice(&self.master);
                let param = self.param_shard.as_ref().map(slice);
                let (m, v) = (slice(&self.exp_avg), slice(&self.exp_avg_sq));
                update_slice(
                    param.as_ref().unwrap_or(&master),
                    &grad,
                    &master,
                    &m,
                    &v,
                    step,
                    c,
                );
            }
        }
        self.pending_scale = None;
        self.reduced = false;
        if self.stage3 {
            // The parameters are gathered when next read.
            return Ok(());
        }
        self.gather_params()
    }

    /// A bf16 gradient shard's update in one kernel over the whole shard
    /// ([`fused_adamw_bf16_grad`]: the bucket loop's bits, with no fp32 copy of the
    /// gradient and the clip scale applied as it is read; 8B's ZeRO-3 shard moves 26 bytes
    /// a parameter instead of 42). On a GPU with `MANTA_FUSED_ADAMW` and
    /// `MANTA_FUSED_ADAMW_BF16_GRAD` on; false where the bucket loop is to run instead (the
    /// CPU, a knob off, or the kernel unavailable, which is logged once).
    pub(super) fn fused_bf16_grad_update(&self, step: AdamWStep) -> bool {
        if !self.master.device().is_cuda()
            || !manta_knobs::fused_adamw()
            || !manta_knobs::fused_adamw_bf16_grad()
        {
            return false;
        }
        let shard = Bf16GradShard {
            grad: &self.grad,
            master: &self.master,
            exp_avg: &self.exp_avg,
            exp_avg_sq: &self.exp_avg_sq,
            param: self.param_shard.as_ref(),
        };
        match fused_adamw_bf16_grad(&shard, self.pending_scale, step) {
            Ok(()) => true,
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(error = %e, "bf16-gradient AdamW kernel unavailable: widening a bucket at a time")
                });
                false
            }
        }
    }

    /// Bucket `b`'s slice of this rank's parameters in their kind: ZeRO-2's bf16 shard,
    /// or the master rounded as the shard would have been (the same ATen conversion, so
    /// the same bits; fp32: the master itself, no copy).
    pub(super) fn param_slice(&self, b: usize) -> Tensor {
        let bucket = &self.layout.buckets[b];
        let (at, len) = (bucket.shard_offset as i64, bucket.shard as i64);
        match &self.param_shard {
            Some(shard) => shard.narrow(0, at, len),
            None => tch::no_grad(|| self.master.narrow(0, at, len).to_kind(self.kind)),
        }
    }

    /// Every rank's shard of the parameters (in their kind) into every rank's model.
    pub(super) fn gather_params(&mut self) -> Result<(), CollectiveError> {
        let world = self.layout.world;
        profile::scoped(Phase::ParamGather, || {
            tch::no_grad(|| {
                for b in 0..self.layout.buckets.len() {
                    let bucket = &self.layout.buckets[b];
                    let src = self.param_slice(b);
                    let mut flat = Tensor::empty(
                        [bucket.padded(world) as i64],
                        (self.kind, self.comm.device()),
                    );
                    self.comm.all_gather(&src, &mut flat)?;
                    self.scatter_into_params(b, &flat);
                }
                Ok(())
            })
        })
    }

    /// Every parameter's fp32 master, gathered from the ranks (a collective: every
    /// rank calls it). Empty in an fp32 run, as [`AdamW::master_weights`].
    pub fn master_weights(&self) -> Result<NamedTensors, CollectiveError> {
        if self.kind == Kind::Float {
            return Ok(Vec::new());
        }
        let world = self.layout.world;
        let mut out = Vec::with_capacity(self.layout.params.len());
        for bucket in &self.layout.buckets {
            let src = self
                .master
                .narrow(0, bucket.shard_offset as i64, bucket.shard as i64);
            let mut flat = Tensor::empty(
                [bucket.padded(world) as i64],
                (Kind::Float, self.comm.device()),
            );
            self.comm.all_gather(&src, &mut flat)?;
            for i in bucket.params.clone() {
                let slot = &self.layout.params[i];
                out.push((
                    slot.name.clone(),
                    flat.narrow(0, slot.offset as i64, slot.numel as i64)
                        .view(slot.shape.as_slice())
                        .copy(),
                ));
            }
        }
        Ok(out)
    }

    /// Clears the parameters' gradients before the next step (and ZeRO-3's reduced
    /// gradient, which accumulates over the micro-batches).
    pub fn zero_grad(&mut self) {
        self.allocate_state();
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        if self.stage3 {
            tch::no_grad(|| {
                let _ = self.grad.zero_();
            });
        }
        self.pending_scale = None;
        self.reduced = false;
    }

    /// fp32, or bf16 with `--grad-reduce-in-bf16`: the kind the gradients are
    /// reduce-scattered in and this rank's reduced-gradient shard is kept (and, under
    /// ZeRO-3, accumulated over micro-batches) in, as Megatron's bf16 `main_grad`.
    pub fn grad_kind(&self) -> Kind {
        self.grad_kind
    }

    /// Bytes of this rank's sharded state now, by what holds them.
    pub fn shard_bytes(&self) -> ShardBytes {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        ShardBytes {
            master: bytes(&self.master),
            moments: bytes(&self.exp_avg) + bytes(&self.exp_avg_sq),
            gradients: bytes(&self.grad),
            parameters: self.param_shard.as_ref().map_or(0, bytes),
        }
    }

    /// Whether the parameters themselves are sharded (ZeRO-3).
    pub fn is_stage3(&self) -> bool {
        self.stage3
    }

    /// The moments and the gradient shard, zeros, if not allocated yet (ZeRO-3 defers
    /// them past the build; idempotent).
    pub(super) fn allocate_state(&mut self) {
        let n = self.layout.shard_numel as i64;
        let device = self.comm.device();
        for (t, kind) in [
            (&mut self.exp_avg, Kind::Float),
            (&mut self.exp_avg_sq, Kind::Float),
            (&mut self.grad, self.grad_kind),
        ] {
            if t.numel() as i64 != n {
                *t = Tensor::zeros([n], (kind, device));
            }
        }
    }

    /// Bucket `b`'s gradients as one flat tensor in [`ZeroAdamW::grad_kind`] (a
    /// parameter without a gradient counts as zero), after which the parameters' full
    /// gradients are dropped: they are not kept past their reduction (the staged copy is
    /// ordered before any reuse of their memory).
    pub(super) fn take_bucket_grads(&self, b: usize) -> Result<Tensor, CollectiveError> {
        let to = (self.grad_kind, self.comm.device());
        let flat = flat_bucket(&self.layout, b, to, |i| {
            let g = self.params[i].grad();
            if g.defined() {
                g
            } else {
                self.params[i].zeros_like()
            }
        });
        for p in &self.params[self.layout.buckets[b].params.clone()] {
            clear_grad(p).map_err(|e| CollectiveError::BadTensor {
                op: "clear_grad",
                message: e.to_string(),
            })?;
        }
        Ok(flat)
    }

    /// Each bucket's parameters (name, shape, kind), in the order
    /// [`ZeroAdamW::visit_buckets`] hands them out: what a reader of the visit can know
    /// before the first gather (a weight broadcast names every round up front).
    pub fn bucket_shapes(&self) -> Vec<Vec<(String, Vec<i64>, Kind)>> {
        self.layout
            .buckets
            .iter()
            .map(|bucket| {
                bucket
                    .params
                    .clone()
                    .map(|i| {
                        let slot = &self.layout.params[i];
                        (slot.name.clone(), slot.shape.clone(), self.kind)
                    })
                    .collect()
            })
            .collect()
    }

    /// Bytes this rank's parameters hold now (ZeRO-3 at rest: none).
    pub fn parameter_bytes(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.numel() * p.kind().elt_size_in_bytes())
            .sum()
    }
}
