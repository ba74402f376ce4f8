//! Where a sequence's keys and values live in the paged KV pool: its slots, and the
//! block tables the paged kernels read. Shared by the paged forward (`paged.rs`) and the
//! batch-invariant kernel's rows (`invariant.rs`).

use tch::{Device, Tensor};

/// One sequence's part of a paged forward: `q_len` new tokens (consecutive in the flat
/// input) whose context, these tokens included, occupies `slots` (length = context length;
/// the last `q_len` slots receive this call's keys and values).
#[derive(Debug, Clone)]
pub struct PagedSeq {
    pub q_len: usize,
    pub slots: Vec<i64>,
}

/// One block table per sequence, [S, max blocks] i32 (block id = first slot / block_size;
/// the slots come in whole blocks).
pub(super) fn block_tables(seqs: &[PagedSeq], block_size: usize, device: Device) -> Tensor {
    let width = seqs
        .iter()
        .map(|s| s.slots.len().div_ceil(block_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut tables = vec![0i32; seqs.len() * width];
    for (row, s) in seqs.iter().enumerate() {
        for (j, block) in s.slots.chunks(block_size).enumerate() {
            tables[row * width + j] = (block[0] / block_size as i64) as i32;
        }
    }
    Tensor::from_slice(&tables)
        .view([seqs.len() as i64, width as i64])
        .to(device)
}
