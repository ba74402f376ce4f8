//! CUDA IPC between processes on one GPU (weight sync when trainer and engine share a
//! device): the owner exports an [`IpcHandle`] per tensor (the allocation's handle plus
//! the data's offset in it); the other process opens each allocation once
//! ([`IpcMapping`]) and copies tensors out of it on the device, never through the host.
//!
//! PyTorch's caching allocator packs many tensors into one allocation, so handles carry
//! the allocation's base address: tensors with the same base share one mapping.

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{Kind, Tensor};

use crate::CudaError;

/// Bytes of a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const HANDLE_BYTES: usize = 64;

extern "C" {
    fn manta_ipc_last_error() -> *const c_char;
    fn manta_ipc_export(
        tensor: *mut c_void,
        handle: *mut u8,
        offset: *mut u64,
        base: *mut u64,
        device: *mut c_int,
    ) -> c_int;
    fn manta_ipc_open(handle: *const u8, device: c_int, base: *mut u64) -> c_int;
    fn manta_ipc_view(
        base: u64,
        offset: u64,
        shape: *const i64,
        ndim: c_int,
        dtype: c_int,
        device: c_int,
    ) -> *mut c_void;
    fn manta_ipc_close(base: u64, device: c_int) -> c_int;
}

fn ipc_error() -> CudaError {
    // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(manta_ipc_last_error()) };
    CudaError(msg.to_string_lossy().into_owned())
}

fn ipc_check(rc: c_int) -> Result<(), CudaError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(ipc_error())
    }
}

/// Where one tensor's data lives, as another process on the same GPU can map it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcHandle {
    /// The allocation's IPC handle.
    pub handle: [u8; HANDLE_BYTES],
    /// The allocation's base address in the exporting process (groups tensors that
    /// share an allocation; meaningless in the importer).
    pub base: u64,
    /// The tensor's data pointer minus the allocation's base.
    pub offset: u64,
    pub device: i32,
}

/// The IPC handle of `tensor`'s allocation. The tensor must stay alive (and keep its
/// storage) while another process maps it.
pub fn export_handle(tensor: &Tensor) -> Result<IpcHandle, CudaError> {
    let mut out = IpcHandle {
        handle: [0; HANDLE_BYTES],
        base: 0,
        offset: 0,
        device: 0,
    };
    let mut device: c_int = 0;
    // SAFETY: the tensor handle is live for the call; the output pointers are valid for
    // writes (the handle buffer holds HANDLE_BYTES).
    ipc_check(unsafe {
        manta_ipc_export(
            tensor.as_ptr() as *mut c_void,
            out.handle.as_mut_ptr(),
            &mut out.offset,
            &mut out.base,
            &mut device,
        )
    })?;
    out.device = device;
    Ok(out)
}

/// c10's ScalarType number for the kinds weights come in.
fn scalar_type(kind: Kind) -> Result<c_int, CudaError> {
    Ok(match kind {
        Kind::Uint8 => 0,
        Kind::Int8 => 1,
        Kind::Int16 => 2,
        Kind::Int => 3,
        Kind::Int64 => 4,
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::Double => 7,
        Kind::Bool => 11,
        Kind::BFloat16 => 15,
        other => {
            return Err(CudaError(format!(
                "CUDA IPC: dtype {other:?} is not supported"
            )))
        }
    })
}

/// Another process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    base: u64,
    device: i32,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` on `device` (the exporter's GPU).
    pub fn open(handle: &[u8; HANDLE_BYTES], device: i32) -> Result<Self, CudaError> {
        let mut base = 0u64;
        // SAFETY: the handle buffer holds HANDLE_BYTES; `base` is valid for writes.
        ipc_check(unsafe { manta_ipc_open(handle.as_ptr(), device, &mut base) })?;
        Ok(Self { base, device })
    }

    /// Copies the tensor at `offset` (with `dst`'s shape and dtype) into `dst`, on the
    /// device, on the current stream.
    pub fn copy_into(&self, offset: u64, dst: &mut Tensor) -> Result<(), CudaError> {
        let view = self.view(offset, &dst.size(), dst.kind())?;
        dst.f_copy_(&view)
            .map_err(|e| CudaError(format!("CUDA IPC copy: {e}")))
    }

    /// A tensor of `shape` and `kind` over the mapped bytes at `offset`; it must not be
    /// used after the mapping is dropped (read it, or copy out of it, first).
    pub fn view(&self, offset: u64, shape: &[i64], kind: Kind) -> Result<Tensor, CudaError> {
        let dtype = scalar_type(kind)?;
        // SAFETY: `shape` is valid for `ndim` reads; the shim returns a new at::Tensor
        // (owned by the returned Tensor) or null with the error kept.
        let ptr = unsafe {
            manta_ipc_view(
                self.base,
                offset,
                shape.as_ptr(),
                shape.len() as c_int,
                dtype,
                self.device,
            )
        };
        if ptr.is_null() {
            return Err(ipc_error());
        }
        // SAFETY: ptr is a heap at::Tensor created for us; Tensor frees it on drop.
        Ok(unsafe { Tensor::from_ptr(ptr as *mut torch_sys::C_tensor) })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: base was mapped by manta_ipc_open and is unmapped once.
        let _ = ipc_check(unsafe { manta_ipc_close(self.base, self.device) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_export_and_open_fail_clearly() {
        let cpu = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
        let err = export_handle(&cpu).unwrap_err().to_string();
        assert!(
            err.contains("needs a CUDA tensor") || err.contains("built without CUDA"),
            "{err}"
        );
        if !tch::Cuda::is_available() {
            let err = IpcMapping::open(&[0; HANDLE_BYTES], 0)
                .unwrap_err()
                .to_string();
            assert!(!err.is_empty());
        }
    }
}
