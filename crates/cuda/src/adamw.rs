//! AdamW over fp32 master weights through ATen's multi-tensor `_fused_adamw_` (the kernel
//! behind `torch.optim.AdamW(fused=True)`), which tch does not expose: one pass over each
//! group of masters, gradients and moments instead of a chain of element-wise kernels per
//! parameter. CPU and CUDA (adamw.cpp).

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::Tensor;

use crate::CudaError;

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
}

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
