//! [`NcclCollective`]: a rank of an NCCL communicator (cudarc, loaded at run time) working
//! straight on tch CUDA tensors' memory, queued on libtorch's current stream so the
//! collectives are ordered with the tensor ops around them without extra syncs.
//!
//! Setting up: rank 0 calls [`NcclCollective::unique_id`] and hands the 128 bytes to
//! every rank (Manta's gRPC will carry them; a file or an environment variable for now),
//! then every rank calls [`NcclCollective::new`] with its GPU.

use std::ffi::{c_char, c_void, CStr};

use cudarc::nccl::{result, sys};
use tch::{Device, Kind, Tensor};

use super::{check_flat, check_pair, check_rank, Collective, CollectiveError, ReduceOp};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// One rank of an NCCL communicator, bound to one GPU.
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    device: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// not concurrent; `&self` methods are only reached through the owning trainer, which
// runs one step at a time.
unsafe impl Send for NcclCollective {}

/// Why NCCL cannot run in this process, if it cannot: no CUDA libtorch, no GPU, no
/// libnccl to load.
fn unavailable(device: usize) -> Option<String> {
    if !manta_cuda::built_with_cuda() {
        return Some("this build has no CUDA libtorch".into());
    }
    let count = tch::Cuda::device_count();
    if count as usize <= device {
        return Some(format!("GPU {device} requested, {count} visible"));
    }
    // SAFETY: only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return Some(
            "libnccl.so not found on LD_LIBRARY_PATH (pip: nvidia/nccl/lib; link libnccl.so.2 \
             as libnccl.so)"
                .into(),
        );
    }
    None
}

/// An NCCL failure with NCCL's own words: the result code, its description and the
/// last error NCCL logged (for `comm`, or the process's before a communicator exists).
fn nccl_err(
    op: &'static str,
    comm: sys::ncclComm_t,
) -> impl Fn(result::NcclError) -> CollectiveError {
    move |e| {
        // SAFETY: both return static or NCCL-owned NUL-terminated strings (or null);
        // a null communicator asks for the last error outside any communicator.
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let (what, last) = unsafe {
            (
                text(sys::ncclGetErrorString(e.0)),
                text(sys::ncclGetLastError(comm)),
            )
        };
        let mut message = format!("{:?} ({what})", e.0);
        if !last.is_empty() {
            message.push_str(": ");
            message.push_str(&last);
        }
        CollectiveError::Nccl { op, message }
    }
}

fn dtype(op: &'static str, kind: Kind) -> Result<sys::ncclDataType_t, CollectiveError> {
    use sys::ncclDataType_t as D;
    Ok(match kind {
        Kind::Float => D::ncclFloat32,
        Kind::BFloat16 => D::ncclBfloat16,
        Kind::Half => D::ncclFloat16,
        Kind::Double => D::ncclFloat64,
        Kind::Int64 => D::ncclInt64,
        Kind::Int => D::ncclInt32,
        other => {
            return Err(CollectiveError::BadTensor {
                op,
                message: format!("{other:?} tensors are not supported"),
            })
        }
    })
}

fn reduce_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclCollective {
    /// A fresh unique id (rank 0 makes it once per group).
    pub fn unique_id() -> Result<Vec<u8>, CollectiveError> {
        if let Some(why) = unavailable(0) {
            return Err(CollectiveError::Unavailable(why));
        }
        let id = result::get_uniqueid().map_err(nccl_err("get_uniqueid", std::ptr::null_mut()))?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    /// Joins the group that `unique_id` names as `rank` of `world` on CUDA device
    /// `device`; blocks until every rank has joined.
    pub fn new(
        rank: usize,
        world: usize,
        unique_id: &[u8],
        device: usize,
    ) -> Result<Self, CollectiveError> {
        check_rank(rank, world)?;
        if unique_id.len() != UNIQUE_ID_BYTES {
            return Err(CollectiveError::Unavailable(format!(
                "unique id has {} bytes, expected {UNIQUE_ID_BYTES}",
                unique_id.len()
            )));
        }
        if let Some(why) = unavailable(device) {
            return Err(CollectiveError::Unavailable(why));
        }
        manta_cuda::set_device(device).map_err(|e| CollectiveError::Nccl {
            op: "set_device",
            message: e.to_string(),
        })?;
        let mut internal = [0 as c_char; UNIQUE_ID_BYTES];
        for (dst, &b) in internal.iter_mut().zip(unique_id) {
            *dst = b as c_char;
        }
        let id = sys::ncclUniqueId { internal };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is valid for writes; NCCL copies the id.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(nccl_err("comm_init_rank", std::ptr::null_mut()))?;
        Ok(Self {
            comm,
            rank,
            world,
            device,
        })
    }

    fn stream(&self, op: &'static str) -> Result<sys::cudaStream_t, CollectiveError> {
        manta_cuda::current_stream(self.device)
            .map(|s| s as sys::cudaStream_t)
            .map_err(|e| CollectiveError::Nccl {
                op,
                message: e.to_string(),
            })
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // Finalize waits for the operations queued on the communicator, then destroy
        // frees it. SAFETY: the communicator is ours and no call on it is being made
        // (`&mut self`).
        let done = unsafe { result::comm_finalize(self.comm) }
            .and_then(|_| unsafe { result::comm_destroy(self.comm) });
        if let Err(e) = done {
            tracing::warn!(error = ?e, "NCCL communicator teardown failed");
        }
    }
}

fn ptr(t: &Tensor) -> *mut c_void {
    t.data_ptr()
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, self.device(), input, output, self.world)?;
        let (dt, stream) = (dtype(OP, input.kind())?, self.stream(OP)?);
        // SAFETY: both buffers are live, contiguous and of the checked sizes on this
        // communicator's device; the stream orders the call with libtorch's ops.
        unsafe {
            result::reduce_scatter(
                ptr(input),
                ptr(output),
                output.numel(),
                dt,
                reduce_op(op),
                self.comm,
                stream,
            )
        }
        .map_err(nccl_err(OP, self.comm))?;
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        const OP: &str = "all_gather";
        check_pair(OP, self.device(), output, input, self.world)?;
        let (dt, stream) = (dtype(OP, input.kind())?, self.stream(OP)?);
        // SAFETY: as in reduce_scatter.
        unsafe {
            result::all_gather(
                ptr(input),
                ptr(output),
                input.numel(),
                dt,
                self.comm,
                stream,
            )
        }
        .map_err(nccl_err(OP, self.comm))?;
        Ok(())
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        check_flat(OP, self.device(), tensor)?;
        let (dt, stream) = (dtype(OP, tensor.kind())?, self.stream(OP)?);
        let p = ptr(tensor);
        // SAFETY: in place on a live contiguous buffer of the checked size.
        unsafe { result::all_reduce(p, p, tensor.numel(), dt, reduce_op(op), self.comm, stream) }
            .map_err(nccl_err(OP, self.comm))?;
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        const OP: &str = "broadcast";
        check_rank(root, self.world)?;
        check_flat(OP, self.device(), tensor)?;
        let (dt, stream) = (dtype(OP, tensor.kind())?, self.stream(OP)?);
        let p = ptr(tensor);
        // SAFETY: in place on a live contiguous buffer of the checked size.
        unsafe { result::broadcast(p, p, tensor.numel(), dt, root as i32, self.comm, stream) }
            .map_err(nccl_err(OP, self.comm))?;
        Ok(())
    }
}
