//! The experts each KV slot's token was routed to (SGLang's `--enable-return-routed-experts`):
//! written as steps compute tokens, read when a request that asked for them finishes.
//! Kept per slot, as the keys and values are, so tokens whose KV came from the prefix
//! cache still have the rows their first computation wrote.

use manta_model::CausalLm;
use tch::{Kind, Tensor};

use super::block_pool::cache_slot;
use crate::RoutedExperts;

/// Host-side [slots, sparse layers, k] i32 record of the pool's tokens.
pub(super) struct RoutingStore {
    layers: u32,
    top_k: u32,
    ids: Vec<i32>,
}

impl RoutingStore {
    /// A record of `slots` KV slots, or `None` for a dense model.
    pub(super) fn new(model: &CausalLm, slots: usize) -> Option<Self> {
        let top_k = u32::try_from(model.experts_per_token()?).ok()?;
        let layers = model.num_sparse_layers() as u32;
        Some(Self {
            layers,
            top_k,
            ids: vec![-1; slots * (layers * top_k) as usize],
        })
    }

    fn per_slot(&self) -> usize {
        (self.layers * self.top_k) as usize
    }

    /// Stores a step's routing, `recorded` [tokens of the step, layers, k] in row order;
    /// `rows` are the step's rows as (blocks, first position, tokens).
    pub(super) fn write<'a>(
        &mut self,
        rows: impl IntoIterator<Item = (&'a [u32], usize, usize)>,
        recorded: &Tensor,
        block_size: usize,
    ) {
        let per = self.per_slot();
        let flat: Vec<i32> =
            Vec::try_from(recorded.to_kind(Kind::Int).contiguous().view([-1])).unwrap_or_default();
        let mut at = 0;
        for (blocks, start, len) in rows {
            for pos in start..start + len {
                let slot = cache_slot(blocks, pos, block_size) as usize;
                if let (Some(dst), Some(src)) = (
                    self.ids.get_mut(slot * per..(slot + 1) * per),
                    flat.get(at..at + per),
                ) {
                    dst.copy_from_slice(src);
                }
                at += per;
            }
        }
    }

    /// The routing of positions `0..n` of a sequence holding `blocks`.
    pub(super) fn read(&self, blocks: &[u32], n: usize, block_size: usize) -> RoutedExperts {
        let per = self.per_slot();
        let mut ids = Vec::with_capacity(n * per);
        for pos in 0..n {
            let slot = cache_slot(blocks, pos, block_size) as usize;
            match self.ids.get(slot * per..(slot + 1) * per) {
                Some(row) => ids.extend_from_slice(row),
                None => ids.extend(std::iter::repeat_n(-1, per)),
            }
        }
        RoutedExperts {
            layers: self.layers,
            top_k: self.top_k,
            ids,
        }
    }
}
