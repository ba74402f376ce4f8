//! The free functions the sharded optimizer is built from: flat buckets, ZeRO-3's layer
//! groups, the squared-norm sum, the gradients' kind and AdamW on one slice.

use std::collections::BTreeMap;

use manta_cuda::adamw::{fused_adamw_masters, AdamWStep, MasterSlot};
use manta_cuda::CudaError;
use tch::{Kind, Tensor};

use super::super::{CollectiveError, FlatLayout};
use crate::optimizer::{master_update, AdamWConfig};

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
pub(super) fn check_one_kind(params: &BTreeMap<String, Tensor>) -> Result<Kind, CollectiveError> {
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
pub(super) fn flat_bucket(
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
pub(super) fn sum_of_squares(t: &Tensor) -> f64 {
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

pub(super) fn sum_of_squares_by(t: &Tensor, slice: i64) -> f64 {
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
pub(super) fn grad_kind(kind: Kind, grad_reduce_in_bf16: bool) -> Result<Kind, CollectiveError> {
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
pub(super) fn update_slice(
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

pub(super) fn stream_error(op: &'static str) -> impl Fn(CudaError) -> CollectiveError {
    move |e| CollectiveError::Stream {
        op,
        message: e.to_string(),
    }
}
