//! The trainer's rotary embedding (rotate-half layout) in one kernel each way (rope.cu.inc),
//! differentiable through a libtorch autograd function (rope.cpp). Through tensor ops,
//! `x * cos + rotate_half(x) * sin` costs five strided element-wise kernels forward (mul,
//! neg, cat, mul, add) and more backward, for q and k in every layer and again in every
//! recomputed layer; a GRPO step of Qwen3-0.6B spent about a sixth of its GPU time there.
//! The forward rounds each product and the sum as ATen's bf16/fp16 `mul` and `add` do, so
//! its output is bit-identical to the tensor ops' (true on-policy mode compares log-probs
//! bit for bit); the backward rounds once.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, ptr, CudaError};

extern "C" {
    fn manta_rope(
        source: *const c_char,
        x: *mut c_void,
        cos: *mut c_void,
        sin: *mut c_void,
        out: *mut *mut c_void,
    ) -> c_int;
}

/// The rotary embedding kernels' CUDA source, NUL-terminated for NVRTC.
const ROPE_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("kind16.cu.inc"),
    include_str!("rope.cu.inc"),
    "\0"
);

/// `x * cos + rotate_half(x) * sin` (`rotate_half(x) = cat(-x[.., hd/2..], x[.., ..hd/2])`)
/// for `x` [rows, heads, head_dim] and `cos`, `sin` [rows, head_dim] (each row's table
/// shared by its heads): contiguous, all bf16 or all fp16, on one CUDA device, head_dim
/// even. Bit-identical to those tensor ops. The result carries an autograd node when `x`
/// requires grad, whose backward is one kernel too; `cos` and `sin` are constants and must
/// not require grad. Compiled with NVRTC on first use per device, launched on libtorch's
/// current stream.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, CudaError> {
    crate::sync_kernel_knobs();
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensor handles for the call and a NUL-terminated static source (the
    // autograd node keeps its address for the backward); the shim checks shapes, kinds and
    // devices. On success `out` is a new at::Tensor we own.
    check(unsafe {
        manta_rope(
            ROPE_SOURCE.as_ptr() as *const c_char,
            ptr(x),
            ptr(cos),
            ptr(sin),
            &mut out,
        )
    })?;
    // SAFETY: on success `out` is a new heap at::Tensor nothing else owns.
    Ok(unsafe { crate::owned_tensor(out) })
}

/// Compiles the rotary embedding kernels for `sm_<arch>` with NVRTC (no GPU needed).
pub fn compile_check(arch: u32) -> Result<(), CudaError> {
    crate::compile_source(ROPE_SOURCE, arch)
}
