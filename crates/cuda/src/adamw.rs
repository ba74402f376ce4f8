//! AdamW over fp32 master weights through ATen's multi-tensor `_fused_adamw_` (the kernel
//! behind `torch.optim.AdamW(fused=True)`), which tch does not expose: one pass over each
//! group of masters, gradients and moments instead of a chain of element-wise kernels per
//! parameter. CPU and CUDA (adamw.cpp).
//!
//! For a data-parallel rank's flat shard on a GPU, two NVRTC kernels (optimizer.cu.inc):
//! [`fused_adamw_bf16_grad`], the same update read straight from a bf16 gradient with the
//! clip scale folded in (no fp32 copy of the gradient), and [`sum_of_squares`], the
//! gradient norm's Σ x² in fp64 without an fp64 copy.
//!
//! For a whole model's list of gradients: [`foreach_sq_norm`], [`foreach_scale_`] and
//! [`foreach_zero_`], ATen's multi-tensor ops (one launch for the list where per-parameter
//! ops launch hundreds of kernels, a GRPO step's optimizer phase mostly spent by the host).

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{Device, Tensor};

use crate::{check, CudaError};

extern "C" {
    fn manta_adamw_last_error() -> *const c_char;
    fn manta_clear_grad(param: *mut c_void) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_fused_adamw_masters(
        params: *mut *mut c_void,
        grads: *mut *mut c_void,
        masters: *mut *mut c_void,
        exp_avgs: *mut *mut c_void,
        exp_avg_sqs: *mut *mut c_void,
        n: c_int,
        step: f64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        group_elems: i64,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_adamw_bf16_grad(
        source: *const c_char,
        grad: *mut c_void,
        master: *mut c_void,
        exp_avg: *mut c_void,
        exp_avg_sq: *mut c_void,
        param: *mut c_void,
        scaled: c_int,
        grad_scale: f64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        step: f64,
    ) -> c_int;
    fn manta_sum_of_squares(source: *const c_char, x: *mut c_void, out: *mut c_void) -> c_int;
    fn manta_foreach_sq_norm(tensors: *mut *mut c_void, n: c_int, out: *mut *mut c_void) -> c_int;
    fn manta_foreach_scale_(tensors: *mut *mut c_void, n: c_int, scale: f64) -> c_int;
    fn manta_foreach_zero_(tensors: *mut *mut c_void, n: c_int) -> c_int;
    fn manta_kernels_compile_check(source: *const c_char, arch: c_int) -> c_int;
}

/// The optimizer kernels' CUDA source, NUL-terminated for NVRTC.
const OPTIMIZER_SOURCE: &str = concat!(include_str!("optimizer.cu.inc"), "\0");

/// AdamW hyperparameters of one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The step number of this update, from 1 (bias correction).
    pub step: u64,
}

/// One parameter's tensors: the low-precision parameter and its gradient, its fp32
/// master and fp32 moments (all on one device).
pub struct MasterSlot<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub master: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
}

/// Elements per group of tensors: bounds the fp32 copy of a group's gradients (1 GiB).
const GROUP_ELEMS: i64 = 1 << 28;

/// Updates every master in place (decoupled weight decay, bias-corrected moments, as
/// torch.optim.AdamW) and copies it, rounded, into its parameter.
pub fn fused_adamw_masters(slots: &[MasterSlot<'_>], c: AdamWStep) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    if slots.is_empty() {
        return Ok(());
    }
    let n = c_int::try_from(slots.len())
        .map_err(|_| CudaError(format!("{} tensors are too many for one call", slots.len())))?;
    let list = |pick: fn(&MasterSlot<'_>) -> *mut c_void| -> Vec<*mut c_void> {
        slots.iter().map(pick).collect()
    };
    let mut params = list(|s| s.param.as_ptr() as *mut c_void);
    let mut grads = list(|s| s.grad.as_ptr() as *mut c_void);
    let mut masters = list(|s| s.master.as_ptr() as *mut c_void);
    let mut exp_avgs = list(|s| s.exp_avg.as_ptr() as *mut c_void);
    let mut exp_avg_sqs = list(|s| s.exp_avg_sq.as_ptr() as *mut c_void);
    // SAFETY: each pointer is a live at::Tensor owned by `slots` for the whole call; the
    // shim reads `n` entries of each array and does not keep them.
    let rc = unsafe {
        manta_fused_adamw_masters(
            params.as_mut_ptr(),
            grads.as_mut_ptr(),
            masters.as_mut_ptr(),
            exp_avgs.as_mut_ptr(),
            exp_avg_sqs.as_mut_ptr(),
            n,
            c.step as f64,
            c.lr,
            c.beta1,
            c.beta2,
            c.weight_decay,
            c.eps,
            GROUP_ELEMS,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(manta_adamw_last_error()) };
        Err(CudaError(msg.to_string_lossy().into_owned()))
    }
}

/// Drops `param`'s gradient (`param.grad = None` in PyTorch): the memory goes back to the
/// allocator and the next backward pass allocates a fresh one. ZeRO-2 calls it once the
/// gradients are reduced into its shard.
pub fn clear_grad(param: &Tensor) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: `as_ptr` is the live at::Tensor behind `param`; the shim only resets its
    // gradient field.
    if unsafe { manta_clear_grad(param.as_ptr() as *mut c_void) } == 0 {
        Ok(())
    } else {
        // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(manta_adamw_last_error()) };
        Err(CudaError(msg.to_string_lossy().into_owned()))
    }
}

/// A data-parallel rank's flat optimizer state whose reduced gradient is kept in bf16
/// (`--grad-reduce-in-bf16`): contiguous tensors of one length on one GPU.
pub struct Bf16GradShard<'a> {
    /// The reduced gradient, bf16; only read.
    pub grad: &'a Tensor,
    /// The fp32 master and moments, updated in place.
    pub master: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    /// A bf16 copy of the master, refreshed after the update (ZeRO-2's parameter shard);
    /// `None` where the master is the only copy (ZeRO-3).
    pub param: Option<&'a Tensor>,
}

/// One AdamW update of `shard` in one pass over it (optimizer.cu.inc): each element's bf16
/// gradient is widened, multiplied by `grad_scale` (the pending clip scale) when given,
/// and put through ATen's fused AdamW arithmetic. The same bits as widening the gradient
/// to fp32, `mul_(grad_scale)` and [`fused_adamw_masters`], which move ~42 bytes per
/// element (bf16 read, fp32 written and re-read twice, then master and moments read and
/// written) where this moves 26 (28 with the bf16 copy). Runs on the current stream.
pub fn fused_adamw_bf16_grad(
    shard: &Bf16GradShard<'_>,
    grad_scale: Option<f64>,
    c: AdamWStep,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    let param = shard
        .param
        .map_or(std::ptr::null_mut(), |p| p.as_ptr() as *mut c_void);
    // SAFETY: live tensor handles for the call (the updated ones are written through
    // ATen's storage, as the fused AdamW writes them); the shim checks kinds, lengths,
    // devices and contiguity before it launches.
    check(unsafe {
        manta_adamw_bf16_grad(
            OPTIMIZER_SOURCE.as_ptr() as *const c_char,
            shard.grad.as_ptr() as *mut c_void,
            shard.master.as_ptr() as *mut c_void,
            shard.exp_avg.as_ptr() as *mut c_void,
            shard.exp_avg_sq.as_ptr() as *mut c_void,
            param,
            grad_scale.is_some() as c_int,
            grad_scale.unwrap_or(1.0),
            c.lr,
            c.beta1,
            c.beta2,
            c.weight_decay,
            c.eps,
            c.step as f64,
        )
    })
}

/// Σ x² of a contiguous bf16 or fp32 CUDA tensor in fp64, as a one-element fp64 tensor on
/// its device (reading it waits for the GPU). It reads `x` once; the tensor-op form
/// (`to(f64).square().sum()`) writes and re-reads an fp64 copy (~34 bytes per bf16
/// element instead of 2). Each square is exact in fp64, so only the additions round: in a
/// fixed order (528 × 256 strided partial sums, then trees), the same bits on every run
/// and GPU, though not ATen's order, so the result may differ from the tensor ops' in the
/// last bits of fp64.
pub fn sum_of_squares(x: &Tensor) -> Result<Tensor, CudaError> {
    crate::sync_kernel_knobs();
    if !matches!(x.device(), Device::Cuda(_)) {
        return Err(CudaError(format!(
            "sum_of_squares runs on a CUDA tensor, got one on {:?}",
            x.device()
        )));
    }
    let mut out = Tensor::zeros([1], (tch::Kind::Double, x.device()));
    // SAFETY: live tensor handles for the call; the shim checks kinds, devices and
    // contiguity.
    check(unsafe {
        manta_sum_of_squares(
            OPTIMIZER_SOURCE.as_ptr() as *const c_char,
            x.as_ptr() as *mut c_void,
            out.as_mut_ptr() as *mut c_void,
        )
    })?;
    Ok(out)
}

/// The tensors' handles for a multi-tensor call, and their count as the shim takes it.
fn handles(tensors: &[Tensor]) -> Result<(Vec<*mut c_void>, c_int), CudaError> {
    let n = c_int::try_from(tensors.len()).map_err(|_| {
        CudaError(format!(
            "{} tensors are too many for one call",
            tensors.len()
        ))
    })?;
    Ok((
        tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect(),
        n,
    ))
}

/// Σ ||t||² over `tensors` (at least one; one device and kind for the single-launch path)
/// as a 0-d fp64 tensor on their device: each norm accumulated in fp32 by ATen's
/// `_foreach_norm`, their squares summed in fp64. Reading it waits for the device.
pub fn foreach_sq_norm(tensors: &[Tensor]) -> Result<Tensor, CudaError> {
    let (mut list, n) = handles(tensors)?;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `list` holds live at::Tensor handles owned by `tensors` for the call; on
    // success `out` is a new at::Tensor we own.
    check(unsafe { manta_foreach_sq_norm(list.as_mut_ptr(), n, &mut out) })?;
    // SAFETY: on success `out` is a new heap at::Tensor nothing else owns.
    Ok(unsafe { crate::owned_tensor(out) })
}

/// Multiplies every tensor of `tensors` in place by `scale` (ATen's `_foreach_mul_`).
pub fn foreach_scale_(tensors: &[Tensor], scale: f64) -> Result<(), CudaError> {
    let (mut list, n) = handles(tensors)?;
    // SAFETY: `list` holds live at::Tensor handles owned by `tensors` for the call.
    check(unsafe { manta_foreach_scale_(list.as_mut_ptr(), n, scale) })
}

/// Sets every tensor of `tensors` to zero in place (ATen's `_foreach_zero_`).
pub fn foreach_zero_(tensors: &[Tensor]) -> Result<(), CudaError> {
    let (mut list, n) = handles(tensors)?;
    // SAFETY: `list` holds live at::Tensor handles owned by `tensors` for the call.
    check(unsafe { manta_foreach_zero_(list.as_mut_ptr(), n) })
}

/// Compiles the optimizer kernels for `sm_<arch>` with NVRTC (no GPU needed).
pub fn optimizer_kernels_compile(arch: u32) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_kernels_compile_check(OPTIMIZER_SOURCE.as_ptr() as *const c_char, arch as c_int)
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::built_with_cuda;

    #[test]
    fn optimizer_kernels_compile_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        if let Err(e) = optimizer_kernels_compile(90) {
            panic!("{e}");
        }
    }

    #[test]
    fn cpu_tensors_are_refused_by_name() {
        let f = |n| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let (master, m, v) = (f(8), f(8), f(8));
        let grad = Tensor::zeros([8], (Kind::BFloat16, Device::Cpu));
        let shard = Bf16GradShard {
            grad: &grad,
            master: &master,
            exp_avg: &m,
            exp_avg_sq: &v,
            param: None,
        };
        let step = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        let e = fused_adamw_bf16_grad(&shard, None, step).unwrap_err();
        let expected = if built_with_cuda() {
            "CUDA"
        } else {
            "built without CUDA"
        };
        assert!(e.to_string().contains(expected), "{e}");
        let e = sum_of_squares(&master).unwrap_err();
        assert!(e.to_string().contains("CUDA tensor"), "{e}");
    }

    /// The multi-tensor helpers against per-tensor ops (ATen runs them on the CPU too).
    #[test]
    fn foreach_helpers_match_per_tensor_ops() {
        tch::manual_seed(1);
        let tensors: Vec<Tensor> = [vec![3, 5], vec![1000], vec![7, 9, 11]]
            .iter()
            .map(|s| {
                Tensor::randn(s.as_slice(), (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16)
            })
            .collect();
        let want: f64 = tensors
            .iter()
            .map(|t| {
                t.to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[])
            })
            .sum();
        let got = foreach_sq_norm(&tensors).expect("norm").double_value(&[]);
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        let before: Vec<Tensor> = tensors.iter().map(|t| t.copy()).collect();
        foreach_scale_(&tensors, 0.25).expect("scale");
        for (t, b) in tensors.iter().zip(&before) {
            assert!(t.equal(&(b * 0.25)), "scaled by a power of two exactly");
        }
        foreach_zero_(&tensors).expect("zero");
        assert!(tensors
            .iter()
            .all(|t| t.abs().sum(Kind::Double).double_value(&[]) == 0.0));
        let e = foreach_sq_norm(&[]).expect_err("no tensors").to_string();
        assert!(e.contains("at least one"), "{e}");
    }

    /// `t`'s elements as integers of its width (fp32 as i32, bf16 as i16), to count ulps.
    fn bits(t: &Tensor) -> Tensor {
        let kind = if t.kind() == Kind::BFloat16 {
            Kind::Int16
        } else {
            Kind::Int
        };
        t.view_dtype(kind).to_kind(Kind::Int64)
    }

    /// How many elements differ and by how many ulps at most (same-sign values).
    fn ulps(a: &Tensor, b: &Tensor) -> (i64, i64) {
        let d = (bits(a) - bits(b)).abs();
        (
            d.ne(0).sum(Kind::Int64).int64_value(&[]),
            d.max().int64_value(&[]),
        )
    }

    /// A random bf16 gradient over many magnitudes, a tenth of it exact zeros.
    fn random_grad(n: i64, dev: Device) -> Tensor {
        let opts = (Kind::Float, dev);
        let magnitude = (Tensor::randn([n], opts) * 3.0).exp() * 1e-3;
        let keep = Tensor::rand([n], opts).gt(0.1).to_kind(Kind::Float);
        (Tensor::randn([n], opts) * magnitude * keep).to_kind(Kind::BFloat16)
    }

    /// `n` elements of `t`, starting `offset` elements in (an offset of 1 makes every
    /// pointer misaligned for 8- and 16-byte accesses: the one-element kernel).
    fn slice(t: Tensor, offset: i64, n: i64) -> Tensor {
        t.narrow(0, offset, n)
    }

    /// One shard of the GPU comparison below.
    struct Case {
        n: i64,
        /// Elements into a fresh tensor the shard starts (1: misaligned).
        offset: i64,
        /// Whether a bf16 copy of the master is refreshed (ZeRO-2).
        with_param: bool,
        weight_decay: f64,
        /// The pending clip scale of each step.
        scales: [Option<f64>; 5],
    }

    /// The kernel against today's path — widen to fp32, `mul_(scale)`, ATen's
    /// `_fused_adamw_` (and its bf16 refresh) — over several steps from the same state, bit
    /// for bit in the master, both moments and the bf16 copy: lengths not a multiple of 4
    /// nor of the 256-thread block, misaligned slices (the one-element kernel), weight decay
    /// on and off, clip scales, and steps far apart (the bias corrections).
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn bf16_grad_adamw_equals_widen_scale_and_aten_fused_adamw() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(31);
        for case in [
            Case {
                n: 1_000_003,
                offset: 0,
                with_param: false,
                weight_decay: 0.1,
                scales: [Some(0.37), None, Some(0.0123), Some(0.9), None],
            },
            Case {
                n: 1_000_003,
                offset: 0,
                with_param: true,
                weight_decay: 0.0,
                scales: [None, Some(0.5), None, Some(0.2), Some(0.999)],
            },
            Case {
                n: 4099,
                offset: 1,
                with_param: true,
                weight_decay: 0.05,
                scales: [Some(0.61), Some(0.07), None, None, Some(0.3)],
            },
        ] {
            let Case {
                n,
                offset,
                with_param,
                weight_decay,
                scales,
            } = case;
            let f32s = |t: Tensor| slice(t, offset, n);
            let opts = (Kind::Float, dev);
            let master = f32s(Tensor::randn([n + offset], opts) * 0.02);
            let (m, v) = (
                f32s(Tensor::zeros([n + offset], opts)),
                f32s(Tensor::zeros([n + offset], opts)),
            );
            let mut param = slice(
                Tensor::zeros([n + offset], (Kind::BFloat16, dev)),
                offset,
                n,
            );
            param.copy_(&master);
            // Today's path on copies of the same state (copies are aligned: only the
            // kernel's pointers carry the offset).
            let (ref_master, ref_m, ref_v, ref_param) =
                (master.copy(), m.copy(), v.copy(), param.copy());
            for (s, (step, scale)) in [1u64, 2, 3, 10, 1000].into_iter().zip(scales).enumerate() {
                let what = format!("n {n} offset {offset} param {with_param} wd {weight_decay} step {step} scale {scale:?}");
                let c = AdamWStep {
                    lr: 3e-4 * (1 + s) as f64,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay,
                    step,
                };
                let mut grad = slice(
                    Tensor::zeros([n + offset], (Kind::BFloat16, dev)),
                    offset,
                    n,
                );
                grad.copy_(&random_grad(n, dev));
                let grad_before = grad.copy();
                tch::no_grad(|| {
                    let mut g = grad.to_kind(Kind::Float);
                    if let Some(scale) = scale {
                        let _ = g.g_mul_scalar_(scale);
                    }
                    let slot = MasterSlot {
                        param: if with_param { &ref_param } else { &ref_master },
                        grad: &g,
                        master: &ref_master,
                        exp_avg: &ref_m,
                        exp_avg_sq: &ref_v,
                    };
                    fused_adamw_masters(&[slot], c).expect("ATen's fused AdamW");
                });
                let shard = Bf16GradShard {
                    grad: &grad,
                    master: &master,
                    exp_avg: &m,
                    exp_avg_sq: &v,
                    param: with_param.then_some(&param),
                };
                fused_adamw_bf16_grad(&shard, scale, c).expect("the kernel runs");
                for (name, got, want) in [
                    ("master", &master, &ref_master),
                    ("exp_avg", &m, &ref_m),
                    ("exp_avg_sq", &v, &ref_v),
                ] {
                    let (count, most) = ulps(got, want);
                    assert!(
                        got.equal(want),
                        "{what}: {name} differs in {count} of {n} elements, by up to {most} ulp"
                    );
                }
                if with_param {
                    let (count, most) = ulps(&param, &ref_param);
                    assert!(
                        param.equal(&ref_param),
                        "{what}: the bf16 copy differs in {count} elements, by up to {most} ulp"
                    );
                }
                assert!(grad.equal(&grad_before), "{what}: the gradient was written");
                assert!(
                    bool::try_from(master.isfinite().all()).expect("a bool"),
                    "{what}: a non-finite master"
                );
            }
        }
    }

    /// Σ x² against a compensated host sum of the exact squares, within fp64 rounding
    /// (1e-13 relative; fp32 sums would miss by ~1e-7), and the same bits on a second run;
    /// today's tensor-op form is held to the same bound. bf16 and fp32, aligned and
    /// misaligned (one element per load), lengths not a multiple of the load, and empty.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn sum_of_squares_is_fp64_of_exact_squares_in_a_fixed_order() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(5);
        for (kind, n, offset) in [
            (Kind::BFloat16, 3_000_017i64, 0i64),
            (Kind::BFloat16, 1001, 1),
            (Kind::Float, 2_000_003, 0),
            (Kind::Float, 999, 1),
            (Kind::BFloat16, 0, 0),
        ] {
            let what = format!("{kind:?} n {n} offset {offset}");
            let opts = (Kind::Float, dev);
            let values =
                Tensor::randn([n + offset], opts) * (Tensor::randn([n + offset], opts) * 4.0).exp();
            let x = values.to_kind(kind).narrow(0, offset, n);
            let got = sum_of_squares(&x).expect("the kernel runs");
            let again = sum_of_squares(&x).expect("the kernel runs");
            assert!(got.equal(&again), "{what}: two runs differ");
            let got = got.double_value(&[0]);
            let host = Vec::<f32>::try_from(x.to_kind(Kind::Float).to(Device::Cpu)).expect("f32");
            // Neumaier's compensated sum: within ~2 ulps of the exact sum.
            let (mut sum, mut carry) = (0f64, 0f64);
            for v in host {
                let sq = v as f64 * v as f64;
                let t = sum + sq;
                carry += if sum.abs() >= sq {
                    (sum - t) + sq
                } else {
                    (sq - t) + sum
                };
                sum = t;
            }
            let exact = sum + carry;
            if n == 0 {
                assert_eq!(got, 0.0, "{what}");
                continue;
            }
            let tensor_ops = x
                .to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[]);
            for (name, value) in [("kernel", got), ("tensor ops", tensor_ops)] {
                let rel = (value - exact).abs() / exact;
                assert!(
                    rel <= 1e-13,
                    "{what}: {name} {value} vs {exact} ({rel:e} relative)"
                );
            }
        }
    }
}
