//! Prefill attention of packed variable-length sequences through cuDNN's fused flash
//! attention (cudnn_attention.cpp), which on Hopper runs a warpgroup-MMA kernel about
//! twice as fast as libtorch's FlashAttention-2 varlen at the engine's prefill chunks.
//! The graph is built once per shape bucket; the sequences' lengths and offsets travel in
//! one small int32 tensor, [`VarlenLengths`], made once per prefill step and read by every
//! layer.

use std::ffi::{c_int, c_void};

use tch::{Device, Tensor};

use crate::{check, ptr, CudaError};

extern "C" {
    fn manta_cudnn_attention_built() -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_cudnn_attention_varlen(
        q: *mut c_void,
        k: *mut c_void,
        v: *mut c_void,
        lengths: *mut c_void,
        max_q: i64,
        max_k: i64,
        scale: f64,
        out: *mut *mut c_void,
    ) -> c_int;
}

/// Whether this build carries the cuDNN path (cuDNN and cuDNN-frontend headers were found).
pub fn built() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { manta_cudnn_attention_built() != 0 }
}

/// What cuDNN's padding mask and ragged layout need for one set of packed sequences, on the
/// device: for `slots` (the sequence count rounded up to a power of two, so that a few
/// cached graphs serve every batch) each slot's query and key count, then `slots + 1`
/// query and key offsets in elements. Unused slots are empty.
pub struct VarlenLengths {
    lengths: Tensor,
    max_q: i64,
    max_k: i64,
}

impl VarlenLengths {
    /// For sequences with `q_lens[i]` queries over `k_lens[i]` keys (a cached prefix where
    /// keys outnumber queries), packed [tokens, heads, head_dim] with `heads` query and
    /// `kv_heads` key/value heads. `None` where cuDNN's 32-bit offsets cannot address the
    /// packed tensors or the lists are empty or unequal.
    pub fn new(
        q_lens: &[i64],
        k_lens: &[i64],
        heads: i64,
        kv_heads: i64,
        head_dim: i64,
        device: Device,
    ) -> Option<Self> {
        let host = host_lengths(q_lens, k_lens, heads, kv_heads, head_dim)?;
        Some(Self {
            lengths: Tensor::from_slice(&host).to(device),
            max_q: q_lens.iter().copied().max()?,
            max_k: k_lens.iter().copied().max()?,
        })
    }
}

/// The host side of [`VarlenLengths::new`].
fn host_lengths(
    q_lens: &[i64],
    k_lens: &[i64],
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
) -> Option<Vec<i32>> {
    if q_lens.is_empty() || q_lens.len() != k_lens.len() {
        return None;
    }
    let slots = q_lens.len().next_power_of_two();
    let as_i32 = |x: i64| i32::try_from(x).ok();
    let mut out = Vec::with_capacity(4 * slots + 2);
    for lens in [q_lens, k_lens] {
        for i in 0..slots {
            out.push(as_i32(lens.get(i).copied().unwrap_or(0))?);
        }
    }
    for (lens, width) in [(q_lens, heads * head_dim), (k_lens, kv_heads * head_dim)] {
        let mut at = 0i64;
        out.push(0);
        for i in 0..slots {
            at += lens.get(i).copied().unwrap_or(0);
            out.push(as_i32(at.checked_mul(width)?)?);
        }
    }
    Some(out)
}

/// Causal attention of packed sequences: `q` [total_q, heads, hd], `k`, `v` [total_k,
/// kv_heads, hd] (contiguous, bf16 or fp16, CUDA), laid out as `lengths` says; a sequence
/// with more keys than queries has its queries at the end of its keys (query i of n sees
/// keys up to `keys - n + i`). Returns [total_q, heads, hd]. An error where cuDNN does not
/// take the shape (the caller falls back to FlashAttention-2).
pub fn attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lengths: &VarlenLengths,
    scale: f64,
) -> Result<Tensor, CudaError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensor handles for the call; on success `out` is a new at::Tensor we own.
    check(unsafe {
        manta_cudnn_attention_varlen(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(&lengths.lengths),
            lengths.max_q,
            lengths.max_k,
            scale,
            &mut out,
        )
    })?;
    // SAFETY: `out` is a heap at::Tensor, which is what tch's tensor handle points to.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    #[test]
    fn lengths_pad_to_a_power_of_two_with_empty_slots() {
        // Three sequences (2 of them with a cached prefix), 4 query heads, 2 kv heads, hd 8.
        let got = host_lengths(&[3, 1, 2], &[3, 4, 5], 4, 2, 8).expect("fits");
        let (q, k) = (4 * 8, 2 * 8);
        assert_eq!(
            got,
            [
                vec![3, 1, 2, 0],
                vec![3, 4, 5, 0],
                vec![0, 3 * q, 4 * q, 6 * q, 6 * q],
                vec![0, 3 * k, 7 * k, 12 * k, 12 * k],
            ]
            .concat()
        );
        assert!(host_lengths(&[], &[], 4, 2, 8).is_none());
        assert!(host_lengths(&[1, 2], &[1], 4, 2, 8).is_none());
        // 2^31 elements do not fit cuDNN's offsets.
        assert!(host_lengths(&[1 << 20], &[1 << 20], 32, 8, 128).is_none());
    }

    /// Against float64 attention per sequence, beside libtorch's FlashAttention-2 on the
    /// same inputs: fresh sequences of mixed lengths (one past a power of two, so the
    /// bucket pads) and sequences with cached prefixes, grouped-query heads, bf16 and fp16.
    /// cuDNN's error must be of FlashAttention-2's order (both round to 16 bits once).
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn cudnn_varlen_matches_float64_attention() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        // A CUDA build on the device machine has the frontend headers (requirements-dev.txt):
        // without them the feature is absent, which must not pass as tested.
        assert!(
            built(),
            "this build lacks cuDNN attention (cudnn.h or cudnn_frontend.h not found)"
        );
        let _serial = crate::gpu_test_lock();
        tch::manual_seed(11);
        let dev = Device::Cuda(gpu);
        let fresh: Vec<(i64, i64)> = [700i64, 65, 1, 300, 129].iter().map(|&n| (n, n)).collect();
        let cached = vec![(5i64, 40i64), (64, 64), (1, 300), (33, 97)];
        for kind in [Kind::BFloat16, Kind::Half] {
            for (heads, kv_heads) in [(8i64, 2i64), (4, 4)] {
                check_case(dev, kind, heads, kv_heads, &fresh);
                check_case(dev, kind, heads, kv_heads, &cached);
            }
        }
    }

    fn check_case(dev: Device, kind: Kind, heads: i64, kv_heads: i64, seqs: &[(i64, i64)]) {
        let hd = 128i64;
        let scale = 1.0 / (hd as f64).sqrt();
        let (q_lens, k_lens): (Vec<i64>, Vec<i64>) = seqs.iter().copied().unzip();
        let (tq, tk) = (q_lens.iter().sum::<i64>(), k_lens.iter().sum::<i64>());
        let q = Tensor::randn([tq, heads, hd], (kind, dev));
        let k = Tensor::randn([tk, kv_heads, hd], (kind, dev));
        let v = Tensor::randn([tk, kv_heads, hd], (kind, dev));
        let lengths = VarlenLengths::new(&q_lens, &k_lens, heads, kv_heads, hd, dev).expect("fits");
        let got = attention_varlen(&q, &k, &v, &lengths, scale)
            .unwrap_or_else(|e| panic!("{kind:?} {heads}/{kv_heads} {seqs:?}: {e}"));
        let cum = |lens: &[i64]| {
            let mut c = vec![0i32];
            for &l in lens {
                c.push(c[c.len() - 1] + l as i32);
            }
            Tensor::from_slice(&c).to(dev)
        };
        let max = |lens: &[i64]| lens.iter().copied().max().unwrap_or(1);
        let flash = crate::flash_attention_varlen(
            &q,
            &k,
            &v,
            &cum(&q_lens),
            &cum(&k_lens),
            max(&q_lens),
            max(&k_lens),
            scale,
        )
        .expect("flash attention runs");
        let reference = reference_attention(&q, &k, &v, seqs, scale);
        let err = |x: &Tensor| {
            (x.to_kind(Kind::Double) - &reference)
                .abs()
                .max()
                .double_value(&[])
        };
        let (e_cudnn, e_flash) = (err(&got), err(&flash));
        assert!(
            e_cudnn <= 2.0 * e_flash + 1e-3,
            "{kind:?} heads {heads}/{kv_heads} {seqs:?}: cuDNN max error {e_cudnn} vs FlashAttention-2 {e_flash}"
        );
    }

    /// Causal attention per sequence in float64, queries aligned to the end of their keys.
    fn reference_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: &[(i64, i64)],
        scale: f64,
    ) -> Tensor {
        let rep = q.size()[1] / k.size()[1];
        let (mut qa, mut ka) = (0i64, 0i64);
        let mut outs = Vec::new();
        for &(nq, nk) in seqs {
            let qs = q.narrow(0, qa, nq).to_kind(Kind::Double).transpose(0, 1);
            let kv = |t: &Tensor| {
                t.narrow(0, ka, nk)
                    .to_kind(Kind::Double)
                    .transpose(0, 1)
                    .repeat_interleave_self_int(rep, 0, None)
            };
            let scores = qs.matmul(&kv(k).transpose(1, 2)) * scale;
            let row = Tensor::arange(nq, (Kind::Int64, q.device())).unsqueeze(1) + (nk - nq);
            let col = Tensor::arange(nk, (Kind::Int64, q.device())).unsqueeze(0);
            let scores = scores.masked_fill(&col.gt_tensor(&row), f64::NEG_INFINITY);
            outs.push(
                scores
                    .softmax(-1, Kind::Double)
                    .matmul(&kv(v))
                    .transpose(0, 1),
            );
            qa += nq;
            ka += nk;
        }
        Tensor::cat(&outs, 0)
    }
}
