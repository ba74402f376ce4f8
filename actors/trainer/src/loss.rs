//! GRPO's clipped surrogate loss, per token, and the sample-mean aggregation.

use tch::{Kind, Tensor};

/// Clip range of the importance ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipRange {
    pub eps_clip: f64,
    pub eps_clip_high: f64,
}

/// Per-token policy loss `max(-ratio*A, -clip(ratio, 1-eps, 1+eps_high)*A)` and whether
/// the clipped branch was taken (for `train/pg_clipfrac`).
///
/// All inputs are 1-D over the same tokens.
pub fn clipped_policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    clip: ClipRange,
) -> (Tensor, Tensor) {
    let ratio = (logp - old_logp).exp();
    let unclipped = -&ratio * advantages;
    let clipped = -ratio.clamp(1.0 - clip.eps_clip, 1.0 + clip.eps_clip_high) * advantages;
    let clipfrac = clipped.gt_tensor(&unclipped).to_kind(Kind::Float);
    (unclipped.maximum(&clipped), clipfrac)
}

/// Per-token weights that turn a token sum into "mean over samples of each sample's
/// token mean": `mask / tokens_in_sample / samples_in_global_batch`. Summing
/// `weight * loss_tok` over every micro-batch gives the global loss exactly.
pub fn sample_mean_weights(mask_per_sample: &[Vec<f32>], global_samples: usize) -> Vec<f32> {
    let n = global_samples.max(1) as f32;
    let mut out = Vec::with_capacity(mask_per_sample.iter().map(Vec::len).sum());
    for mask in mask_per_sample {
        let count: f32 = mask.iter().sum();
        for &m in mask {
            out.push(if count > 0.0 { m / count / n } else { 0.0 });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn matches_hand_computed_values() {
        // ratio = exp(logp - old): [1.0, e^0.5=1.6487, e^-0.5=0.6065, 1.1]
        let old = t(&[0.0, 0.0, 0.0, 0.0]);
        let logp = t(&[0.0, 0.5, -0.5, 1.1f64.ln()]);
        let adv = t(&[2.0, 1.0, -1.0, -3.0]);
        let clip = ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        };
        let (loss, clipfrac) = clipped_policy_loss(&logp, &old, &adv, clip);
        let loss = Vec::<f64>::try_from(loss).unwrap();
        let clipfrac = Vec::<f64>::try_from(clipfrac).unwrap();
        // token 0: ratio 1 -> -2 both branches.
        // token 1: A=1, ratio 1.6487: unclipped -1.6487, clipped -1.28 -> max = -1.28 (clipped)
        // token 2: A=-1, ratio 0.6065: unclipped 0.6065, clipped 0.8 -> max = 0.8 (clipped)
        // token 3: A=-3, ratio 1.1: unclipped 3.3, clipped 3.3 -> 3.3, not clipped
        let want = [-2.0, -1.28, 0.8, 3.3];
        for (g, w) in loss.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{loss:?}");
        }
        assert_eq!(clipfrac, vec![0.0, 1.0, 1.0, 0.0]);
    }

    #[test]
    fn on_policy_gradient_is_minus_advantage() {
        let logp = t(&[-1.0, -2.0]).set_requires_grad(true);
        let old = logp.detach();
        let adv = t(&[0.5, -2.0]);
        let clip = ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        };
        let (loss, _) = clipped_policy_loss(&logp, &old, &adv, clip);
        loss.sum(Kind::Double).backward();
        let g = Vec::<f64>::try_from(logp.grad()).unwrap();
        assert_eq!(g, vec![-0.5, 2.0]);
    }

    #[test]
    fn weights_average_tokens_then_samples() {
        let w = sample_mean_weights(&[vec![1.0, 1.0, 0.0], vec![1.0], vec![0.0, 0.0]], 4);
        assert_eq!(w, vec![0.125, 0.125, 0.0, 0.25, 0.0, 0.0]);
    }
}
