//! The fused RMSNorm (`manta_cuda::rms_norm::rms_norm`) against the tensor ops it replaces
//! (`x.rms_norm(None) * w`, as crates/model's decoder norms in bf16/fp16), on the GPU:
//!
//! - forward: against the tensor ops, bf16 and fp16, at row widths that take each kernel
//!   shape (8, 24, 128, 1024, 4096, 5120: one thread a row up to four 8-element chunks a
//!   thread, some of them masked) and an x that is not 16-byte aligned. The sum of squares
//!   runs in another order than libtorch's, so an element may round the other way; each may
//!   differ by a couple of units in the last place and at most 1 in 1,000 may differ at all.
//!   Both are also held to an fp64 evaluation of the formula. A wrong scale is off by much
//!   more (the kind's unit roundoff is 2^-8 or 2^-11).
//! - backward: dx and dw of Σ y·G against fp64 evaluations of their formulas from the same
//!   rounded inputs, within rounding bounds scaled by each element's magnitude, and autograd
//!   of the tensor ops against the same references (so the bounds are ones the tensor ops
//!   meet too); the same bits on a second run (the dw reduction has a fixed order).
//! - a row's output does not depend on the rows beside it (true on-policy mode), and no
//!   rows give an empty result;
//! - bad inputs: an error that names the problem.
//!
//! Returns early, saying so, without a CUDA device.

mod common;

use std::sync::Mutex;

use common::{gpu, max, misaligned, unit};
use manta_cuda::rms_norm::rms_norm;
use tch::{Device, Kind, Tensor};

/// One test at a time: they share the CUDA generator.
static SERIAL: Mutex<()> = Mutex::new(());

const EPS: f64 = 1e-6;

/// The decoder's tensor ops (crates/model `RmsNorm::forward` off the fused path).
fn tensor_ops(x: &Tensor, w: &Tensor) -> Tensor {
    let dim = w.size()[0];
    x.rms_norm([dim], None::<Tensor>, EPS) * w
}

/// Random rows over a few octaves, a weight near 1 with either sign, in `kind`.
fn inputs(rows: i64, dim: i64, kind: Kind, device: Device) -> (Tensor, Tensor) {
    let x = (Tensor::randn([rows, dim], (Kind::Float, device)) * 3.0).to_kind(kind);
    let w = (Tensor::randn([dim], (Kind::Float, device)) * 0.5 + 1.0).to_kind(kind);
    (x, w)
}

/// fp64 per-row rsqrt(mean(x²) + eps) [rows, 1].
fn rstd64(x: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::Double);
    (x.square().mean_dim(-1, true, Kind::Double) + EPS).rsqrt()
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rms_norm_forward_matches_the_tensor_ops() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    tch::manual_seed(7);
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, dim) in [
            (4099, 8),
            (1001, 24),
            (16_000, 128),
            (4096, 1024),
            (777, 4096),
            (513, 5120),
        ] {
            let (x, w) = inputs(rows, dim, kind, device);
            for aligned in [true, false] {
                let xin = if aligned {
                    x.shallow_clone()
                } else {
                    misaligned(&x)
                };
                let fused = rms_norm(&xin, &w, EPS)
                    .unwrap_or_else(|e| panic!("{kind:?} {rows}x{dim}: {e}"));
                let ops = tensor_ops(&x, &w);
                let (f, o) = (fused.to_kind(Kind::Double), ops.to_kind(Kind::Double));
                let what = format!("{kind:?} {rows}x{dim} aligned={aligned}");
                // Both within rounding of the exact formula: R(R(n)·w) is within about
                // 2u of n·w, and n's fp32 evaluation adds little.
                let exact = x.to_kind(Kind::Double) * rstd64(&x) * w.to_kind(Kind::Double);
                let bound = exact.abs() * (2.5 * unit(kind)) + 1e-6;
                for (name, y) in [("fused", &f), ("tensor ops", &o)] {
                    let worst = max(&((y - &exact).abs() - &bound));
                    assert!(
                        worst <= 0.0,
                        "{what}: {name} off the fp64 formula by {worst} past its bound"
                    );
                }
                let differ = f.ne_tensor(&o).sum(Kind::Int64).int64_value(&[]);
                assert!(
                    differ as f64 <= (rows * dim) as f64 * 1e-3,
                    "{what}: {differ} of {} elements differ from the tensor ops",
                    rows * dim
                );
                let gap = max(&((&f - &o).abs() - o.abs() * (4.0 * unit(kind))));
                assert!(
                    gap <= 1e-6,
                    "{what}: an element differs from the tensor ops by more than 2 ulp"
                );
            }
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rms_norm_backward_is_within_rounding_and_deterministic() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    tch::manual_seed(11);
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, dim) in [
            (3001, 24),
            (16_000, 128),
            (4096, 1024),
            (777, 4096),
            (513, 5120),
        ] {
            let what = format!("{kind:?} {rows}x{dim}");
            let (x, w) = inputs(rows, dim, kind, device);
            let g_out = Tensor::randn([rows, dim], (Kind::Float, device)).to_kind(kind);
            let grads = |fused: bool| {
                let xg = x.detach().set_requires_grad(true);
                let wg = w.detach().set_requires_grad(true);
                let y = if fused {
                    rms_norm(&xg, &wg, EPS).expect("fused")
                } else {
                    tensor_ops(&xg, &wg)
                };
                (y * &g_out).sum(Kind::Float).backward();
                (xg.grad(), wg.grad())
            };
            let (dx_f, dw_f) = grads(true);
            let (dx_again, dw_again) = grads(true);
            assert!(
                dx_f.equal(&dx_again) && dw_f.equal(&dw_again),
                "{what}: a second backward differs"
            );
            let (dx_o, dw_o) = grads(false);

            // References in fp64 from the rounded inputs the formulas take: g = R(G·w) and
            // the normed x rounded, as the multiply's autograd rounds them.
            let u = unit(kind);
            let r = rstd64(&x);
            let n = x.to_kind(Kind::Double) * &r;
            let g = (&g_out * &w).to_kind(Kind::Double);
            let mean = (&g * &n).mean_dim(-1, true, Kind::Double);
            let dx_ref = &r * (&g - &n * &mean);
            // Magnitude of the terms: cancellation can leave dx far smaller than them.
            let dx_mag = &r * (g.abs() + (&n * &mean).abs());
            let dx_bound = dx_ref.abs() * (1.5 * u) + &dx_mag * 1e-3 + 1e-6;
            let terms = (&g_out * n.to_kind(kind)).to_kind(Kind::Double);
            let dw_ref = terms.sum_dim_intlist(0, false, Kind::Double);
            let dw_mag = terms.abs().sum_dim_intlist(0, false, Kind::Double);
            let dw_bound = dw_ref.abs() * (1.5 * u) + &dw_mag * 1e-4 + 1e-6;
            for (name, dx, dw) in [("fused", &dx_f, &dw_f), ("autograd", &dx_o, &dw_o)] {
                let worst = max(&((dx.to_kind(Kind::Double) - &dx_ref).abs() - &dx_bound));
                assert!(
                    worst <= 0.0,
                    "{what}: {name} dx off its fp64 reference by {worst} past the bound"
                );
                let worst = max(&((dw.to_kind(Kind::Double) - &dw_ref).abs() - &dw_bound));
                assert!(
                    worst <= 0.0,
                    "{what}: {name} dw off its fp64 reference by {worst} past the bound"
                );
            }
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rms_norm_rows_do_not_depend_on_their_batch() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    tch::manual_seed(3);
    for dim in [128, 1024, 4096] {
        let (x, w) = inputs(1000, dim, Kind::BFloat16, device);
        let all = rms_norm(&x, &w, EPS).expect("fused");
        let none = rms_norm(&x.narrow(0, 0, 0).contiguous(), &w, EPS).expect("no rows");
        assert_eq!(none.size(), vec![0, dim], "zero rows");
        for (start, len) in [(0, 1), (17, 5), (999, 1)] {
            let part = rms_norm(&x.narrow(0, start, len).contiguous(), &w, EPS).expect("fused");
            assert!(
                part.equal(&all.narrow(0, start, len)),
                "dim {dim}: rows {start}..+{len} alone differ"
            );
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rms_norm_reports_bad_inputs() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    let (x, w) = inputs(4, 64, Kind::BFloat16, device);
    let err = |x: &Tensor, w: &Tensor| rms_norm(x, w, EPS).expect_err("bad input").to_string();
    let e = err(&x.to_kind(Kind::Float), &w);
    assert!(e.contains("bf16 or fp16"), "{e}");
    let (x12, w12) = inputs(4, 12, Kind::BFloat16, device);
    let e = err(&x12, &w12);
    assert!(e.contains("multiple of 8") && e.contains("12"), "{e}");
    let e = err(&x, &w.narrow(0, 0, 32));
    assert!(e.contains("weight") && e.contains("[64]"), "{e}");
    let e = err(&x.view([2, 2, 64]), &w);
    assert!(e.contains("[rows, dim]"), "{e}");
}
