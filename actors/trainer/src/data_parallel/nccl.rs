//! [`NcclCollective`]: a rank of an NCCL communicator working straight on tch CUDA
//! tensors' memory, queued on libtorch's current stream so the collectives are ordered
//! with the tensor ops around them without extra syncs (or, through
//! [`Collective::all_gather_on`] and [`Collective::reduce_scatter_on`], on a side stream
//! the caller orders by events). NCCL is the one libtorch loaded
//! (`nccl_api`): cudarc only supplies the C types.
//!
//! Setting up: rank 0 calls [`NcclCollective::unique_id`] and hands the 128 bytes to
//! every rank (Manta's gRPC will carry them; a file or an environment variable for now),
//! then every rank calls [`NcclCollective::new`] with its GPU. The process that made the
//! id must live until every rank has joined: the id names a socket it listens on.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use manta_cuda::CudaStream;
use tch::{Device, Kind, Tensor};

use super::nccl_api::{nccl_api, NcclApi};
use super::{check_flat, check_pair, check_rank, Collective, CollectiveError, ReduceOp};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// One rank of an NCCL communicator, bound to one GPU.
pub struct NcclCollective {
    api: &'static NcclApi,
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    device: usize,
    /// Shared with the [`NcclAborter`]s handed out.
    state: Arc<CommState>,
}

/// What a rank and its aborters share, so that the communicator is freed exactly once —
/// by the rank's drop or by an abort, whichever comes first — and no call is made on it
/// after an abort.
#[derive(Default)]
struct CommState {
    /// Set by the first of an abort and the rank's drop: the other then leaves the
    /// communicator alone, and collectives refuse to start.
    released: AtomicBool,
    /// Held while a call is made on the communicator: an abort waits (briefly) for a
    /// call that returns, so it does not free the communicator under a starting call.
    calls: Mutex<()>,
}

impl CommState {
    fn calls(&self) -> MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims the freeing of the communicator: true for the first caller only (an abort
    /// or the rank's drop), after which no collective starts.
    fn claim(&self) -> bool {
        !self.released.swap(true, Ordering::SeqCst)
    }

    /// Waits up to `wait` until no call is being made; `None`: one still is (blocked).
    fn idle_within(&self, wait: Duration) -> Option<MutexGuard<'_, ()>> {
        let deadline = Instant::now() + wait;
        loop {
            match self.calls.try_lock() {
                Ok(guard) => return Some(guard),
                Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(TryLockError::WouldBlock) => return None,
            }
        }
    }
}

/// How long an abort waits for a call in progress to return before aborting under it
/// (a call blocked on a peer that is gone never returns by itself).
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// Aborts one rank's communicator from another thread (`ncclCommAbort`, as torch's
/// watchdog does): the rank's collectives waiting for a peer that is gone end with an
/// error, its kernels leave the GPU and its later collectives fail at once, so the rank
/// can stop and a new rank can join a new group on the same GPU. Its worker calls it when
/// the driver stops the rank after another rank was lost. Aborting twice, or after the
/// rank was dropped, does nothing.
#[derive(Clone)]
pub struct NcclAborter {
    api: &'static NcclApi,
    /// The communicator's address: valid until `state.released` is set.
    comm: usize,
    state: Arc<CommState>,
}

impl NcclAborter {
    pub fn abort(&self) -> Result<(), CollectiveError> {
        if !self.state.claim() {
            return Ok(());
        }
        // A call that is only queueing work returns quickly; one blocked on a gone peer
        // does not, and NCCL's abort is what ends it (torch aborts under it likewise).
        let _idle = self.state.idle_within(ABORT_WAIT);
        let comm = self.comm as sys::ncclComm_t;
        // SAFETY: `released` was unset, so neither the rank's drop nor another abort
        // freed the communicator, and no call can start on it any more.
        let code = unsafe { (self.api.comm_abort)(comm) };
        check(self.api, "comm_abort", std::ptr::null_mut(), code)
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// not concurrent; `&self` methods are only reached through the owning trainer, which
// runs one step at a time.
unsafe impl Send for NcclCollective {}

/// The process's NCCL, or why NCCL cannot run here: no CUDA libtorch, no such GPU, no
/// NCCL in the process or on the library path.
fn available(device: usize) -> Result<&'static NcclApi, CollectiveError> {
    if !manta_cuda::built_with_cuda() {
        return Err(CollectiveError::Unavailable(
            "this build has no CUDA libtorch".into(),
        ));
    }
    let count = tch::Cuda::device_count();
    if count as usize <= device {
        return Err(CollectiveError::Unavailable(format!(
            "GPU {device} requested, {count} visible"
        )));
    }
    // Before NCCL's first communicator: ranks must agree with SGLang's on buffer memory.
    manta_cuda::process_group::align_nccl_env();
    nccl_api().map_err(CollectiveError::Unavailable)
}

/// Turns NCCL's result `code` of `op` into an error in NCCL's words.
fn check(
    api: &NcclApi,
    op: &'static str,
    comm: sys::ncclComm_t,
    code: sys::ncclResult_t,
) -> Result<(), CollectiveError> {
    if code == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    Err(CollectiveError::Nccl {
        op,
        message: api.describe(code, comm),
    })
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
    /// A fresh unique id (rank 0 makes it once per group), checked against GPU 0.
    pub fn unique_id() -> Result<Vec<u8>, CollectiveError> {
        Self::unique_id_on(0)
    }

    /// [`NcclCollective::unique_id`] made where rank 0 runs: `device` is its GPU, so a
    /// process that cannot run that rank (no CUDA, no such GPU) says so here rather than
    /// when the other ranks are already waiting to join.
    pub fn unique_id_on(device: usize) -> Result<Vec<u8>, CollectiveError> {
        let api = available(device)?;
        let mut id = sys::ncclUniqueId {
            internal: [0 as c_char; UNIQUE_ID_BYTES],
        };
        // SAFETY: a valid out-pointer.
        let code = unsafe { (api.get_unique_id)(&mut id) };
        check(api, "get_unique_id", std::ptr::null_mut(), code)?;
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
        let api = available(device)?;
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
        let code = unsafe { (api.comm_init_rank)(&mut comm, world as i32, id, rank as i32) };
        check(api, "comm_init_rank", std::ptr::null_mut(), code)?;
        if rank == 0 {
            tracing::info!(version = %api.version(), from = api.origin, world, "NCCL communicator");
        }
        Ok(Self {
            api,
            comm,
            rank,
            world,
            device,
            state: Arc::default(),
        })
    }

    /// What aborts this rank's communicator from another thread (see [`NcclAborter`]).
    pub fn aborter(&self) -> NcclAborter {
        NcclAborter {
            api: self.api,
            comm: self.comm as usize,
            state: self.state.clone(),
        }
    }

    /// Makes NCCL call `f` on the communicator unless it was aborted; the result checked
    /// in NCCL's words (an aborted communicator is not asked for its last error).
    fn call(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<(), CollectiveError> {
        let aborted = || CollectiveError::PeerFailed(format!("{op}: this rank was aborted"));
        let _in_call = self.state.calls();
        if self.state.released.load(Ordering::SeqCst) {
            return Err(aborted());
        }
        let code = f(self.comm);
        if code != sys::ncclResult_t::ncclSuccess && self.state.released.load(Ordering::SeqCst) {
            return Err(aborted());
        }
        self.check(op, code)
    }

    fn stream(&self, op: &'static str) -> Result<sys::cudaStream_t, CollectiveError> {
        manta_cuda::current_stream(self.device)
            .map(|s| s as sys::cudaStream_t)
            .map_err(|e| CollectiveError::Nccl {
                op,
                message: e.to_string(),
            })
    }

    /// `stream`'s raw handle, once it is known to be on this rank's GPU (NCCL would
    /// queue work for another device's stream on this communicator's device).
    fn side(
        &self,
        op: &'static str,
        stream: &CudaStream,
    ) -> Result<sys::cudaStream_t, CollectiveError> {
        if stream.device() != self.device {
            return Err(CollectiveError::BadTensor {
                op,
                message: format!(
                    "a stream of GPU {} for the communicator on GPU {}",
                    stream.device(),
                    self.device
                ),
            });
        }
        Ok(stream.raw() as sys::cudaStream_t)
    }

    fn reduce_scatter_queued(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
        stream: Option<&CudaStream>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, self.device(), input, output, self.world)?;
        let dt = dtype(OP, input.kind())?;
        let stream = match stream {
            Some(s) => self.side(OP, s)?,
            None => self.stream(OP)?,
        };
        // SAFETY: both buffers are live, contiguous and of the checked sizes on this
        // communicator's device; the stream is this device's (libtorch's current one
        // orders the call with its ops; a side stream's caller orders it by events).
        self.call(OP, |comm| unsafe {
            (self.api.reduce_scatter)(
                ptr(input),
                ptr(output),
                output.numel(),
                dt,
                reduce_op(op),
                comm,
                stream,
            )
        })
    }

    fn all_gather_queued(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        stream: Option<&CudaStream>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all_gather";
        check_pair(OP, self.device(), output, input, self.world)?;
        let dt = dtype(OP, input.kind())?;
        let stream = match stream {
            Some(s) => self.side(OP, s)?,
            None => self.stream(OP)?,
        };
        // SAFETY: as in reduce_scatter_queued.
        self.call(OP, |comm| unsafe {
            (self.api.all_gather)(ptr(input), ptr(output), input.numel(), dt, comm, stream)
        })
    }

    fn check(&self, op: &'static str, code: sys::ncclResult_t) -> Result<(), CollectiveError> {
        check(self.api, op, self.comm, code)
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // An abort freed the communicator already (or is about to).
        if !self.state.claim() {
            return;
        }
        // Finalize waits for the operations queued on the communicator, then destroy
        // frees it. SAFETY: the communicator is ours and no call on it is being made
        // (`&mut self`).
        let finalized = self.check("comm_finalize", unsafe {
            (self.api.comm_finalize)(self.comm)
        });
        let done = finalized.and_then(|()| {
            // SAFETY: as above; finalize has drained the communicator, destroy frees it once.
            self.check("comm_destroy", unsafe {
                (self.api.comm_destroy)(self.comm)
            })
        });
        if let Err(e) = done {
            tracing::warn!(error = %e, "NCCL communicator teardown failed");
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
        self.reduce_scatter_queued(input, output, op, None)
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        self.all_gather_queued(input, output, None)
    }

    fn takes_streams(&self) -> bool {
        true
    }

    fn all_gather_on(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        stream: &CudaStream,
    ) -> Result<(), CollectiveError> {
        self.all_gather_queued(input, output, Some(stream))
    }

    fn reduce_scatter_on(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<(), CollectiveError> {
        self.reduce_scatter_queued(input, output, op, Some(stream))
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        check_flat(OP, self.device(), tensor)?;
        let (dt, stream) = (dtype(OP, tensor.kind())?, self.stream(OP)?);
        let p = ptr(tensor);
        // SAFETY: in place on a live contiguous buffer of the checked size.
        self.call(OP, |comm| unsafe {
            (self.api.all_reduce)(p, p, tensor.numel(), dt, reduce_op(op), comm, stream)
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        const OP: &str = "broadcast";
        check_rank(root, self.world)?;
        check_flat(OP, self.device(), tensor)?;
        let (dt, stream) = (dtype(OP, tensor.kind())?, self.stream(OP)?);
        let p = ptr(tensor);
        // SAFETY: in place on a live contiguous buffer of the checked size.
        self.call(OP, |comm| unsafe {
            (self.api.broadcast)(p, p, tensor.numel(), dt, root as i32, comm, stream)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The communicator is freed once — by the first of an abort and the rank's drop —
    /// and an abort waits for a call that returns but not for one that is blocked.
    #[test]
    fn an_abort_and_the_drop_free_the_communicator_once() {
        let state = CommState::default();
        assert!(state.claim());
        assert!(!state.claim(), "a second abort or the drop leaves it alone");
        let in_call = state.calls();
        let started = Instant::now();
        assert!(state.idle_within(Duration::from_millis(50)).is_none());
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop(in_call);
        assert!(state.idle_within(Duration::from_millis(50)).is_some());
    }
}
