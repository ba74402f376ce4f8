//! The fused rotary embedding (`manta_cuda::rope::rope`) against the tensor ops it replaces
//! (`x * cos + rotate_half(x) * sin`, as crates/model's decoder applies it), on the GPU:
//!
//! - forward: bit for bit, bf16 and fp16, at the trainer's shape (37k rows × 16 heads × 128),
//!   a small one, odd row counts, head_dim 64, the kernels' scalar path (head_dim 72, whose
//!   half is not whole 8-element chunks, and an x that is not 16-byte aligned);
//! - backward: the gradient w.r.t. x of Σ out·w. The kernel forms each element as one fp32
//!   sum of two exact products, rounded once; autograd rounds both products and their sum.
//!   With u the unit roundoff (2^-8 bf16, 2^-11 fp16) and m = |g·c| + |g'·s'| the element's
//!   magnitude, the kernel is within u·|exact| of the exact value and autograd within
//!   about 2u·m, so they differ by at most 3u·m; both bounds are asserted per element (plus
//!   fp16's subnormal spacing), and the kernel's against an fp32 evaluation of the formula.
//!   A wrong sign or a swapped half is off by the element's whole size.
//!
//! Returns early, saying so, without a CUDA device.

mod common;

use std::sync::Mutex;

use common::{gpu, misaligned};
use manta_cuda::rope::rope;
use tch::{Device, Kind, Tensor};

/// One test at a time: they share the CUDA generator.
static SERIAL: Mutex<()> = Mutex::new(());

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

/// The decoder's tensor ops, with the [rows, hd] tables broadcast over the heads.
fn tensor_ops(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
    x * &cos + rotate_half(x) * &sin
}

/// Random x (values of either sign over a few octaves) and the cos/sin of random positions'
/// angles, as the decoder's tables are: fp32 cos/sin rounded to `kind`.
fn inputs(rows: i64, heads: i64, hd: i64, kind: Kind, device: Device) -> (Tensor, Tensor, Tensor) {
    let x = (Tensor::randn([rows, heads, hd], (Kind::Float, device)) * 3.0).to_kind(kind);
    let positions = Tensor::randint(40_000, [rows, 1], (Kind::Int64, device)).to_kind(Kind::Float);
    let inv_freq = Tensor::pow_scalar(
        1_000_000.0,
        &(Tensor::arange_start_step(0, hd, 2, (Kind::Float, device)) / hd as f64),
    )
    .reciprocal();
    let freqs = positions * inv_freq;
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (x, emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rope_forward_is_bit_identical_to_the_tensor_ops() {
    let Some(device) = gpu() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(5);
    let cases: &[(i64, i64, i64, Kind, bool)] = &[
        (37_000, 16, 128, Kind::BFloat16, false),
        (1_000, 8, 128, Kind::BFloat16, false),
        (997, 8, 128, Kind::BFloat16, false),
        (37_001, 8, 128, Kind::BFloat16, false),
        (1, 16, 128, Kind::BFloat16, false),
        (333, 3, 64, Kind::BFloat16, false),
        (101, 5, 72, Kind::BFloat16, false),
        (257, 4, 128, Kind::BFloat16, true),
        (1_000, 8, 128, Kind::Half, false),
        (999, 4, 72, Kind::Half, false),
        (257, 4, 128, Kind::Half, true),
    ];
    for &(rows, heads, hd, kind, unaligned) in cases {
        let what = format!(
            "[{rows}, {heads}, {hd}] {kind:?}{}",
            if unaligned { " unaligned" } else { "" }
        );
        let (x, cos, sin) = inputs(rows, heads, hd, kind, device);
        let x = if unaligned { misaligned(&x) } else { x };
        let want = tensor_ops(&x, &cos, &sin);
        let got = rope(&x, &cos, &sin).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.size(), want.size(), "{what}");
        assert_eq!(got.kind(), kind, "{what}");
        let differ = got.ne_tensor(&want).sum(Kind::Int64).int64_value(&[]);
        let max = (got.to_kind(Kind::Float) - want.to_kind(Kind::Float))
            .abs()
            .max()
            .double_value(&[]);
        eprintln!("{what}: {differ} elements differ (max {max:e})");
        assert_eq!(
            differ, 0,
            "{what}: {differ} elements differ from the tensor ops, by up to {max:e}"
        );
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rope_backward_matches_autograd_within_rounding() {
    let Some(device) = gpu() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(7);
    let cases: &[(i64, i64, i64, Kind, bool)] = &[
        (37_000, 16, 128, Kind::BFloat16, false),
        (997, 8, 128, Kind::BFloat16, false),
        (101, 5, 72, Kind::BFloat16, false),
        (257, 4, 128, Kind::BFloat16, true),
        (1_000, 8, 128, Kind::Half, false),
        (999, 4, 72, Kind::Half, false),
    ];
    for &(rows, heads, hd, kind, unaligned) in cases {
        let what = format!(
            "[{rows}, {heads}, {hd}] {kind:?}{}",
            if unaligned { " unaligned" } else { "" }
        );
        let (x, cos, sin) = inputs(rows, heads, hd, kind, device);
        let x = if unaligned { misaligned(&x) } else { x };
        // The output's gradient: w itself in both paths (Σ's backward is ones, and ones·w
        // is exact).
        let w = Tensor::randn([rows, heads, hd], (Kind::Float, device)).to_kind(kind);
        let grad_of = |fused: bool| {
            let leaf = x.detach().copy().set_requires_grad(true);
            let out = if fused {
                rope(&leaf, &cos, &sin).unwrap_or_else(|e| panic!("{what}: {e}"))
            } else {
                tensor_ops(&leaf, &cos, &sin)
            };
            assert!(out.requires_grad(), "{what}: the output carries no graph");
            (out * &w).sum(Kind::Float).backward();
            let g = leaf.grad();
            assert_eq!(g.kind(), kind, "{what}");
            g.to_kind(Kind::Float)
        };
        let (got, want) = (grad_of(true), grad_of(false));
        // The formula in fp32 (its products are exact) and the element's magnitude.
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        let (g, c, s) = (f(&w), f(&cos).unsqueeze(1), f(&sin).unsqueeze(1));
        let gs = &g * &s;
        let half = hd / 2;
        let rot_t = |t: &Tensor| {
            Tensor::cat(
                &[&t.narrow(-1, half, half), &t.narrow(-1, 0, half).neg()],
                -1,
            )
        };
        let exact = &g * &c + rot_t(&gs);
        let magnitude = (&g * &c).abs() + rot_t(&gs).abs();
        let (u, tiny) = match kind {
            Kind::Half => (2f64.powi(-11), 3.0 * 2f64.powi(-24)),
            _ => (2f64.powi(-8), 0.0),
        };
        let excess = |d: Tensor, bound: Tensor| (d - bound).max().double_value(&[]);
        // Rounded once: half an ulp of the exact value (plus fp32's error in forming it).
        let once = excess(
            (&got - &exact).abs(),
            exact.abs() * (u * 1.001) + &magnitude * 2f64.powi(-22) + tiny,
        );
        assert!(
            once <= 0.0,
            "{what}: the kernel's gradient is not the formula rounded once (by {once:e})"
        );
        let vs_autograd = excess(
            (&got - &want).abs(),
            &magnitude * (3.0 * u * 1.01) + 2.0 * tiny,
        );
        let max = (&got - &want).abs().max().double_value(&[]);
        let scale = magnitude.max().double_value(&[]);
        eprintln!("{what}: max |Δ| against autograd {max:e} (largest magnitude {scale:e})");
        assert!(
            vs_autograd <= 0.0,
            "{what}: the gradient differs from autograd's past 3u·m (by {vs_autograd:e})"
        );
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rope_reports_bad_inputs() {
    let Some(device) = gpu() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (x, cos, sin) = inputs(8, 2, 64, Kind::BFloat16, device);
    let err = |r: Result<Tensor, manta_cuda::CudaError>| r.expect_err("bad input").to_string();
    let e = err(rope(&x.to_kind(Kind::Float), &cos, &sin));
    assert!(e.contains("bf16 or fp16"), "{e}");
    let e = err(rope(&x, &cos.narrow(0, 0, 4), &sin));
    assert!(e.contains("cos and sin"), "{e}");
    let e = err(rope(&x, &cos.to_kind(Kind::Half), &sin));
    assert!(e.contains("cos and sin"), "{e}");
    let e = err(rope(&x.transpose(0, 1), &cos, &sin));
    assert!(e.contains("contiguous"), "{e}");
    let e = err(rope(&x, &cos.copy().set_requires_grad(true), &sin));
    assert!(e.contains("require grad"), "{e}");
    // Without a graph (inference): no node, the same values.
    let plain =
        tch::no_grad(|| rope(&x.copy().set_requires_grad(true), &cos, &sin)).expect("no_grad");
    assert!(!plain.requires_grad());
    assert!(plain.equal(&tensor_ops(&x, &cos, &sin)));
}
