//! ZeRO-2 AdamW: each rank keeps the fp32 master weights and AdamW moments of its shard
//! of the flattened parameters only ([`FlatLayout`]). A step reduce-scatters the
//! gradients bucket by bucket (summed: the loss weights already divide by global counts,
//! see [`super`]), clips by the global norm (an all-reduce of the shards' squared norms),
//! updates the shard with the same AdamW as the unsharded optimizer, and all-gathers the
//! updated shards into every rank's parameters, so all ranks stay identical.

use std::collections::BTreeMap;
use std::path::Path;

use manta_cuda::adamw::{clear_grad, fused_adamw_masters, AdamWStep, MasterSlot};
use tch::{Kind, Tensor};

use super::{Collective, CollectiveError, FlatLayout, ReduceOp};
use crate::optimizer::{master_update, AdamW, AdamWConfig};
use crate::trainer::NamedTensors;

/// Default bucket size: 64 Mi elements (256 MiB of fp32 gradients staged at a time).
pub const DEFAULT_BUCKET_NUMEL: usize = 1 << 26;

/// The sharded optimizer of one data-parallel rank.
pub struct ZeroAdamW {
    pub config: AdamWConfig,
    comm: Box<dyn Collective>,
    layout: FlatLayout,
    /// The model's parameters in layout order (handles to the model's tensors).
    params: Vec<Tensor>,
    /// The parameters' kind (one for all: fp32, or bf16 with `--bf16`).
    kind: Kind,
    /// This rank's fp32 masters, moments and reduced gradients, `[shard_numel]`.
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Tensor,
    /// The updated shard in the parameters' kind (the master itself in fp32), which the
    /// all-gather sends.
    param_shard: Tensor,
    /// Whether `grad` holds this step's reduced gradients.
    reduced: bool,
    step: u64,
}

fn flat_bucket(
    layout: &FlatLayout,
    b: usize,
    kind: Kind,
    pick: impl Fn(usize) -> Tensor,
) -> Tensor {
    let bucket = &layout.buckets[b];
    let mut parts: Vec<Tensor> = bucket
        .params
        .clone()
        .map(|i| pick(i).to_kind(kind).reshape([-1]))
        .collect();
    let pad = bucket.padded(layout.world) - bucket.numel;
    if pad > 0 {
        let device = parts
            .first()
            .map_or(tch::Device::Cpu, |t: &Tensor| t.device());
        parts.push(Tensor::zeros([pad as i64], (kind, device)));
    }
    Tensor::cat(&parts, 0)
}

/// Σ x² of a flat tensor in fp64, a slice at a time on the device: an fp64 copy of a
/// whole shard (an 8B model's is 4 G elements over two ranks) would take 33 GB.
fn sum_of_squares(t: &Tensor) -> f64 {
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

impl ZeroAdamW {
    /// Shards `params` (the model's trainable variables; every rank passes the same
    /// names and shapes) over `comm`'s ranks, after making every rank's values rank 0's.
    pub fn new(
        params: BTreeMap<String, Tensor>,
        config: AdamWConfig,
        comm: Box<dyn Collective>,
        bucket_numel: usize,
    ) -> Result<Self, CollectiveError> {
        let kinds: Vec<Kind> = params.values().map(|t| t.kind()).collect();
        let kind = kinds.first().copied().unwrap_or(Kind::Float);
        if let Some((name, t)) = params.iter().find(|(_, t)| t.kind() != kind) {
            return Err(CollectiveError::BadTensor {
                op: "zero",
                message: format!("parameter {name} is {:?}, others {kind:?}", t.kind()),
            });
        }
        let shapes: Vec<(String, Vec<i64>)> =
            params.iter().map(|(k, t)| (k.clone(), t.size())).collect();
        let layout = FlatLayout::new(&shapes, comm.world_size(), bucket_numel);
        let params: Vec<Tensor> = params.into_values().collect();
        let device = comm.device();
        let (rank, world) = (comm.rank(), comm.world_size());
        let shard_numel = layout.shard_numel as i64;
        let zeros = || Tensor::zeros([shard_numel], (Kind::Float, device));
        let master = zeros();
        let mut me = Self {
            config,
            layout,
            kind,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            grad: zeros(),
            param_shard: if kind == Kind::Float {
                master.shallow_clone()
            } else {
                Tensor::zeros([master.numel() as i64], (kind, device))
            },
            master,
            params,
            comm,
            reduced: false,
            step: 0,
        };
        // Rank 0's weights everywhere, then each rank's master shard from them.
        tch::no_grad(|| -> Result<(), CollectiveError> {
            for b in 0..me.layout.buckets.len() {
                let mut flat = flat_bucket(&me.layout, b, kind, |i| me.params[i].detach());
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
        if kind != Kind::Float {
            tch::no_grad(|| me.param_shard.copy_(&me.master));
        }
        tracing::info!(
            rank,
            world,
            buckets = me.layout.buckets.len(),
            shard_elements = me.layout.shard_numel,
            "ZeRO-2 optimizer"
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
    /// (fp32), bucket by bucket, dropping the parameters' own gradients. Parameters
    /// without a gradient count as zero.
    pub fn reduce_gradients(&mut self) -> Result<(), CollectiveError> {
        tch::no_grad(|| {
            for b in 0..self.layout.buckets.len() {
                let flat = flat_bucket(&self.layout, b, Kind::Float, |i| {
                    let g = self.params[i].grad();
                    if g.defined() {
                        g
                    } else {
                        self.params[i].zeros_like()
                    }
                });
                let bucket = &self.layout.buckets[b];
                // ZeRO-2: the full gradients are not kept past their reduction (the
                // staged copy is ordered before any reuse of their memory).
                for p in &self.params[bucket.params.clone()] {
                    clear_grad(p).map_err(|e| CollectiveError::BadTensor {
                        op: "clear_grad",
                        message: e.to_string(),
                    })?;
                }
                let mut out = self
                    .grad
                    .narrow(0, bucket.shard_offset as i64, bucket.shard as i64);
                self.comm.reduce_scatter(&flat, &mut out, ReduceOp::Sum)?;
            }
            Ok::<(), CollectiveError>(())
        })?;
        self.reduced = true;
        Ok(())
    }

    /// The global gradient's L2 norm (reduces the gradients first if not done yet).
    pub fn grad_norm(&mut self) -> Result<f64, CollectiveError> {
        if !self.reduced {
            self.reduce_gradients()?;
        }
        let local = tch::no_grad(|| sum_of_squares(&self.grad));
        let mut total = [local];
        self.comm.all_reduce_f64(&mut total, ReduceOp::Sum)?;
        Ok(total[0].sqrt())
    }

    /// As [`AdamW::clip_grad_norm`], on the reduced global gradient.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, CollectiveError> {
        let norm = self.grad_norm()?;
        if norm.is_finite() && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                let _ = self.grad.g_mul_scalar_(scale);
            });
        }
        Ok(norm)
    }

    /// One AdamW update of this rank's shard, then the all-gather of every rank's
    /// updated shard into the parameters.
    pub fn step(&mut self) -> Result<(), CollectiveError> {
        if !self.reduced {
            self.reduce_gradients()?;
        }
        self.step += 1;
        let c = self.config;
        let fused = manta_knobs::fused_adamw();
        let slot = MasterSlot {
            param: &self.param_shard,
            grad: &self.grad,
            master: &self.master,
            exp_avg: &self.exp_avg,
            exp_avg_sq: &self.exp_avg_sq,
        };
        let step = AdamWStep {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
        };
        if !(fused && fused_adamw_masters(&[slot], step).is_ok()) {
            let bias1 = 1.0 - c.beta1.powi(self.step as i32);
            let bias2 = 1.0 - c.beta2.powi(self.step as i32);
            tch::no_grad(|| {
                master_update(
                    &mut self.master,
                    &mut self.exp_avg,
                    &mut self.exp_avg_sq,
                    &self.grad,
                    c,
                    bias1,
                    bias2,
                );
                if self.kind != Kind::Float {
                    self.param_shard.copy_(&self.master);
                }
            });
        }
        self.reduced = false;
        self.gather_params()
    }

    /// Every rank's shard of the parameters (in their kind) into every rank's model.
    fn gather_params(&mut self) -> Result<(), CollectiveError> {
        let world = self.layout.world;
        tch::no_grad(|| {
            for b in 0..self.layout.buckets.len() {
                let bucket = &self.layout.buckets[b];
                let src =
                    self.param_shard
                        .narrow(0, bucket.shard_offset as i64, bucket.shard as i64);
                let mut flat = Tensor::empty(
                    [bucket.padded(world) as i64],
                    (self.kind, self.comm.device()),
                );
                self.comm.all_gather(&src, &mut flat)?;
                self.scatter_into_params(b, &flat);
            }
            Ok(())
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

    /// Clears the parameters' gradients before the next step.
    pub fn zero_grad(&mut self) {
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        self.reduced = false;
    }

    fn shard_file(&self, dir: &Path) -> std::path::PathBuf {
        dir.join(format!(
            "optimizer.rank{}-of-{}.safetensors",
            self.comm.rank(),
            self.layout.world
        ))
    }

    /// Writes this rank's shard (masters and moments, flat) to
    /// `optimizer.rank<r>-of-<world>.safetensors` in `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        let named = [
            ("master", &self.master),
            ("exp_avg", &self.exp_avg),
            ("exp_avg_sq", &self.exp_avg_sq),
        ];
        Tensor::write_safetensors(&named, self.shard_file(dir))
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
        tch::no_grad(|| {
            self.master.copy_(&staged[0]);
            self.exp_avg.copy_(&staged[1]);
            self.exp_avg_sq.copy_(&staged[2]);
            if self.kind != Kind::Float {
                self.param_shard.copy_(&self.master);
            }
        });
        self.step = step;
        self.gather_params().map_err(|e| e.to_string())
    }

    /// This rank's saved master, first and second moments, checked against the layout.
    fn read_shard(&self, dir: &Path) -> Result<Vec<Tensor>, String> {
        let path = self.shard_file(dir);
        let tensors =
            Tensor::read_safetensors(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let map: BTreeMap<String, Tensor> = tensors.into_iter().collect();
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
}
