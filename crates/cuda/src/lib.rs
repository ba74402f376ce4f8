//! What tch does not expose of libtorch's CUDA side: CUDA graphs (capture a sequence of
//! tensor operations once, replay it with one launch — decode steps are otherwise bound by
//! per-kernel launch cost), the device's total memory (to size a KV cache from
//! `--mem-fraction-static`), and the native engine's decode kernels: paged attention and
//! fused element-wise ops that replace chains of small kernels (NVRTC-compiled at run time
//! from the `.cu.inc` sources beside this file), and side streams ordered by events
//! ([`stream`]: collectives overlapping compute). A small C++ shim compiled against the
//! linked libtorch.

pub mod adamw;
pub mod cudnn_attention;
pub mod gemv;
pub mod invariant_attention;
pub mod ipc;
pub mod logprobs;
pub mod process_group;
pub mod rendezvous;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod stream;
pub mod swiglu;
pub mod torch_profiler;
pub mod weight_group;

pub use stream::CudaStream;
pub use torch_profiler::{TorchProfile, TorchProfileError};

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{Kind, Tensor};

extern "C" {
    fn manta_kernels_compile_check(source: *const c_char, arch: c_int) -> c_int;
    fn manta_set_kernel_knobs(values: *const i64, n: c_int);
    fn manta_cuda_last_error() -> *const c_char;
    fn manta_cuda_built_with_cuda() -> c_int;
    fn manta_cuda_total_memory(device: c_int, total: *mut usize) -> c_int;
    fn manta_cuda_device_arch(device: c_int, arch: *mut c_int) -> c_int;
    fn manta_cuda_empty_cache() -> c_int;
    fn manta_cuda_current_stream(device: c_int, stream: *mut *mut c_void) -> c_int;
    fn manta_cuda_set_device(device: c_int) -> c_int;
    fn manta_cuda_peak_allocated(device: c_int, reset: c_int, bytes: *mut usize) -> c_int;
    fn manta_graph_new() -> *mut c_void;
    fn manta_graph_capture_begin(g: *mut c_void, device: c_int, share: *mut c_void) -> c_int;
    fn manta_graph_capture_end(g: *mut c_void) -> c_int;
    fn manta_graph_replay(g: *mut c_void) -> c_int;
    fn manta_graph_free(g: *mut c_void);
    fn manta_copy_nonblocking(dst: *mut c_void, src: *mut c_void) -> c_int;
    fn manta_pin_memory(src: *mut c_void, out: *mut *mut c_void) -> c_int;
    fn manta_event_record(device: c_int, out: *mut *mut c_void) -> c_int;
    fn manta_event_synchronize(event: *mut c_void) -> c_int;
    fn manta_event_free(event: *mut c_void);
    #[allow(clippy::too_many_arguments)]
    fn manta_paged_decode_attention(
        source: *const c_char,
        q: *mut c_void,
        k_pool: *mut c_void,
        v_pool: *mut c_void,
        tables: *mut c_void,
        lens: *mut c_void,
        counters: *mut c_void,
        out: *mut c_void,
        block_size: c_int,
        scale: f32,
    ) -> c_int;
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn manta_decode_kernels_compile_check(
        paged_source: *const c_char,
        fused_source: *const c_char,
        hidden: c_int,
        intermediate: c_int,
        heads: c_int,
        kv_heads: c_int,
        head_dim: c_int,
        qk_norm: c_int,
        arch: c_int,
    ) -> c_int;
    fn manta_rope_table(
        source: *const c_char,
        positions: *mut c_void,
        inv_freq: *mut c_void,
        table: *mut c_void,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_qk_norm_rope_store(
        source: *const c_char,
        qkv: *mut c_void,
        q_w: *mut c_void,
        k_w: *mut c_void,
        rope: *mut c_void,
        slots: *mut c_void,
        k_pool: *mut c_void,
        v_pool: *mut c_void,
        q_out: *mut c_void,
        eps: f32,
    ) -> c_int;
    fn manta_add_rms_norm(
        source: *const c_char,
        residual: *mut c_void,
        delta: *mut c_void,
        weight: *mut c_void,
        out: *mut c_void,
        eps: f32,
    ) -> c_int;
    fn manta_silu_mul(source: *const c_char, gate_up: *mut c_void, out: *mut c_void) -> c_int;
    fn manta_lt_linear(x: *mut c_void, w: *mut c_void, y: *mut c_void) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn manta_flash_varlen(
        q: *mut c_void,
        k: *mut c_void,
        v: *mut c_void,
        cu_q: *mut c_void,
        cu_k: *mut c_void,
        max_q: i64,
        max_k: i64,
        scale: f64,
        out: *mut *mut c_void,
    ) -> c_int;
}

/// The paged attention kernels' CUDA source, NUL-terminated for NVRTC.
const PAGED_ATTENTION_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("paged_attention.cu.inc"),
    "\0"
);

/// The fused element-wise decode kernels' source, NUL-terminated for NVRTC.
const FUSED_OPS_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("fused_ops.cu.inc"),
    "\0"
);

/// A model shape the decode kernels are compiled for.
#[derive(Debug, Clone, Copy)]
pub struct KernelShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Qwen3's per-head q/k norm.
    pub qk_norm: bool,
}

/// Hands the shim the kernel knobs ([`manta_knobs::KERNEL_KNOBS`]) when they changed since
/// the last call (the first call, and after a benchmark's override): every entry point
/// that compiles or launches a kernel calls this first, so the shim never reads the
/// environment.
pub(crate) fn sync_kernel_knobs() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static APPLIED: AtomicU64 = AtomicU64::new(u64::MAX);
    let generation = manta_knobs::generation();
    if APPLIED.load(Ordering::Acquire) == generation {
        return;
    }
    let values = manta_knobs::kernel_values();
    // SAFETY: a live array of `values.len()` i64s; the shim copies them.
    unsafe { manta_set_kernel_knobs(values.as_ptr(), values.len() as c_int) };
    APPLIED.store(generation, Ordering::Release);
}

/// Compiles every decode kernel for `shape` and `sm_<arch>` with NVRTC, which needs no
/// GPU: a check that CPU machines can run.
pub fn decode_kernels_compile(shape: KernelShape, arch: u32) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: both sources are NUL-terminated statics.
    check(unsafe {
        manta_decode_kernels_compile_check(
            PAGED_ATTENTION_SOURCE.as_ptr() as *const c_char,
            FUSED_OPS_SOURCE.as_ptr() as *const c_char,
            shape.hidden as c_int,
            shape.intermediate as c_int,
            shape.heads as c_int,
            shape.kv_heads as c_int,
            shape.head_dim as c_int,
            shape.qk_norm as c_int,
            arch as c_int,
        )
    })
}

/// Compiles an NVRTC `source` (a NUL-terminated static) for `sm_<arch>`: no GPU needed.
fn compile_source(source: &'static str, arch: u32) -> Result<(), CudaError> {
    sync_kernel_knobs();
    debug_assert!(source.ends_with('\0'), "NVRTC sources are NUL-terminated");
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe { manta_kernels_compile_check(source.as_ptr() as *const c_char, arch as c_int) })
}

/// Owns the at::Tensor a successful shim call wrote through its out-pointer.
///
/// # Safety
/// `out` must be a heap `at::Tensor` that nothing else owns (what the shim's functions
/// returning a tensor write on success).
unsafe fn owned_tensor(out: *mut c_void) -> Tensor {
    // SAFETY: by the contract above; tch's tensor handle is a pointer to an at::Tensor.
    unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) }
}

fn ptr(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

fn opt_ptr(t: Option<&Tensor>) -> *mut c_void {
    t.map_or(std::ptr::null_mut(), ptr)
}

/// The rotary table of a forward's tokens, [N, head_dim] bf16: row n holds
/// `cos(positions[n] × inv_freq)` and then the sines, rounded to bf16 as the model's
/// tables are. Computed once per forward for every layer's [`qk_norm_rope_store`].
pub fn rope_table(positions: &Tensor, inv_freq: &Tensor) -> Result<Tensor, CudaError> {
    let table = Tensor::empty(
        [positions.numel() as i64, 2 * inv_freq.numel() as i64],
        (Kind::BFloat16, positions.device()),
    );
    sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe {
        manta_rope_table(
            FUSED_OPS_SOURCE.as_ptr() as *const c_char,
            ptr(positions),
            ptr(inv_freq),
            ptr(&table),
        )
    })?;
    Ok(table)
}

/// For every token of a flat batch: Qwen3's per-head RMS norm of queries and keys (when
/// `qk_norm` weights are given), the rotary embedding (rotate-half layout, from `rope`,
/// the batch's [`rope_table`]), keys and values stored in their cache `slots`, queries
/// written to `q_out` [N, heads, head_dim]. `qkv` holds each token's projected
/// [heads | kv_heads | kv_heads] × head_dim (bf16). `slots` is read before the wait on the
/// kernel launched before, so it must be written before the forward's first plain launch
/// (a host copy, as the engine's inputs are), not by a dependent kernel.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store(
    qkv: &Tensor,
    qk_norm: Option<(&Tensor, &Tensor)>,
    rope: &Tensor,
    slots: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    q_out: &mut Tensor,
    eps: f64,
) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe {
        manta_qk_norm_rope_store(
            FUSED_OPS_SOURCE.as_ptr() as *const c_char,
            ptr(qkv),
            opt_ptr(qk_norm.map(|n| n.0)),
            opt_ptr(qk_norm.map(|n| n.1)),
            ptr(rope),
            ptr(slots),
            ptr(k_pool),
            ptr(v_pool),
            ptr(q_out),
            eps as f32,
        )
    })
}

/// `residual += delta` in place (rounded to bf16) when `delta` is given, then
/// `out = rms_norm(residual) × weight`: the residual add and the next norm in one kernel.
pub fn add_rms_norm(
    residual: &mut Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    out: &mut Tensor,
    eps: f64,
) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe {
        manta_add_rms_norm(
            FUSED_OPS_SOURCE.as_ptr() as *const c_char,
            ptr(residual),
            opt_ptr(delta),
            ptr(weight),
            ptr(out),
            eps as f32,
        )
    })
}

/// `out = silu(gate) × up` for `gate_up` rows laid out [gate | up].
pub fn silu_mul(gate_up: &Tensor, out: &mut Tensor) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe {
        manta_silu_mul(
            FUSED_OPS_SOURCE.as_ptr() as *const c_char,
            ptr(gate_up),
            ptr(out),
        )
    })
}

/// `y = x · wᵀ` for bf16 CUDA tensors (x [.., in], w [out, in], y [.., out]) through
/// cuBLASLt's heuristic choice, which reads a decode step's weights faster than the cuBLAS
/// GEMM of `Tensor::linear` (BENCHMARKS.md); at::mm where cuBLASLt offers no algorithm, or
/// with `MANTA_DECODE_LT=0`. Launched on the current stream (CUDA graphs capture it).
pub fn linear(x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: live tensor handles for the call; the shim checks shapes, dtypes, devices.
    check(unsafe { manta_lt_linear(ptr(x), ptr(w), ptr(y)) })
}

/// Causal attention over packed sequences of different lengths in one launch, through
/// libtorch's flash attention (varlen): `q` [total_q, heads, hd], `k`, `v` [total_k,
/// kv_heads, hd] (bf16 or fp16, CUDA; heads a multiple of kv_heads), `cu_q`, `cu_k` the
/// sequences' cumulative query and key counts [seqs + 1] (int32, on the device), `max_q`,
/// `max_k` the largest of each. A sequence with more keys than queries (a cached prefix)
/// has its queries at the end: query i of n sees keys up to `keys - n + i`. A prefill step
/// runs one call per layer instead of one per sequence. Returns [total_q, heads, hd].
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &Tensor,
    cu_k: &Tensor,
    max_q: i64,
    max_k: i64,
    scale: f64,
) -> Result<Tensor, CudaError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensor handles for the call; on success `out` is a new at::Tensor we own.
    check(unsafe {
        manta_flash_varlen(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(cu_q),
            ptr(cu_k),
            max_q,
            max_k,
            scale,
            &mut out,
        )
    })?;
    // SAFETY: `out` is a heap at::Tensor, which is what tch's tensor handle points to.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Decode attention straight over a paged KV cache, one query token per sequence.
///
/// `q` [B, heads, head_dim], pools [slots, kv_heads, head_dim] (bf16, contiguous),
/// `tables` [B, max_blocks] i32 block ids (slot = id × block_size + offset), `lens` [B]
/// i32 context lengths; writes `out` (like `q`). The context is split across CTAs when the
/// batch alone would not fill the GPU (under two CTAs per SM); `counters` (≥ B × kv_heads
/// i32 zeros, left zero after each call, so one buffer serves every layer and every CUDA
/// graph replay) let the last CTA of each split group merge them in the same kernel, else a
/// second kernel does.
/// Compiled with NVRTC on first use per shape, launched on the current stream (so CUDA
/// graphs capture it).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    tables: &Tensor,
    lens: &Tensor,
    counters: Option<&Tensor>,
    out: &mut Tensor,
    block_size: usize,
    scale: f64,
) -> Result<(), CudaError> {
    sync_kernel_knobs();
    // SAFETY: the pointers are live at::Tensor handles for the duration of the call; the
    // shim checks shapes, dtypes and devices before touching their data.
    check(unsafe {
        manta_paged_decode_attention(
            PAGED_ATTENTION_SOURCE.as_ptr() as *const c_char,
            q.as_ptr() as *mut c_void,
            k_pool.as_ptr() as *mut c_void,
            v_pool.as_ptr() as *mut c_void,
            tables.as_ptr() as *mut c_void,
            lens.as_ptr() as *mut c_void,
            opt_ptr(counters),
            out.as_mut_ptr() as *mut c_void,
            block_size as c_int,
            scale as f32,
        )
    })
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

/// `dst.copy_(src)` without waiting for the device: from pinned host memory to the GPU the
/// host returns once the copy is queued. `src` must stay unchanged until the copy has run
/// (a later synchronisation on the stream says so). tch's `copy_` always waits.
pub fn copy_nonblocking(dst: &mut Tensor, src: &Tensor) -> Result<(), CudaError> {
    // SAFETY: live tensor handles for the call; libtorch checks shapes and devices.
    check(unsafe {
        manta_copy_nonblocking(dst.as_mut_ptr() as *mut c_void, src.as_ptr() as *mut c_void)
    })
}

/// A page-locked (pinned) copy of the CPU tensor `src`, which non-blocking copies to and
/// from the GPU need.
pub fn pin_memory(src: &Tensor) -> Result<Tensor, CudaError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live tensor handle; on success `out` is a new at::Tensor we now own.
    check(unsafe { manta_pin_memory(src.as_ptr() as *mut c_void, &mut out) })?;
    // SAFETY: `out` is a heap at::Tensor, which is what tch's tensor handle points to.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Bytes of memory on CUDA device `device`.
pub fn total_memory(device: usize) -> Result<usize, CudaError> {
    let mut total = 0usize;
    // SAFETY: the pointer is valid for writes.
    check(unsafe { manta_cuda_total_memory(device as c_int, &mut total) })?;
    Ok(total)
}

/// Returns the CUDA caching allocator's unused blocks to the device, so memory an engine
/// released (its KV cache) becomes available to a trainer sharing the GPU.
pub fn empty_cache() -> Result<(), CudaError> {
    // SAFETY: no arguments; the allocator is thread-safe.
    check(unsafe { manta_cuda_empty_cache() })
}

/// The compute capability of CUDA device `device` as NVRTC names it (90 for sm_90).
pub fn device_arch(device: usize) -> Result<u32, CudaError> {
    let mut arch: c_int = 0;
    // SAFETY: the pointer is valid for writes.
    check(unsafe { manta_cuda_device_arch(device as c_int, &mut arch) })?;
    Ok(arch as u32)
}

/// The raw `cudaStream_t` of libtorch's current stream on `device`: work queued there
/// (NCCL collectives on tch tensors' memory) is ordered with the tensor ops around it.
pub fn current_stream(device: usize) -> Result<*mut c_void, CudaError> {
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: the pointer is valid for writes.
    check(unsafe { manta_cuda_current_stream(device as c_int, &mut stream) })?;
    Ok(stream)
}

/// Makes `device` the calling thread's current CUDA device (an NCCL communicator binds
/// to the device current when it is created).
pub fn set_device(device: usize) -> Result<(), CudaError> {
    // SAFETY: plain integer argument.
    check(unsafe { manta_cuda_set_device(device as c_int) })
}

/// The most bytes libtorch's caching allocator had allocated on `device` at once since
/// the start or the last reset (`torch.cuda.max_memory_allocated`); `reset` then starts
/// a new peak (`torch.cuda.reset_peak_memory_stats`).
pub fn peak_allocated(device: usize, reset: bool) -> Result<usize, CudaError> {
    let mut bytes = 0usize;
    // SAFETY: the pointer is valid for writes.
    check(unsafe { manta_cuda_peak_allocated(device as c_int, reset as c_int, &mut bytes) })?;
    Ok(bytes)
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

/// A point in a device's current stream: the host can wait for the work queued before it
/// while the work queued after it goes on (an engine reads one step's tokens while the
/// next step runs).
pub struct CudaEvent {
    ptr: *mut c_void,
}

// SAFETY: a CUDA event may be recorded, waited on and destroyed from any thread.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// Records an event on `device`'s current stream.
    pub fn record(device: usize) -> Result<Self, CudaError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the pointer is valid for writes; on success it holds a new event we own.
        check(unsafe { manta_event_record(device as c_int, &mut ptr) })?;
        Ok(Self { ptr })
    }

    /// Blocks until the work queued before the event has run.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: ptr is a live event.
        check(unsafe { manta_event_synchronize(self.ptr) })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: ptr came from manta_event_record and is freed once.
        unsafe { manta_event_free(self.ptr) }
    }
}

/// The environment variable naming the GPU that CUDA tests run on (default 0).
pub const TEST_GPU_ENV: &str = "MANTA_TEST_GPU";

/// The GPU a CUDA test runs on: `MANTA_TEST_GPU` (default 0), so the same tests prove
/// the code on GPU 1 of a two-GPU machine, where the calling thread's current device is
/// still GPU 0. `None` where libtorch sees no CUDA device (the test then reports itself
/// skipped). Panics when the variable is not an index of a visible GPU: a test asked to
/// run on a GPU it cannot reach must fail, not skip.
pub fn test_gpu() -> Option<usize> {
    if !tch::Cuda::is_available() {
        return None;
    }
    let count = tch::Cuda::device_count().max(0) as usize;
    let value = std::env::var(TEST_GPU_ENV).ok();
    Some(parse_test_gpu(value.as_deref(), count).unwrap_or_else(|e| panic!("{e}")))
}

/// `MANTA_TEST_GPU`'s value (`None`: unset) as a GPU index below `count`.
fn parse_test_gpu(value: Option<&str>, count: usize) -> Result<usize, String> {
    let gpu = match value {
        None => 0,
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("{TEST_GPU_ENV}={v:?} is not a GPU index"))?,
    };
    if gpu >= count {
        return Err(format!(
            "{TEST_GPU_ENV}={gpu}, but libtorch sees {count} CUDA device(s)"
        ));
    }
    Ok(gpu)
}

/// Serialises this crate's GPU tests: a CUDA graph capture in one test thread makes any
/// other thread's use of the CUDA random generator fail ("Offset increment outside graph
/// capture encountered unexpectedly"). Tests that set kernel knobs (process-wide) take it
/// too, so no other test's kernels change layout under it.
#[cfg(test)]
pub(crate) fn gpu_test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn the_test_gpu_is_an_index_of_a_visible_gpu() {
        assert_eq!(parse_test_gpu(None, 1), Ok(0));
        assert_eq!(parse_test_gpu(Some(" 1 "), 2), Ok(1));
        let e = parse_test_gpu(Some("one"), 2).unwrap_err();
        assert!(
            e.contains("MANTA_TEST_GPU=\"one\" is not a GPU index"),
            "{e}"
        );
        let e = parse_test_gpu(Some("1"), 1).unwrap_err();
        assert!(
            e.contains("MANTA_TEST_GPU=1, but libtorch sees 1 CUDA device"),
            "{e}"
        );
    }

    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn a_graph_replays_its_captured_work_on_new_inputs() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        let x = Tensor::zeros([4], (Kind::Float, dev));
        let w = Tensor::ones([4], (Kind::Float, dev)) * 2.0;
        let _ = (&x * &w + 1.0).sum(Kind::Float); // warm-up
        let (graph, y) =
            CudaGraph::capture(gpu, None, || (&x * &w + 1.0).sum(Kind::Float)).unwrap();
        let mut xin = x.shallow_clone();
        xin.copy_(&Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).to(dev));
        graph.replay().unwrap();
        assert_eq!(y.double_value(&[]), 24.0);
        assert!(total_memory(gpu).unwrap() > 0);
    }

    /// Waiting on an event sees the copy queued before it, while later work is still queued.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn an_event_waits_for_the_work_queued_before_it() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        let a = Tensor::randn([2048, 2048], (Kind::Float, dev));
        let x = (a.matmul(&a).sum(Kind::Float) * 0.0 + 7.0).reshape([1]);
        let mut host = pin_memory(&Tensor::zeros([1], (Kind::Float, Device::Cpu))).unwrap();
        copy_nonblocking(&mut host, &x).unwrap();
        let event = CudaEvent::record(gpu).unwrap();
        // Work queued after the event, which the wait below need not cover.
        let mut later = a.shallow_clone();
        for _ in 0..8 {
            later = later.matmul(&a);
        }
        event.synchronize().unwrap();
        assert_eq!(host.double_value(&[0]), 7.0);
        drop(later);
    }

    /// Varlen flash attention against fp32 attention with an explicit mask, per sequence:
    /// sequences with a cached prefix (more keys than queries) see keys up to their own
    /// position, aligned at the end of their keys; grouped heads (GQA) share a key head.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn varlen_flash_attention_matches_masked_attention() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        tch::manual_seed(11);
        let dev = Device::Cuda(gpu);
        let (heads, kv_heads, hd) = (8i64, 2i64, 128i64);
        // (queries, keys) per sequence: cached prefixes, a plain prefill, one token.
        let seqs = [(5i64, 12i64), (7, 7), (1, 9), (64, 200)];
        let (tq, tk): (i64, i64) = (
            seqs.iter().map(|s| s.0).sum(),
            seqs.iter().map(|s| s.1).sum(),
        );
        let opts = (Kind::BFloat16, dev);
        let q = Tensor::randn([tq, heads, hd], opts);
        let k = Tensor::randn([tk, kv_heads, hd], opts);
        let v = Tensor::randn([tk, kv_heads, hd], opts);
        let cum = |f: fn(&(i64, i64)) -> i64| {
            let mut c = vec![0i32];
            for s in &seqs {
                c.push(c[c.len() - 1] + f(s) as i32);
            }
            Tensor::from_slice(&c).to(dev)
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let out = flash_attention_varlen(&q, &k, &v, &cum(|s| s.0), &cum(|s| s.1), 64, 200, scale)
            .unwrap();
        assert_eq!(out.size(), [tq, heads, hd]);
        let (mut at_q, mut at_k) = (0i64, 0i64);
        for &(nq, nk) in &seqs {
            let qs = q.narrow(0, at_q, nq).to_kind(Kind::Float).transpose(0, 1);
            let rep = |t: &Tensor| {
                t.narrow(0, at_k, nk)
                    .to_kind(Kind::Float)
                    .transpose(0, 1)
                    .repeat_interleave_self_int(heads / kv_heads, 0, None)
            };
            let scores = qs.matmul(&rep(&k).transpose(1, 2)) * scale;
            let q_pos = Tensor::arange_start(nk - nq, nk, (Kind::Int64, dev));
            let k_pos = Tensor::arange(nk, (Kind::Int64, dev));
            let visible = k_pos.unsqueeze(0).le_tensor(&q_pos.unsqueeze(1));
            let scores = scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
            let expected = scores
                .softmax(-1, Kind::Float)
                .matmul(&rep(&v))
                .transpose(0, 1);
            let got = out.narrow(0, at_q, nq).to_kind(Kind::Float);
            let err = (&got - &expected).abs().max().double_value(&[]);
            assert!(
                err < 2e-2,
                "sequence ({nq} queries, {nk} keys): max error {err}"
            );
            at_q += nq;
            at_k += nk;
        }
    }

    /// The trainer's fused kernels (rotary embedding, RMSNorm, gated activation) compile
    /// for Ampere and Hopper with NVRTC, with no GPU needed.
    #[test]
    fn trainer_kernels_compile_for_hopper_and_ampere() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        type CompileCheck = fn(u32) -> Result<(), CudaError>;
        let kernels: [(&str, CompileCheck); 3] = [
            ("rope", rope::compile_check),
            ("rms_norm", rms_norm::compile_check),
            ("swiglu", swiglu::compile_check),
        ];
        for (name, compile) in kernels {
            for arch in [80, 90] {
                if let Err(e) = compile(arch) {
                    panic!("{name}, sm_{arch}: {e}");
                }
            }
        }
    }

    /// The trainer's fused ops refuse CPU tensors with an error that says so.
    #[test]
    fn trainer_kernels_refuse_cpu_tensors_with_an_error() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        let rows = Tensor::zeros([4, 16], (Kind::BFloat16, Device::Cpu));
        let table = Tensor::zeros([4, 8], (Kind::BFloat16, Device::Cpu));
        let weight = Tensor::ones([16], (Kind::BFloat16, Device::Cpu));
        let errors = [
            rope::rope(&rows.view([4, 2, 8]), &table, &table).map(|_| ()),
            rms_norm::rms_norm(&rows, &weight, 1e-6).map(|_| ()),
            swiglu::swiglu(&rows, &rows).map(|_| ()),
        ];
        for e in errors {
            let e = e.expect_err("a CPU tensor").to_string();
            assert!(e.contains("CUDA tensor"), "{e}");
        }
    }

    /// NVRTC compiles every decode kernel for the shapes the engine uses (Qwen3-0.6B,
    /// Qwen3-8B, and a Qwen2-0.5B-like head_dim 64 without q/k norms) on Hopper, with no
    /// GPU needed.
    #[test]
    fn decode_kernels_compile_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        let shapes = [
            (1024, 3072, 16, 8, 128, true),
            (4096, 12288, 32, 8, 128, true),
            (896, 4864, 14, 2, 64, false),
        ];
        for (hidden, intermediate, heads, kv_heads, head_dim, qk_norm) in shapes {
            let shape = KernelShape {
                hidden,
                intermediate,
                heads,
                kv_heads,
                head_dim,
                qk_norm,
            };
            if let Err(e) = decode_kernels_compile(shape, 90) {
                panic!("{shape:?}: {e}");
            }
        }
    }

    /// The kernel against gather + softmax in fp32, over a shuffled block table.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn paged_decode_attention_matches_gathered_attention() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(3);
        // Four rows split the context across CTAs (the lane-group kernel); forty rows fill
        // the GPU unsplit (the tensor-core kernel, MANTA_PAGED_MMA).
        let few = vec![1i32, 17, 200, 333];
        let many: Vec<i32> = (0..40).map(|i| 1 + (i * 97) % 384).collect();
        let shapes = [(16i64, 8i64, 128i64), (32, 8, 128), (8, 8, 64)];
        // Queries × 8 make scores of spread ~8: a sharp softmax whose running max jumps
        // by several units between tokens, so the rescaling of the running sums matters.
        for ((nh, nkv, hd), lens_v, sharpness) in shapes.iter().flat_map(|s| {
            [
                (*s, few.clone(), 1.0),
                (*s, many.clone(), 1.0),
                (*s, many.clone(), 8.0),
            ]
        }) {
            let (bs, blocks) = (16i64, 64i64);
            let kp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
            let vp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
            let b = lens_v.len() as i64;
            let q = Tensor::randn([b, nh, hd], (Kind::BFloat16, dev)) * sharpness;
            let max_blocks = 24i64;
            let perm: Vec<i64> =
                Vec::try_from(&Tensor::randperm(blocks, (Kind::Int64, Device::Cpu))).unwrap();
            let table_v: Vec<i32> = (0..b * max_blocks)
                .map(|i| perm[(i as usize * 7) % perm.len()] as i32)
                .collect();
            let tables = Tensor::from_slice(&table_v).view([b, max_blocks]).to(dev);
            let lens = Tensor::from_slice(&lens_v).to(dev);
            let scale = 1.0 / (hd as f64).sqrt();
            let mut out = q.zeros_like();
            paged_decode_attention(
                &q,
                &kp,
                &vp,
                &tables,
                &lens,
                None,
                &mut out,
                bs as usize,
                scale,
            )
            .unwrap();
            // Merged in the kernel: twice over one counter buffer, which must stay zero.
            let counters = Tensor::zeros([b * nkv], (Kind::Int, dev));
            for _ in 0..2 {
                let mut merged = q.zeros_like();
                let c = Some(&counters);
                paged_decode_attention(
                    &q,
                    &kp,
                    &vp,
                    &tables,
                    &lens,
                    c,
                    &mut merged,
                    bs as usize,
                    scale,
                )
                .unwrap();
                assert!(
                    merged.equal(&out),
                    "in-kernel merge differs from the combine kernel"
                );
            }
            assert_eq!(
                counters.abs().sum(Kind::Int64).int64_value(&[]),
                0,
                "counters reset"
            );
            for row in 0..b as usize {
                let len = lens_v[row] as i64;
                let slots: Vec<i64> = (0..len)
                    .map(|t| {
                        table_v[row * max_blocks as usize + (t / bs) as usize] as i64 * bs + t % bs
                    })
                    .collect();
                let idx = Tensor::from_slice(&slots).to(dev);
                let k = kp.index_select(0, &idx).to_kind(Kind::Float); // [len, nkv, hd]
                let v = vp.index_select(0, &idx).to_kind(Kind::Float);
                let qr = q
                    .get(row as i64)
                    .to_kind(Kind::Float)
                    .view([nkv, nh / nkv, hd]);
                let scores = qr.matmul(&k.permute([1, 2, 0])) * scale; // [nkv, rep, len]
                let expect = scores
                    .softmax(-1, Kind::Float)
                    .matmul(&v.transpose(0, 1))
                    .view([nh, hd]);
                let got = out.get(row as i64).to_kind(Kind::Float);
                let diff = (got - &expect).abs().max().double_value(&[]);
                assert!(
                    diff < 2e-2,
                    "heads {nh}/{nkv} hd {hd} batch {b} sharpness {sharpness} row {row}: max diff {diff}"
                );
            }
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
            .abs()
            .max()
            .double_value(&[])
    }

    /// The fused decode ops against the tensor ops they replace (bf16 on the GPU).
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn lt_linear_matches_the_fp32_product() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let bf = (Kind::BFloat16, Device::Cuda(gpu));
        tch::manual_seed(9);
        // Decode-sized rows, a projection's shape and an odd one, and an x that starts 2
        // bytes into its buffer (cuBLASLt must pick a kernel for that alignment).
        for (rows, n, k, offset) in [
            (1i64, 4096i64, 1024i64, 0i64),
            (3, 1000, 72, 0),
            (64, 6144, 1024, 0),
            (130, 1024, 3072, 0),
            (64, 512, 256, 1),
        ] {
            let buf = Tensor::randn([rows * k + offset], bf);
            let x = buf.narrow(0, offset, rows * k).view([rows, k]);
            let w = Tensor::randn([n, k], bf) * 0.05;
            let mut y = Tensor::empty([rows, n], bf);
            linear(&x, &w, &mut y).unwrap();
            let want = x
                .to_kind(Kind::Float)
                .matmul(&w.to_kind(Kind::Float).transpose(0, 1));
            let scale = want.abs().max().double_value(&[]);
            let d = (y.to_kind(Kind::Float) - &want)
                .abs()
                .max()
                .double_value(&[]);
            // bf16 output: within one ulp (≤ 2⁻⁷ of the largest value; a wrong layout or
            // operand is off by the values themselves).
            assert!(
                d <= 8e-3 * scale,
                "{rows}x{k} by {n}x{k} (offset {offset}): max diff {d} of {scale}"
            );
        }
        let x = Tensor::randn([4, 64], bf);
        let w = Tensor::randn([32, 64], bf);
        let mut wrong = Tensor::empty([4, 31], bf);
        let e = linear(&x, &w, &mut wrong).unwrap_err().to_string();
        assert!(e.contains("y must be [4, 32]"), "{e}");
    }

    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn fused_ops_match_the_tensor_ops_they_replace() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        let bf = (Kind::BFloat16, dev);
        tch::manual_seed(5);
        let eps = 1e-6;
        // add_rms_norm, with and without the residual add.
        for hidden in [1024i64, 4096, 896] {
            let n = 7;
            let x = Tensor::randn([n, hidden], bf);
            let delta = Tensor::randn([n, hidden], bf);
            let w = Tensor::rand([hidden], bf) + 0.5;
            let sum = &x + &delta;
            // transformers' order: the normalised row rounded to bf16, then times the weight.
            let expect = sum.rms_norm([hidden], None::<Tensor>, eps) * &w;
            let mut residual = x.copy();
            let mut out = x.empty_like();
            add_rms_norm(&mut residual, Some(&delta), &w, &mut out, eps).unwrap();
            assert_eq!(max_diff(&residual, &sum), 0.0, "hidden {hidden}: residual");
            let d = max_diff(&out, &expect);
            assert!(d < 3e-2, "hidden {hidden}: add_rms_norm max diff {d}");
            let mut plain = x.empty_like();
            let mut same = x.copy();
            add_rms_norm(&mut same, None, &w, &mut plain, eps).unwrap();
            let d = max_diff(&plain, &(x.rms_norm([hidden], None::<Tensor>, eps) * &w));
            assert!(d < 3e-2, "hidden {hidden}: rms_norm max diff {d}");
            assert_eq!(
                max_diff(&same, &x),
                0.0,
                "no delta leaves the residual alone"
            );
        }
        // silu_mul: decode's few rows and a prefill chunk's thousands (a grid of thousands
        // of blocks).
        for (rows, inter) in [(5i64, 3072i64), (5, 4864), (3001, 3072)] {
            let gu = Tensor::randn([rows, 2 * inter], bf) * 3.0;
            let expect = gu.narrow(1, 0, inter).silu() * gu.narrow(1, inter, inter);
            let mut out = Tensor::empty([rows, inter], bf);
            silu_mul(&gu, &mut out).unwrap();
            let d = max_diff(&out, &expect);
            assert!(d < 6e-2, "{rows} x {inter}: silu_mul max diff {d}");
        }
        // qk_norm_rope_store against norm + rotate-half rope + index_copy into the pools;
        // 7 + 2 × 1 heads leave most of a CTA with no head.
        for (nh, nkv, hd, norm) in [
            (16i64, 8i64, 128i64, true),
            (14, 2, 64, false),
            (7, 1, 128, true),
            (4, 2, 256, true),
        ] {
            let n = 6i64;
            let slots_total = 64i64;
            let qkv = Tensor::randn([n, (nh + 2 * nkv) * hd], bf);
            let qw = Tensor::rand([hd], bf) + 0.5;
            let kw = Tensor::rand([hd], bf) + 0.5;
            let positions = Tensor::from_slice(&[0i64, 1, 17, 500, 4095, 40000]).to(dev);
            let inv_freq = Tensor::pow_scalar(
                1_000_000f64,
                &(Tensor::arange_start_step(0, hd, 2, (Kind::Float, dev)) / hd as f64),
            )
            .reciprocal();
            let slots = Tensor::from_slice(&[3i64, 9, 10, 40, 41, 63]).to(dev);
            let kp = Tensor::zeros([slots_total, nkv, hd], bf);
            let vp = Tensor::zeros([slots_total, nkv, hd], bf);
            let mut q_out = Tensor::empty([n, nh, hd], bf);
            let weights = norm.then_some((&qw, &kw));
            let rope = rope_table(&positions, &inv_freq).unwrap();
            qk_norm_rope_store(&qkv, weights, &rope, &slots, &kp, &vp, &mut q_out, eps).unwrap();
            // The reference, as the model's composite path computes it.
            let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &inv_freq;
            let emb = Tensor::cat(&[&freqs, &freqs], -1);
            let (cos, sin) = (
                emb.cos().to_kind(Kind::BFloat16).unsqueeze(1),
                emb.sin().to_kind(Kind::BFloat16).unsqueeze(1),
            );
            // The table holds the model's rounded cosines and sines, bit for bit.
            let half = hd / 2;
            assert_eq!(
                max_diff(
                    &rope.narrow(1, 0, half),
                    &cos.squeeze_dim(1).narrow(1, 0, half)
                ),
                0.0,
                "rope table cosines"
            );
            assert_eq!(
                max_diff(
                    &rope.narrow(1, half, half),
                    &sin.squeeze_dim(1).narrow(1, 0, half)
                ),
                0.0,
                "rope table sines"
            );
            let what = format!("heads {nh}/{nkv}, head_dim {hd}");
            let rotate = |x: &Tensor| {
                let rot = Tensor::cat(
                    &[&x.narrow(-1, half, half).neg(), &x.narrow(-1, 0, half)],
                    -1,
                );
                x * &cos + rot * &sin
            };
            let q = qkv.narrow(1, 0, nh * hd).view([n, nh, hd]);
            let k = qkv.narrow(1, nh * hd, nkv * hd).view([n, nkv, hd]);
            let v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view([n, nkv, hd]);
            let (q, k) = if norm {
                (
                    q.rms_norm([hd], None::<Tensor>, eps) * &qw,
                    k.rms_norm([hd], None::<Tensor>, eps) * &kw,
                )
            } else {
                (q, k)
            };
            let (q, k) = (rotate(&q), rotate(&k));
            let d = max_diff(&q_out, &q);
            assert!(d < 6e-2, "{what}: queries max diff {d}");
            let d = max_diff(&kp.index_select(0, &slots), &k);
            assert!(d < 6e-2, "{what}: keys max diff {d}");
            assert_eq!(
                max_diff(&vp.index_select(0, &slots), &v),
                0.0,
                "values are copied"
            );
            let untouched = Tensor::from_slice(&[0i64, 1, 2, 4, 62]).to(dev);
            assert_eq!(
                kp.index_select(0, &untouched)
                    .abs()
                    .sum(Kind::Float)
                    .double_value(&[]),
                0.0,
                "only the given slots are written"
            );
        }
    }
}
