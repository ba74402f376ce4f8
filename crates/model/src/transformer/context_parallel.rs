//! Context parallelism: the ranks of a CP group share one packed row's tokens.
//!
//! The row (padded to a multiple of 2N tokens, the padding a segment of its own that no
//! real token sees) is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r,
//! Megatron's load balancing for causal attention (every rank gets as many early and
//! late queries). Positions (RoPE) stay the global ones. Each rank holds the whole model.
//!
//! Per layer a rank computes its tokens' q, k, v, all-gathers k and v over the group and
//! attends its queries to every key under a mask built from global token indices and
//! segments (causal within each sample). tch cannot define autograd functions, so the
//! backward pass runs layer by layer: the gathered k/v are leaves, their gradients are
//! reduce-scattered (summed) back to the ranks that own those tokens, and the local
//! q/k/v graph is back-propagated with them. Each rank's parameter gradients are then its
//! tokens' share; the caller sums them over the group (the ZeRO-2 reduce-scatter does).
//!
//! On CUDA in 16 bits the attention is one variable-length flash call per layer: the
//! rank's tokens are cut into pieces (chunk ∩ sample), each piece's queries attending
//! the gathered keys of its sample from the sample's start to the piece's last token
//! (flash's bottom-right causal alignment), so a rank computes only the causal half, as
//! one GPU does. Elsewhere (the CPU, fp32) a dense mask ([local tokens, row tokens]) over
//! every key: simple and exact, twice the work.

use std::cell::OnceCell;

use tch::{Device, Kind, Tensor};

use super::{repeat_kv, CausalLm, DecoderLayer};

/// What a rank needs from its context-parallel group: flat contiguous tensors, every rank
/// calling the same operations in the same order with the same sizes.
pub trait CpGroup {
    type Error;
    fn cp_rank(&self) -> usize;
    fn cp_size(&self) -> usize;
    /// Every rank's `local` concatenated in rank order.
    fn cp_all_gather(&self, local: &Tensor) -> Result<Tensor, Self::Error>;
    /// The sum over the ranks of `full` (`cp_size × n` elements), this rank's n-element slice.
    fn cp_reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Self::Error>;
}

/// Why a row cannot be split.
#[derive(Debug, thiserror::Error)]
pub enum CpError {
    #[error("--context-parallel-size: rank {rank} is outside a group of {size}")]
    BadRank { rank: usize, size: usize },
    #[error("--context-parallel-size: a context-parallel group needs at least 2 ranks, got {0}")]
    TooSmall(usize),
}

/// One packed row's split over a CP group, seen from one rank.
pub struct CpRow {
    tokens: i64,
    chunk: i64,
    /// Global token index of each of this rank's 2 × chunk tokens (>= `tokens`: padding).
    local: Vec<i64>,
    /// Global token index of each gathered key, in gather (rank) order.
    keys: Vec<i64>,
    /// Sample (segment) of each global token; padding is one segment of its own.
    segment: Vec<i64>,
    device: Device,
    /// [1, 1, 2 × chunk, size × 2 × chunk] bool: local query may attend gathered key.
    /// Made on first use (the dense path only).
    mask: OnceCell<Tensor>,
    /// The flash pieces (CUDA only).
    flash: Option<FlashPieces>,
}

/// This rank's queries cut into pieces for one variable-length flash call: piece i is
/// `cu_q[i]..cu_q[i+1]` of the local tokens and attends gathered keys
/// `key_index[cu_k[i]..cu_k[i+1]]` (its sample's, from the start to its last query).
struct FlashPieces {
    cu_q: Tensor,
    cu_k: Tensor,
    key_index: Tensor,
    max_q: i64,
    max_k: i64,
}

impl FlashPieces {
    /// The pieces of `rank` of `size` for a row of samples of `lengths` cut into 2 × size
    /// chunks of `chunk` tokens; `keys`: the global token at each gathered position.
    fn for_rank(
        lengths: &[i64],
        rank: i64,
        size: i64,
        chunk: i64,
        keys: &[i64],
        device: Device,
    ) -> Self {
        let padded = 2 * size * chunk;
        let mut bounds = Vec::with_capacity(lengths.len() + 1);
        let mut start = 0;
        for &len in lengths.iter().filter(|&&l| l > 0) {
            bounds.push((start, start + len));
            start += len;
        }
        if start < padded {
            bounds.push((start, padded));
        }
        Self::new(&bounds, [rank, 2 * size - 1 - rank], chunk, keys, device)
    }

    /// `bounds`: each segment's global [start, end); `chunks`: this rank's chunks in local
    /// order; `keys`: the global token at each gathered position.
    fn new(
        bounds: &[(i64, i64)],
        chunks: [i64; 2],
        chunk: i64,
        keys: &[i64],
        device: Device,
    ) -> Self {
        let mut gathered_at = vec![0i64; keys.len()];
        for (p, &g) in keys.iter().enumerate() {
            gathered_at[g as usize] = p as i64;
        }
        let (mut cu_q, mut cu_k, mut index) = (vec![0i32], vec![0i32], Vec::new());
        let (mut max_q, mut max_k) = (0i64, 0i64);
        for c in chunks {
            let (c0, c1) = (c * chunk, (c + 1) * chunk);
            for &(a, b) in bounds {
                let (q0, q1) = (a.max(c0), b.min(c1));
                if q0 >= q1 {
                    continue;
                }
                index.extend((a..q1).map(|g| gathered_at[g as usize]));
                cu_q.push(cu_q[cu_q.len() - 1] + (q1 - q0) as i32);
                cu_k.push(cu_k[cu_k.len() - 1] + (q1 - a) as i32);
                max_q = max_q.max(q1 - q0);
                max_k = max_k.max(q1 - a);
            }
        }
        FlashPieces {
            cu_q: Tensor::from_slice(&cu_q).to(device),
            cu_k: Tensor::from_slice(&cu_k).to(device),
            key_index: Tensor::from_slice(&index).to(device),
            max_q,
            max_k,
        }
    }

    /// Attention of local queries q [1, nh, local, hd] over the gathered k/v
    /// [1, nkv, row, hd]: [1, local, nh × hd].
    fn attend(&self, q: &Tensor, k_all: &Tensor, v_all: &Tensor, head_dim: i64) -> Tensor {
        let tokens = |x: &Tensor| x.squeeze_dim(0).transpose(0, 1);
        let pick = |x: &Tensor| tokens(x).index_select(0, &self.key_index);
        let t = q.size()[2];
        let width = q.size()[1] * head_dim;
        manta_cuda::flash_attention_varlen(
            &tokens(q),
            &pick(k_all),
            &pick(v_all),
            &self.cu_q,
            &self.cu_k,
            self.max_q,
            self.max_k,
            1.0 / (head_dim as f64).sqrt(),
        )
        .unwrap_or_else(|e| panic!("context-parallel flash attention over {t} local tokens: {e}"))
        .reshape([1, t, width])
    }
}

impl CpRow {
    /// Splits a row holding sequences of `lengths` (back to back) for `rank` of `size`.
    /// A row shorter than 2 × size tokens is padded like any other.
    pub fn new(lengths: &[i64], rank: usize, size: usize, device: Device) -> Result<Self, CpError> {
        if size < 2 {
            return Err(CpError::TooSmall(size));
        }
        if rank >= size {
            return Err(CpError::BadRank { rank, size });
        }
        let tokens: i64 = lengths.iter().sum();
        let parts = 2 * size as i64;
        let chunk = ((tokens + parts - 1) / parts).max(1);
        let mut segment = Vec::with_capacity((chunk * parts) as usize);
        for (s, &len) in lengths.iter().enumerate() {
            segment.extend(std::iter::repeat_n(s as i64, len.max(0) as usize));
        }
        // Padding: one segment of its own.
        segment.resize((chunk * parts) as usize, lengths.len() as i64);
        let owned = |r: i64| {
            (r * chunk..(r + 1) * chunk).chain((parts - 1 - r) * chunk..(parts - r) * chunk)
        };
        let local: Vec<i64> = owned(rank as i64).collect();
        let keys: Vec<i64> = (0..size as i64).flat_map(owned).collect();
        let flash = device.is_cuda().then(|| {
            FlashPieces::for_rank(lengths, rank as i64, size as i64, chunk, &keys, device)
        });
        Ok(CpRow {
            tokens,
            chunk,
            local,
            keys,
            segment,
            device,
            mask: OnceCell::new(),
            flash,
        })
    }

    /// The dense attention mask (see the field), made once.
    fn mask(&self) -> &Tensor {
        self.mask.get_or_init(|| {
            let seg = |idx: &[i64]| {
                let s: Vec<i64> = idx.iter().map(|&i| self.segment[i as usize]).collect();
                Tensor::from_slice(&s).to(self.device)
            };
            let (qi, ki) = (
                Tensor::from_slice(&self.local).to(self.device),
                Tensor::from_slice(&self.keys).to(self.device),
            );
            seg(&self.local)
                .unsqueeze(1)
                .eq_tensor(&seg(&self.keys).unsqueeze(0))
                .logical_and(&ki.unsqueeze(0).le_tensor(&qi.unsqueeze(1)))
                .view([1, 1, self.local.len() as i64, self.keys.len() as i64])
        })
    }

    /// This rank's tokens of a [1, tokens] row (padding filled with 0): [1, 2 × chunk].
    pub fn take(&self, row: &Tensor) -> Tensor {
        let padded = row.constant_pad_nd([0, self.keys.len() as i64 - self.tokens]);
        let index = Tensor::from_slice(&self.local).to(row.device());
        padded.index_select(1, &index)
    }

    /// How many tokens this rank holds (two chunks, padding included).
    pub fn local_len(&self) -> i64 {
        2 * self.chunk
    }

    /// Where global token `index` sits among this rank's tokens, if it holds it. O(1):
    /// called for every trained token of a row (a search took ~0.1 s per 32k-token row).
    pub fn local_index(&self, index: i64) -> Option<i64> {
        if !(0..self.tokens).contains(&index) {
            return None;
        }
        // The rank's two chunks, each `chunk` consecutive global tokens.
        let (first, second) = (self.local[0], self.local[self.chunk as usize]);
        if (first..first + self.chunk).contains(&index) {
            Some(index - first)
        } else if (second..second + self.chunk).contains(&index) {
            Some(self.chunk + index - second)
        } else {
            None
        }
    }
}

/// One layer's pass on a rank: the leaves its backward needs.
struct LayerPass {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_leaf: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    out: Tensor,
}

impl DecoderLayer {
    fn cp_pass<G: CpGroup>(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        row: &CpRow,
        group: &G,
    ) -> Result<LayerPass, G::Error> {
        let sa = &self.self_attn;
        let (q, k, v) = sa.qkv(&self.input_layernorm.forward(x), cos, sin);
        let gather = |t: &Tensor| -> Result<Tensor, G::Error> {
            let s = t.size();
            let all = group.cp_all_gather(&t.detach().contiguous().view([-1]))?;
            // [size, 1, nkv, local, hd] -> [1, nkv, size × local, hd], keys in rank order.
            Ok(all
                .view([group.cp_size() as i64, s[1], s[2], s[3]])
                .permute([1, 0, 2, 3])
                .reshape([1, s[1], -1, s[3]])
                .set_requires_grad(true))
        };
        let (k_all, v_all) = (gather(&k)?, gather(&v)?);
        let q_leaf = q.detach().set_requires_grad(true);
        let attn = match &row.flash {
            Some(flash) if matches!(q.kind(), Kind::BFloat16 | Kind::Half) => {
                flash.attend(&q_leaf, &k_all, &v_all, sa.head_dim)
            }
            _ => {
                let rep = sa.num_heads / sa.num_kv_heads;
                let (ka, va) = if rep > 1 {
                    (repeat_kv(&k_all, rep), repeat_kv(&v_all, rep))
                } else {
                    (k_all.shallow_clone(), v_all.shallow_clone())
                };
                let t = q.size()[2];
                Tensor::scaled_dot_product_attention(
                    &q_leaf,
                    &ka,
                    &va,
                    Some(row.mask()),
                    0.0,
                    false,
                    None,
                    false,
                )
                .transpose(1, 2)
                .reshape([1, t, sa.num_heads * sa.head_dim])
            }
        };
        let h = x + super::linear_rows(&attn, &sa.o_proj, None, sa.min_rows);
        let out = self.mlp.forward(&self.post_attention_layernorm.forward(&h));
        Ok(LayerPass {
            q,
            k,
            v,
            q_leaf,
            k_all,
            v_all,
            out: h + out,
        })
    }
}

/// Sums a gathered [1, nkv, size × local, hd] gradient back to the owners' [1, nkv, local, hd].
fn scatter_back<G: CpGroup>(grad: &Tensor, like: &Tensor, group: &G) -> Result<Tensor, G::Error> {
    let s = like.size();
    let full = grad
        .view([s[1], group.cp_size() as i64, s[2], s[3]])
        .permute([1, 0, 2, 3])
        .contiguous()
        .view([-1]);
    Ok(group.cp_reduce_scatter(&full)?.view(s.as_slice()))
}

impl CausalLm {
    /// Final-normed hidden states [1, local, H] of this rank's tokens (`row.take` of the
    /// row's ids and positions), no autograd: log-prob passes.
    pub fn forward_hidden_cp<G: CpGroup>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        row: &CpRow,
        group: &G,
    ) -> Result<Tensor, G::Error> {
        tch::no_grad(|| {
            let mut x = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
            let (cos, sin) = self.rotary.cos_sin(position_ids, x.kind());
            for layer in &self.layers {
                x = layer.cp_pass(&x, &cos, &sin, row, group)?.out;
            }
            Ok(self.norm.forward(&x))
        })
    }

    /// [`CausalLm::forward_backward`] of this rank's tokens of a row split over a CP
    /// group (module doc). `loss_fn` gets the local hidden states [1, local, H] and may
    /// itself use the group (gathering log-probs); every rank must call this together.
    /// With any recompute setting every layer is recomputed in the backward pass (its
    /// keys and values gathered again); otherwise every activation is kept.
    pub fn forward_backward_cp<G: CpGroup>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        row: &CpRow,
        group: &G,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor, G::Error>,
    ) -> Result<Tensor, G::Error> {
        let recompute = self.recompute.is_some();
        let embedded = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        let (cos, sin) = tch::no_grad(|| self.rotary.cos_sin(position_ids, embedded.kind()));
        let mut saved: Vec<(Tensor, Option<LayerPass>)> = Vec::with_capacity(self.layers.len());
        let mut x = embedded.detach();
        for layer in &self.layers {
            if recompute {
                let out = tch::no_grad(|| layer.cp_pass(&x, &cos, &sin, row, group))?.out;
                saved.push((x, None));
                x = out;
            } else {
                let input = x.detach().set_requires_grad(true);
                let pass = layer.cp_pass(&input, &cos, &sin, row, group)?;
                x = pass.out.detach();
                saved.push((input, Some(pass)));
            }
        }
        let last = x.detach().set_requires_grad(true);
        let loss = loss_fn(&self.norm.forward(&last))?;
        // A rank scoring none of the row's trained tokens has a loss without a graph; it
        // still runs the layers' backward (the others need its reduce-scatters).
        if loss.requires_grad() {
            loss.backward();
        }
        let or_zeros = |g: Tensor, like: &Tensor| if g.defined() { g } else { like.zeros_like() };
        let mut grad = or_zeros(last.grad(), &last);
        for (layer, (input, pass)) in self.layers.iter().zip(saved).rev() {
            let (input, pass) = match pass {
                Some(pass) => (input, pass),
                None => {
                    let input = input.detach().set_requires_grad(true);
                    let pass = layer.cp_pass(&input, &cos, &sin, row, group)?;
                    (input, pass)
                }
            };
            // The layer's output side: its parameters, the residual into `input`, and
            // the gradients of the gathered keys/values and of the local queries.
            (&pass.out * &grad).sum(None::<Kind>).backward();
            let dk = scatter_back(&or_zeros(pass.k_all.grad(), &pass.k_all), &pass.k, group)?;
            let dv = scatter_back(&or_zeros(pass.v_all.grad(), &pass.v_all), &pass.v, group)?;
            let dq = or_zeros(pass.q_leaf.grad(), &pass.q_leaf);
            // The q/k/v side, with every rank's gradient of this rank's keys and values.
            ((&pass.q * dq).sum(None::<Kind>)
                + (&pass.k * dk).sum(None::<Kind>)
                + (&pass.v * dv).sum(None::<Kind>))
            .backward();
            grad = or_zeros(input.grad(), &input);
        }
        (embedded * &grad).sum(None::<Kind>).backward();
        Ok(loss.detach())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `local_index` finds each global token where `take` puts it, for every rank of
    /// rows that divide evenly, need padding, or are shorter than the chunks.
    #[test]
    fn local_index_is_where_take_puts_each_token() {
        for (lengths, size) in [
            (vec![8i64], 2usize),
            (vec![5, 6], 2),
            (vec![3], 2),
            (vec![7, 1, 9], 3),
            (vec![13], 4),
        ] {
            let tokens: i64 = lengths.iter().sum();
            let row_ids = Tensor::arange(tokens, (Kind::Int64, Device::Cpu)).view([1, -1]);
            let mut owners = vec![0; tokens as usize];
            for rank in 0..size {
                let row = CpRow::new(&lengths, rank, size, Device::Cpu).unwrap();
                let held: Vec<i64> = Vec::try_from(row.take(&row_ids).view([-1])).unwrap();
                for g in -1..tokens + 3 {
                    // The search this replaces, over the rank's global indices.
                    let expected = (0..tokens)
                        .contains(&g)
                        .then(|| row.local.iter().position(|&l| l == g))
                        .flatten()
                        .map(|p| p as i64);
                    assert_eq!(
                        row.local_index(g),
                        expected,
                        "{lengths:?} rank {rank}/{size} token {g}"
                    );
                    if let Some(p) = expected {
                        assert_eq!(held[p as usize], g, "take puts token {g} at {p}");
                        owners[g as usize] += 1;
                    }
                }
            }
            assert!(
                owners.iter().all(|&n| n == 1),
                "{lengths:?}: every token has one owner"
            );
        }
    }

    /// Which gathered keys each local query attends, as [local, keys] booleans.
    fn pieces_as_mask(p: &FlashPieces, local: usize, keys: usize) -> Vec<Vec<bool>> {
        let v = |t: &Tensor| Vec::<i64>::try_from(t.to_kind(Kind::Int64)).unwrap();
        let (cu_q, cu_k, index) = (v(&p.cu_q), v(&p.cu_k), v(&p.key_index));
        let mut m = vec![vec![false; keys]; local];
        for i in 0..cu_q.len() - 1 {
            let (nq, nk) = (cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]);
            for qi in 0..nq {
                // Bottom-right causal: query qi of nq sees the first nk - nq + qi + 1 keys.
                for ki in 0..(nk - nq + qi + 1) {
                    m[(cu_q[i] + qi) as usize][index[(cu_k[i] + ki) as usize] as usize] = true;
                }
            }
        }
        m
    }

    /// The flash pieces let every query see exactly the keys the dense mask allows: its
    /// own sample's, up to itself (padding included as a sample of its own).
    #[test]
    fn flash_pieces_attend_exactly_what_the_dense_mask_allows() {
        for (lengths, size) in [
            (vec![5i64, 3, 9], 2usize),
            (vec![1, 1, 1], 2),
            (vec![16], 2),
            (vec![4, 0, 7, 2, 11], 3),
        ] {
            for rank in 0..size {
                let row = CpRow::new(&lengths, rank, size, Device::Cpu).unwrap();
                let p = FlashPieces::for_rank(
                    &lengths,
                    rank as i64,
                    size as i64,
                    row.chunk,
                    &row.keys,
                    Device::Cpu,
                );
                let dense: Vec<Vec<bool>> = (0..row.local.len() as i64)
                    .map(|q| Vec::<bool>::try_from(row.mask().get(0).get(0).get(q)).unwrap())
                    .collect();
                assert_eq!(
                    pieces_as_mask(&p, row.local.len(), row.keys.len()),
                    dense,
                    "lengths {lengths:?}, rank {rank} of {size}"
                );
            }
        }
    }
}
