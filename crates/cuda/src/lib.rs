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
mod tests;
