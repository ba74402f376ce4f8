//! The decoder MLP's gated activation `silu(gate) * up` in one kernel each way
//! (swiglu.cu.inc), differentiable through a libtorch autograd function (swiglu.cpp).
//! Through tensor ops it is two kernels forward and three backward over [tokens,
//! intermediate] tensors in every layer, forward, recompute and backward. The forward rounds
//! as ATen's silu and mul do (bit-identical output: true on-policy mode compares log-probs
//! bit for bit); the backward applies autograd's roundings in its order.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, ptr, CudaError};

extern "C" {
    fn manta_swiglu(
        source: *const c_char,
        gate: *mut c_void,
        up: *mut c_void,
        out: *mut *mut c_void,
    ) -> c_int;
}

/// The gated activation kernels' CUDA source, NUL-terminated for NVRTC.
const SWIGLU_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("kind16.cu.inc"),
    include_str!("swiglu.cu.inc"),
    "\0"
);

/// `silu(gate) * up` element-wise: `gate` and `up` of one shape, both bf16 or both fp16,
/// on one CUDA device. Bit-identical to those tensor ops. The result carries an autograd
/// node when either requires grad, whose backward (one kernel) gives both gradients.
/// Compiled with NVRTC on first use per device, launched on libtorch's current stream.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor, CudaError> {
    crate::sync_kernel_knobs();
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensor handles for the call and a NUL-terminated static source (the
    // autograd node keeps its address for the backward); the shim checks shapes, kinds and
    // devices. On success `out` is a new at::Tensor we own.
    check(unsafe {
        manta_swiglu(
            SWIGLU_SOURCE.as_ptr() as *const c_char,
            ptr(gate),
            ptr(up),
            &mut out,
        )
    })?;
    // SAFETY: on success `out` is a new heap at::Tensor nothing else owns.
    Ok(unsafe { crate::owned_tensor(out) })
}

/// Compiles the gated activation kernels for `sm_<arch>` with NVRTC (no GPU needed).
pub fn compile_check(arch: u32) -> Result<(), CudaError> {
    crate::compile_source(SWIGLU_SOURCE, arch)
}
