//! Per-token log-probabilities and entropies from final hidden states, in row chunks so
//! that the full [tokens x vocab] fp32 logits never exist as one tensor.
//!
//! On CUDA in bf16/fp16 (unless `MANTA_FUSED_LOGPROBS=0`) a chunk is scored by one kernel
//! over its fp32 logits and its LM-head backward takes the logits' gradient from a second
//! one (`manta_cuda::logprobs`), instead of a dozen full-width tensor ops and their
//! autograd backward; elsewhere, and for `token_logprobs` under autograd, tensor ops.

use tch::{Device, Kind, Tensor};

use crate::kernel_check::{Fused, FusedOp};
use crate::transformer::CausalLm;

/// Per-token log-probs and entropy of `targets` under softmax(hidden @ lm_head^T / temperature), computed in chunks of `chunk_tokens`
/// rows so a [tokens x vocab] fp32 tensor is never materialized whole. hidden [N, H], targets [N] i64 -> (logp [N], entropy [N]).
/// The log-probs are differentiable w.r.t. hidden and the lm_head weight; the entropy is
/// computed without autograd (it is reported, not trained on).
///
/// Logits are upcast to fp32 before the softmax, so bf16 models give fp32 log-probs.
/// Under autograd each chunk still keeps its softmax for the backward pass, so chunking
/// saves nothing there: call it under `tch::no_grad`, and train through
/// [`DeferredLogprobs`], which holds one chunk's softmax at a time. Without a graph to
/// build, a 16-bit model on CUDA scores through the fused kernel (module docs).
pub fn token_logprobs(
    model: &CausalLm,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_tokens: i64,
) -> (Tensor, Tensor) {
    let differentiable =
        || (hidden.requires_grad() || model.lm_head_weight().requires_grad()) && grad_mode();
    let fused = fused_applies(model, hidden) && !differentiable();
    let scored = score(model, hidden, targets, temperature, chunk_tokens, fused);
    (scored.logp, scored.entropy)
}

/// What scoring a pass gives: [N] log-probs and entropies, and with the fused kernel each
/// row's softmax statistics ([N, 2]: max and log-sum of logits / T) for its backward.
struct Scores {
    logp: Tensor,
    entropy: Tensor,
    stats: Option<Tensor>,
}

/// [`token_logprobs`]' chunked scoring, through the fused kernel when `fused`.
fn score(
    model: &CausalLm,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_tokens: i64,
    fused: bool,
) -> Scores {
    let n = hidden.size()[0];
    check_shapes(hidden, targets, temperature);
    let chunk = chunk_tokens.max(1);
    let targets = targets.to_device(hidden.device());
    if n == 0 {
        // Two tensors, not two handles of one: DeferredLogprobs flags each for autograd.
        let empty = || Tensor::zeros([0], (Kind::Float, hidden.device()));
        return Scores {
            logp: empty(),
            entropy: empty(),
            stats: fused.then(|| Tensor::zeros([0, 2], (Kind::Float, hidden.device()))),
        };
    }
    if fused {
        FUSED.ran();
        return score_fused(model, hidden, &targets, temperature, chunk);
    }
    let mut logps = Vec::new();
    let mut entropies = Vec::new();
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let logp_all = chunk_log_softmax(model, &hidden.narrow(0, start, len), temperature);
        logps.push(pick(&logp_all, &targets.narrow(0, start, len)));
        // Entropy is a metric here: computed without autograd.
        entropies.push(tch::no_grad(|| entropy(&logp_all)));
        start += len;
    }
    Scores {
        logp: Tensor::cat(&logps, 0),
        entropy: Tensor::cat(&entropies, 0),
        stats: None,
    }
}

/// The fused kernel's scoring: per chunk the fp32 logits (the GEMM alone, no graph), then
/// one read of them for the log-probs, entropies and softmax statistics.
fn score_fused(
    model: &CausalLm,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk: i64,
) -> Scores {
    let n = hidden.size()[0];
    let device = hidden.device();
    let targets = targets.to_kind(Kind::Int64);
    let f32s = |shape: &[i64]| Tensor::empty(shape, (Kind::Float, device));
    let (logp, entropy, stats) = (f32s(&[n]), f32s(&[n]), f32s(&[n, 2]));
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let logits = model.logits_f32_detached(&hidden.narrow(0, start, len));
        let out = manta_cuda::logprobs::RowScores {
            logp: &mut logp.narrow(0, start, len),
            entropy: &mut entropy.narrow(0, start, len),
            stats: &mut stats.narrow(0, start, len),
        };
        if let Err(e) = manta_cuda::logprobs::logprob_rows(
            &logits,
            &targets.narrow(0, start, len),
            temperature,
            out,
        ) {
            panic!(
                "fused log-prob kernel on rows {start}..{} of {n}: {e}",
                start + len
            );
        }
        start += len;
    }
    Scores {
        logp,
        entropy,
        stats: Some(stats),
    }
}

/// Whether `hidden` of `model` scores through the fused kernels: 16-bit on CUDA with the
/// LM head in the same kind, `MANTA_FUSED_LOGPROBS` on, and the kernels compiling there.
fn fused_applies(model: &CausalLm, hidden: &Tensor) -> bool {
    model.lm_head_weight().kind() == hidden.kind()
        && model.lm_head_weight().device() == hidden.device()
        && FUSED.applies_to(hidden)
}

const FUSED: FusedOp = FusedOp {
    op: Fused::Logprobs,
    name: "fused log-prob kernels",
    instead: "scoring through tensor ops",
    enabled: manta_knobs::fused_logprobs,
    compile: manta_cuda::logprobs::compile_check,
};

/// Whether autograd records operations here (tch has no query for the grad mode): an op
/// on a leaf that requires grad requires grad only then.
fn grad_mode() -> bool {
    let leaf = Tensor::zeros([], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&leaf * 1.0).requires_grad()
}

fn check_shapes(hidden: &Tensor, targets: &Tensor, temperature: f64) {
    assert_eq!(hidden.dim(), 2, "hidden must be [N, H]");
    assert_eq!(targets.size(), [hidden.size()[0]], "targets must be [N]");
    assert!(
        temperature > 0.0,
        "temperature must be positive, got {temperature}"
    );
}

/// fp32 log-softmax [rows, vocab] of one chunk's logits at `temperature`.
fn chunk_log_softmax(model: &CausalLm, hidden: &Tensor, temperature: f64) -> Tensor {
    let mut logits = model.logits_f32(hidden);
    if temperature != 1.0 {
        logits /= temperature;
    }
    logits.log_softmax(-1, None::<Kind>)
}

/// Each row's entry at its target: [rows, vocab] x [rows] -> [rows].
fn pick(logp_all: &Tensor, targets: &Tensor) -> Tensor {
    logp_all
        .gather(-1, &targets.unsqueeze(-1), false)
        .squeeze_dim(-1)
}

/// Each row's entropy from its log-softmax: [rows, vocab] -> [rows].
fn entropy(logp_all: &Tensor) -> Tensor {
    -(logp_all.exp() * logp_all).sum_dim_intlist(-1, false, None::<Kind>)
}

/// The training form of [`token_logprobs`]: the log-probs (and entropies) of a pass's
/// trained tokens with the backward through the LM head deferred, so the step holds one
/// chunk's [chunk, vocab] logits and softmax at a time instead of every chunk's (autograd
/// keeps each chunk's fp32 log-softmax until the backward, ~0.6 GB per 1024 rows of
/// Qwen3's vocabulary; tch cannot define a custom autograd function that would recompute
/// them).
///
/// [`DeferredLogprobs::new`] scores the rows without autograd and exposes the values as
/// leaves that require grad; the caller builds its loss from them and hands it to
/// [`DeferredLogprobs::backward`], which back-propagates the loss to those leaves (a graph
/// of [N] vectors), then recomputes each chunk's logits with autograd from a detached
/// copy of its hidden rows and back-propagates the chunk's share — the LM head weight
/// accumulates its gradient in `.grad` (into the embedding when tied), the rows' gradient
/// is kept — and returns a surrogate scalar: the loss's value, with the collected
/// gradient as its gradient w.r.t. `hidden`, so one `backward()` of the surrogate carries
/// on through the layers exactly as a backward of the loss through the chunks would.
/// With the fused kernels (module docs) the recompute is the fp32 logits alone and the
/// gradient w.r.t. them comes from one kernel; the LM head's GEMMs are autograd's.
pub struct DeferredLogprobs<'a> {
    model: &'a CausalLm,
    /// [N, H], still attached to the model's graph.
    hidden: Tensor,
    targets: Tensor,
    temperature: f64,
    chunk: i64,
    logp: Tensor,
    entropy: Tensor,
    /// [N, 2] softmax statistics when the fused kernels scored the rows: the backward
    /// then takes the logits' gradient from the fused kernel too.
    stats: Option<Tensor>,
}

impl<'a> DeferredLogprobs<'a> {
    /// Scores `targets` [N] from `hidden` [N, H] in chunks of `chunk_tokens` rows (the
    /// values [`token_logprobs`] gives). `entropy_grad`: the loss trains on the entropy
    /// (an entropy bonus), so [`DeferredLogprobs::entropy`] requires grad too; otherwise
    /// it is a plain tensor for the metrics.
    pub fn new(
        model: &'a CausalLm,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
        chunk_tokens: i64,
        entropy_grad: bool,
    ) -> Self {
        let fused = fused_applies(model, hidden);
        let scored =
            tch::no_grad(|| score(model, hidden, targets, temperature, chunk_tokens, fused));
        DeferredLogprobs {
            model,
            hidden: hidden.shallow_clone(),
            targets: targets.to_device(hidden.device()),
            temperature,
            chunk: chunk_tokens.max(1),
            logp: scored.logp.set_requires_grad(true),
            entropy: scored.entropy.set_requires_grad(entropy_grad),
            stats: scored.stats,
        }
    }

    /// Log-probs [N] fp32: a leaf that requires grad; the loss is built from it.
    pub fn logp(&self) -> &Tensor {
        &self.logp
    }

    /// Entropies [N] fp32: a leaf that requires grad when built with `entropy_grad`.
    pub fn entropy(&self) -> &Tensor {
        &self.entropy
    }

    /// Back-propagates `loss` (a scalar built from [`DeferredLogprobs::logp`] and
    /// [`DeferredLogprobs::entropy`]) into the LM head's `.grad` chunk by chunk, and
    /// returns the surrogate to call `backward()` on for the rest of the model (its
    /// value is the loss's). A loss without a graph is returned detached, with nothing
    /// back-propagated. Panics as tch's `backward` does (out of memory included).
    pub fn backward(self, loss: &Tensor) -> Tensor {
        let value = loss.detach();
        if !loss.requires_grad() {
            return value;
        }
        tch::with_grad(|| {
            loss.backward();
            let grad_of = |t: &Tensor| {
                let g = t.grad();
                g.defined().then_some(g)
            };
            let (g_logp, g_entropy) = (grad_of(&self.logp), grad_of(&self.entropy));
            if let Some(stats) = &self.stats {
                let g_hidden = self.backward_fused(stats, g_logp.as_ref(), g_entropy.as_ref());
                return surrogate(&self.hidden, value, g_hidden);
            }
            let n = self.hidden.size()[0];
            // The rows' gradient, filled a chunk at a time (one [N, H] buffer, no concat).
            let mut g_hidden = self
                .hidden
                .requires_grad()
                .then(|| self.hidden.detach().zeros_like());
            let mut start = 0;
            while start < n {
                let len = self.chunk.min(n - start);
                let h = self
                    .hidden
                    .narrow(0, start, len)
                    .detach()
                    .set_requires_grad(g_hidden.is_some());
                let logp_all = chunk_log_softmax(self.model, &h, self.temperature);
                // Σ logp·dL/dlogp (+ Σ entropy·dL/dentropy): its gradient is the loss's
                // through this chunk.
                let weighted = |values: Tensor, g: &Tensor| {
                    (values * g.narrow(0, start, len)).sum(Kind::Float)
                };
                let targets = self.targets.narrow(0, start, len);
                let logp = g_logp
                    .as_ref()
                    .map(|g| weighted(pick(&logp_all, &targets), g));
                let ent = g_entropy.as_ref().map(|g| weighted(entropy(&logp_all), g));
                let term = match (logp, ent) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                };
                if let Some(term) = term.filter(Tensor::requires_grad) {
                    term.backward();
                }
                let g = h.grad();
                if let (Some(rows), true) = (&mut g_hidden, g.defined()) {
                    rows.narrow(0, start, len).copy_(&g);
                }
                start += len;
            }
            surrogate(&self.hidden, value, g_hidden)
        })
    }

    /// The fused backward: per chunk the fp32 logits again (the GEMM alone, no graph), the
    /// kernel's gradient w.r.t. them in the model's kind (what autograd's cast back of the
    /// fp32 logits hands the bf16 product), then the LM head's two GEMMs: the rows'
    /// gradient straight into its [N, H] buffer and the head's accumulated into its
    /// `.grad` (one rounding per chunk, where autograd rounds the chunk's product and then
    /// the sum). Returns the rows' gradient, as the tensor-op loop does.
    fn backward_fused(
        &self,
        stats: &Tensor,
        g_logp: Option<&Tensor>,
        g_entropy: Option<&Tensor>,
    ) -> Option<Tensor> {
        let head = self.model.lm_head_weight();
        let g_hidden = self
            .hidden
            .requires_grad()
            .then(|| self.hidden.detach().zeros_like());
        let train_head = head.requires_grad();
        if (g_logp.is_none() && g_entropy.is_none()) || (g_hidden.is_none() && !train_head) {
            return g_hidden;
        }
        let n = self.hidden.size()[0];
        let targets = self.targets.to_kind(Kind::Int64);
        let g_logp = g_logp.map(|g| g.to_kind(Kind::Float).contiguous());
        let g_entropy = g_entropy.map(|g| g.to_kind(Kind::Float).contiguous());
        tch::no_grad(|| {
            let mut start = 0;
            while start < n {
                let len = self.chunk.min(n - start);
                let h = self.hidden.narrow(0, start, len).detach().contiguous();
                let logits = self.model.logits_f32_detached(&h);
                let mut grad = Tensor::empty(logits.size(), (h.kind(), h.device()));
                let row = manta_cuda::logprobs::RowStats {
                    stats: &stats.narrow(0, start, len),
                    entropy: &self.entropy.detach().narrow(0, start, len),
                };
                let rows = |g: &Option<Tensor>| g.as_ref().map(|g| g.narrow(0, start, len));
                if let Err(e) = manta_cuda::logprobs::logprob_grad(
                    &logits,
                    &targets.narrow(0, start, len),
                    row,
                    rows(&g_logp).as_ref(),
                    rows(&g_entropy).as_ref(),
                    self.temperature,
                    &mut grad,
                ) {
                    panic!(
                        "fused log-prob gradient kernel on rows {start}..{} of {n}: {e}",
                        start + len
                    );
                }
                // The fp32 logits are not needed for the GEMMs: free them first.
                drop(logits);
                if let Some(all) = &g_hidden {
                    let _ = grad.mm_out(&all.narrow(0, start, len), head);
                }
                if train_head {
                    accumulate_grad(head, &grad.tr(), &h);
                }
                start += len;
            }
        });
        g_hidden
    }
}

/// `param.grad += a @ b`, allocating the gradient as `a @ b` when the parameter has none
/// (autograd's accumulation, for a product computed outside it).
fn accumulate_grad(param: &Tensor, a: &Tensor, b: &Tensor) {
    let mut grad = param.grad();
    if grad.defined() {
        let _ = grad.addmm_(a, b);
    } else if let Err(e) = manta_cuda::logprobs::set_grad(param, &a.mm(b)) {
        panic!("LM head gradient: {e}");
    }
}

/// `value`, with `g_hidden` (if any) as its gradient w.r.t. `hidden`: what a backward of
/// the loss through every chunk would have sent into the layers.
fn surrogate(hidden: &Tensor, value: Tensor, g_hidden: Option<Tensor>) -> Tensor {
    let Some(g_hidden) = g_hidden else {
        return value;
    };
    // (hidden - sg(hidden)) is exactly zero, so the value stays the loss's while the
    // gradient w.r.t. hidden is the collected one, bit for bit.
    let surrogate = ((hidden - hidden.detach()) * g_hidden).sum(Kind::Float);
    let kind = value.kind();
    value + surrogate.to_kind(kind)
}
