//! Forward passes over a paged key/value cache, for engines that batch many sequences of
//! different lengths (continuous batching): the new tokens of every sequence are laid out
//! flat, their keys and values go into fixed-size blocks of a pool shared by all
//! sequences, and each sequence attends to the slots of its own context.

use std::cell::OnceCell;

use tch::{Device, Kind, Tensor};

use super::invariant::{PagedKeys, PagedRows};
use super::paged_seq::{block_tables, PagedSeq};
use super::{linear_rows, repeat_kv, CausalLm, SelfAttention};
use crate::config::ModelConfig;

/// Keys and values of every layer in one pool of `num_blocks × block_size` slots, allocated
/// once. Slot `s` holds the token at offset `s % block_size` of block `s / block_size`.
pub struct PagedKvCache {
    /// Per layer, [num_slots, num_key_value_heads, head_dim].
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl PagedKvCache {
    pub fn new(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let slots = (num_blocks * block_size) as i64;
        let shape = [slots, cfg.num_key_value_heads, cfg.head_dim()];
        let layers = cfg.num_hidden_layers as usize;
        Self {
            k: (0..layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect(),
            v: (0..layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect(),
        }
    }

    /// Bytes one block takes across all layers (keys and values), to size the pool.
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, kind: Kind) -> usize {
        let per_token = 2
            * cfg.num_hidden_layers as usize
            * cfg.num_key_value_heads as usize
            * cfg.head_dim() as usize
            * kind.elt_size_in_bytes();
        per_token * block_size
    }

    /// Slots in the pool (`num_blocks × block_size`).
    pub fn num_slots(&self) -> usize {
        self.k.first().map_or(0, |t| t.size()[0] as usize)
    }

    /// The dtype keys and values are stored in.
    pub fn kind(&self) -> Kind {
        self.k.first().map_or(Kind::Float, |t| t.kind())
    }

    /// The pools of one layer (keys, values), [num_slots, kv_heads, head_dim].
    pub fn layer(&self, i: usize) -> (&Tensor, &Tensor) {
        (&self.k[i], &self.v[i])
    }
}

/// How the leading one-token sequences reach their keys and values.
enum DecodeAttention {
    /// Gathered into a padded batch: [Bd, W] i64 slots and a [Bd, 1, 1, W] bool mask.
    Gather { slots: Tensor, keep: Tensor },
    /// Read in place by the paged CUDA kernel: [Bd, max_blocks] i32 block tables (slot =
    /// id × block_size + offset), [Bd] i32 context lengths, and the kernel's split counters
    /// (i32 zeros, [Bd × KV_HEADS_MAX], left zero by every layer's call).
    Paged {
        tables: Tensor,
        lens: Tensor,
        counters: Tensor,
        block_size: usize,
    },
}

/// Key/value heads the paged kernel's split counters are sized for, per decode row.
pub const KV_HEADS_MAX: i64 = 256;

/// Zeroed split counters for `rows` decode rows of the paged attention kernel.
pub fn decode_counters(rows: i64, device: Device) -> Tensor {
    Tensor::zeros([rows * KV_HEADS_MAX], (Kind::Int, device))
}

/// Tensors describing a flat batch, built once per forward and shared by all layers.
pub struct PagedBatch {
    /// [N] i64 slots receiving the new keys and values.
    pub(super) slot_mapping: Tensor,
    /// Sequences with one new token that lead the batch, attended together.
    decode: Option<(usize, DecodeAttention)>,
    /// The remaining sequences (prompts being prefilled).
    prefill: Option<Prefill>,
    /// Every row's keys for the batch-invariant kernel ([`PagedBatch::new_invariant`]).
    invariant: Option<PagedRows>,
}

/// Which attention a model's paged forwards run: one choice per model, made when its
/// engine starts, not per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PagedAttention {
    /// Decode rows gather their keys and values from the pool (tensor ops; any device).
    Gathered,
    /// Decode rows read the pool in place through the CUDA paged-attention kernel.
    Kernels,
    /// Every row goes through the batch-invariant kernel (true on-policy mode).
    Invariant,
}

impl PagedBatch {
    /// Lays out `seqs` (in flat order) for a forward on `device`; decode rows gather their
    /// keys and values.
    pub fn new(seqs: &[PagedSeq], device: Device) -> Self {
        Self::layout(seqs, device, None)
    }

    /// Like [`PagedBatch::new`], with decode rows read in place by the paged attention
    /// kernel (models with [`CausalLm::enable_decode_kernels`]); slots must come in whole
    /// blocks of `block_size` consecutive slots.
    pub fn new_paged(seqs: &[PagedSeq], device: Device, block_size: usize) -> Self {
        Self::layout(seqs, device, Some(block_size))
    }

    /// Like [`PagedBatch::new_paged`], for models with
    /// [`CausalLm::set_invariant_attention`]: every row, prefill or decode, goes to the
    /// batch-invariant kernel through its sequence's block table.
    pub fn new_invariant(seqs: &[PagedSeq], device: Device, block_size: usize) -> Self {
        Self {
            slot_mapping: Tensor::from_slice(&new_slots(seqs)).to(device),
            decode: None,
            prefill: None,
            invariant: Some(PagedRows::new(seqs, block_size, device)),
        }
    }

    fn layout(seqs: &[PagedSeq], device: Device, paged: Option<usize>) -> Self {
        let slot_mapping = new_slots(seqs);
        let decode_count = seqs.iter().take_while(|s| s.q_len == 1).count();
        let decode = (decode_count > 0).then(|| {
            let group = &seqs[..decode_count];
            let rows = decode_count as i64;
            if let Some(block_size) = paged {
                let lens: Vec<i32> = group.iter().map(|s| s.slots.len() as i32).collect();
                return (
                    decode_count,
                    DecodeAttention::Paged {
                        tables: block_tables(group, block_size, device),
                        lens: Tensor::from_slice(&lens).to(device),
                        counters: decode_counters(rows, device),
                        block_size,
                    },
                );
            }
            let width = group.iter().map(|s| s.slots.len()).max().unwrap_or(1);
            let mut slots = vec![0i64; decode_count * width];
            let mut keep = vec![false; decode_count * width];
            for (row, s) in group.iter().enumerate() {
                slots[row * width..row * width + s.slots.len()].copy_from_slice(&s.slots);
                keep[row * width..row * width + s.slots.len()].fill(true);
            }
            (
                decode_count,
                DecodeAttention::Gather {
                    slots: Tensor::from_slice(&slots)
                        .view([rows, width as i64])
                        .to(device),
                    keep: Tensor::from_slice(&keep)
                        .view([rows, 1, 1, width as i64])
                        .to(device),
                },
            )
        });
        let prefill = (decode_count < seqs.len())
            .then(|| Prefill::new(&seqs[decode_count..], decode_count, device));
        Self {
            slot_mapping: Tensor::from_slice(&slot_mapping).to(device),
            decode,
            prefill,
            invariant: None,
        }
    }
}

/// The slots receiving each sequence's new keys and values, in flat order.
fn new_slots(seqs: &[PagedSeq]) -> Vec<i64> {
    let mut slots = Vec::new();
    for s in seqs {
        assert!(
            s.q_len >= 1 && s.q_len <= s.slots.len(),
            "each sequence needs 1..=context new tokens"
        );
        slots.extend_from_slice(&s.slots[s.slots.len() - s.q_len..]);
    }
    slots
}

impl PagedBatch {
    /// A batch of one-token sequences from tensors the caller keeps (CUDA graphs replay
    /// over fixed buffers): `slot_mapping` [B], `slots` [B, W] i64 and `keep` [B, 1, 1, W]
    /// bool (each row must keep at least one key).
    pub fn decode_only(slot_mapping: &Tensor, slots: &Tensor, keep: &Tensor) -> Self {
        let rows = slots.size()[0] as usize;
        Self {
            slot_mapping: slot_mapping.shallow_clone(),
            decode: Some((
                rows,
                DecodeAttention::Gather {
                    slots: slots.shallow_clone(),
                    keep: keep.shallow_clone(),
                },
            )),
            prefill: None,
            invariant: None,
        }
    }

    /// Like [`PagedBatch::decode_only`], for the paged CUDA kernel (bf16 on CUDA only):
    /// `tables` [B, max_blocks] i32 block ids, `lens` [B] i32 context lengths, `counters`
    /// from [`decode_counters`] (kept by the caller, e.g. for a CUDA graph's replays).
    pub fn decode_paged(
        slot_mapping: &Tensor,
        tables: &Tensor,
        lens: &Tensor,
        counters: &Tensor,
        block_size: usize,
    ) -> Self {
        let rows = tables.size()[0] as usize;
        Self {
            slot_mapping: slot_mapping.shallow_clone(),
            decode: Some((
                rows,
                DecodeAttention::Paged {
                    tables: tables.shallow_clone(),
                    lens: lens.shallow_clone(),
                    counters: counters.shallow_clone(),
                    block_size,
                },
            )),
            prefill: None,
            invariant: None,
        }
    }
}

impl SelfAttention {
    /// x: [1, N, H] flat tokens. Writes their keys/values into the layer's pools and
    /// returns the attention output [1, N, H].
    fn forward_paged(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        pools: (&Tensor, &Tensor),
        batch: &PagedBatch,
        invariant: bool,
    ) -> Tensor {
        let (q, k, v) = self.qkv(x, cos, sin);
        // [1, heads, N, hd] -> [N, heads, hd]
        let q = q.squeeze_dim(0).transpose(0, 1);
        let (k_pool, v_pool) = pools;
        let _ = k_pool.shallow_clone().index_copy_(
            0,
            &batch.slot_mapping,
            &k.squeeze_dim(0).transpose(0, 1),
        );
        let _ = v_pool.shallow_clone().index_copy_(
            0,
            &batch.slot_mapping,
            &v.squeeze_dim(0).transpose(0, 1),
        );
        linear_rows(
            &self.attend(&q, pools, batch, invariant).unsqueeze(0),
            &self.o_proj,
            None,
            self.min_rows,
        )
    }

    /// Attention of the flat queries q [N, heads, hd] over their sequences' cached keys
    /// and values (this call's included); [N, heads × hd]. With `invariant`, through the
    /// batch-invariant kernel.
    pub(super) fn attend(
        &self,
        q: &Tensor,
        pools: (&Tensor, &Tensor),
        batch: &PagedBatch,
        invariant: bool,
    ) -> Tensor {
        if invariant {
            let keys = match (&batch.invariant, &batch.decode) {
                (Some(rows), _) => PagedKeys::Rows(rows),
                (
                    None,
                    Some((
                        _,
                        DecodeAttention::Paged {
                            tables,
                            lens,
                            block_size,
                            ..
                        },
                    )),
                ) if batch.prefill.is_none() => PagedKeys::Decode {
                    tables,
                    lens,
                    block_size: *block_size,
                },
                _ => panic!(
                    "batch-invariant attention needs a batch from PagedBatch::new_invariant or \
                     PagedBatch::decode_paged"
                ),
            };
            return self.paged_invariant(q, pools, keys);
        }
        assert!(
            batch.invariant.is_none(),
            "a batch from PagedBatch::new_invariant needs CausalLm::set_invariant_attention"
        );
        let n = q.size()[0];
        let (k_pool, v_pool) = (pools.0.shallow_clone(), pools.1.shallow_clone());
        let rep = self.num_heads / self.num_kv_heads;
        let (hd, nkv) = (self.head_dim, self.num_kv_heads);
        let mut outs = Vec::with_capacity(2);
        if let Some((
            rows,
            DecodeAttention::Paged {
                tables,
                lens,
                counters,
                block_size,
            },
        )) = &batch.decode
        {
            let qd = q.narrow(0, 0, *rows as i64).contiguous();
            let mut out = qd.empty_like();
            let scale = self.scale();
            if let Err(e) = manta_cuda::paged_decode_attention(
                &qd,
                &k_pool,
                &v_pool,
                tables,
                lens,
                Some(counters),
                &mut out,
                *block_size,
                scale,
            ) {
                panic!("paged decode attention: {e}");
            }
            outs.push(out.view([*rows as i64, self.num_heads * hd]));
        }
        if let Some((rows, DecodeAttention::Gather { slots, keep })) = &batch.decode {
            // One query per row: two batched matmuls over the row's gathered keys and values,
            // with the query heads of each key/value head side by side (no repeated K/V).
            let rows = *rows as i64;
            let width = slots.size()[1];
            let gather = |pool: &Tensor| {
                pool.index_select(0, &slots.view([-1]))
                    .view([rows, width, nkv, hd])
                    .transpose(1, 2)
            };
            let qd = q.narrow(0, 0, rows).view([rows, nkv, rep, hd]);
            // Rounded where flash attention (the trainer's SDPA, transformers') rounds:
            // scores and softmax in fp32, the unnormalised weights rounded to the model's
            // dtype for the product with the values, which is normalised in fp32 after.
            let scores = wide_matmul(&qd, &gather(&k_pool).transpose(2, 3)) * self.scale();
            let scores = scores.masked_fill(&keep.logical_not(), f64::NEG_INFINITY);
            let weights = (&scores - scores.amax([-1], true)).exp();
            let sum = weights.sum_dim_intlist(-1, true, Kind::Float);
            let out = wide_matmul(&weights.to_kind(q.kind()), &gather(&v_pool)) / sum;
            outs.push(out.to_kind(q.kind()).reshape([rows, self.num_heads * hd]));
        }
        if let Some(prefill) = &batch.prefill {
            outs.push(self.attend_prefill(q, (&k_pool, &v_pool), prefill));
        }
        let out = if outs.len() == 1 {
            outs.remove(0)
        } else {
            Tensor::cat(&outs, 0)
        };
        debug_assert_eq!(out.size()[0], n);
        out
    }
}

impl SelfAttention {
    /// Causal attention of the prefill rows over their sequences' keys and values (this
    /// call's and any cached prefix's): one varlen flash-attention call on CUDA in 16 bits
    /// (unless `MANTA_PREFILL_VARLEN=0`), else one SDPA per sequence. [prefill rows, H].
    fn attend_prefill(&self, q: &Tensor, pools: (&Tensor, &Tensor), prefill: &Prefill) -> Tensor {
        let (k_pool, v_pool) = pools;
        let (hd, rep) = (self.head_dim, self.num_heads / self.num_kv_heads);
        let lowp = matches!(q.kind(), Kind::BFloat16 | Kind::Half);
        if let (Some(packed), true) = (&prefill.packed, lowp) {
            let qs = q.narrow(0, prefill.start, prefill.rows).contiguous();
            let (ks, vs) = (
                k_pool.index_select(0, &prefill.slots),
                v_pool.index_select(0, &prefill.slots),
            );
            if let Some(out) = self.attend_prefill_cudnn(&qs, &ks, &vs, prefill) {
                return out.reshape([prefill.rows, self.num_heads * hd]);
            }
            let out = manta_cuda::flash_attention_varlen(
                &qs,
                &ks,
                &vs,
                &packed.cu_q,
                &packed.cu_k,
                packed.max_q,
                packed.max_k,
                self.scale(),
            )
            .unwrap_or_else(|e| panic!("varlen flash attention: {e}"));
            return out.reshape([prefill.rows, self.num_heads * hd]);
        }
        let mut outs = Vec::with_capacity(prefill.seqs.len());
        for &PrefillSeq {
            start,
            q_len,
            slots_start,
            ctx,
        } in &prefill.seqs
        {
            let slots = prefill.slots.narrow(0, slots_start, ctx);
            let gather = |pool: &Tensor| {
                repeat_kv(
                    &pool.index_select(0, &slots).transpose(0, 1).unsqueeze(0),
                    rep,
                )
            };
            let qs = q.narrow(0, start, q_len).transpose(0, 1).unsqueeze(0);
            let (mask, causal) = if ctx == q_len {
                (None, true)
            } else {
                let device = q.device();
                let q_pos = Tensor::arange_start(ctx - q_len, ctx, (Kind::Int64, device));
                let k_pos = Tensor::arange(ctx, (Kind::Int64, device));
                (
                    Some(
                        k_pos
                            .unsqueeze(0)
                            .le_tensor(&q_pos.unsqueeze(1))
                            .view([1, 1, q_len, ctx]),
                    ),
                    false,
                )
            };
            let out = Tensor::scaled_dot_product_attention(
                &qs,
                &gather(k_pool),
                &gather(v_pool),
                mask.as_ref(),
                0.0,
                causal,
                None,
                false,
            );
            outs.push(
                out.squeeze_dim(0)
                    .transpose(0, 1)
                    .reshape([q_len, self.num_heads * hd]),
            );
        }
        Tensor::cat(&outs, 0)
    }

    /// The packed prefill attention through cuDNN (`MANTA_PREFILL_CUDNN`, on by default):
    /// `None` where the build lacks it, the knob is off, or cuDNN refuses the shape (said
    /// once in the log; the caller runs FlashAttention-2).
    fn attend_prefill_cudnn(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        prefill: &Prefill,
    ) -> Option<Tensor> {
        static REFUSED: std::sync::Once = std::sync::Once::new();
        if !(manta_knobs::prefill_cudnn() && manta_cuda::cudnn_attention::built()) {
            return None;
        }
        let lengths = prefill
            .cudnn
            .get_or_init(|| {
                let q_lens: Vec<i64> = prefill.seqs.iter().map(|s| s.q_len).collect();
                let k_lens: Vec<i64> = prefill.seqs.iter().map(|s| s.ctx).collect();
                manta_cuda::cudnn_attention::VarlenLengths::new(
                    &q_lens,
                    &k_lens,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    q.device(),
                )
            })
            .as_ref()?;
        match manta_cuda::cudnn_attention::attention_varlen(q, k, v, lengths, self.scale()) {
            Ok(out) => Some(out),
            Err(e) => {
                REFUSED.call_once(|| {
                    tracing::warn!(error = %e, "cuDNN prefill attention unavailable for this shape; FlashAttention-2 runs it")
                });
                None
            }
        }
    }
}

/// Whether prefill attention runs as one varlen flash-attention call (`MANTA_PREFILL_VARLEN`
/// not `0`; read once).
fn prefill_varlen_enabled() -> bool {
    manta_knobs::prefill_varlen()
}

/// The sequences of a batch after its decode rows, their context slots packed one after
/// another.
struct Prefill {
    /// Flat index of the first prefill row, and how many rows there are.
    start: i64,
    rows: i64,
    seqs: Vec<PrefillSeq>,
    /// [sum of contexts] i64: each sequence's context slots, in order.
    slots: Tensor,
    /// What the varlen kernel needs, on CUDA unless `MANTA_PREFILL_VARLEN=0`.
    packed: Option<PackedLengths>,
    /// What cuDNN's varlen attention needs, made by the first layer that asks (it needs
    /// the attention's head counts) and read by the rest.
    cudnn: OnceCell<Option<manta_cuda::cudnn_attention::VarlenLengths>>,
}

#[derive(Debug, Clone, Copy)]
struct PrefillSeq {
    /// Flat index of its first query row, its query count.
    start: i64,
    q_len: i64,
    /// Where its context starts in [`Prefill::slots`], and its length.
    slots_start: i64,
    ctx: i64,
}

/// Cumulative query and key counts [seqs + 1] (int32, on the device) and the largest count
/// of each.
struct PackedLengths {
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: i64,
    max_k: i64,
}

impl Prefill {
    fn new(seqs: &[PagedSeq], start: usize, device: Device) -> Self {
        let (mut all_slots, mut parts) = (Vec::new(), Vec::with_capacity(seqs.len()));
        let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
        let mut row = start as i64;
        for s in seqs {
            let (q_len, ctx) = (s.q_len as i64, s.slots.len() as i64);
            parts.push(PrefillSeq {
                start: row,
                q_len,
                slots_start: all_slots.len() as i64,
                ctx,
            });
            all_slots.extend_from_slice(&s.slots);
            row += q_len;
            cu_q.push(cu_q[cu_q.len() - 1] + q_len as i32);
            cu_k.push(cu_k[cu_k.len() - 1] + ctx as i32);
        }
        let packed = (device.is_cuda() && prefill_varlen_enabled()).then(|| PackedLengths {
            cu_q: Tensor::from_slice(&cu_q).to(device),
            cu_k: Tensor::from_slice(&cu_k).to(device),
            max_q: parts.iter().map(|p| p.q_len).max().unwrap_or(1),
            max_k: parts.iter().map(|p| p.ctx).max().unwrap_or(1),
        });
        Self {
            start: start as i64,
            rows: row - start as i64,
            seqs: parts,
            slots: Tensor::from_slice(&all_slots).to(device),
            packed,
            cudnn: OnceCell::new(),
        }
    }
}

/// a [.., m, k] @ b [.., k, n] in fp32 with nothing rounded to 16 bits: on CUDA one batched
/// GEMM writes fp32 from bf16/fp16 inputs; elsewhere (no such kernel) both are upcast.
fn wide_matmul(a: &Tensor, b: &Tensor) -> Tensor {
    let lowp = matches!(a.kind(), Kind::BFloat16 | Kind::Half);
    if !(lowp && a.device().is_cuda()) {
        return a.to_kind(Kind::Float).matmul(&b.to_kind(Kind::Float));
    }
    let (sa, sb) = (a.size(), b.size());
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let mut shape = sa[..sa.len() - 2].to_vec();
    let out = a
        .reshape([-1, m, k])
        .bmm_dtype(&b.reshape([-1, k, n]), Kind::Float);
    shape.extend([m, n]);
    out.view(shape.as_slice())
}

impl CausalLm {
    /// Runs the new tokens of several sequences at once over a paged cache.
    ///
    /// `input_ids` and `positions` are [N] i64, the sequences' new tokens back to back in
    /// the order of the `batch`'s sequences. Returns the final-normed hidden states [N, H].
    pub fn forward_paged(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        batch: &PagedBatch,
        cache: &PagedKvCache,
    ) -> Tensor {
        assert_eq!(
            cache.k.len(),
            self.layers.len(),
            "PagedKvCache was made for a different number of layers"
        );
        if let Some(kernels) = &self.decode_kernels {
            return self.forward_paged_kernels(kernels, input_ids, positions, batch, cache);
        }
        let ids = input_ids.unsqueeze(0);
        let mut x = Tensor::embedding(&self.embed_tokens, &ids, -1, false, false);
        let (cos, sin) = self.rotary.cos_sin(&positions.unsqueeze(0), x.kind());
        for (i, layer) in self.layers.iter().enumerate() {
            let h = &x
                + layer.self_attn.forward_paged(
                    &layer.input_layernorm.forward(&x),
                    &cos,
                    &sin,
                    cache.layer(i),
                    batch,
                    self.invariant_attention,
                );
            x = &h
                + layer
                    .mlp
                    .forward(&layer.post_attention_layernorm.forward(&h));
        }
        self.norm.forward(&x).squeeze_dim(0)
    }

    /// How this model's paged forwards attend, as set up when its engine started
    /// ([`CausalLm::enable_decode_kernels`], [`CausalLm::set_invariant_attention`]).
    pub fn paged_attention(&self) -> PagedAttention {
        if self.invariant_attention_enabled() {
            PagedAttention::Invariant
        } else if self.decode_kernels_enabled() {
            PagedAttention::Kernels
        } else {
            PagedAttention::Gathered
        }
    }

    /// Lays out `seqs` for a paged forward the way [`CausalLm::paged_attention`] reads
    /// them; slots come in whole blocks of `block_size` consecutive slots.
    pub fn paged_batch(&self, seqs: &[PagedSeq], device: Device, block_size: usize) -> PagedBatch {
        match self.paged_attention() {
            PagedAttention::Invariant => PagedBatch::new_invariant(seqs, device, block_size),
            PagedAttention::Kernels => PagedBatch::new_paged(seqs, device, block_size),
            PagedAttention::Gathered => PagedBatch::new(seqs, device),
        }
    }
}
