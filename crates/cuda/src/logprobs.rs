//! The trainer's per-token log-probs, entropies and their gradient w.r.t. the logits in one
//! kernel each (logprobs.cu.inc). Scoring a [rows × vocab] chunk through tensor ops reads and
//! writes its fp32 logits a dozen times (scale, log-softmax, gather, exp, product, sum, and
//! autograd's backward of each); these kernels read them once per pass and write only [rows]
//! results, or the 16-bit gradient that the LM head's GEMMs consume.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, opt_ptr, CudaError};

extern "C" {
    fn manta_logprob_rows(
        source: *const c_char,
        logits: *mut c_void,
        targets: *mut c_void,
        temperature: f64,
        logp: *mut c_void,
        entropy: *mut c_void,
        stats: *mut c_void,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_logprob_grad(
        source: *const c_char,
        logits: *mut c_void,
        targets: *mut c_void,
        stats: *mut c_void,
        entropy: *mut c_void,
        g_logp: *mut c_void,
        g_entropy: *mut c_void,
        temperature: f64,
        out: *mut c_void,
    ) -> c_int;
    fn manta_kernels_compile_check(source: *const c_char, arch: c_int) -> c_int;
    fn manta_set_grad(param: *mut c_void, grad: *mut c_void) -> c_int;
}

/// The log-prob kernels' CUDA source, NUL-terminated for NVRTC.
const LOGPROBS_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("logprobs.cu.inc"),
    "\0"
);

/// What [`logprob_rows`] writes, per row.
pub struct RowScores<'a> {
    /// [rows] fp32: `log_softmax(logits / T)` at the target (NaN for a target outside the
    /// vocabulary).
    pub logp: &'a mut Tensor,
    /// [rows] fp32: the entropy of `softmax(logits / T)`.
    pub entropy: &'a mut Tensor,
    /// [rows, 2] fp32: the max of `logits / T` and the log of `Σ exp(logits / T − max)`,
    /// which [`logprob_grad`] reuses instead of reducing the row again.
    pub stats: &'a mut Tensor,
}

/// For each row of `logits` [rows, vocab] (contiguous fp32, CUDA) and its target (`targets`
/// [rows] int64): the target's log-prob, the entropy and the softmax statistics at
/// `temperature`, in one read of the row, as ATen's `(logits / T).log_softmax(-1)` gathers
/// them up to the order of its sums. Runs on libtorch's current stream.
pub fn logprob_rows(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
    out: RowScores<'_>,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, kinds and devices.
    check(unsafe {
        manta_logprob_rows(
            LOGPROBS_SOURCE.as_ptr() as *const c_char,
            logits.as_ptr() as *mut c_void,
            targets.as_ptr() as *mut c_void,
            temperature,
            out.logp.as_mut_ptr() as *mut c_void,
            out.entropy.as_mut_ptr() as *mut c_void,
            out.stats.as_mut_ptr() as *mut c_void,
        )
    })
}

/// The inputs of [`logprob_grad`] that [`logprob_rows`] produced for the same rows.
pub struct RowStats<'a> {
    /// [rows, 2] fp32, [`RowScores::stats`].
    pub stats: &'a Tensor,
    /// [rows] fp32, [`RowScores::entropy`].
    pub entropy: &'a Tensor,
}

/// Writes to `out` (bf16 or fp16, shaped like `logits`) the gradient w.r.t. `logits` of
/// `Σ g_logp·logp + Σ g_entropy·entropy` at `temperature` (a term whose gradient is `None`
/// is absent), rounded once to `out`'s kind: what autograd hands a 16-bit LM head through
/// `(logits.to(float) / T).log_softmax(-1)`, its gather and its entropy. `g_*`: [rows] fp32.
pub fn logprob_grad(
    logits: &Tensor,
    targets: &Tensor,
    row: RowStats<'_>,
    g_logp: Option<&Tensor>,
    g_entropy: Option<&Tensor>,
    temperature: f64,
    out: &mut Tensor,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: live tensor handles (or null for an absent term) for the call; the shim
    // checks shapes, kinds and devices.
    check(unsafe {
        manta_logprob_grad(
            LOGPROBS_SOURCE.as_ptr() as *const c_char,
            logits.as_ptr() as *mut c_void,
            targets.as_ptr() as *mut c_void,
            row.stats.as_ptr() as *mut c_void,
            row.entropy.as_ptr() as *mut c_void,
            opt_ptr(g_logp),
            opt_ptr(g_entropy),
            temperature,
            out.as_mut_ptr() as *mut c_void,
        )
    })
}

/// Compiles the log-prob kernels for `sm_<arch>` with NVRTC (no GPU needed).
pub fn compile_check(arch: u32) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_kernels_compile_check(LOGPROBS_SOURCE.as_ptr() as *const c_char, arch as c_int)
    })
}

/// `param.grad = grad` (tch has no setter): a gradient computed outside autograd becomes the
/// parameter's when it has none yet, as autograd's first accumulation would make it (the
/// tensor itself, not a copy: later accumulations add into it). `grad` must match the
/// parameter's shape, kind and device. CUDA builds only.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<(), CudaError> {
    // SAFETY: live tensor handles for the call; the shim checks shape, kind and device.
    check(unsafe { manta_set_grad(param.as_ptr() as *mut c_void, grad.as_ptr() as *mut c_void) })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::built_with_cuda;

    #[test]
    fn logprob_kernels_compile_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        if let Err(e) = compile_check(90) {
            panic!("{e}");
        }
    }

    #[test]
    fn set_grad_gives_a_parameter_its_gradient() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        let param = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        assert!(!param.grad().defined());
        let values = Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.]).view([3, 2]);
        set_grad(&param, &values.copy()).expect("same shape, kind and device");
        assert!(param.grad().equal(&values));
        // Autograd accumulates into it from then on.
        (&param * 2.0).sum(Kind::Float).backward();
        assert!(param.grad().equal(&(&values + 2.0)));
        let wrong = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let e = set_grad(&param, &wrong)
            .expect_err("shape differs")
            .to_string();
        assert!(e.contains("must match its parameter"), "{e}");
    }

    /// Against float64 arithmetic on the host from the same fp32 logits: log-probs within
    /// 5e-6 (a few fp32 ulps of log(vocab)), entropies within 4e-6, the gradient within one
    /// bf16 rounding of the float64 value (2^-8 relative, plus fp32's error in p and
    /// log p + H where the terms cancel) for both terms at once, at T = 0.7 and 1, rows of
    /// Qwen's vocabulary (float4 path) and of an odd one (scalar path); an out-of-range
    /// target's log-prob is NaN.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn logprob_kernels_match_float64() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        tch::manual_seed(11);
        for (rows, vocab) in [(5i64, 151_936i64), (7, 1001)] {
            for temperature in [0.7, 1.0] {
                check_against_float64(gpu, rows, vocab, temperature);
            }
        }
    }

    fn check_against_float64(gpu: usize, rows: i64, vocab: i64, temperature: f64) {
        let device = Device::Cuda(gpu);
        let logits = Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * 2.5;
        // A target in every row; the last row's is out of range (a NaN log-prob).
        let targets: Vec<i64> = (0..rows)
            .map(|r| {
                if r == rows - 1 {
                    vocab
                } else {
                    (r * 7919) % vocab
                }
            })
            .collect();
        let g_logp: Vec<f32> = (0..rows).map(|r| 0.5 - r as f32 * 0.3).collect();
        let g_ent: Vec<f32> = (0..rows).map(|r| 0.2 + r as f32 * 0.1).collect();
        let on = |t: &Tensor| t.to(device);
        let (logits_d, targets_d) = (on(&logits), on(&Tensor::from_slice(&targets)));
        let f32s = |n: i64| Tensor::zeros([n], (Kind::Float, device));
        let (mut logp, mut entropy, mut stats) = (f32s(rows), f32s(rows), f32s(2 * rows));
        let scores = RowScores {
            logp: &mut logp,
            entropy: &mut entropy,
            stats: &mut stats,
        };
        logprob_rows(&logits_d, &targets_d, temperature, scores).expect("forward kernel");
        let mut grad = Tensor::zeros([rows, vocab], (Kind::BFloat16, device));
        let stats = stats.view([rows, 2]);
        let row = RowStats {
            stats: &stats,
            entropy: &entropy,
        };
        let (gl, ge) = (
            on(&Tensor::from_slice(&g_logp)),
            on(&Tensor::from_slice(&g_ent)),
        );
        logprob_grad(
            &logits_d,
            &targets_d,
            row,
            Some(&gl),
            Some(&ge),
            temperature,
            &mut grad,
        )
        .expect("gradient kernel");
        let host = |t: &Tensor| {
            Vec::<f64>::try_from(t.to(Device::Cpu).to_kind(Kind::Double).view([-1])).expect("f64")
        };
        let (logp, entropy, grad) = (host(&logp), host(&entropy), host(&grad));
        let z = host(&logits);
        let inv_t32 = 1.0f32 / temperature as f32;
        let inv_t = inv_t32 as f64;
        for r in 0..rows as usize {
            // logits / T as fp32 holds it (ATen and the kernel scale alike); the rest in f64.
            let x: Vec<f64> = z[r * vocab as usize..(r + 1) * vocab as usize]
                .iter()
                .map(|&v| (v as f32 * inv_t32) as f64)
                .collect();
            let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            let lp: Vec<f64> = x.iter().map(|v| v - lse).collect();
            let h: f64 = -lp.iter().map(|l| l.exp() * l).sum::<f64>();
            let what = format!("vocab {vocab} T {temperature} row {r}");
            let target = targets[r] as usize;
            if target < vocab as usize {
                let want = lp[target];
                assert!(
                    (logp[r] - want).abs() < 5e-6,
                    "{what}: logp {} vs {want}",
                    logp[r]
                );
            } else {
                assert!(
                    logp[r].is_nan(),
                    "{what}: out-of-range target gives {}",
                    logp[r]
                );
            }
            assert!(
                (entropy[r] - h).abs() < 4e-6,
                "{what}: entropy {} vs {h}",
                entropy[r]
            );
            let (a, b) = (g_logp[r] as f64, g_ent[r] as f64);
            for (j, &l) in lp.iter().enumerate() {
                let p = l.exp();
                let onehot = if j == target { 1.0 } else { 0.0 };
                let want = (a * (onehot - p) - b * p * (l + h)) * inv_t;
                // One bf16 rounding, plus fp32's error in p and lp + H where the terms
                // cancel.
                let slack = 2e-5 * p * (a.abs() + b.abs() * (l.abs() + h + 1.0)) * inv_t;
                let got = grad[r * vocab as usize + j];
                assert!(
                    (got - want).abs() <= want.abs() / 256.0 + slack + 1e-12,
                    "{what} column {j}: gradient {got} vs {want}"
                );
            }
        }
    }
}
