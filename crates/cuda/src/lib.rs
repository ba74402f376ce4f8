//! What tch does not expose of libtorch's CUDA side: CUDA graphs (capture a sequence of
//! tensor operations once, replay it with one launch — decode steps are otherwise bound by
//! per-kernel launch cost) and the device's total memory (to size a KV cache from
//! `--mem-fraction-static`). A small C++ shim compiled against the linked libtorch.

pub mod ipc;

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::Tensor;

extern "C" {
    fn manta_cuda_last_error() -> *const c_char;
    fn manta_cuda_built_with_cuda() -> c_int;
    fn manta_cuda_total_memory(device: c_int, total: *mut usize) -> c_int;
    fn manta_graph_new() -> *mut c_void;
    fn manta_graph_capture_begin(g: *mut c_void, device: c_int, share: *mut c_void) -> c_int;
    fn manta_graph_capture_end(g: *mut c_void) -> c_int;
    fn manta_graph_replay(g: *mut c_void) -> c_int;
    fn manta_graph_free(g: *mut c_void);
    #[allow(clippy::too_many_arguments)]
    fn manta_paged_decode_attention(
        source: *const c_char,
        q: *mut c_void,
        k_pool: *mut c_void,
        v_pool: *mut c_void,
        tables: *mut c_void,
        lens: *mut c_void,
        out: *mut c_void,
        block_size: c_int,
        scale: f32,
    ) -> c_int;
}

extern "C" {
    fn manta_paged_attention_compile_check(
        source: *const c_char,
        hd: c_int,
        rep: c_int,
        nkv: c_int,
        arch: c_int,
    ) -> c_int;
}

/// Compiles the paged attention kernel for one shape and `sm_<arch>` with NVRTC, which
/// needs no GPU: a check that CPU machines can run.
pub fn paged_attention_compiles(
    hd: usize,
    rep: usize,
    nkv: usize,
    arch: u32,
) -> Result<(), CudaError> {
    // SAFETY: the source is NUL-terminated and outlives the call.
    check(unsafe {
        manta_paged_attention_compile_check(
            PAGED_ATTENTION_SOURCE.as_ptr() as *const c_char,
            hd as c_int,
            rep as c_int,
            nkv as c_int,
            arch as c_int,
        )
    })
}

/// The kernel's CUDA source, NUL-terminated for NVRTC.
const PAGED_ATTENTION_SOURCE: &str = concat!(include_str!("paged_attention.cu.inc"), "\0");

/// Decode attention straight over a paged KV cache, one query token per sequence.
///
/// `q` [B, heads, head_dim], pools [slots, kv_heads, head_dim] (bf16, contiguous),
/// `tables` [B, max_blocks] i32 block ids (slot = id × block_size + offset), `lens` [B]
/// i32 context lengths; writes `out` (like `q`). Compiled with NVRTC on first use per
/// shape, launched on the current stream (so CUDA graphs capture it).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    tables: &Tensor,
    lens: &Tensor,
    out: &mut Tensor,
    block_size: usize,
    scale: f64,
) -> Result<(), CudaError> {
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
        xin.copy_(&Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).to(dev));
        graph.replay().unwrap();
        assert_eq!(y.double_value(&[]), 24.0);
        assert!(total_memory(0).unwrap() > 0);
    }

    /// NVRTC compiles the kernel for the shapes the engine uses (Qwen3-0.6B: 16/8 heads,
    /// 8B: 32/8, and a head_dim of 64) on Hopper, with no GPU needed.
    #[test]
    fn paged_attention_kernel_compiles_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        for (hd, rep, nkv) in [(128, 2, 8), (128, 4, 8), (64, 1, 8)] {
            if let Err(e) = paged_attention_compiles(hd, rep, nkv, 90) {
                panic!("head_dim {hd}, {rep} query heads per kv head: {e}");
            }
        }
    }

    /// The kernel against gather + softmax in fp32, over a shuffled block table.
    #[test]
    fn paged_decode_attention_matches_gathered_attention() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        }
        let dev = Device::Cuda(0);
        tch::manual_seed(3);
        for (nh, nkv, hd) in [(16i64, 8i64, 128i64), (32, 8, 128), (8, 8, 64)] {
            let (bs, blocks) = (16i64, 64i64);
            let kp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
            let vp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
            let lens_v = [1i32, 17, 200, 333];
            let b = lens_v.len() as i64;
            let q = Tensor::randn([b, nh, hd], (Kind::BFloat16, dev));
            let max_blocks = 24i64;
            let perm = Tensor::randperm(blocks, (Kind::Int64, Device::Cpu));
            let table_v: Vec<i64> =
                Vec::try_from(&perm.narrow(0, 0, b * max_blocks % blocks)).unwrap();
            let table_v: Vec<i32> = (0..b * max_blocks)
                .map(|i| table_v[(i as usize * 7) % table_v.len()] as i32)
                .collect();
            let tables = Tensor::from_slice(&table_v).view([b, max_blocks]).to(dev);
            let lens = Tensor::from_slice(&lens_v).to(dev);
            let mut out = q.zeros_like();
            let scale = 1.0 / (hd as f64).sqrt();
            paged_decode_attention(&q, &kp, &vp, &tables, &lens, &mut out, bs as usize, scale)
                .unwrap();
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
                    "heads {nh}/{nkv} hd {hd} row {row}: max diff {diff}"
                );
            }
        }
    }
}
