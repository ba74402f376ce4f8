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
use std::path::Path;

use manta_cuda::adamw::{
    clear_grad, fused_adamw_bf16_grad, fused_adamw_masters, AdamWStep, Bf16GradShard, MasterSlot,
};
use manta_cuda::{CudaError, CudaEvent, CudaStream};
use tch::{Device, Kind, Tensor};

use super::prefetch::{PrefetchPlanner, PrefetchStats, Zero3Pass};
use super::{Collective, CollectiveError, FlatLayout, ReduceOp};
use crate::optimizer::{master_update, AdamW, AdamWConfig};
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
    comm: Box<dyn Collective>,
    layout: FlatLayout,
    /// The model's parameters in layout order (handles to the model's tensors).
    params: Vec<Tensor>,
    /// The parameters' kind (one for all: fp32, or bf16 with `--bf16`).
    kind: Kind,
    /// This rank's fp32 masters and moments, `[shard_numel]`.
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// This rank's reduced gradients, `[shard_numel]`, in `grad_kind`.
    grad: Tensor,
    /// fp32, or the parameters' bf16 with `--grad-reduce-in-bf16` (reduce-scattered and
    /// accumulated in bf16, widened a bucket at a time by the update).
    grad_kind: Kind,
    /// The clip scale not yet applied to a bf16 `grad`: it is applied in fp32 as each
    /// bucket is widened, so clipping adds no bf16 rounding.
    pending_scale: Option<f64>,
    /// ZeRO-2 with bf16 weights: the updated shard in the parameters' kind, which the
    /// all-gather sends. `None` where it would only be the master: fp32 weights (the
    /// master is the shard) and ZeRO-3 (each gather rounds its slice of the master).
    param_shard: Option<Tensor>,
    /// Whether `grad` holds this step's reduced gradients.
    reduced: bool,
    /// ZeRO-3: the parameters hold no values at rest (only this rank's slice of the
    /// masters); a bucket is one decoder layer (or the embedding, final norm and head),
    /// gathered before use and reduce-scattered into `grad` (accumulating over
    /// micro-batches) as soon as its backward is done.
    stage3: bool,
    /// ZeRO-2's bucket size (0 under ZeRO-3), recorded in the shard file so a reader of
    /// the shards alone (the HF export) can lay them out again.
    bucket_numel: usize,
    step: u64,
    /// ZeRO-3's layer prefetch and overlapped reduce-scatters ([`super::prefetch`]).
    prefetch: Prefetch,
}

/// ZeRO-3's collectives in flight within a pass of the decoder ([`ZeroAdamW::layer_pass`]).
///
/// On a GPU with NCCL they are queued on `side`, ordered with the compute stream
/// (libtorch's current one) by events alone: the side stream waits for an event recorded
/// on the compute stream after the collective's input is made and its output allocated
/// (so after every earlier user of that memory too), and the compute stream waits for an
/// event recorded on the side stream after the collective before it reads the output.
/// Every buffer the side stream touches is allocated on the compute stream and freed only
/// after the compute stream has waited ([`ZeroAdamW::land`]), so libtorch's caching
/// allocator, which orders reuse within the allocating stream only, cannot hand it out
/// while the collective still runs. All of a pass's layer collectives go to the one side
/// stream, so the communicator's collectives run on the GPU in the order every rank
/// queued them; the pass ends with the compute stream waiting for the last of them, so
/// whatever follows on the compute stream (the head's reduce-scatter, the optimizer) is
/// ordered after all of them. On the CPU backends a queued collective has already run.
struct Prefetch {
    /// `MANTA_ZERO3_PREFETCH`, read when the optimizer is built (ZeRO-3 only).
    enabled: bool,
    /// The side stream (NCCL ranks); `None` where collectives run at once (CPU backends).
    side: Option<CudaStream>,
    /// The current pass's guesses; `None` between passes.
    planner: Option<PrefetchPlanner>,
    /// The all-gather of the layer guessed next.
    ahead: Option<InFlight>,
    /// The last layer's reduce-scatter, whose slice is added into the gradient shard when
    /// the next layer is reduced or the pass ends.
    reducing: Option<InFlight>,
    stats: PrefetchStats,
}

/// A collective queued on the side stream (on the CPU: already run) with the buffers it
/// reads and writes, kept until the compute stream has waited for it.
struct InFlight {
    bucket: usize,
    output: Tensor,
    input: Tensor,
    /// Recorded on the side stream after the collective; `None`: it ran at once.
    done: Option<CudaEvent>,
}

impl Prefetch {
    /// ZeRO-3 prefetches unless `MANTA_ZERO3_PREFETCH` is off; on a GPU whose collective
    /// takes streams (NCCL) through a side stream of the highest priority.
    fn new(stage3: bool, comm: &dyn Collective) -> Result<Self, CollectiveError> {
        let enabled = stage3 && manta_knobs::zero3_prefetch();
        let side = match comm.device() {
            Device::Cuda(i) if enabled && comm.takes_streams() => {
                Some(CudaStream::new(i, true).map_err(stream_error("create side stream"))?)
            }
            _ => None,
        };
        Ok(Self {
            enabled,
            side,
            planner: None,
            ahead: None,
            reducing: None,
            stats: PrefetchStats::default(),
        })
    }
}

fn stream_error(op: &'static str) -> impl Fn(CudaError) -> CollectiveError {
    move |e| CollectiveError::Stream {
        op,
        message: e.to_string(),
    }
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

/// The name of rank `rank`'s optimizer shard in a checkpoint of `world` ranks.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer.rank{rank}-of-{world}.safetensors")
}

/// ZeRO-3's bucket of the embedding, final norm and LM head; decoder layer `i` is
/// bucket `i + 1`.
pub const OUTER_BUCKET: usize = 0;

/// ZeRO-3's shard groups of `named` (name order within each group): bucket
/// [`OUTER_BUCKET`] for the parameters outside the decoder layers, bucket `i + 1` for
/// layer `i`'s `model.layers.<i>.*`. Shared by the optimizer and by whatever reads its
/// shards back (the HF export), so both lay a layer's slices out the same way.
pub fn stage3_groups<T>(
    named: Vec<(String, T)>,
    layers: usize,
) -> Result<Vec<Vec<(String, T)>>, CollectiveError> {
    let mut groups: Vec<Vec<(String, T)>> = (0..=layers).map(|_| Vec::new()).collect();
    for (name, t) in named {
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .map(|i| {
                i.parse::<usize>()
                    .ok()
                    .filter(|&i| i < layers)
                    .ok_or_else(|| CollectiveError::BadTensor {
                        op: "zero-3",
                        message: format!("parameter {name}: no decoder layer {i} of {layers}"),
                    })
            })
            .transpose()?;
        groups[layer.map_or(OUTER_BUCKET, |i| i + 1)].push((name, t));
    }
    if let Some(i) = groups.iter().position(Vec::is_empty) {
        return Err(CollectiveError::BadTensor {
            op: "zero-3",
            message: format!(
                "bucket {i} (0: embedding and head, i: layer i - 1) has no parameters"
            ),
        });
    }
    for g in &mut groups {
        g.sort_by(|a, b| a.0.cmp(&b.0));
    }
    Ok(groups)
}

/// The kind every parameter shares (one for all: fp32, or bf16 with `--bf16`).
fn check_one_kind(params: &BTreeMap<String, Tensor>) -> Result<Kind, CollectiveError> {
    let kind = params.values().next().map_or(Kind::Float, Tensor::kind);
    if let Some((name, t)) = params.iter().find(|(_, t)| t.kind() != kind) {
        return Err(CollectiveError::BadTensor {
            op: "zero",
            message: format!("parameter {name} is {:?}, others {kind:?}", t.kind()),
        });
    }
    Ok(kind)
}

/// Bucket `b` of the tensors `pick` gives, flat in `kind`, padded with zeros. Each is
/// converted as it is copied in: no converted copy of a parameter (8B's embedding in
/// fp32 is 2.5 GB) lives beside the flat buffer.
fn flat_bucket(
    layout: &FlatLayout,
    b: usize,
    (kind, device): (Kind, tch::Device),
    pick: impl Fn(usize) -> Tensor,
) -> Tensor {
    let bucket = &layout.buckets[b];
    let flat = Tensor::empty([bucket.padded(layout.world) as i64], (kind, device));
    for i in bucket.params.clone() {
        let slot = &layout.params[i];
        flat.narrow(0, slot.offset as i64, slot.numel as i64)
            .copy_(&pick(i).reshape([-1]));
    }
    let pad = bucket.padded(layout.world) - bucket.numel;
    if pad > 0 {
        let _ = flat.narrow(0, bucket.numel as i64, pad as i64).zero_();
    }
    flat
}

/// Σ x² of a flat tensor in fp64. On a GPU one kernel reads it once
/// ([`manta_cuda::adamw::sum_of_squares`]; 8B's bf16 shard over two ranks: 8 GB read
/// instead of ~140 GB of fp64 copies moved), adding the exact squares in a fixed order, so
/// its last fp64 bits may differ from the tensor ops' sum. Elsewhere, or with
/// `MANTA_GRAD_NORM_KERNEL` off, a slice at a time: an fp64 copy of a whole shard (an 8B
/// model's is 4 G elements over two ranks) would take 33 GB.
fn sum_of_squares(t: &Tensor) -> f64 {
    if t.device().is_cuda() && manta_knobs::grad_norm_kernel() {
        match manta_cuda::adamw::sum_of_squares(t) {
            Ok(sum) => return sum.double_value(&[0]),
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(error = %e, "sum-of-squares kernel unavailable: the gradient norm goes through fp64 slices")
                });
            }
        }
    }
    sum_of_squares_by(t, 1 << 26)
}

fn sum_of_squares_by(t: &Tensor, slice: i64) -> f64 {
    let n = t.numel() as i64;
    let mut acc = Tensor::zeros([], (Kind::Double, t.device()));
    let mut at = 0;
    while at < n {
        let len = slice.min(n - at);
        acc += t
            .narrow(0, at, len)
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double);
        at += len;
    }
    acc.double_value(&[])
}

/// The reduced gradients' kind for parameters of `kind`: bf16 with
/// `--grad-reduce-in-bf16`, which only bf16 weights take (fp32 weights reduce in fp32).
fn grad_kind(kind: Kind, grad_reduce_in_bf16: bool) -> Result<Kind, CollectiveError> {
    match (grad_reduce_in_bf16, kind) {
        (false, _) => Ok(Kind::Float),
        (true, Kind::BFloat16) => Ok(Kind::BFloat16),
        (true, other) => Err(CollectiveError::BadTensor {
            op: "zero",
            message: format!(
                "--grad-reduce-in-bf16 reduces bf16 gradients, and the parameters are {other:?}: \
                 train in bf16 (--bf16) or drop the flag"
            ),
        }),
    }
}

/// AdamW on one slice of a rank's state: `grad` fp32, `param` the slice's copy in the
/// parameters' kind (the master itself when there is none), refreshed from the master.
fn update_slice(
    param: &Tensor,
    grad: &Tensor,
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: AdamWStep,
    c: AdamWConfig,
) {
    let slot = MasterSlot {
        param,
        grad,
        master,
        exp_avg,
        exp_avg_sq,
    };
    if manta_knobs::fused_adamw() && fused_adamw_masters(&[slot], step).is_ok() {
        return;
    }
    let bias1 = 1.0 - c.beta1.powi(step.step as i32);
    let bias2 = 1.0 - c.beta2.powi(step.step as i32);
    tch::no_grad(|| {
        let (mut master, mut m, mut v) = (
            master.shallow_clone(),
            exp_avg.shallow_clone(),
            exp_avg_sq.shallow_clone(),
        );
        master_update(&mut master, &mut m, &mut v, grad, c, bias1, bias2);
        if param.data_ptr() != master.data_ptr() {
            param.shallow_clone().copy_(&master);
        }
    });
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
    fn with_layout(
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
    fn scatter_into_params(&mut self, b: usize, flat: &Tensor) {
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
    fn fused_bf16_grad_update(&self, step: AdamWStep) -> bool {
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
    fn param_slice(&self, b: usize) -> Tensor {
        let bucket = &self.layout.buckets[b];
        let (at, len) = (bucket.shard_offset as i64, bucket.shard as i64);
        match &self.param_shard {
            Some(shard) => shard.narrow(0, at, len),
            None => tch::no_grad(|| self.master.narrow(0, at, len).to_kind(self.kind)),
        }
    }

    /// Every rank's shard of the parameters (in their kind) into every rank's model.
    fn gather_params(&mut self) -> Result<(), CollectiveError> {
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

    /// Bucket `b`'s full values in the parameters' kind: every rank's slice
    /// all-gathered into one new flat buffer (a collective), and each parameter's view
    /// of it by name.
    fn gathered_bucket(&self, b: usize) -> Result<(Tensor, NamedTensors), CollectiveError> {
        let src = self.param_slice(b);
        let bucket = &self.layout.buckets[b];
        let mut flat = Tensor::empty(
            [bucket.padded(self.layout.world) as i64],
            (self.kind, self.comm.device()),
        );
        tch::no_grad(|| self.comm.all_gather(&src, &mut flat))?;
        let views = self.views(b, &flat);
        Ok((flat, views))
    }

    /// Each of bucket `b`'s parameters as a view of its gathered `flat` values, by name.
    fn views(&self, b: usize, flat: &Tensor) -> NamedTensors {
        self.layout.buckets[b]
            .params
            .clone()
            .map(|i| {
                let slot = &self.layout.params[i];
                let view = flat
                    .narrow(0, slot.offset as i64, slot.numel as i64)
                    .view(slot.shape.as_slice());
                (slot.name.clone(), view)
            })
            .collect()
    }

    /// Bucket `b`'s parameters take their values from its gathered `flat` buffer.
    fn install(&mut self, b: usize, flat: &Tensor) {
        let views = self.views(b, flat);
        let range = self.layout.buckets[b].params.clone();
        tch::no_grad(|| {
            for (p, (_, view)) in self.params[range].iter_mut().zip(&views) {
                p.set_data(view);
            }
        });
    }

    /// ZeRO-3: bucket `b`'s parameters take their full values (views of one gathered
    /// buffer) until [`ZeroAdamW::release_bucket`] or [`ZeroAdamW::reduce_bucket`].
    pub fn gather_bucket(&mut self, b: usize) -> Result<(), CollectiveError> {
        profile::scoped(Phase::ParamGather, || {
            let (flat, _) = self.gathered_bucket(b)?;
            self.install(b, &flat);
            Ok(())
        })
    }

    /// ZeRO-3: the [`LayerHooks`](manta_model::LayerHooks) of one pass of the decoder
    /// (decoder layer `i` is bucket `i + 1`; the embedding, norm and head are the
    /// caller's to gather), which prefetches the next layer unless
    /// `MANTA_ZERO3_PREFETCH` is off ([`super::prefetch`]). End it with
    /// [`Zero3Pass::finish`].
    pub fn layer_pass(&mut self) -> Zero3Pass<'_> {
        Zero3Pass::new(self)
    }

    /// Whether passes prefetch (`MANTA_ZERO3_PREFETCH` when the optimizer was built).
    pub fn prefetches(&self) -> bool {
        self.prefetch.enabled
    }

    /// How this rank's prefetches went so far.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.prefetch.stats
    }

    pub(crate) fn begin_layer_pass(&mut self) {
        if self.prefetch.enabled {
            let layers = self.layout.buckets.len().saturating_sub(1);
            self.prefetch.planner = Some(PrefetchPlanner::new(layers));
        }
    }

    /// Ends a pass: the gather guessed ahead and never asked for is dropped and the last
    /// reduce-scatter's slice added, so the compute stream has waited for every
    /// collective of the pass. Both are tried even if the first fails.
    pub(crate) fn end_layer_pass(&mut self) -> Result<(), CollectiveError> {
        self.prefetch.planner = None;
        let dropped = profile::scoped(Phase::ParamGather, || self.drop_ahead());
        let reduced = profile::scoped(Phase::GradReduce, || self.complete_reduce());
        dropped.and(reduced)
    }

    /// Decoder layer `layer` is asked for: its parameters gathered (or its prefetched
    /// gather waited for), and the layer guessed next queued.
    ///
    /// The profile's `param_gather` counts what the compute stream spends here: rounding
    /// the slices, and waiting for the gather — for a prefetched layer only the part of
    /// its all-gather that had not finished while the layers before it ran.
    pub(crate) fn gather_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        let b = layer + 1;
        let Some(planner) = self.prefetch.planner.as_mut() else {
            return self.gather_bucket(b);
        };
        let plan = planner.gather(layer);
        profile::scoped(Phase::ParamGather, || {
            let flat = match self.prefetch.ahead.take() {
                Some(g) if plan.prefetched && g.bucket == b => {
                    self.prefetch.stats.used += 1;
                    self.land(g)?
                }
                other => {
                    // Not the layer guessed (or nothing was): drop the guess.
                    self.prefetch.ahead = other;
                    self.drop_ahead()?;
                    let g = self.start_gather(b)?;
                    self.land(g)?
                }
            };
            self.install(b, &flat);
            if let Some(next) = plan.ahead {
                self.prefetch.ahead = Some(self.start_gather(next + 1)?);
                self.prefetch.stats.issued += 1;
            }
            Ok(())
        })
    }

    /// Decoder layer `layer`'s forward is done: its parameters released.
    pub(crate) fn release_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        if let Some(planner) = self.prefetch.planner.as_mut() {
            if planner.release(layer).is_some() {
                profile::scoped(Phase::ParamGather, || self.drop_ahead())?;
            }
        }
        self.release_bucket(layer + 1);
        Ok(())
    }

    /// Decoder layer `layer`'s backward is done: its gradients reduce-scattered. In a
    /// prefetching pass the reduce-scatter is queued on the side stream (overlapping the
    /// next layer's backward) and its slice added into the gradient shard when the next
    /// layer is reduced or the pass ends; the same sum and the same add as
    /// [`ZeroAdamW::reduce_bucket`], later. `grad_reduce` counts the staging and the
    /// compute stream's wait for the previous layer's reduce-scatter.
    pub(crate) fn reduce_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        let b = layer + 1;
        let Some(planner) = self.prefetch.planner.as_mut() else {
            return self.reduce_bucket(b);
        };
        if planner.reduce(layer).is_some() {
            profile::scoped(Phase::ParamGather, || self.drop_ahead())?;
        }
        self.allocate_state();
        profile::scoped(Phase::GradReduce, || {
            self.complete_reduce()?;
            let input = tch::no_grad(|| self.take_bucket_grads(b))?;
            let shard = self.layout.buckets[b].shard as i64;
            let mut output = Tensor::empty([shard], (self.grad_kind, self.comm.device()));
            let done = match &self.prefetch.side {
                None => {
                    tch::no_grad(|| self.comm.reduce_scatter(&input, &mut output, ReduceOp::Sum))?;
                    None
                }
                Some(side) => {
                    self.side_waits_for_compute(side)?;
                    tch::no_grad(|| {
                        self.comm
                            .reduce_scatter_on(&input, &mut output, ReduceOp::Sum, side)
                    })?;
                    Some(side.record().map_err(stream_error("record"))?)
                }
            };
            self.prefetch.stats.on_side_stream += u64::from(done.is_some());
            self.prefetch.reducing = Some(InFlight {
                bucket: b,
                output,
                input,
                done,
            });
            Ok(())
        })?;
        self.release_bucket(b);
        Ok(())
    }

    /// Bucket `b`'s all-gather into a new buffer, queued on the side stream after the
    /// compute stream's work so far (the rounding of the slice, the buffer's earlier
    /// users), or run at once without one.
    fn start_gather(&mut self, b: usize) -> Result<InFlight, CollectiveError> {
        let input = self.param_slice(b);
        let padded = self.layout.buckets[b].padded(self.layout.world) as i64;
        let mut output = Tensor::empty([padded], (self.kind, self.comm.device()));
        let done = match &self.prefetch.side {
            None => {
                tch::no_grad(|| self.comm.all_gather(&input, &mut output))?;
                None
            }
            Some(side) => {
                self.side_waits_for_compute(side)?;
                tch::no_grad(|| self.comm.all_gather_on(&input, &mut output, side))?;
                Some(side.record().map_err(stream_error("record"))?)
            }
        };
        self.prefetch.stats.on_side_stream += u64::from(done.is_some());
        Ok(InFlight {
            bucket: b,
            output,
            input,
            done,
        })
    }

    /// The compute stream (libtorch's current one on this rank's GPU).
    fn compute_stream(&self) -> Result<CudaStream, CollectiveError> {
        match self.comm.device() {
            Device::Cuda(i) => CudaStream::current(i).map_err(stream_error("current stream")),
            other => Err(CollectiveError::Stream {
                op: "current stream",
                message: format!("no CUDA stream on {other:?}"),
            }),
        }
    }

    /// Makes `side` wait for the work queued on the compute stream so far.
    fn side_waits_for_compute(&self, side: &CudaStream) -> Result<(), CollectiveError> {
        let ready = self
            .compute_stream()?
            .record()
            .map_err(stream_error("record"))?;
        side.wait(&ready).map_err(stream_error("wait"))
    }

    /// `f`'s output, once the compute stream has waited for its collective: from then on
    /// the compute stream may read it, and may reuse both buffers once freed. If the wait
    /// cannot be queued the host waits instead; if that fails too the buffers are leaked
    /// rather than handed back while the collective may still write them.
    fn land(&self, f: InFlight) -> Result<Tensor, CollectiveError> {
        let InFlight {
            output,
            input,
            done,
            ..
        } = f;
        let Some(done) = done else {
            return Ok(output);
        };
        let waited = self
            .compute_stream()
            .and_then(|s| s.wait(&done).map_err(stream_error("wait")));
        if let Err(e) = waited {
            if done.synchronize().is_err() {
                std::mem::forget(input);
                std::mem::forget(output);
            }
            return Err(e);
        }
        drop(input);
        Ok(output)
    }

    /// Drops the gather guessed ahead (a wrong guess, or the pass ended first).
    fn drop_ahead(&mut self) -> Result<(), CollectiveError> {
        match self.prefetch.ahead.take() {
            Some(g) => {
                self.prefetch.stats.wasted += 1;
                self.land(g).map(drop)
            }
            None => Ok(()),
        }
    }

    /// Adds the last layer's reduce-scattered slice into the gradient shard.
    fn complete_reduce(&mut self) -> Result<(), CollectiveError> {
        let Some(r) = self.prefetch.reducing.take() else {
            return Ok(());
        };
        let b = r.bucket;
        let part = self.land(r)?;
        let bucket = &self.layout.buckets[b];
        let (offset, shard) = (bucket.shard_offset as i64, bucket.shard as i64);
        tch::no_grad(|| {
            let _ = self.grad.narrow(0, offset, shard).g_add_(&part);
        });
        Ok(())
    }

    /// ZeRO-3: bucket `b`'s parameters hold no values (their storage is freed once no
    /// autograd graph reads it).
    pub fn release_bucket(&mut self, b: usize) {
        let empty = Tensor::empty([0], (self.kind, self.comm.device()));
        let range = self.layout.buckets[b].params.clone();
        tch::no_grad(|| {
            for p in &mut self.params[range] {
                p.set_data(&empty);
            }
        });
    }

    /// Every bucket released ([`ZeroAdamW::release_bucket`]): the parameters at rest,
    /// and (ZeRO-3) the moments and gradient shard allocated in the room they leave.
    pub fn release_all(&mut self) {
        for b in 0..self.layout.buckets.len() {
            self.release_bucket(b);
        }
        self.allocate_state();
    }

    /// The moments and the gradient shard, zeros, if not allocated yet (ZeRO-3 defers
    /// them past the build; idempotent).
    fn allocate_state(&mut self) {
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
    fn take_bucket_grads(&self, b: usize) -> Result<Tensor, CollectiveError> {
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

    /// ZeRO-3, after bucket `b`'s backward: its gradients summed over the ranks, this
    /// rank's slice added to `grad` (in [`ZeroAdamW::grad_kind`]), then the full
    /// gradients dropped and the parameters released. Parameters without a gradient
    /// count as zero.
    pub fn reduce_bucket(&mut self, b: usize) -> Result<(), CollectiveError> {
        self.allocate_state();
        profile::scoped(Phase::GradReduce, || {
            let flat = tch::no_grad(|| self.take_bucket_grads(b))?;
            let bucket = &self.layout.buckets[b];
            let (offset, shard) = (bucket.shard_offset as i64, bucket.shard as i64);
            let mut part = Tensor::empty([shard], (self.grad_kind, self.comm.device()));
            tch::no_grad(|| -> Result<(), CollectiveError> {
                self.comm.reduce_scatter(&flat, &mut part, ReduceOp::Sum)?;
                let _ = self.grad.narrow(0, offset, shard).g_add_(&part);
                Ok(())
            })
        })?;
        self.release_bucket(b);
        Ok(())
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

    /// ZeRO-3: every parameter's full value, one bucket (a decoder layer) gathered at a
    /// time and handed to `visit` (a collective: every rank calls it; the tensors are
    /// views of a buffer that lives as long as `visit` keeps them). `E` is the caller's
    /// error, which a failed gather converts into.
    pub fn visit_buckets<E: From<CollectiveError>>(
        &self,
        mut visit: impl FnMut(NamedTensors) -> Result<(), E>,
    ) -> Result<(), E> {
        for b in 0..self.layout.buckets.len() {
            let (_flat, views) = self.gathered_bucket(b)?;
            visit(views)?;
        }
        Ok(())
    }

    /// Bytes this rank's parameters hold now (ZeRO-3 at rest: none).
    pub fn parameter_bytes(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.numel() * p.kind().elt_size_in_bytes())
            .sum()
    }

    fn shard_file(&self, dir: &Path) -> std::path::PathBuf {
        dir.join(shard_file_name(self.comm.rank(), self.layout.world))
    }

    /// Writes this rank's shard (masters and moments, flat) to
    /// `optimizer.rank<r>-of-<world>.safetensors` in `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        // The stage goes with the shard: the two stages lay the flat slices out
        // differently, so a resume must use the stage that saved them.
        let stage = Tensor::from(self.zero_stage());
        let bucket_numel = Tensor::from(self.bucket_numel as i64);
        // Moments not allocated yet (a ZeRO-3 optimizer saved before `release_all`) are
        // the zeros they would start as.
        let unallocated = self.exp_avg.numel() != self.master.numel();
        let zeros = unallocated.then(|| self.master.zeros_like());
        let (m, v) = match &zeros {
            Some(z) => (z, z),
            None => (&self.exp_avg, &self.exp_avg_sq),
        };
        let named = [
            ("master", &self.master),
            ("exp_avg", m),
            ("exp_avg_sq", v),
            (ZERO_STAGE_KEY, &stage),
            (BUCKET_NUMEL_KEY, &bucket_numel),
        ];
        Tensor::write_safetensors(&named, self.shard_file(dir))
    }

    /// 2 or 3 (`--zero-stage`).
    fn zero_stage(&self) -> i64 {
        if self.stage3 {
            3
        } else {
            2
        }
    }

    /// Restores the shard [`ZeroAdamW::save`] wrote (same world size and model), then
    /// refreshes every rank's parameters from the masters.
    pub fn load(&mut self, dir: &Path, step: u64) -> Result<(), String> {
        let staged = self.read_shard(dir);
        // Every rank learns whether all ranks read their shard before the all-gather
        // below, so one unreadable shard stops every rank instead of leaving the others
        // waiting in it.
        let mut failed = [f64::from(u8::from(staged.is_err()))];
        self.comm
            .all_reduce_f64(&mut failed, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let staged = staged?;
        if failed[0] > 0.0 {
            return Err("another data-parallel rank could not read its optimizer shard".into());
        }
        self.allocate_state();
        tch::no_grad(|| {
            self.master.copy_(&staged[0]);
            self.exp_avg.copy_(&staged[1]);
            self.exp_avg_sq.copy_(&staged[2]);
            if let Some(shard) = &mut self.param_shard {
                shard.copy_(&self.master);
            }
        });
        self.step = step;
        if self.stage3 {
            return Ok(());
        }
        self.gather_params().map_err(|e| e.to_string())
    }

    /// This rank's saved master, first and second moments, checked against the layout.
    fn read_shard(&self, dir: &Path) -> Result<Vec<Tensor>, String> {
        let path = self.shard_file(dir);
        let tensors =
            Tensor::read_safetensors(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let map: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        // Shards written before the stage was recorded are ZeRO-2's.
        let saved = map.get(ZERO_STAGE_KEY).map_or(2, |t| t.int64_value(&[]));
        if saved != self.zero_stage() {
            return Err(format!(
                "{}: saved by --zero-stage {saved} ranks, and this run uses --zero-stage {}: \
                 resume with --zero-stage {saved} (the stages lay the shards out differently)",
                path.display(),
                self.zero_stage()
            ));
        }
        let mut staged = Vec::new();
        for key in ["master", "exp_avg", "exp_avg_sq"] {
            let t = map
                .get(key)
                .ok_or_else(|| format!("{}: missing tensor {key}", path.display()))?;
            if t.size() != [self.layout.shard_numel as i64] {
                return Err(format!(
                    "{}: tensor {key} has shape {:?}, expected [{}] (another world size or model?)",
                    path.display(),
                    t.size(),
                    self.layout.shard_numel
                ));
            }
            staged.push(t.shallow_clone());
        }
        Ok(staged)
    }
}

/// A trainer rank's optimizer: the whole AdamW (one rank: exactly the single-GPU path)
/// or this rank's ZeRO-2 shard.
pub enum RankOptimizer {
    Whole(AdamW),
    Sharded(Box<ZeroAdamW>),
}

impl RankOptimizer {
    pub fn config(&self) -> AdamWConfig {
        match self {
            Self::Whole(o) => o.config,
            Self::Sharded(o) => o.config,
        }
    }

    pub fn set_lr(&mut self, lr: f64) {
        match self {
            Self::Whole(o) => o.config.lr = lr,
            Self::Sharded(o) => o.config.lr = lr,
        }
    }

    pub fn step_count(&self) -> u64 {
        match self {
            Self::Whole(o) => o.step_count(),
            Self::Sharded(o) => o.step_count(),
        }
    }

    /// This rank's sharded optimizer (ZeRO-2 or ZeRO-3).
    pub fn sharded(&self) -> Option<&ZeroAdamW> {
        match self {
            Self::Whole(_) => None,
            Self::Sharded(o) => Some(o),
        }
    }

    /// This rank's optimizer when the parameters are sharded too (ZeRO-3).
    pub fn zero3(&self) -> Option<&ZeroAdamW> {
        match self {
            Self::Sharded(o) if o.stage3 => Some(o),
            _ => None,
        }
    }

    /// [`RankOptimizer::zero3`], mutable.
    pub fn zero3_mut(&mut self) -> Option<&mut ZeroAdamW> {
        match self {
            Self::Sharded(o) if o.stage3 => Some(o),
            _ => None,
        }
    }

    /// The data-parallel group, when sharded.
    pub fn collective(&self) -> Option<&dyn Collective> {
        match self {
            Self::Whole(_) => None,
            Self::Sharded(o) => Some(o.collective()),
        }
    }

    pub fn has_master_weights(&self) -> bool {
        match self {
            Self::Whole(o) => o.has_master_weights(),
            Self::Sharded(o) => o.kind != Kind::Float,
        }
    }

    pub fn master_weights(&self) -> Result<NamedTensors, CollectiveError> {
        match self {
            Self::Whole(o) => Ok(o.master_weights()),
            Self::Sharded(o) => o.master_weights(),
        }
    }

    /// Clips the (global) gradient norm; returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, CollectiveError> {
        match self {
            Self::Whole(o) => Ok(o.clip_grad_norm(max_norm)),
            Self::Sharded(o) => o.clip_grad_norm(max_norm),
        }
    }

    pub fn step(&mut self) -> Result<(), CollectiveError> {
        match self {
            Self::Whole(o) => {
                o.step();
                Ok(())
            }
            Self::Sharded(o) => o.step(),
        }
    }

    pub fn zero_grad(&mut self) {
        match self {
            Self::Whole(o) => o.zero_grad(),
            Self::Sharded(o) => o.zero_grad(),
        }
    }

    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        match self {
            Self::Whole(o) => o.save(dir),
            Self::Sharded(o) => o.save(dir),
        }
    }

    pub fn load(&mut self, dir: &Path, step: u64) -> Result<(), String> {
        match self {
            Self::Whole(o) => o.load(dir, step),
            Self::Sharded(o) => o.load(dir, step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ThreadCollective;
    use super::*;
    use tch::Device;

    /// Slicing changes only the order of an fp64 sum: uneven slices, one slice, the whole.
    #[test]
    fn sliced_sum_of_squares_equals_the_whole_sum() {
        tch::manual_seed(3);
        let t = Tensor::randn([1003], (Kind::Float, Device::Cpu));
        let whole = t
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double)
            .double_value(&[]);
        for slice in [7, 1000, 1003, 5000] {
            let got = sum_of_squares_by(&t, slice);
            assert!(
                (got - whole).abs() <= 1e-12 * whole,
                "slice {slice}: {got} vs {whole}"
            );
        }
        assert_eq!(
            sum_of_squares_by(&Tensor::zeros([0], (Kind::Float, Device::Cpu)), 7),
            0.0
        );
    }

    fn params() -> BTreeMap<String, Tensor> {
        [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.norm.weight",
        ]
        .into_iter()
        .map(|n| {
            (
                n.to_string(),
                Tensor::randn([4, 3], (Kind::Float, Device::Cpu)),
            )
        })
        .collect()
    }

    fn optimizer(stage3: bool) -> ZeroAdamW {
        let comm = ThreadCollective::group(1)
            .expect("a group of one")
            .pop()
            .expect("rank 0");
        let config = AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        if stage3 {
            ZeroAdamW::new_stage3(params(), config, Box::new(comm), 1, false).expect("stage 3")
        } else {
            ZeroAdamW::new(
                params(),
                config,
                Box::new(comm),
                DEFAULT_BUCKET_NUMEL,
                false,
            )
            .expect("stage 2")
        }
    }

    /// ZeRO-3 allocates its moments and fp32 gradient shard only once the whole weights
    /// it was built from are released (the build's peak holds neither beside them);
    /// ZeRO-2 has them from the start.
    #[test]
    fn zero3_allocates_its_moments_after_the_whole_weights_are_released() {
        let mut three = optimizer(true);
        let n = three.layout.shard_numel as i64;
        for t in [&three.exp_avg, &three.exp_avg_sq, &three.grad] {
            assert_eq!(t.numel(), 0);
        }
        three.release_all();
        for t in [&three.exp_avg, &three.exp_avg_sq, &three.grad] {
            assert_eq!(t.numel() as i64, n);
        }
        let two = optimizer(false);
        for t in [&two.exp_avg, &two.exp_avg_sq, &two.grad] {
            assert_eq!(t.numel() as i64, two.layout.shard_numel as i64);
        }
    }

    /// A resume with the other stage is refused naming the flag, both ways; the same
    /// stage loads.
    #[test]
    fn a_shard_resumes_only_with_the_zero_stage_that_saved_it() {
        for (saved, resumed) in [(false, true), (true, false)] {
            let dir = tempfile::tempdir().expect("tempdir");
            optimizer(saved).save(dir.path()).expect("save");
            let err = optimizer(resumed)
                .load(dir.path(), 1)
                .expect_err("the other stage's shard");
            let (s, r) = if saved { (3, 2) } else { (2, 3) };
            assert!(
                err.contains(&format!("saved by --zero-stage {s}"))
                    && err.contains(&format!("uses --zero-stage {r}")),
                "{err}"
            );
            optimizer(saved)
                .load(dir.path(), 1)
                .expect("the same stage resumes");
        }
    }
}
