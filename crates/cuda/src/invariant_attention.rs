//! Batch-invariant causal attention (invariant_attention.cu.inc) for true on-policy runs.
//!
//! Flash-style kernels pick their tiling and split the keys by batch size and occupancy, so
//! a token's attention output differs in its last bits between the engine (one row per
//! decode step, prompts in prefill chunks) and the trainer (whole packed sequences). In a
//! bf16 model those bits grow over the layers into log-prob differences of ~6e-3. This
//! kernel reduces every query row in one fixed order that depends only on the row's length,
//! so both sides running it get the same bits (Miles' `--true-on-policy-mode`).

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, CudaError};

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn manta_invariant_attention(
        source: *const c_char,
        q: *mut c_void,
        k: *mut c_void,
        v: *mut c_void,
        tables: *mut c_void,
        row_ref: *mut c_void,
        row_len: *mut c_void,
        out: *mut c_void,
        block_size: c_int,
        scale: f32,
    ) -> c_int;
    fn manta_invariant_attention_compile_check(
        source: *const c_char,
        heads: c_int,
        kv_heads: c_int,
        head_dim: c_int,
        arch: c_int,
    ) -> c_int;
}

/// The kernel's CUDA source, NUL-terminated for NVRTC.
const SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("invariant_attention.cu.inc"),
    "\0"
);

/// Where each query row's keys and values are (`k`/`v` are [slots, kv_heads, head_dim]).
pub enum KeyLayout<'a> {
    /// Through block tables [S, W] i32 (slot = id × block_size + offset); `row_table` [R]
    /// i32 picks each row's table, or row r uses table r when `None` (decode rows).
    Paged {
        tables: &'a Tensor,
        row_table: Option<&'a Tensor>,
        block_size: usize,
    },
    /// Row r's keys at slots `first[r] .. first[r] + len[r]` ([R] i32), e.g. a packed
    /// sequence's own keys.
    Contiguous { first: &'a Tensor },
}

/// Causal attention of `q` [R, heads, head_dim] over each row's first `row_len[r]` keys
/// ([R] i32), into `out` (like `q`); bf16 on CUDA, scores scaled by `scale`. A row's
/// result does not depend on the other rows.
pub fn invariant_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: KeyLayout,
    row_len: &Tensor,
    out: &mut Tensor,
    scale: f64,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    let (tables, row_ref, block_size) = match layout {
        KeyLayout::Paged {
            tables,
            row_table,
            block_size,
        } => (Some(tables), row_table, block_size),
        KeyLayout::Contiguous { first } => (None, Some(first), 1),
    };
    // SAFETY: the pointers are live at::Tensor handles for the duration of the call; the
    // shim checks shapes, dtypes and devices before touching their data.
    check(unsafe {
        manta_invariant_attention(
            SOURCE.as_ptr() as *const c_char,
            q.as_ptr() as *mut c_void,
            k.as_ptr() as *mut c_void,
            v.as_ptr() as *mut c_void,
            tables.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut c_void),
            row_ref.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut c_void),
            row_len.as_ptr() as *mut c_void,
            out.as_mut_ptr() as *mut c_void,
            block_size as c_int,
            scale as f32,
        )
    })
}

/// Compiles the kernel for a model shape and `sm_<arch>` with NVRTC (no GPU needed).
pub fn compile_check(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    arch: u32,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_invariant_attention_compile_check(
            SOURCE.as_ptr() as *const c_char,
            heads as c_int,
            kv_heads as c_int,
            head_dim as c_int,
            arch as c_int,
        )
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    /// NVRTC compiles the kernel for the engine's shapes (Qwen3-0.6B, Qwen3-8B, head_dim
    /// 64) on Hopper, with no GPU needed.
    #[test]
    fn compiles_for_hopper() {
        if !crate::built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        for (heads, kv_heads, head_dim) in [(16, 8, 128), (32, 8, 128), (14, 2, 64)] {
            if let Err(e) = compile_check(heads, kv_heads, head_dim, 90) {
                panic!("{heads}/{kv_heads} heads, head_dim {head_dim}: {e}");
            }
        }
    }

    fn ints(v: &[i32], dev: Device) -> Tensor {
        Tensor::from_slice(v).to(dev)
    }

    /// Every row against softmax in fp32 (within bf16 rounding), and bit for bit the same
    /// whether it runs alone, among other rows, as a decode row through its own block table,
    /// as one of a prompt's rows sharing a table, or over contiguous keys.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn rows_match_softmax_and_do_not_depend_on_the_batch() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(11);
        for (nh, nkv, hd) in [(16i64, 8i64, 128i64), (32, 8, 128), (14, 2, 64)] {
            let scale = 1.0 / (hd as f64).sqrt();
            // One sequence of 300 tokens in shuffled blocks of 16; keys also laid out flat.
            let (bs, len) = (16i64, 300i64);
            let blocks = (len + bs - 1) / bs;
            let perm: Vec<i64> =
                Vec::try_from(&Tensor::randperm(blocks + 5, (Kind::Int64, Device::Cpu))).unwrap();
            let table: Vec<i32> = perm[..blocks as usize].iter().map(|&b| b as i32).collect();
            let flat_k = Tensor::randn([len, nkv, hd], (Kind::BFloat16, dev));
            let flat_v = Tensor::randn([len, nkv, hd], (Kind::BFloat16, dev));
            let slots: Vec<i64> = (0..len)
                .map(|t| table[(t / bs) as usize] as i64 * bs + t % bs)
                .collect();
            let idx = Tensor::from_slice(&slots).to(dev);
            let pool = |flat: &Tensor| {
                let p = Tensor::zeros([(blocks + 5) * bs, nkv, hd], (Kind::BFloat16, dev));
                p.index_copy(0, &idx, flat)
            };
            let (kp, vp) = (pool(&flat_k), pool(&flat_v));
            let q = Tensor::randn([len, nh, hd], (Kind::BFloat16, dev));
            let lens: Vec<i32> = (1..=len as i32).collect();

            // Prompt style: all 300 rows through one shared table.
            let tables = ints(&table, dev).view([1, blocks]);
            let mut prompt = q.empty_like();
            let layout = KeyLayout::Paged {
                tables: &tables,
                row_table: Some(&ints(&vec![0; len as usize], dev)),
                block_size: bs as usize,
            };
            invariant_attention(&q, &kp, &vp, layout, &ints(&lens, dev), &mut prompt, scale)
                .unwrap();
            // Flat keys, row r's first key at slot 0.
            let mut flat = q.empty_like();
            let layout = KeyLayout::Contiguous {
                first: &ints(&vec![0; len as usize], dev),
            };
            invariant_attention(
                &q,
                &flat_k,
                &flat_v,
                layout,
                &ints(&lens, dev),
                &mut flat,
                scale,
            )
            .unwrap();
            assert!(flat.equal(&prompt), "{nh}/{nkv}: flat keys differ");
            // Decode style, a few rows alone and then together, each with its own table.
            let picks = [0i64, 63, 64, 65, 200, 299];
            for &row in &picks {
                let mut one = q.narrow(0, row, 1).empty_like();
                let layout = KeyLayout::Paged {
                    tables: &tables,
                    row_table: None,
                    block_size: bs as usize,
                };
                invariant_attention(
                    &q.narrow(0, row, 1).contiguous(),
                    &kp,
                    &vp,
                    layout,
                    &ints(&[row as i32 + 1], dev),
                    &mut one,
                    scale,
                )
                .unwrap();
                assert!(
                    one.equal(&prompt.narrow(0, row, 1)),
                    "{nh}/{nkv}: row {row} alone differs from the prompt's"
                );
            }
            let pick_idx = Tensor::from_slice(&picks).to(dev);
            let rows = picks.len() as i64;
            let many_tables = tables.expand([rows, blocks], false).contiguous();
            let mut together = q.index_select(0, &pick_idx).empty_like();
            let layout = KeyLayout::Paged {
                tables: &many_tables,
                row_table: None,
                block_size: bs as usize,
            };
            let pick_lens: Vec<i32> = picks.iter().map(|&r| r as i32 + 1).collect();
            invariant_attention(
                &q.index_select(0, &pick_idx),
                &kp,
                &vp,
                layout,
                &ints(&pick_lens, dev),
                &mut together,
                scale,
            )
            .unwrap();
            assert!(
                together.equal(&prompt.index_select(0, &pick_idx)),
                "{nh}/{nkv}: decode rows together differ from the prompt's"
            );
            // Against fp32 softmax with a causal mask.
            let qf = q.to_kind(Kind::Float).view([len, nkv, nh / nkv, hd]);
            let kf = flat_k.to_kind(Kind::Float);
            let vf = flat_v.to_kind(Kind::Float);
            let scores = qf
                .permute([1, 2, 0, 3])
                .matmul(&kf.permute([1, 2, 0]).unsqueeze(1))
                * scale; // [nkv, rep, len(q), len(k)]
            let causal = Tensor::ones([len, len], (Kind::Bool, dev)).tril(0);
            let scores = scores.masked_fill(&causal.logical_not(), f64::NEG_INFINITY);
            let expect = scores
                .softmax(-1, Kind::Float)
                .matmul(&vf.permute([1, 0, 2]).unsqueeze(1)) // [nkv, rep, len, hd]
                .permute([2, 0, 1, 3])
                .reshape([len, nh, hd]);
            let diff = (prompt.to_kind(Kind::Float) - expect)
                .abs()
                .max()
                .double_value(&[]);
            assert!(
                diff < 2e-2,
                "{nh}/{nkv} hd {hd}: max diff {diff} from softmax"
            );
        }
    }
}
