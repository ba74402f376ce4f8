//! The contiguous key/value cache of [`super::CausalLm::forward_hidden`].

use tch::Tensor;

/// Keys and values of earlier positions, per layer, for incremental decoding.
/// Each layer holds `(k, v)` of shape [B, num_key_value_heads, S, head_dim].
pub struct KvCache {
    pub(super) layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: (0..num_layers).map(|_| None).collect(),
        }
    }

    /// Number of cached positions (the S of the next call's key mask is this plus T).
    pub fn seq_len(&self) -> i64 {
        match self.layers.first() {
            Some(Some((k, _))) => k.size()[2],
            _ => 0,
        }
    }

    /// Number of layers this cache was made for.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The cached `(k, v)` of one layer, if any call has filled it.
    pub fn layer(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers.get(i)?.as_ref().map(|(k, v)| (k, v))
    }

    /// A cache holding only the batch rows listed in `rows` (i64 indices), in that order;
    /// lets an engine drop finished sequences from a batch.
    pub fn select_rows(&self, rows: &Tensor) -> KvCache {
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    l.as_ref().map(|(k, v)| {
                        let idx = rows.to_device(k.device());
                        (k.index_select(0, &idx), v.index_select(0, &idx))
                    })
                })
                .collect(),
        }
    }
}
