//! An NCCL process group through libtorch's own `c10d::ProcessGroupNCCL`
//! (process_group.cpp): the weight-update group of SGLang's `/init_weights_update_group`.
//!
//! Joining builds exactly what SGLang's `init_custom_process_group(backend="nccl",
//! init_method="tcp://addr:port", world_size, rank, group_name)` builds in Python — a
//! `TCPStore` hosted by rank 0, the same chain of `PrefixStore`s, a `ProcessGroupNCCL` —
//! so a Manta rank and a Python/SGLang rank meet on the same store keys and NCCL
//! communicator. The trainer is rank 0 and broadcasts; engines receive in the same order.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Duration;

use tch::{Device, Tensor};

extern "C" {
    fn manta_pg_last_error() -> *const c_char;
    fn manta_pg_built_with_nccl() -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_pg_nccl_join(
        host: *const c_char,
        port: c_int,
        rank: c_int,
        world_size: c_int,
        group_name: *const c_char,
        device: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    fn manta_pg_store_port(handle: *mut c_void) -> c_int;
    fn manta_pg_broadcast(
        handle: *mut c_void,
        tensors: *mut *mut c_void,
        n: c_int,
        src: c_int,
        enqueue_seconds: *mut f64,
    ) -> c_int;
    fn manta_pg_free(handle: *mut c_void);
    fn manta_pg_aborter(handle: *mut c_void) -> *mut c_void;
    fn manta_pg_abort(aborter: *mut c_void) -> c_int;
    fn manta_pg_aborter_free(aborter: *mut c_void);
}

/// A refused or failed group operation (`op`: join, broadcast), with the reason: bad
/// parameters, no CUDA device, libtorch's or NCCL's message.
#[derive(Debug, Clone, thiserror::Error)]
#[error("weight-update group {op}: {message}")]
pub struct GroupError {
    pub op: &'static str,
    pub message: String,
}

fn error(op: &'static str, message: impl Into<String>) -> GroupError {
    GroupError {
        op,
        message: message.into(),
    }
}

fn check(op: &'static str, rc: c_int) -> Result<(), GroupError> {
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
    let message = unsafe { CStr::from_ptr(manta_pg_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(error(op, message))
}

/// The NCCL variable whose value must agree across the ranks of a group.
pub const NCCL_CUMEM_VAR: &str = "NCCL_CUMEM_ENABLE";

/// Makes this process's NCCL allocate its buffers as SGLang's and vLLM's processes do
/// (`NCCL_CUMEM_ENABLE=0`), unless the user set the variable. Ranks that disagree on it
/// cannot map each other's buffers, and the first broadcast between them fails with
/// "unhandled cuda error": SGLang 0.5 sets 0 in its server, NCCL's default is 1. NCCL
/// reads the variable once, at its first communicator, so binaries call this first thing
/// in `main`, before any thread starts; [`ProcessGroup::join`] and the data-parallel
/// trainer call it again before their first communicator (a no-op by then) for callers
/// such as tests that have no such `main`. Answers what was decided, for the log.
pub fn align_nccl_env() -> &'static str {
    static DECIDED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DECIDED.get_or_init(|| match std::env::var(NCCL_CUMEM_VAR) {
        Ok(v) => format!("{NCCL_CUMEM_VAR}={v} (set by the user)"),
        Err(_) => {
            std::env::set_var(NCCL_CUMEM_VAR, "0");
            format!("{NCCL_CUMEM_VAR}=0 (as SGLang's servers use)")
        }
    })
}

/// Whether this build has `ProcessGroupNCCL` (CUDA libtorch, CUDA and NCCL headers).
pub fn built_with_nccl() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { manta_pg_built_with_nccl() != 0 }
}

/// Where and as whom to join a group (SGLang's `/init_weights_update_group` fields).
#[derive(Debug, Clone)]
pub struct GroupSpec {
    /// The store's address: rank 0 hosts it (listening on every interface), the others
    /// connect here.
    pub master_address: String,
    /// The store's port; rank 0 may give 0 for any free port ([`ProcessGroup::store_port`]).
    pub master_port: u16,
    pub rank: usize,
    pub world_size: usize,
    pub group_name: String,
    /// CUDA device index every tensor of this member lives on.
    pub device: usize,
    /// Bounds the store's waits and each collective (torch's `timeout`).
    pub timeout: Duration,
}

impl GroupSpec {
    /// The parameters a group cannot be made of, named.
    pub fn validate(&self) -> Result<(), GroupError> {
        let bad = |m: String| Err(error("join", m));
        if self.world_size == 0 {
            return bad("world_size 0: a group has at least one rank".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            ));
        }
        if c_int::try_from(self.world_size).is_err() {
            return bad(format!("world_size {} is too large", self.world_size));
        }
        if self.group_name.is_empty() {
            return bad("group_name is empty".into());
        }
        if self.group_name.contains('\0') {
            return bad(format!(
                "group_name {:?} contains a NUL byte",
                self.group_name
            ));
        }
        if self.master_address.is_empty() || self.master_address.contains('\0') {
            return bad(format!(
                "master_address {:?} is not a host name or address",
                self.master_address
            ));
        }
        if self.rank != 0 && self.master_port == 0 {
            return bad(format!(
                "master_port 0: rank {} must be told the port rank 0 hosts the store on",
                self.rank
            ));
        }
        if c_int::try_from(self.device).is_err() {
            return bad(format!("device {} is not a CUDA device index", self.device));
        }
        Ok(())
    }
}

/// A member of an NCCL process group; dropping it destroys the group on this side
/// (torch's `destroy_process_group`: shutdown, then the store connection closes).
pub struct ProcessGroup {
    handle: *mut c_void,
    spec: GroupSpec,
    /// Host time the last broadcast spent issuing its collectives.
    last_enqueue: Duration,
}

// SAFETY: the handle is owned by this value; libtorch's ProcessGroupNCCL may be driven
// from any thread, one call at a time (`&mut self` or an owner's lock keeps it so).
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    /// Joins the group described by `spec` (see [`GroupSpec`]). Rank 0 hosts the store and
    /// returns at once; the NCCL communicator is created by the first broadcast, when every
    /// rank has joined. Without a CUDA device this is an error, not a crash.
    pub fn join(spec: GroupSpec) -> Result<Self, GroupError> {
        spec.validate()?;
        align_nccl_env();
        let host = CString::new(spec.master_address.as_str())
            .map_err(|_| error("join", "master_address contains a NUL byte"))?;
        let name = CString::new(spec.group_name.as_str())
            .map_err(|_| error("join", "group_name contains a NUL byte"))?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid C strings and an out-pointer for the call; sizes checked above.
        check("join", unsafe {
            manta_pg_nccl_join(
                host.as_ptr(),
                c_int::from(spec.master_port),
                spec.rank as c_int,
                spec.world_size as c_int,
                name.as_ptr(),
                spec.device as c_int,
                spec.timeout.as_millis().min(i64::MAX as u128) as i64,
                &mut handle,
            )
        })
        .map_err(|e| GroupError {
            message: format!(
                "group {:?} at {}:{} as rank {} of {}: {}",
                spec.group_name,
                spec.master_address,
                spec.master_port,
                spec.rank,
                spec.world_size,
                e.message
            ),
            ..e
        })?;
        Ok(Self {
            handle,
            spec,
            last_enqueue: Duration::ZERO,
        })
    }

    /// A handle that aborts this group from another thread: a broadcast waiting on a
    /// peer that failed (say, a server that answered its half of the update with an
    /// error) then returns an error instead of waiting out the timeout.
    pub fn aborter(&self) -> Aborter {
        Aborter {
            // SAFETY: a live handle; the aborter holds its own reference to the group.
            handle: unsafe { manta_pg_aborter(self.handle) },
            group_name: self.spec.group_name.clone(),
        }
    }

    /// What this member joined as.
    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }

    /// The port the group's store listens on (rank 0's choice when it hosted on port 0).
    pub fn store_port(&self) -> u16 {
        // SAFETY: a live handle.
        unsafe { manta_pg_store_port(self.handle) }.clamp(0, c_int::from(u16::MAX)) as u16
    }

    /// Broadcasts `tensors` from rank `src` in order, one NCCL broadcast each (as
    /// `torch.distributed.broadcast` per tensor): the root sends its tensors, the others
    /// receive into theirs. Every tensor must be contiguous and on the group's CUDA
    /// device; one that is not is refused by name before anything is sent. Returns when
    /// this member's tensors hold the root's data.
    pub fn broadcast(
        &mut self,
        tensors: &[(String, Tensor)],
        src: usize,
    ) -> Result<(), GroupError> {
        if src >= self.spec.world_size {
            return Err(error(
                "broadcast",
                format!("src {src} is not below world_size {}", self.spec.world_size),
            ));
        }
        let device = Device::Cuda(self.spec.device);
        for (name, t) in tensors {
            if t.device() != device {
                return Err(error(
                    "broadcast",
                    format!(
                        "tensor {name} is on {:?}, the group is on {device:?}",
                        t.device()
                    ),
                ));
            }
            if !t.is_contiguous() {
                return Err(error(
                    "broadcast",
                    format!("tensor {name} is not contiguous (NCCL sends dense memory)"),
                ));
            }
        }
        let n = c_int::try_from(tensors.len()).map_err(|_| {
            error(
                "broadcast",
                format!("{} tensors in one call", tensors.len()),
            )
        })?;
        let mut ptrs: Vec<*mut c_void> = tensors
            .iter()
            .map(|(_, t)| t.as_ptr() as *mut c_void)
            .collect();
        let mut enqueue_seconds = 0f64;
        // SAFETY: a live handle, `n` live at::Tensor handles and a live f64 for the call.
        check("broadcast", unsafe {
            manta_pg_broadcast(
                self.handle,
                ptrs.as_mut_ptr(),
                n,
                src as c_int,
                &mut enqueue_seconds,
            )
        })
        .map_err(|e| GroupError {
            message: format!("group {:?}: {}", self.spec.group_name, e.message),
            ..e
        })?;
        self.last_enqueue = Duration::try_from_secs_f64(enqueue_seconds).unwrap_or_default();
        Ok(())
    }

    /// How long the last broadcast took to issue its collectives on the host (after the
    /// communicator existed). Close to the whole broadcast's time: launch-bound, not
    /// bandwidth-bound.
    pub fn last_enqueue(&self) -> Duration {
        self.last_enqueue
    }
}

/// Aborts one group's NCCL communicators (`ncclCommAbort`, as torch's watchdog does on a
/// timeout) from any thread; see [`ProcessGroup::aborter`]. Valid after the group is
/// dropped. An aborted group is unusable: its owner drops it and joins a new one.
pub struct Aborter {
    handle: *mut c_void,
    group_name: String,
}

// SAFETY: the handle is a reference-counted ProcessGroupNCCL plus an atomic flag; abort is
// what torch's own watchdog thread calls while other threads wait in collectives.
unsafe impl Send for Aborter {}
// SAFETY: as for Send: abort may be called from any thread at any time.
unsafe impl Sync for Aborter {}

impl Aborter {
    /// Aborts the group (once; later calls do nothing).
    pub fn abort(&self) -> Result<(), GroupError> {
        if self.handle.is_null() {
            return Err(error("abort", "this build has no NCCL process group"));
        }
        // SAFETY: a live aborter handle.
        check("abort", unsafe { manta_pg_abort(self.handle) }).map_err(|e| GroupError {
            message: format!("group {:?}: {}", self.group_name, e.message),
            ..e
        })
    }
}

impl Drop for Aborter {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle came from manta_pg_aborter and is freed once.
            unsafe { manta_pg_aborter_free(self.handle) };
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: the handle came from manta_pg_nccl_join and is freed once.
        unsafe { manta_pg_free(self.handle) };
    }
}
