//! The decoder's RMSNorm with Hugging Face's rounding in one kernel forward and two backward
//! (rms_norm.cu.inc), differentiable through a libtorch autograd function (rms_norm.cpp).
//! Through tensor ops the norm is libtorch's rms_norm, a broadcast multiply by the weight
//! (a strided, unvectorised kernel), and backward their gradients plus a reduction over
//! rows for the weight: about a quarter of a Qwen3-0.6B GRPO step's GPU time, for the
//! hidden states twice a layer and every head's q and k, forward, recompute and backward.
//! The forward rounds as those ops do (the normed value, then ATen's multiply); its sum of
//! squares runs in another order than libtorch's, so an element can round the other way
//! where the two sums differ in their last bit. The backward is within rounding of
//! autograd's and deterministic.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, ptr, CudaError};

extern "C" {
    fn manta_rms_norm(
        source: *const c_char,
        x: *mut c_void,
        w: *mut c_void,
        eps: f64,
        out: *mut *mut c_void,
    ) -> c_int;
}

/// The widest row the kernels take (their `RN_THREADS · 8 · 4`).
pub const MAX_DIM: i64 = 8192;

/// The RMSNorm kernels' CUDA source, NUL-terminated for NVRTC.
const RMS_NORM_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("kind16.cu.inc"),
    include_str!("rms_norm.cu.inc"),
    "\0"
);

/// `R(R(x · rsqrt(mean(x²) + eps)) · w)` per row of `x` [rows, dim] with `w` [dim] (R: the
/// 16-bit kind's rounding): Hugging Face's Qwen3/Llama RMSNorm, the norm in fp32 rounded
/// before the weight multiplies it. Contiguous, both bf16 or both fp16, on one CUDA device,
/// `dim` a multiple of 8 up to [`MAX_DIM`]. The result carries an autograd node when `x`
/// or `w` requires grad, whose backward gives both gradients. Compiled with NVRTC on first
/// use per device, launched on libtorch's current stream.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, CudaError> {
    crate::sync_kernel_knobs();
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensor handles for the call and a NUL-terminated static source (the
    // autograd node keeps its address for the backward); the shim checks shapes, kinds and
    // devices. On success `out` is a new at::Tensor we own.
    check(unsafe {
        manta_rms_norm(
            RMS_NORM_SOURCE.as_ptr() as *const c_char,
            ptr(x),
            ptr(w),
            eps,
            &mut out,
        )
    })?;
    // SAFETY: on success `out` is a new heap at::Tensor nothing else owns.
    Ok(unsafe { crate::owned_tensor(out) })
}

/// Compiles the RMSNorm kernels for `sm_<arch>` with NVRTC (no GPU needed).
pub fn compile_check(arch: u32) -> Result<(), CudaError> {
    crate::compile_source(RMS_NORM_SOURCE, arch)
}
