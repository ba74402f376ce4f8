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
/// Under autograd each chunk still keeps its softmax for the backward pass; call it under
/// `tch::no_grad` (or on a micro-batch) when memory is tight.
pub fn token_logprobs(
    model: &CausalLm,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_tokens: i64,
) -> (Tensor, Tensor) {
    let n = hidden.size()[0];
    assert_eq!(hidden.dim(), 2, "hidden must be [N, H]");
    assert_eq!(targets.size(), [n], "targets must be [N]");
    assert!(
        temperature > 0.0,
        "temperature must be positive, got {temperature}"
    );
    let chunk = chunk_tokens.max(1);
    let targets = targets.to_device(hidden.device());
    let mut logps = Vec::new();
    let mut entropies = Vec::new();
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let h = hidden.narrow(0, start, len);
        let t = targets.narrow(0, start, len);
        let mut logits = model.logits_f32(&h);
        if temperature != 1.0 {
            logits /= temperature;
        }
        let logp_all = logits.log_softmax(-1, None::<Kind>);
        logps.push(logp_all.gather(-1, &t.unsqueeze(-1), false).squeeze_dim(-1));
        // Entropy is a metric (no entropy bonus yet): computed without autograd.
        entropies.push(tch::no_grad(|| {
            -(logp_all.exp() * &logp_all).sum_dim_intlist(-1, false, None::<Kind>)
        }));
        start += len;
    }
    if logps.is_empty() {
        let empty = Tensor::zeros([0], (Kind::Float, hidden.device()));
        return (empty.shallow_clone(), empty);
    }
    (Tensor::cat(&logps, 0), Tensor::cat(&entropies, 0))
}
