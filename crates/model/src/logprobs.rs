//! Per-token log-probabilities and entropies from final hidden states, in row chunks so
//! that the full [tokens x vocab] fp32 logits never exist as one tensor.

use tch::{Kind, Tensor};

use crate::transformer::CausalLm;

/// Per-token log-probs and entropy of `targets` under softmax(hidden @ lm_head^T / temperature), computed in chunks of `chunk_tokens`
/// rows so a [tokens x vocab] fp32 tensor is never materialized whole. hidden [N, H], targets [N] i64 -> (logp [N], entropy [N]).
/// The log-probs are differentiable w.r.t. hidden and the lm_head weight; the entropy is
/// computed without autograd (it is reported, not trained on).
///
/// Logits are upcast to fp32 before the softmax, so bf16 models give fp32 log-probs.
/// Under autograd each chunk still keeps its softmax for the backward pass, so chunking
/// saves nothing there: call it under `tch::no_grad`, and train through
/// [`DeferredLogprobs`], which holds one chunk's softmax at a time.
pub fn token_logprobs(
    model: &CausalLm,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_tokens: i64,
) -> (Tensor, Tensor) {
    let n = hidden.size()[0];
    check_shapes(hidden, targets, temperature);
    let chunk = chunk_tokens.max(1);
    let targets = targets.to_device(hidden.device());
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
    if logps.is_empty() {
        // Two tensors, not two handles of one: DeferredLogprobs flags each for autograd.
        let empty = || Tensor::zeros([0], (Kind::Float, hidden.device()));
        return (empty(), empty());
    }
    (Tensor::cat(&logps, 0), Tensor::cat(&entropies, 0))
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
pub struct DeferredLogprobs<'a> {
    model: &'a CausalLm,
    /// [N, H], still attached to the model's graph.
    hidden: Tensor,
    targets: Tensor,
    temperature: f64,
    chunk: i64,
    logp: Tensor,
    entropy: Tensor,
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
        let (logp, entropy) =
            tch::no_grad(|| token_logprobs(model, hidden, targets, temperature, chunk_tokens));
        DeferredLogprobs {
            model,
            hidden: hidden.shallow_clone(),
            targets: targets.to_device(hidden.device()),
            temperature,
            chunk: chunk_tokens.max(1),
            logp: logp.set_requires_grad(true),
            entropy: entropy.set_requires_grad(entropy_grad),
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
            let Some(g_hidden) = g_hidden else {
                return value;
            };
            // (hidden - sg(hidden)) is exactly zero, so the value stays the loss's while
            // the gradient w.r.t. hidden is the collected one, bit for bit.
            let surrogate = ((&self.hidden - self.hidden.detach()) * g_hidden).sum(Kind::Float);
            let kind = value.kind();
            value + surrogate.to_kind(kind)
        })
    }
}
