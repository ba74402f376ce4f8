//! True on-policy attention: every token's attention through the batch-invariant CUDA
//! kernel (`manta_cuda::invariant_attention`), in the trainer's packed forward and in the
//! engine's paged steps alike. Flash attention and the paged decode kernel round each
//! token's output by how the batch is tiled and split, and in a bf16 model those last bits
//! grow over the layers into log-prob differences of ~6e-3 between engine and trainer;
//! with one kernel reducing every row in one fixed order both sides get the same bits.
//! The trainer's gradients still come from flash attention's backward: the forward value
//! is the kernel's, the derivative flash attention's (the same function, rounded apart).

use manta_cuda::invariant_attention::{self as kernel, KeyLayout};
use tch::{Device, Tensor};

use super::paged_seq::{block_tables, PagedSeq};
use super::{CausalLm, SelfAttention};

/// Rows every projection runs on in true on-policy mode: from about 128 rows on, cuBLAS
/// gives a row the bits it gets among thousands (H100, Qwen3-0.6B's shapes,
/// bench/py/row_invariance.py); below, some shapes switch to split-K kernels.
pub const INVARIANT_MIN_ROWS: i64 = 256;

/// Where each token of one packed row finds its keys: its sequence's first slot and how
/// many keys it sees (itself included), [T] i32 each.
pub(super) struct PackedRows {
    first: Tensor,
    len: Tensor,
}

impl PackedRows {
    /// Rows of sequences laid back to back with these lengths.
    pub(super) fn new(lengths: &[i64], device: Device) -> Self {
        let total = lengths.iter().sum::<i64>() as usize;
        let (mut first, mut len) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let mut start = 0i32;
        for &l in lengths {
            for i in 0..l as i32 {
                first.push(start);
                len.push(i + 1);
            }
            start += l as i32;
        }
        Self {
            first: Tensor::from_slice(&first).to(device),
            len: Tensor::from_slice(&len).to(device),
        }
    }
}

/// Every row of a paged step for the kernel: one block table per sequence [S, W] i32,
/// each row's sequence [N] i32 and key count [N] i32.
pub(super) struct PagedRows {
    tables: Tensor,
    row_table: Tensor,
    row_len: Tensor,
    block_size: usize,
}

impl PagedRows {
    /// `seqs` in flat order; their slots come in whole blocks of `block_size`.
    pub(super) fn new(seqs: &[PagedSeq], block_size: usize, device: Device) -> Self {
        let (mut row_table, mut row_len) = (Vec::new(), Vec::new());
        for (i, s) in seqs.iter().enumerate() {
            let past = (s.slots.len() - s.q_len) as i32;
            for t in 0..s.q_len as i32 {
                row_table.push(i as i32);
                row_len.push(past + t + 1);
            }
        }
        Self {
            tables: block_tables(seqs, block_size, device),
            row_table: Tensor::from_slice(&row_table).to(device),
            row_len: Tensor::from_slice(&row_len).to(device),
            block_size,
        }
    }
}

/// How a paged forward's rows reach the kernel: every row of a mixed step, or decode rows
/// with one table each (CUDA graph replays).
pub(super) enum PagedKeys<'a> {
    Rows(&'a PagedRows),
    Decode {
        tables: &'a Tensor,
        lens: &'a Tensor,
        block_size: usize,
    },
}

impl SelfAttention {
    /// The kernel over [R, heads, hd] queries; [R, heads × hd].
    fn run_invariant(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layout: KeyLayout,
        len: &Tensor,
    ) -> Tensor {
        let q = q.contiguous();
        let mut out = q.empty_like();
        if let Err(e) = kernel::invariant_attention(&q, k, v, layout, len, &mut out, self.scale()) {
            panic!("batch-invariant attention kernel: {e}");
        }
        out.view([-1, self.num_heads * self.head_dim])
    }

    /// [`SelfAttention::segmented`]'s result through the batch-invariant kernel: q [1, nh,
    /// T, hd], k/v [1, nkv, T, hd] -> [T, nh × hd]. Under autograd the value is the
    /// kernel's and the gradient flash attention's.
    pub(super) fn segmented_invariant(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        runs: &[(i64, i64, i64)],
        rows: &PackedRows,
    ) -> Tensor {
        let flat = |x: &Tensor| x.detach().squeeze_dim(0).transpose(0, 1).contiguous();
        let out = self.run_invariant(
            &flat(q),
            &flat(k),
            &flat(v),
            KeyLayout::Contiguous { first: &rows.first },
            &rows.len,
        );
        if !(q.requires_grad() || k.requires_grad() || v.requires_grad()) {
            return out;
        }
        // x - x is exactly zero, so the sum's value is the kernel's bits.
        let flash = self.segmented(q, k, v, runs);
        out + (&flash - flash.detach())
    }

    /// Attention of the flat queries q [N, heads, hd] of a paged step over the pools.
    pub(super) fn paged_invariant(
        &self,
        q: &Tensor,
        pools: (&Tensor, &Tensor),
        keys: PagedKeys,
    ) -> Tensor {
        let (layout, len) = match keys {
            PagedKeys::Rows(rows) => (
                KeyLayout::Paged {
                    tables: &rows.tables,
                    row_table: Some(&rows.row_table),
                    block_size: rows.block_size,
                },
                &rows.row_len,
            ),
            PagedKeys::Decode {
                tables,
                lens,
                block_size,
            } => (
                KeyLayout::Paged {
                    tables,
                    row_table: None,
                    block_size,
                },
                lens,
            ),
        };
        self.run_invariant(q, pools.0, pools.1, layout, len)
    }
}

impl CausalLm {
    /// Runs attention through the batch-invariant kernel (true on-policy mode): in the
    /// packed forward (`Attention::Segments`, the trainer's) and in paged forwards (the
    /// engine's, whose batches must then come from [`super::PagedBatch::new_invariant`] or
    /// `decode_paged`); projections run on at least [`INVARIANT_MIN_ROWS`] rows, so they
    /// round as the trainer's cuBLAS GEMMs do. Refused while the decode kernels are on
    /// (their fused ops round differently), and they are refused while this is on. CUDA and bf16 only; the kernel is compiled here, so a problem is
    /// reported now and the model stays as it was.
    pub fn set_invariant_attention(&mut self, on: bool) -> Result<(), String> {
        if on {
            if self.cfg.moe().is_some() {
                return Err(format!(
                    "true on-policy mode (batch-invariant kernels) does not run {} \
                     (mixture-of-experts) models yet",
                    self.cfg.model_type
                ));
            }
            if self.decode_kernels.is_some() {
                return Err(
                    "the decode kernels are on: they round differently from the trainer's ops, \
                     so true on-policy mode needs a model without them"
                        .into(),
                );
            }
            let index = self.kernel_device("batch-invariant attention kernels")?;
            let cfg = &self.cfg;
            let arch = manta_cuda::device_arch(index).map_err(|e| e.to_string())?;
            kernel::compile_check(
                cfg.num_attention_heads as usize,
                cfg.num_key_value_heads as usize,
                cfg.head_dim() as usize,
                arch,
            )
            .map_err(|e| e.to_string())?;
        }
        self.invariant_attention = on;
        let min_rows = if on { INVARIANT_MIN_ROWS } else { 0 };
        for layer in &mut self.layers {
            layer.self_attn.min_rows = min_rows;
            layer.mlp.set_min_rows(min_rows);
        }
        Ok(())
    }

    /// Whether attention runs through the batch-invariant kernel.
    pub fn invariant_attention_enabled(&self) -> bool {
        self.invariant_attention
    }
}
