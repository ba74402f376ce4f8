//! The decoder: RMSNorm, rotary embeddings, grouped-query attention and SwiGLU MLP, with the
//! per-family differences of Qwen3 (q/k head norms), Qwen2 (q/k/v bias) and Llama 3 (rope
//! scaling). Numerics follow Hugging Face transformers so that logits match it.
//!
//! Methods here take tensors built by the caller (not by users) and panic with a message on
//! shape misuse, as tch itself does; all input from outside goes through `config`/`checkpoint`.

use std::f64::consts::PI;
use std::sync::{Arc, Mutex};

use tch::nn::{Init, Path};
use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, ModelFamily, RopeScaling};
use crate::kernel_check::{Fused, FusedOp};
use crate::moe::{Routing, SparseMoe};
use crate::recompute::Recompute;

mod context_parallel;
mod decode_kernels;
mod invariant;
mod kv_cache;
mod mlp;
mod paged;
mod paged_seq;
mod routing_api;
mod training;
pub use context_parallel::{CpError, CpGroup, CpRow};
pub use kv_cache::KvCache;
use mlp::{FeedForward, Mlp};
pub use paged::{decode_counters, PagedAttention, PagedBatch, PagedKvCache};
pub use paged_seq::PagedSeq;

/// How tokens of a batch may attend to each other.
pub enum Attention<'a> {
    /// Causal attention within each row. `key_mask` [B, S] (1 = real token, 0 = padding) where S = cached length + T;
    /// used for left-padded batched generation.
    Causal { key_mask: Option<&'a Tensor> },
    /// Packed rows: `seq_ids` [B, T] i64; a token attends causally only to earlier tokens with the same seq id.
    Packed { seq_ids: &'a Tensor },
    /// One row [1, T] holding sequences back to back (`lengths` sum to T), each attending
    /// causally within itself only. Unlike `Packed` there is no T x T mask and no work is
    /// spent across sequences (the trainer's packed micro-batches); [`SegmentKernel`]
    /// says which kernels run it.
    Segments { lengths: &'a [i64] },
}

/// How [`Attention::Segments`] runs: a model property, set once
/// ([`CausalLm::set_segment_kernel`]), not chosen per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SegmentKernel {
    /// One variable-length flash-attention call over every sequence of the row, forward
    /// and backward, where flash attention runs (CUDA sm80+, bf16 or f16, head_dim a
    /// multiple of 8 up to 256); [`SegmentKernel::PerRun`] elsewhere. A trainer
    /// micro-batch of many episode lengths costs one kernel per layer, not one per length.
    #[default]
    Varlen,
    /// One causal SDPA call per run of equal-length sequences (CPU and fp32 always run
    /// this way).
    PerRun,
}

/// Sequence boundaries of one packed row for the variable-length flash kernel.
struct VarlenRow {
    /// [sequences + 1] i32 offsets of each sequence's first token (flash's `cu_seqlens`).
    offsets: Tensor,
    longest: i64,
}

/// Root-mean-square norm computed in fp32 and cast back, as Hugging Face does.
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(p: Path, dim: i64, eps: f64) -> Self {
        RmsNorm {
            weight: p.ones("weight", &[dim]),
            eps,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        // libtorch's fused rms_norm (one kernel on CUDA, fp32 accumulation) instead of
        // the five-op composite: measured 1.29x on the whole forward+backward (BENCHMARKS.md).
        let dim = self.weight.size()[0];
        if matches!(x.kind(), Kind::Float | Kind::Double) {
            return x.rms_norm([dim], Some(&self.weight), self.eps);
        }
        if let Some(y) = fused_rms_norm(x, &self.weight, self.eps) {
            return y;
        }
        // bf16/fp16: Hugging Face rounds the normalised x to the input dtype before the
        // weight multiplies it; the fused op rounds once after (26% of bf16 outputs differ).
        x.rms_norm([dim], None::<Tensor>, self.eps) * &self.weight
    }
}

/// [`RmsNorm`] of `x` [.., dim] through the CUDA kernels (`manta_cuda::rms_norm`): one pass
/// forward and two backward where the tensor ops take four or more (a quarter of a GRPO
/// step's GPU time on Qwen3-0.6B). The same rounding; differentiable w.r.t. `x` and the
/// weight. `None` where it does not apply, and the caller takes the tensor ops: off CUDA,
/// outside bf16/fp16, a weight of another kind, `dim` not a multiple of 8 or above the
/// kernels' widest, `MANTA_FUSED_RMSNORM=0`, or kernels that do not compile on this GPU.
fn fused_rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Tensor> {
    const OP: FusedOp = FusedOp {
        op: Fused::RmsNorm,
        name: "fused RMSNorm",
        instead: "norming through tensor ops",
        enabled: manta_knobs::fused_rms_norm,
        compile: manta_cuda::rms_norm::compile_check,
    };
    let dim = *weight.size().first()?;
    if weight.kind() != x.kind()
        || weight.device() != x.device()
        || x.size().last() != Some(&dim)
        || dim % 8 != 0
        || dim > manta_cuda::rms_norm::MAX_DIM
        || !OP.applies_to(x)
    {
        return None;
    }
    let shape = x.size();
    // Rows counted, not inferred: a view of zero elements cannot infer a -1 dimension.
    let rows = x.contiguous().view([x.numel() as i64 / dim, dim]);
    OP.output(manta_cuda::rms_norm::rms_norm(&rows, weight, eps))
        .map(|y| y.view(shape.as_slice()))
}

/// Rotary position embedding frequencies (fp32), with optional llama3 scaling.
struct Rotary {
    inv_freq: Tensor,
}

impl Rotary {
    fn new(cfg: &ModelConfig, device: Device) -> Self {
        let dim = cfg.head_dim();
        let exponents =
            Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / dim;
        let mut inv_freq = Tensor::pow_scalar(cfg.rope_theta, &exponents).reciprocal();
        if let Some(rs) = &cfg.rope_scaling {
            inv_freq = llama3_inv_freq(&inv_freq, rs);
        }
        Rotary { inv_freq }
    }

    /// cos and sin of shape [B, 1, T, head_dim] in `kind`, for `position_ids` [B, T].
    fn cos_sin(&self, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = position_ids.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (
            emb.cos().to_kind(kind).unsqueeze(1),
            emb.sin().to_kind(kind).unsqueeze(1),
        )
    }
}

/// Llama 3 scaling: long wavelengths are divided by `factor`, short ones kept, and the band
/// between them interpolated smoothly.
fn llama3_inv_freq(inv_freq: &Tensor, rs: &RopeScaling) -> Tensor {
    let old_ctx = rs.original_max_position_embeddings as f64;
    let low_freq_wavelen = old_ctx / rs.low_freq_factor;
    let high_freq_wavelen = old_ctx / rs.high_freq_factor;
    let wavelen = inv_freq.reciprocal() * (2.0 * PI);
    let long = wavelen.gt(low_freq_wavelen);
    let scaled = (inv_freq / rs.factor).where_self(&long, inv_freq);
    let smooth = ((wavelen.reciprocal() * old_ctx) - rs.low_freq_factor)
        / (rs.high_freq_factor - rs.low_freq_factor);
    let smoothed = (smooth.ones_like() - &smooth) * &scaled / rs.factor + &smooth * &scaled;
    let medium = wavelen
        .lt(high_freq_wavelen)
        .logical_not()
        .logical_and(&long.logical_not());
    smoothed.where_self(&medium, &scaled)
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    x * cos + rotate_half(x) * sin
}

/// The rotary embedding of `y` [B, T, n, hd] with `cos`, `sin` [B, 1, T, hd] through one
/// CUDA kernel each way (`manta_cuda::rope`) instead of `apply_rope`'s chain of strided
/// element-wise ops and their backward — a sixth of a GRPO step's GPU time on Qwen3-0.6B.
/// Its output is bit-identical to `apply_rope`'s and differentiable w.r.t. `y`. `None`
/// where it does not apply, and the caller takes the tensor ops: off CUDA, outside
/// bf16/fp16, with `MANTA_FUSED_ROPE=0`, tables of another shape (a batch of one shared by
/// B rows), tables that require grad, or kernels that do not compile on this GPU.
fn fused_rope(y: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<Tensor> {
    const OP: FusedOp = FusedOp {
        op: Fused::Rope,
        name: "fused rotary embedding",
        instead: "rotating through tensor ops",
        enabled: manta_knobs::fused_rope,
        compile: manta_cuda::rope::compile_check,
    };
    let &[b, t, n, hd] = y.size().as_slice() else {
        return None;
    };
    let tables = [b, 1, t, hd];
    let table_fits = |c: &Tensor| {
        c.size() == tables && c.kind() == y.kind() && c.device() == y.device() && !c.requires_grad()
    };
    if !table_fits(cos) || !table_fits(sin) || !OP.applies_to(y) {
        return None;
    }
    let rows = b * t;
    let x = y.contiguous().view([rows, n, hd]);
    let (cos, sin) = (
        cos.reshape([rows, hd]).contiguous(),
        sin.reshape([rows, hd]).contiguous(),
    );
    OP.output(manta_cuda::rope::rope(&x, &cos, &sin))
        .map(|out| out.view([b, t, n, hd]))
}

/// Per-forward attention inputs shared by all layers.
struct Ctx {
    cos: Tensor,
    sin: Tensor,
    /// Boolean [B or 1, 1, T, S], true where a query may attend to a key.
    mask: Option<Tensor>,
    is_causal: bool,
    /// `Attention::Segments`: runs of equal-length sequences as (start, count, length).
    segments: Option<Vec<(i64, i64, i64)>>,
    /// Each packed token's keys for the batch-invariant kernel, when it is on.
    invariant: Option<invariant::PackedRows>,
    /// `Attention::Segments` through one variable-length flash call, where it applies.
    varlen: Option<VarlenRow>,
}

struct SelfAttention {
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    /// Projections run on at least this many rows (true on-policy mode; 0 otherwise).
    min_rows: i64,
}

fn matrix(p: &Path, name: &str, out_dim: i64, in_dim: i64, std: f64) -> Tensor {
    p.var(
        name,
        &[out_dim, in_dim],
        Init::Randn {
            mean: 0.0,
            stdev: std,
        },
    )
}

/// `x [.., K] · wᵀ (+ bias)` computed on at least `min_rows` rows (zero rows appended, then
/// dropped). cuBLAS picks its kernel by the row count — split-K below ~128 rows for some
/// shapes — so a row's bits depend on how many rows share the call; from a fixed minimum on
/// they do not, which true on-policy mode needs (a decode step's few rows must round as
/// the trainer's thousands).
fn linear_rows(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, min_rows: i64) -> Tensor {
    let width = x.size().last().copied().unwrap_or(0);
    let rows = if width > 0 {
        x.numel() as i64 / width
    } else {
        0
    };
    if rows >= min_rows || rows == 0 {
        return x.linear(w, bias);
    }
    let flat = x.reshape([rows, width]);
    let padded = Tensor::cat(
        &[
            flat,
            x.new_zeros([min_rows - rows, width], (x.kind(), x.device())),
        ],
        0,
    );
    let mut shape = x.size();
    shape.pop();
    shape.push(w.size()[0]);
    padded
        .linear(w, bias)
        .narrow(0, 0, rows)
        .reshape(shape.as_slice())
}

impl SelfAttention {
    /// The softmax scale of scores, 1 / sqrt(head_dim) (SDPA's default).
    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    fn new(p: Path, cfg: &ModelConfig) -> Self {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let std = cfg.initializer_range;
        let lin = |name: &str, out_dim: i64, in_dim: i64| {
            matrix(&(&p / name), "weight", out_dim, in_dim, std)
        };
        let bias = |name: &str, dim: i64| {
            cfg.attention_bias
                .then(|| (&p / name).zeros("bias", &[dim]))
        };
        let head_norm = |name: &str| {
            (cfg.family() == ModelFamily::Qwen3)
                .then(|| RmsNorm::new(&p / name, hd, cfg.rms_norm_eps))
        };
        SelfAttention {
            q_proj: lin("q_proj", nh * hd, h),
            k_proj: lin("k_proj", nkv * hd, h),
            v_proj: lin("v_proj", nkv * hd, h),
            o_proj: lin("o_proj", h, nh * hd),
            q_bias: bias("q_proj", nh * hd),
            k_bias: bias("k_proj", nkv * hd),
            v_bias: bias("v_proj", nkv * hd),
            q_norm: head_norm("q_norm"),
            k_norm: head_norm("k_norm"),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            min_rows: 0,
        }
    }

    /// Projects x [B, T, H] to heads [B, T, n, hd] (not yet transposed), with the optional
    /// head norm.
    fn heads(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Option<Tensor>,
        n: i64,
        norm: &Option<RmsNorm>,
    ) -> Tensor {
        let (bsz, t) = (x.size()[0], x.size()[1]);
        let y = linear_rows(x, w, b.as_ref(), self.min_rows).view([bsz, t, n, self.head_dim]);
        match norm {
            Some(norm) => norm.forward(&y),
            None => y,
        }
    }

    /// Queries, keys and values [B, heads, T, hd] of x [B, T, H], head-normed and rotated.
    /// `cos` and `sin` are [B, 1, T, hd] (`Rotary::cos_sin`). The rotary embedding runs on
    /// the heads while they are still [B, T, heads, hd] and contiguous, through the fused
    /// kernel where it applies ([`fused_rope`]: the same bits), else as tensor ops.
    fn qkv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let q = self.heads(x, &self.q_proj, &self.q_bias, self.num_heads, &self.q_norm);
        let k = self.heads(
            x,
            &self.k_proj,
            &self.k_bias,
            self.num_kv_heads,
            &self.k_norm,
        );
        let v = self
            .heads(x, &self.v_proj, &self.v_bias, self.num_kv_heads, &None)
            .transpose(1, 2);
        let rotate = |y: Tensor| match fused_rope(&y, cos, sin) {
            Some(rotated) => rotated.transpose(1, 2),
            None => apply_rope(&y.transpose(1, 2), cos, sin),
        };
        (rotate(q), rotate(k), v)
    }

    fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Tensor {
        let (bsz, t) = (x.size()[0], x.size()[1]);
        let (q, mut k, mut v) = self.qkv(x, &ctx.cos, &ctx.sin);
        if let Some(runs) = &ctx.segments {
            let out = match (&ctx.invariant, &ctx.varlen) {
                (Some(rows), _) => self.segmented_invariant(&q, &k, &v, runs, rows),
                (None, Some(row)) => self.varlen(&q, &k, &v, row),
                (None, None) => self.segmented(&q, &k, &v, runs),
            };
            let out = out.view([bsz, t, self.num_heads * self.head_dim]);
            return linear_rows(&out, &self.o_proj, None, self.min_rows);
        }
        if let Some(slot) = cache {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2);
                v = Tensor::cat(&[pv, &v], 2);
            }
            *slot = Some((k.shallow_clone(), v.shallow_clone()));
        }
        let rep = self.num_heads / self.num_kv_heads;
        // Without a mask SDPA takes grouped K/V itself (no copy); masked kernels get
        // explicitly repeated heads so every backend stays available.
        let native_gqa = rep > 1 && ctx.mask.is_none();
        let (k, v) = if rep > 1 && !native_gqa {
            (repeat_kv(&k, rep), repeat_kv(&v, rep))
        } else {
            (k, v)
        };
        let out = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            ctx.mask.as_ref(),
            0.0,
            ctx.is_causal,
            None,
            native_gqa,
        );
        let out = out
            .transpose(1, 2)
            .reshape([bsz, t, self.num_heads * self.head_dim]);
        linear_rows(&out, &self.o_proj, None, self.min_rows)
    }
}

impl SelfAttention {
    /// Causal attention within each segment of one packed row in one flash call: q
    /// [1, nh, T, hd] and k/v [1, nkv, T, hd] -> [T, nh * hd]. Grouped keys and values go
    /// in as they are (the kernel maps query heads to them).
    fn varlen(&self, q: &Tensor, k: &Tensor, v: &Tensor, row: &VarlenRow) -> Tensor {
        let tokens = |x: &Tensor| x.squeeze_dim(0).transpose(0, 1);
        let t = q.size()[2];
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let out = manta_cuda::flash_attention_varlen(
            &tokens(q),
            &tokens(k),
            &tokens(v),
            &row.offsets,
            &row.offsets,
            row.longest,
            row.longest,
            scale,
        )
        .unwrap_or_else(|e| panic!("variable-length flash attention over {t} tokens: {e}"));
        out.reshape([t, self.num_heads * self.head_dim])
    }

    /// Causal attention within each segment of one packed row: q [1, nh, T, hd] and
    /// k/v [1, nkv, T, hd] -> [T, nh * hd]. Each run of `count` sequences of length `len`
    /// starting at `start` becomes one batched causal SDPA call.
    fn segmented(&self, q: &Tensor, k: &Tensor, v: &Tensor, runs: &[(i64, i64, i64)]) -> Tensor {
        let gqa = self.num_heads > self.num_kv_heads;
        let width = self.num_heads * self.head_dim;
        // [1, n, T, hd] -> the run's [count, n, len, hd] (a view).
        let split = |x: &Tensor, start: i64, count: i64, len: i64| {
            let n = x.size()[1];
            x.squeeze_dim(0)
                .narrow(1, start, count * len)
                .view([n, count, len, self.head_dim])
                .transpose(0, 1)
        };
        let mut outs: Vec<Tensor> = runs
            .iter()
            .map(|&(start, count, len)| {
                Tensor::scaled_dot_product_attention(
                    &split(q, start, count, len),
                    &split(k, start, count, len),
                    &split(v, start, count, len),
                    None::<&Tensor>,
                    0.0,
                    true,
                    None,
                    gqa,
                )
                .transpose(1, 2)
                .reshape([count * len, width])
            })
            .collect();
        match outs.len() {
            0 => q.new_zeros([0, width], (q.kind(), q.device())),
            1 => outs.remove(0),
            _ => Tensor::cat(&outs, 0),
        }
    }
}

/// [B, nkv, S, hd] -> [B, nkv * rep, S, hd], kv head i serving query heads i*rep..(i+1)*rep.
/// Explicit repetition keeps every SDPA backend (including masked CUDA kernels) available.
fn repeat_kv(x: &Tensor, rep: i64) -> Tensor {
    let s = x.size();
    x.unsqueeze(2)
        .expand([s[0], s[1], rep, s[2], s[3]], false)
        .reshape([s[0], s[1] * rep, s[2], s[3]])
}

impl VarlenRow {
    fn new(lengths: &[i64], device: Device) -> Self {
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        offsets.push(0i32);
        let mut end = 0i64;
        for &len in lengths.iter().filter(|&&len| len > 0) {
            end += len;
            offsets.push(i32::try_from(end).expect("a packed row of more than 2^31 tokens"));
        }
        VarlenRow {
            offsets: Tensor::from_slice(&offsets).to(device),
            longest: lengths.iter().copied().max().unwrap_or(0),
        }
    }
}

/// Groups consecutive sequences of equal length: (start, count, length) per run; empty
/// sequences are dropped.
fn equal_length_runs(lengths: &[i64]) -> Vec<(i64, i64, i64)> {
    let mut runs: Vec<(i64, i64, i64)> = Vec::new();
    let mut start = 0;
    for &len in lengths {
        match runs.last_mut() {
            Some((_, count, l)) if *l == len => *count += 1,
            _ if len > 0 => runs.push((start, 1, len)),
            _ => {}
        }
        start += len;
    }
    runs
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Tensor {
        let h = x + self
            .self_attn
            .forward(&self.input_layernorm.forward(x), ctx, cache);
        let out = self.mlp.forward(&self.post_attention_layernorm.forward(&h));
        h + out
    }
}

/// A decoder-only language model whose parameters live in a `VarStore` under Hugging Face names.
pub struct CausalLm {
    cfg: ModelConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rotary: Rotary,
    /// Layers [`CausalLm::forward_backward`] recomputes; `None` keeps every activation.
    recompute: Option<Recompute>,
    /// Fused projections for the CUDA decode kernels, when an engine enabled them
    /// ([`CausalLm::enable_decode_kernels`]).
    decode_kernels: Option<decode_kernels::DecodeKernels>,
    /// Attention through the batch-invariant kernel ([`CausalLm::set_invariant_attention`]).
    invariant_attention: bool,
    segment_kernel: SegmentKernel,
    /// What the sparse layers replay and record (`routing_api`); shared with them.
    routing: Arc<Mutex<Routing>>,
}

impl CausalLm {
    /// Registers variables under `vs` with exact HF names: model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    /// (+ .bias for q/k/v when attention_bias), model.layers.{i}.self_attn.{q,k}_norm.weight (Qwen3), model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    /// model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight (absent when tied).
    /// Random init: normal(0, initializer_range) for matrices/embeddings, ones for norms, zeros for biases. Caller seeds with tch::manual_seed.
    ///
    /// Pass `vs.root()` so that names match checkpoints exactly; the VarStore's kind and
    /// device decide the parameters' dtype and device.
    pub fn new(vs: &Path, cfg: &ModelConfig) -> Self {
        let model = vs / "model";
        let std = cfg.initializer_range;
        let sparse = cfg.moe().map(|m| m.sparse_layers(cfg.num_hidden_layers));
        let routing = Arc::new(Mutex::new(Routing::new(
            sparse.as_ref().map_or(0, Vec::len),
        )));
        let embed_tokens = matrix(
            &(&model / "embed_tokens"),
            "weight",
            cfg.vocab_size,
            cfg.hidden_size,
            std,
        );
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                DecoderLayer {
                    input_layernorm: RmsNorm::new(
                        &p / "input_layernorm",
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                    ),
                    self_attn: SelfAttention::new(&p / "self_attn", cfg),
                    post_attention_layernorm: RmsNorm::new(
                        &p / "post_attention_layernorm",
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                    ),
                    mlp: match (cfg.moe(), &sparse) {
                        (Some(moe), Some(sparse)) if moe.is_sparse(i) => {
                            let slot = sparse.iter().position(|&l| l == i).unwrap_or(0) as i64;
                            let p = &p / "mlp";
                            FeedForward::Sparse(SparseMoe::new(
                                p,
                                cfg.hidden_size,
                                moe,
                                std,
                                slot,
                                routing.clone(),
                            ))
                        }
                        _ => FeedForward::Dense(Mlp::new(&p / "mlp", cfg)),
                    },
                }
            })
            .collect();
        let norm = RmsNorm::new(&model / "norm", cfg.hidden_size, cfg.rms_norm_eps);
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            matrix(
                &(vs / "lm_head"),
                "weight",
                cfg.vocab_size,
                cfg.hidden_size,
                std,
            )
        };
        CausalLm {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary: Rotary::new(cfg, vs.device()),
            recompute: None,
            decode_kernels: None,
            invariant_attention: false,
            segment_kernel: SegmentKernel::default(),
            routing,
        }
    }

    /// Which kernels run [`Attention::Segments`] (the default, [`SegmentKernel::Varlen`],
    /// falls back by itself where flash attention cannot run).
    pub fn set_segment_kernel(&mut self, kernel: SegmentKernel) {
        self.segment_kernel = kernel;
    }

    /// Whether `Attention::Segments` takes the variable-length flash kernel for
    /// activations of `kind` on `device`.
    fn varlen_applies(&self, kind: Kind, device: Device) -> bool {
        let Device::Cuda(index) = device else {
            return false;
        };
        let head_dim = self.cfg.head_dim();
        self.segment_kernel == SegmentKernel::Varlen
            && matches!(kind, Kind::BFloat16 | Kind::Half)
            && head_dim % 8 == 0
            && head_dim <= 256
            && manta_cuda::device_arch(index).is_ok_and(|arch| arch >= 80)
    }

    /// The configuration this model was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Embeddings, masks and rotary tables for one call.
    fn prepare(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        past_len: i64,
    ) -> (Tensor, Ctx) {
        let size = input_ids.size();
        assert!(size.len() == 2, "input_ids must be [B, T], got {size:?}");
        assert_eq!(
            position_ids.size(),
            size,
            "position_ids must have the shape of input_ids"
        );
        let (bsz, t) = (size[0], size[1]);
        self.routing_lock().clear_aux();
        let x = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        let (cos, sin) = self.rotary.cos_sin(position_ids, x.kind());
        let device = x.device();
        let s = past_len + t;
        let q_pos = Tensor::arange_start(past_len, s, (Kind::Int64, device)).unsqueeze(1);
        let k_pos = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(0);
        let mut segments = None;
        let mut invariant = None;
        let mut varlen = None;
        let (mask, is_causal) = match attn {
            Attention::Causal { key_mask: None } => {
                if t == 1 {
                    (None, false)
                } else if past_len == 0 {
                    (None, true)
                } else {
                    (Some(k_pos.le_tensor(&q_pos).view([1, 1, t, s])), false)
                }
            }
            Attention::Causal {
                key_mask: Some(key_mask),
            } => {
                assert_eq!(
                    key_mask.size(),
                    [bsz, s],
                    "key_mask must be [B, cached + T]"
                );
                let keep = key_mask
                    .to_device(device)
                    .to_kind(Kind::Bool)
                    .view([bsz, 1, 1, s]);
                // A query always sees itself, so padding rows never softmax over nothing
                // (which would put NaN into the padding's keys and values).
                let diag = k_pos.eq_tensor(&q_pos);
                let mask = k_pos.le_tensor(&q_pos).logical_and(&keep).logical_or(&diag);
                (Some(mask), false)
            }
            Attention::Packed { seq_ids } => {
                assert_eq!(past_len, 0, "packed attention does not support a KV cache");
                assert_eq!(seq_ids.size(), [bsz, t], "seq_ids must be [B, T]");
                let ids = seq_ids.to_device(device);
                let same = ids.unsqueeze(2).eq_tensor(&ids.unsqueeze(1));
                let mask = same.logical_and(&k_pos.le_tensor(&q_pos)).unsqueeze(1);
                (Some(mask), false)
            }
            Attention::Segments { lengths } => {
                assert_eq!(
                    past_len, 0,
                    "segmented attention does not support a KV cache"
                );
                assert_eq!(bsz, 1, "segmented attention takes one packed row");
                assert_eq!(
                    lengths.iter().sum::<i64>(),
                    t,
                    "segment lengths must add up to the row's length"
                );
                segments = Some(equal_length_runs(lengths));
                if self.invariant_attention {
                    invariant = Some(invariant::PackedRows::new(lengths, device));
                } else if self.varlen_applies(x.kind(), device) {
                    varlen = Some(VarlenRow::new(lengths, device));
                }
                (None, false)
            }
        };
        (
            x,
            Ctx {
                cos,
                sin,
                mask,
                is_causal,
                segments,
                invariant,
                varlen,
            },
        )
    }

    /// input_ids, position_ids: [B, T] i64. Returns final-normed hidden states [B, T, hidden]. With a cache, appends this call's k/v.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        cache: Option<&mut KvCache>,
    ) -> Tensor {
        let past_len = cache.as_ref().map_or(0, |c| c.seq_len());
        let (mut x, ctx) = self.prepare(input_ids, position_ids, attn, past_len);
        match cache {
            Some(cache) => {
                assert_eq!(
                    cache.layers.len(),
                    self.layers.len(),
                    "KvCache was made for a different number of layers"
                );
                for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
                    x = layer.forward(&x, &ctx, Some(slot));
                }
            }
            None => {
                for layer in &self.layers {
                    x = layer.forward(&x, &ctx, None);
                }
            }
        }
        self.norm.forward(&x)
    }

    /// hidden [.., hidden] -> logits [.., vocab] (tied => embed_tokens weight).
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.linear(&self.lm_head, None::<Tensor>)
    }

    /// hidden [.., hidden] -> fp32 logits [.., vocab], never rounded to bf16.
    ///
    /// Rounding logits to bf16 moves a log-prob by up to half a bf16 step (~4e-3 for
    /// logits in [1, 2)), and two forwards that differ in the last bit round differently.
    /// The engine and the trainer both score tokens through this, so their log-probs
    /// agree to what their hidden states agree. On CUDA the bf16 GEMM writes fp32
    /// directly; gradients flow through the bf16 product (the fp32 correction is
    /// detached), which is the bf16 model's own derivative.
    pub fn logits_f32(&self, hidden: &Tensor) -> Tensor {
        let lowp = matches!(hidden.kind(), Kind::BFloat16 | Kind::Half);
        if !(lowp && hidden.device().is_cuda()) {
            return self.logits(hidden).to_kind(Kind::Float);
        }
        let mut shape = hidden.size();
        let width = shape.pop().unwrap_or(1);
        let flat = hidden.reshape([-1, width]);
        // Models with the decode kernels on are for inference (engines): their GEMV has no
        // backward, so logits of a few rows carry no gradient to the LM head there.
        if !hidden.requires_grad() {
            if let Some(logits) = self.logits_gemv(&flat) {
                shape.push(logits.size()[1]);
                return logits.view(shape.as_slice());
            }
        }
        let wide = tch::no_grad(|| flat.detach().mm_dtype(&self.lm_head.tr(), Kind::Float));
        shape.push(wide.size()[1]);
        let wide = wide.view(shape.as_slice());
        if !(hidden.requires_grad() || self.lm_head.requires_grad()) {
            return wide;
        }
        // The fp32 correction is computed in place on `wide` (one fp32 [N, vocab] buffer
        // less at the peak of a logits chunk).
        let narrow = self.logits(hidden).to_kind(Kind::Float);
        let mut correction = wide;
        let _ = correction.g_sub_(&narrow.detach());
        narrow + correction
    }

    /// [`CausalLm::logits_f32`]'s values without a graph, whatever needs gradients: on CUDA
    /// in 16 bits only the GEMM writing fp32 runs (`logits_f32` also runs the bf16 product
    /// for gradients whenever the LM head requires grad, even under `no_grad`). For scoring
    /// passes and the fused log-prob kernels, which take the gradient themselves.
    pub fn logits_f32_detached(&self, hidden: &Tensor) -> Tensor {
        tch::no_grad(|| {
            let hidden = hidden.detach();
            let lowp = matches!(hidden.kind(), Kind::BFloat16 | Kind::Half);
            if !(lowp && hidden.device().is_cuda()) {
                return self.logits(&hidden).to_kind(Kind::Float);
            }
            let mut shape = hidden.size();
            let width = shape.pop().unwrap_or(1);
            let flat = hidden.reshape([-1, width]);
            let logits = self
                .logits_gemv(&flat)
                .unwrap_or_else(|| flat.mm_dtype(&self.lm_head.tr(), Kind::Float));
            shape.push(logits.size()[1]);
            logits.view(shape.as_slice())
        })
    }

    /// The output projection [vocab, hidden]; the embedding matrix when tied.
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Convenience: forward_hidden + logits.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        cache: Option<&mut KvCache>,
    ) -> Tensor {
        self.logits(&self.forward_hidden(input_ids, position_ids, attn, cache))
    }
}
