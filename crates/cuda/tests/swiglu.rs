//! The fused gated activation (`manta_cuda::swiglu::swiglu`) against the tensor ops it
//! replaces (`gate.silu() * up`, as crates/model's MLP computes it), on the GPU:
//!
//! - forward: bit for bit, bf16 and fp16, at a trainer's shape (8k tokens × 3,072) and small
//!   ones, the scalar path (a length that is not a multiple of 8, an unaligned gate);
//! - backward: both gradients of Σ h·G against autograd of the tensor ops. The kernel applies
//!   autograd's roundings in its order, so they agree but where the compilers contract the
//!   silu gradient's multiply-add differently: within 2 units in the last place, and the
//!   gate's gradient within rounding of an fp64 evaluation from the same rounded inputs;
//! - bad inputs: an error that names the problem.
//!
//! Returns early, saying so, without a CUDA device.

mod common;

use std::sync::Mutex;

use common::{gpu, max, misaligned, unit};
use manta_cuda::swiglu::swiglu;
use tch::{Device, Kind, Tensor};

/// One test at a time: they share the CUDA generator.
static SERIAL: Mutex<()> = Mutex::new(());

/// Gate values over silu's whole shape (large negative to large positive), up near ±1.
fn inputs(shape: &[i64], kind: Kind, device: Device) -> (Tensor, Tensor) {
    let g = (Tensor::randn(shape, (Kind::Float, device)) * 4.0).to_kind(kind);
    let u = Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
    (g, u)
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_swiglu_forward_is_bit_identical_to_the_tensor_ops() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    tch::manual_seed(5);
    for kind in [Kind::BFloat16, Kind::Half] {
        for shape in [vec![8192, 3072], vec![3, 5, 64], vec![1001, 13]] {
            let (g, u) = inputs(&shape, kind, device);
            for aligned in [true, false] {
                let gin = if aligned {
                    g.shallow_clone()
                } else {
                    misaligned(&g)
                };
                let fused = swiglu(&gin, &u).unwrap_or_else(|e| panic!("{kind:?} {shape:?}: {e}"));
                let ops = g.silu() * &u;
                let differ = fused.ne_tensor(&ops).sum(Kind::Int64).int64_value(&[]);
                assert_eq!(
                    differ, 0,
                    "{kind:?} {shape:?} aligned={aligned}: elements differ"
                );
            }
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_swiglu_backward_matches_autograd() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    tch::manual_seed(9);
    for kind in [Kind::BFloat16, Kind::Half] {
        for shape in [vec![8192, 3072], vec![1001, 13]] {
            let what = format!("{kind:?} {shape:?}");
            let (g, u) = inputs(&shape, kind, device);
            let g_out = Tensor::randn(shape.as_slice(), (Kind::Float, device)).to_kind(kind);
            let grads = |fused: bool| {
                let gg = g.detach().set_requires_grad(true);
                let ug = u.detach().set_requires_grad(true);
                let h = if fused {
                    swiglu(&gg, &ug).expect("fused")
                } else {
                    gg.silu() * &ug
                };
                (h * &g_out).sum(Kind::Float).backward();
                (gg.grad(), ug.grad())
            };
            let (dg_f, du_f) = grads(true);
            let (dg_o, du_o) = grads(false);
            let u2 = 2.0 * unit(kind);
            for (name, f, o) in [("gate", &dg_f, &dg_o), ("up", &du_f, &du_o)] {
                let (f, o) = (f.to_kind(Kind::Double), o.to_kind(Kind::Double));
                let gap = max(&((&f - &o).abs() - o.abs() * (2.0 * u2) - 1e-7));
                assert!(
                    gap <= 0.0,
                    "{what}: the {name} gradient differs from autograd's by more than 2 ulp"
                );
            }
            // The gate's gradient against fp64 from the same rounded d = R(G·u).
            let g64 = g.to_kind(Kind::Double);
            let sig = g64.sigmoid();
            let d = (&g_out * &u).to_kind(Kind::Double);
            let one_minus: Tensor = sig.ones_like() - &sig;
            let exact: Tensor = &d * &sig * ((&g64 * one_minus) + 1.0);
            let bound = exact.abs() * (1.5 * unit(kind)) + d.abs() * 1e-6 + 1e-7;
            let worst = max(&((dg_f.to_kind(Kind::Double) - &exact).abs() - bound));
            assert!(
                worst <= 0.0,
                "{what}: the gate's gradient is off fp64 by {worst} past its bound"
            );
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_swiglu_reports_bad_inputs() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(device) = gpu() else { return };
    let (g, u) = inputs(&[4, 64], Kind::BFloat16, device);
    let e = swiglu(&g.to_kind(Kind::Float), &u)
        .expect_err("fp32")
        .to_string();
    assert!(e.contains("bf16 or fp16"), "{e}");
    let e = swiglu(&g, &u.narrow(1, 0, 32))
        .expect_err("shapes")
        .to_string();
    assert!(e.contains("up must be [4, 64]"), "{e}");
}
