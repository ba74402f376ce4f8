//! libtorch's Kineto profiler (torch_profiler.cpp): a Chrome trace of the aten ops and,
//! on CUDA, every kernel, copy and memset with its time on the device. The GPU machines
//! have no nsys, but CUPTI works through Kineto, so this is how a step's device time is
//! broken down (bench/py/kernel_summary.py reads the trace).
//!
//! Kineto records CPU ops per thread: the thread that calls [`TorchProfile::start`]
//! (and threads that inherit its thread-local state, such as ATen's intra-op pool) is
//! the one whose ops land in the trace, and it must be the one that calls
//! [`TorchProfile::finish`] ([`TorchProfile`] is not `Send`). CUDA activities are
//! recorded for the whole process, whatever thread launched them. One profile runs at a
//! time in a process.

use std::ffi::{c_char, c_int, CStr, CString};
use std::marker::PhantomData;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

extern "C" {
    fn manta_torch_profiler_last_error() -> *const c_char;
    fn manta_torch_profiler_start(cuda: c_int) -> c_int;
    fn manta_torch_profiler_finish(path: *const c_char) -> c_int;
    fn manta_torch_profiler_discard() -> c_int;
}

/// Whether a profile is running anywhere in the process: libtorch keeps one Kineto
/// session, so a second start would fail inside it or, worse, tangle two traces.
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Why a profile could not be started or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TorchProfileError {
    #[error("a torch profile is already running in this process (one at a time)")]
    AlreadyRunning,
    #[error("torch profiler {op}: {message}")]
    Torch { op: &'static str, message: String },
    #[error("torch profile trace {}: {message}", path.display())]
    Trace { path: PathBuf, message: String },
}

fn check(op: &'static str, rc: c_int) -> Result<(), TorchProfileError> {
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
    let message = unsafe { CStr::from_ptr(manta_torch_profiler_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(TorchProfileError::Torch { op, message })
}

/// A running profile, from [`TorchProfile::start`] to [`TorchProfile::finish`] on the
/// same thread. Dropped without finishing (the profiled work failed), it stops the
/// profiler and discards the trace, so the next profile can start.
pub struct TorchProfile {
    finished: bool,
    /// Kineto's CPU-op recording belongs to the starting thread.
    _thread: PhantomData<*const ()>,
}

impl TorchProfile {
    /// Enables the profiler on this thread: aten ops with their input shapes, and with
    /// `cuda` the device's kernels, copies and runtime calls (CUPTI).
    pub fn start(cuda: bool) -> Result<Self, TorchProfileError> {
        if RUNNING
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(TorchProfileError::AlreadyRunning);
        }
        // SAFETY: no arguments beyond an int; failures come back as a code.
        if let Err(e) = check("start", unsafe {
            manta_torch_profiler_start(c_int::from(cuda))
        }) {
            RUNNING.store(false, Ordering::Release);
            return Err(e);
        }
        Ok(Self {
            finished: false,
            _thread: PhantomData,
        })
    }

    /// Stops the profiler and writes its Chrome trace JSON to `path` (its folder is
    /// created if missing). With CUDA activities the device's queued work should be
    /// synchronized first, or its kernels may end after the trace does.
    pub fn finish(mut self, path: &Path) -> Result<(), TorchProfileError> {
        let trace_error = |message: String| TorchProfileError::Trace {
            path: path.to_path_buf(),
            message,
        };
        // On an early return `self` drops, which discards the profile.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| trace_error(format!("creating {}: {e}", dir.display())))?;
        }
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| trace_error("the path contains a NUL byte".into()))?;
        self.finished = true;
        RUNNING.store(false, Ordering::Release);
        // SAFETY: a C string valid for the call; the profiler was enabled on this thread.
        check("finish", unsafe {
            manta_torch_profiler_finish(c_path.as_ptr())
        })?;
        // Kineto logs a file it cannot open instead of failing.
        if !path.is_file() {
            return Err(trace_error("the profiler wrote no file there".into()));
        }
        Ok(())
    }
}

impl Drop for TorchProfile {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // SAFETY: the profiler was enabled on this thread and is still running; an error
        // (nothing to stop) leaves nothing to clean up.
        let _ = unsafe { manta_torch_profiler_discard() };
        RUNNING.store(false, Ordering::Release);
    }
}
