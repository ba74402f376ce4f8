//! Next-token choice on the GPU in two kernels per step (sampling.cu.inc): greedy argmax
//! or inverse-CDF sampling over `softmax(logits / T)`, with the chosen token's log-prob.
//! A decode step's sampling is otherwise a dozen small tensor ops, each a launch from the
//! host; at small batches their launch cost rivals the model's forward.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, CudaError};

extern "C" {
    fn manta_sample_rows(
        source: *const c_char,
        logits: *mut c_void,
        params: *mut c_void,
        out: *mut c_void,
    ) -> c_int;
    fn manta_kernels_compile_check(source: *const c_char, arch: c_int) -> c_int;
}

/// The sampling kernel's CUDA source, NUL-terminated for NVRTC.
const SAMPLING_SOURCE: &str = concat!(include_str!("sampling.cu.inc"), "\0");

/// For each row of `logits` [rows, vocab] (fp32, CUDA): with `params` [2, rows] fp32 holding
/// the temperature (≤ 0: greedy, log-prob at temperature 1) and a uniform draw in [0, 1),
/// writes `out` [2, rows] f64 = (token id, log-prob under `log_softmax(logits / T)`).
/// Sampled tokens are the first in vocabulary order whose cumulative mass exceeds
/// `u × total`, as the tensor-op sampler's inverse CDF. No top-k / top-p / min-p here.
pub fn sample_rows(logits: &Tensor, params: &Tensor, out: &mut Tensor) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe {
        manta_sample_rows(
            SAMPLING_SOURCE.as_ptr() as *const c_char,
            logits.as_ptr() as *mut c_void,
            params.as_ptr() as *mut c_void,
            out.as_mut_ptr() as *mut c_void,
        )
    })
}

/// Compiles the sampling kernel for `sm_<arch>` with NVRTC (no GPU needed).
pub fn sampling_compile(arch: u32) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_kernels_compile_check(SAMPLING_SOURCE.as_ptr() as *const c_char, arch as c_int)
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::built_with_cuda;

    #[test]
    fn sampling_kernel_compiles_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        if let Err(e) = sampling_compile(90) {
            panic!("{e}");
        }
    }

    /// Against float64 arithmetic on the host: greedy rows pick the argmax; sampled rows pick
    /// the token whose cumulative-mass interval holds u × total (up to float32 rounding at
    /// the interval's ends); log-probs are log_softmax(logits / T) at the chosen token.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn sample_rows_matches_float64_inverse_cdf() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        tch::manual_seed(7);
        // One chunk, a few chunks, and Qwen's vocabulary (75 chunks): each chunk held in
        // registers. Past 256 × 2,048 logits the chunks are longer and read twice.
        for vocab in [1000i64, 5000, 151_936] {
            check_against_float64(gpu, 48, vocab);
        }
        check_against_float64(gpu, 8, 600_000);
    }

    fn check_against_float64(gpu: usize, rows: i64, vocab: i64) {
        let logits = Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * 3.0;
        let temps: Vec<f32> = (0..rows)
            .map(|r| match r % 4 {
                0 => 0.0,
                1 => 1.0,
                2 => 0.7,
                _ => 1.6,
            })
            .collect();
        let uniform: Vec<f32> = (0..rows)
            .map(|r| ((r * 37 + 11) % 97) as f32 / 97.0)
            .collect();
        let params = Tensor::from_slice(&[temps.clone(), uniform.clone()].concat())
            .view([2, rows])
            .to(Device::Cuda(gpu));
        let mut out = Tensor::zeros([2, rows], (Kind::Double, Device::Cuda(gpu)));
        sample_rows(&logits.to(Device::Cuda(gpu)), &params, &mut out).expect("kernel runs");
        let out = Vec::<f64>::try_from(out.to(Device::Cpu).view([-1])).expect("f64");
        let host = Vec::<f32>::try_from(logits.view([-1])).expect("f32");
        for r in 0..rows as usize {
            let row = &host[r * vocab as usize..(r + 1) * vocab as usize];
            let token = out[r] as usize;
            let logprob = out[rows as usize + r];
            let t = if temps[r] > 0.0 { temps[r] as f64 } else { 1.0 };
            let scaled: Vec<f64> = row.iter().map(|&x| x as f64 / t).collect();
            let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = scaled.iter().map(|x| (x - max).exp()).sum();
            let lse = max + total.ln();
            assert!(
                (logprob - (scaled[token] - lse)).abs() < 1e-4,
                "row {r}: log-prob {logprob} vs {}",
                scaled[token] - lse
            );
            if temps[r] <= 0.0 {
                let argmax = (0..row.len())
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                    .unwrap_or(0);
                assert_eq!(token, argmax, "row {r}: greedy");
                continue;
            }
            let target = uniform[r] as f64 * total;
            let before: f64 = scaled[..token].iter().map(|x| (x - max).exp()).sum();
            let through = before + (scaled[token] - max).exp();
            let slack = 1e-5 * total;
            assert!(
                before <= target + slack && through > target - slack,
                "vocab {vocab} row {r}: token {token} covers [{before}, {through}), target {target}"
            );
        }
    }
}
