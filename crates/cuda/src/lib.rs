//! What tch does not expose of libtorch's CUDA side: CUDA graphs (capture a sequence of
//! tensor operations once, replay it with one launch — decode steps are otherwise bound by
//! per-kernel launch cost) and the device's total memory (to size a KV cache from
//! `--mem-fraction-static`). A small C++ shim compiled against the linked libtorch.

use std::ffi::{c_char, c_int, c_void, CStr};

extern "C" {
    fn manta_cuda_last_error() -> *const c_char;
    fn manta_cuda_built_with_cuda() -> c_int;
    fn manta_cuda_total_memory(device: c_int, total: *mut usize) -> c_int;
    fn manta_graph_new() -> *mut c_void;
    fn manta_graph_capture_begin(g: *mut c_void, device: c_int, share: *mut c_void) -> c_int;
    fn manta_graph_capture_end(g: *mut c_void) -> c_int;
    fn manta_graph_replay(g: *mut c_void) -> c_int;
    fn manta_graph_free(g: *mut c_void);
}

#[derive(Debug, thiserror::Error)]
#[error("CUDA: {0}")]
pub struct CudaError(String);

fn last_error() -> CudaError {
    // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(manta_cuda_last_error()) };
    CudaError(msg.to_string_lossy().into_owned())
}

fn check(rc: c_int) -> Result<(), CudaError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(last_error())
    }
}

/// Whether the shim was compiled with CUDA (a CUDA libtorch and CUDA headers were found).
pub fn built_with_cuda() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { manta_cuda_built_with_cuda() != 0 }
}

/// Bytes of memory on CUDA device `device`.
pub fn total_memory(device: usize) -> Result<usize, CudaError> {
    let mut total = 0usize;
    // SAFETY: the pointer is valid for writes.
    check(unsafe { manta_cuda_total_memory(device as c_int, &mut total) })?;
    Ok(total)
}

/// A captured CUDA graph. Tensors used during capture must stay alive and keep their
/// storage while the graph may replay: replays read and write those same addresses.
pub struct CudaGraph {
    ptr: *mut c_void,
    captured: bool,
}

// SAFETY: the graph is only driven from the thread that owns it; moving it is fine.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures what `f` launches on CUDA device `device`. Run `f` once before (warm-up)
    /// so lazy initialisation does not happen during capture. `share_pool` lets graphs
    /// that never replay concurrently share one memory pool.
    pub fn capture<T>(
        device: usize,
        share_pool: Option<&CudaGraph>,
        f: impl FnOnce() -> T,
    ) -> Result<(Self, T), CudaError> {
        // SAFETY: creates a heap object owned by the returned CudaGraph.
        let ptr = unsafe { manta_graph_new() };
        if ptr.is_null() {
            return Err(last_error());
        }
        let mut graph = CudaGraph {
            ptr,
            captured: false,
        };
        let share = share_pool.map_or(std::ptr::null_mut(), |g| g.ptr);
        // SAFETY: ptr is a live graph; share is null or a live captured graph.
        check(unsafe { manta_graph_capture_begin(ptr, device as c_int, share) })?;
        let out = f();
        // SAFETY: capture was begun on this graph above.
        check(unsafe { manta_graph_capture_end(ptr) })?;
        graph.captured = true;
        Ok((graph, out))
    }

    /// Launches the captured work on the current stream.
    pub fn replay(&self) -> Result<(), CudaError> {
        debug_assert!(self.captured);
        // SAFETY: ptr is a live, captured graph.
        check(unsafe { manta_graph_replay(self.ptr) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: ptr came from manta_graph_new and is freed once.
        unsafe { manta_graph_free(self.ptr) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_graph_replays_its_captured_work_on_new_inputs() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        }
        let dev = Device::Cuda(0);
        let x = Tensor::zeros([4], (Kind::Float, dev));
        let w = Tensor::ones([4], (Kind::Float, dev)) * 2.0;
        let _ = (&x * &w + 1.0).sum(Kind::Float); // warm-up
        let (graph, y) = CudaGraph::capture(0, None, || (&x * &w + 1.0).sum(Kind::Float)).unwrap();
        let mut xin = x.shallow_clone();
        let _ = xin.copy_(&Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).to(dev));
        graph.replay().unwrap();
        assert_eq!(y.double_value(&[]), 24.0);
        assert!(total_memory(0).unwrap() > 0);
    }
}
