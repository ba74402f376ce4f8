//! NCCL's entry points, bound to the libnccl this process already has: the one libtorch
//! loaded (`libnccl.so.2` of the pip `nvidia-nccl` wheel), found in the process's global
//! symbol scope. cudarc's own loader opens the first `libnccl.so` on the library path
//! instead — on a machine whose system NCCL differs from torch's, that put two NCCLs in
//! one process, and a communicator made by one was "corrupted" to the other. Only
//! where libtorch brought no NCCL is `libnccl.so.2` opened by name.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};
use libloading::os::unix::{Library, Symbol};

type Result_ = ncclResult_t;

/// The shape `ncclAllReduce` and `ncclReduceScatter` share: send buffer, receive buffer,
/// count, dtype, operation, communicator, stream.
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> Result_;

/// The entry points Manta calls, with NCCL's C signatures (nccl.h).
pub struct NcclApi {
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Result_,
    pub comm_init_rank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Result_,
    /// `ncclAllReduce`: `count` elements in, `count` out.
    pub all_reduce: ReduceFn,
    /// `ncclReduceScatter`: the last argument but two is the count *received*.
    pub reduce_scatter: ReduceFn,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> Result_,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> Result_,
    pub comm_finalize: unsafe extern "C" fn(ncclComm_t) -> Result_,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Result_,
    /// `ncclCommAbort`: frees the communicator and ends its operations still running on
    /// the GPU (a rank waiting for a peer that is gone).
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> Result_,
    get_error_string: unsafe extern "C" fn(Result_) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    get_version: unsafe extern "C" fn(*mut c_int) -> Result_,
    /// Where the entry points came from, for the log.
    pub origin: &'static str,
}

impl NcclApi {
    /// NCCL's version as `major.minor.patch`.
    pub fn version(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        if unsafe { (self.get_version)(&mut v) } != ncclResult_t::ncclSuccess {
            return "unknown".into();
        }
        // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9.
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    }

    /// `code`'s description and the last error NCCL logged for `comm` (or outside any
    /// communicator when null), as one line.
    pub fn describe(&self, code: ncclResult_t, comm: ncclComm_t) -> String {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns static or NCCL-owned NUL-terminated strings.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: plain value arguments; a null communicator is allowed.
        let (what, last) = unsafe {
            (
                text((self.get_error_string)(code)),
                text((self.get_last_error)(comm)),
            )
        };
        let mut message = format!("{code:?} ({what})");
        if !last.is_empty() {
            message.push_str(": ");
            message.push_str(&last);
        }
        message
    }
}

/// The process's NCCL, bound once; the error says why there is none.
pub fn nccl_api() -> Result<&'static NcclApi, String> {
    static API: OnceLock<Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<NcclApi, String> {
    // The executable's global scope holds libtorch_cuda's dependencies, NCCL among them.
    let this = Library::this();
    // SAFETY: only looks a symbol up.
    let (lib, origin) = if unsafe { this.get::<*const c_void>(b"ncclCommInitRank\0") }.is_ok() {
        (this, "the NCCL libtorch loaded")
    } else {
        // SAFETY: loading NCCL runs no code of ours; its initialisers are NCCL's.
        let lib = unsafe { Library::new("libnccl.so.2") }.map_err(|e| {
            format!(
                "no NCCL in this process (libtorch without CUDA?) and libnccl.so.2 not found: {e}"
            )
        })?;
        (lib, "libnccl.so.2 from the library path")
    };
    // The library stays loaded for the process: the entry points outlive this call.
    let lib: &'static Library = Box::leak(Box::new(lib));
    fn sym<T: Copy>(lib: &'static Library, name: &[u8]) -> Result<T, String> {
        // SAFETY: `T` is the entry point's C signature (nccl.h), as declared in NcclApi.
        let s: Symbol<T> = unsafe { lib.get(name) }.map_err(|e| {
            format!(
                "NCCL has no {}: {e}",
                String::from_utf8_lossy(&name[..name.len() - 1])
            )
        })?;
        Ok(*s)
    }
    Ok(NcclApi {
        get_unique_id: sym(lib, b"ncclGetUniqueId\0")?,
        comm_init_rank: sym(lib, b"ncclCommInitRank\0")?,
        all_reduce: sym(lib, b"ncclAllReduce\0")?,
        reduce_scatter: sym(lib, b"ncclReduceScatter\0")?,
        all_gather: sym(lib, b"ncclAllGather\0")?,
        broadcast: sym(lib, b"ncclBroadcast\0")?,
        comm_finalize: sym(lib, b"ncclCommFinalize\0")?,
        comm_destroy: sym(lib, b"ncclCommDestroy\0")?,
        comm_abort: sym(lib, b"ncclCommAbort\0")?,
        get_error_string: sym(lib, b"ncclGetErrorString\0")?,
        get_last_error: sym(lib, b"ncclGetLastError\0")?,
        get_version: sym(lib, b"ncclGetVersion\0")?,
        origin,
    })
}
