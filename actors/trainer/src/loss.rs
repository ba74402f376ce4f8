//! slime's policy loss (REFERENCE.md §4, slime `ppo_utils.py` / megatron `loss.py`):
//! PPO-clip with optional dual clip, GSPO's sequence-level ratio, CISPO, KL to a frozen
//! reference, an entropy bonus, truncated importance sampling against the engine's
//! log-probs, off-policy sequence masking, and the two aggregations.

use tch::{Kind, Tensor};

/// Clip range of the importance ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipRange {
    pub eps_clip: f64,
    pub eps_clip_high: f64,
}

pub use manta_core::algo::{AdvantageEstimator, KlType, TisMode};

/// Everything about the loss beyond the clip range; defaults are slime's.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossOptions {
    pub estimator: AdvantageEstimator,
    /// Dual-clip bound for negative advantages (> 1), off when `None`.
    pub eps_clip_c: Option<f64>,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: KlType,
    /// Weight the KL estimate by π/π_old (DeepSeek-V3.2's unbiased estimator).
    pub use_unbiased_kl: bool,
    pub entropy_coef: f64,
    pub use_tis: bool,
    pub tis_clip: f64,
    pub tis_clip_low: f64,
    pub tis_mode: TisMode,
    pub use_opsm: bool,
    pub opsm_delta: f64,
    /// Global token mean instead of the mean of per-sample token means.
    pub calculate_per_token_loss: bool,
}

impl Default for LossOptions {
    fn default() -> Self {
        Self {
            estimator: AdvantageEstimator::Grpo,
            eps_clip_c: None,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            kl_loss_type: KlType::K1,
            use_unbiased_kl: false,
            entropy_coef: 0.0,
            use_tis: false,
            tis_clip: 2.0,
            tis_clip_low: 0.0,
            tis_mode: TisMode::Truncate,
            use_opsm: false,
            opsm_delta: 1e-4,
            calculate_per_token_loss: false,
        }
    }
}

/// Per-token KL estimate of `logp` against `base` (`log_ratio = logp - base`): k1 is the
/// log-ratio, k2 half its square, k3 `exp(-x) - 1 + x`; `importance` multiplies it
/// (unbiased KL); low_var_kl clamps the result to [-10, 10].
pub fn approx_kl(
    logp: &Tensor,
    base: &Tensor,
    kind: KlType,
    importance: Option<&Tensor>,
) -> Tensor {
    let x = logp.to_kind(Kind::Float) - base.to_kind(Kind::Float);
    let mut kl = match kind {
        KlType::K1 => x,
        KlType::K2 => x.square() / 2.0,
        KlType::K3 | KlType::LowVarKl => {
            let neg = -x;
            neg.exp() - 1.0 - neg
        }
    };
    if let Some(w) = importance {
        kl = w * kl;
    }
    if kind == KlType::LowVarKl {
        kl = kl.clamp(-10.0, 10.0);
    }
    kl
}

/// PPO-clip per token from `ppo_kl = old_logp - logp`: `max(-r·A, -clip(r)·A)`, and for
/// `A < 0` with dual clip `min(that, -eps_clip_c·A)`. Also returns where the clipped
/// branch was larger (`train/pg_clipfrac`).
pub fn policy_loss(
    ppo_kl: &Tensor,
    advantages: &Tensor,
    clip: ClipRange,
    eps_clip_c: Option<f64>,
) -> (Tensor, Tensor) {
    let ratio = (-ppo_kl).exp();
    let unclipped = -&ratio * advantages;
    let clipped = -ratio.clamp(1.0 - clip.eps_clip, 1.0 + clip.eps_clip_high) * advantages;
    let clipfrac = clipped.gt_tensor(&unclipped).to_kind(Kind::Float);
    let loss = unclipped.maximum(&clipped);
    let loss = match eps_clip_c {
        Some(c) => {
            let dual = loss.minimum(&(advantages * -c));
            dual.where_self(&advantages.lt(0.0), &loss)
        }
        None => loss,
    };
    (loss, clipfrac)
}

/// CISPO per token: `-sg(clip(r)) · A · logp`; clipped tokens still get gradient through
/// `logp`. The fraction marks tokens whose ratio the clip changed.
pub fn cispo_loss(
    ppo_kl: &Tensor,
    logp: &Tensor,
    advantages: &Tensor,
    clip: ClipRange,
) -> (Tensor, Tensor) {
    let ratio = (-ppo_kl).exp();
    let truncated = ratio.clamp(1.0 - clip.eps_clip, 1.0 + clip.eps_clip_high);
    let clipfrac = truncated.ne_tensor(&ratio).to_kind(Kind::Float);
    (-truncated.detach() * advantages * logp, clipfrac)
}

/// The per-sample mean of `values` over each sample's tokens, repeated on each of its
/// tokens. `segment[i]` is the sample of token `i`; `counts[s]` its token count.
pub fn segment_mean(values: &Tensor, segment: &Tensor, counts: &Tensor) -> Tensor {
    let n = counts.size()[0];
    let sums = Tensor::zeros([n], (values.kind(), values.device())).index_add(0, segment, values);
    (sums / counts.clamp_min(1.0)).index_select(0, segment)
}

/// Backward-compatible name of [`policy_loss`] without dual clip.
pub fn clipped_policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    clip: ClipRange,
) -> (Tensor, Tensor) {
    policy_loss(&(old_logp - logp), advantages, clip, None)
}

/// One micro-batch's trained tokens (loss mask 1), flattened in sample order.
pub struct TokenBatch<'a> {
    /// Current policy log-probs (differentiable).
    pub logp: &'a Tensor,
    /// Token entropy; differentiable when `entropy_coef != 0`.
    pub entropy: &'a Tensor,
    /// π_old: the engine's log-probs with `--use-rollout-logprobs`, else the trainer's
    /// before this rollout's first update.
    pub old_logp: &'a Tensor,
    /// The trainer's log-probs before the update (TIS weights compare these to the engine's).
    pub train_logp: &'a Tensor,
    pub rollout_logp: &'a Tensor,
    /// Frozen reference log-probs; required with `use_kl_loss`.
    pub ref_logp: Option<&'a Tensor>,
    pub advantages: &'a Tensor,
    /// Reducer weights: summed over every micro-batch they give the global aggregate.
    pub weights: &'a Tensor,
    /// Sample (within the micro-batch) of each token, i64.
    pub segment: &'a Tensor,
    /// Tokens per sample in the micro-batch, float.
    pub counts: &'a Tensor,
    pub use_rollout_logprobs: bool,
}

/// A micro-batch's contribution: the differentiable loss and the weighted metric sums,
/// keyed by slime's `train/` names (without the prefix).
pub struct LossTerms {
    pub loss: Tensor,
    pub metrics: Vec<(&'static str, f64)>,
}

/// slime's `policy_loss_function` on one micro-batch, reduced with `t.weights`.
// `x = x * y` rather than `x *= y`: in-place ops would overwrite tensors autograd saved.
#[allow(clippy::assign_op_pattern)]
pub fn policy_objective(t: &TokenBatch, clip: ClipRange, o: &LossOptions) -> LossTerms {
    let reduce = |x: &Tensor| (x.to_kind(Kind::Float) * t.weights).sum(Kind::Float);
    let value = |x: &Tensor| tch::no_grad(|| reduce(x).double_value(&[]));
    let ppo_kl = match o.estimator {
        AdvantageEstimator::Gspo => segment_mean(&(t.old_logp - t.logp), t.segment, t.counts),
        _ => t.old_logp - t.logp,
    };
    let (mut pg, clipfrac) = match o.estimator {
        AdvantageEstimator::Cispo => cispo_loss(&ppo_kl, t.logp, t.advantages, clip),
        _ => policy_loss(&ppo_kl, t.advantages, clip, o.eps_clip_c),
    };
    let mut metrics = Vec::new();
    if o.use_opsm {
        // Sequences with A < 0 whose mean log-ratio old/new exceeds delta are dropped.
        let seq_kl = tch::no_grad(|| segment_mean(&(t.old_logp - t.logp), t.segment, t.counts));
        let masked = t.advantages.lt(0.0).logical_and(&seq_kl.gt(o.opsm_delta));
        let masked_f = masked.to_kind(Kind::Float);
        // slime sums masked tokens / tokens per sample: the number of masked sequences.
        let seqs = tch::no_grad(|| {
            (&masked_f / t.counts.index_select(0, t.segment).clamp_min(1.0))
                .sum(Kind::Double)
                .double_value(&[])
        });
        metrics.push(("opsm_clipfrac", seqs));
        pg = pg * (1.0 - masked_f);
    }
    if o.use_tis {
        let ratio = tch::no_grad(|| (t.train_logp - t.rollout_logp).exp());
        let w = match o.tis_mode {
            TisMode::Truncate => ratio.clamp(o.tis_clip_low, o.tis_clip),
            TisMode::Mask => {
                let inside = ratio.ge(o.tis_clip_low).logical_and(&ratio.le(o.tis_clip));
                ratio.where_self(&inside, &ratio.zeros_like())
            }
        };
        metrics.push(("tis", value(&ratio)));
        metrics.push((
            "tis_clipfrac",
            value(&w.ne_tensor(&ratio).to_kind(Kind::Float)),
        ));
        metrics.push(("tis_abs", value(&(&ratio - 1.0).abs())));
        metrics.push(("ois", value(&(-&ppo_kl).exp())));
        pg = pg * w;
    }
    let pg_loss = reduce(&pg);
    let entropy_loss = reduce(t.entropy);
    let mut loss = &pg_loss - o.entropy_coef * &entropy_loss;
    metrics.push(("pg_loss", pg_loss.double_value(&[])));
    metrics.push(("pg_clipfrac", value(&clipfrac)));
    metrics.push(("ppo_kl", value(&ppo_kl)));
    metrics.push(("entropy_loss", entropy_loss.double_value(&[])));
    if o.use_kl_loss {
        if let Some(reference) = t.ref_logp {
            let importance = o.use_unbiased_kl.then(|| (t.logp - t.old_logp).exp());
            let kl = approx_kl(t.logp, reference, o.kl_loss_type, importance.as_ref());
            let kl_loss = reduce(&kl);
            metrics.push(("kl_loss", kl_loss.double_value(&[])));
            loss = loss + o.kl_loss_coef * kl_loss;
        }
    }
    let compare = if t.use_rollout_logprobs {
        t.logp
    } else {
        t.old_logp
    };
    metrics.push((
        "train_rollout_logprob_abs_diff",
        value(&(compare - t.rollout_logp).abs()),
    ));
    metrics.push(("loss", loss.double_value(&[])));
    LossTerms { loss, metrics }
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

/// Weights for `--calculate-per-token-loss`: every trained token of the global batch
/// counts `1 / global_tokens`.
pub fn token_mean_weights(mask_per_sample: &[Vec<f32>], global_tokens: usize) -> Vec<f32> {
    let n = global_tokens.max(1) as f32;
    mask_per_sample.iter().flatten().map(|&m| m / n).collect()
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

    fn vals(x: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(x.to_kind(Kind::Double)).unwrap()
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn dual_clip_caps_negative_advantages_only() {
        // ratio e^2 = 7.389: A=-2 → PPO loss 14.78, dual clip caps at -3·A = 6;
        // A=+2 → clipped branch -1.2·2 = -2.4 wins (max), dual clip not applied.
        let ppo_kl = t(&[-2.0, -2.0]);
        let adv = t(&[-2.0, 2.0]);
        let clip = ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        };
        let (loss, _) = policy_loss(&ppo_kl, &adv, clip, Some(3.0));
        close(&vals(&loss), &[6.0, -2.4]);
        let (loss, _) = policy_loss(&ppo_kl, &adv, clip, None);
        close(&vals(&loss), &[2.0 * 2f64.exp(), -2.4]);
    }

    #[test]
    fn kl_estimators_by_hand() {
        let logp = t(&[0.5, -20.0]);
        let base = t(&[0.0, 0.0]);
        close(
            &vals(&approx_kl(&logp, &base, KlType::K1, None)),
            &[0.5, -20.0],
        );
        close(
            &vals(&approx_kl(&logp, &base, KlType::K2, None)),
            &[0.125, 200.0],
        );
        let k3_first = (-0.5f64).exp() - 1.0 + 0.5;
        let k3 = vals(&approx_kl(&logp, &base, KlType::K3, None));
        close(&k3[..1], &[k3_first]);
        assert!(k3[1] > 1e8, "k3 is not clamped: {k3:?}");
        close(
            &vals(&approx_kl(&logp, &base, KlType::LowVarKl, None)),
            &[k3_first, 10.0],
        );
        let w = t(&[2.0, 1.0]);
        close(
            &vals(&approx_kl(&logp, &base, KlType::K1, Some(&w))),
            &[1.0, -20.0],
        );
    }

    #[test]
    fn cispo_weights_logp_by_the_clipped_ratio_without_its_gradient() {
        // ratio e^0.5 = 1.6487 → clipped to 1.28; loss = -1.28·A·logp, d/dlogp = -1.28·A.
        let logp = t(&[0.5, 0.0]).set_requires_grad(true);
        let old = t(&[0.0, 0.0]);
        let adv = t(&[2.0, -1.0]);
        let clip = ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        };
        let (loss, frac) = cispo_loss(&(&old - &logp), &logp, &adv, clip);
        close(&vals(&loss), &[-1.28 * 2.0 * 0.5, 0.0]);
        close(&vals(&frac), &[1.0, 0.0]);
        loss.sum(Kind::Double).backward();
        close(&vals(&logp.grad()), &[-2.56, 1.0]);
    }

    /// Three tokens: sample 0 has two, sample 1 one; sample-mean weights over 2 samples.
    struct Fixture {
        logp: Tensor,
        entropy: Tensor,
        old: Tensor,
        rollout: Tensor,
        reference: Tensor,
        adv: Tensor,
        w: Tensor,
        seg: Tensor,
        counts: Tensor,
    }

    fn fixture() -> Fixture {
        Fixture {
            logp: t(&[-1.0, -1.0, -1.0])
                .to_kind(Kind::Float)
                .set_requires_grad(true),
            entropy: t(&[1.0, 2.0, 3.0]).to_kind(Kind::Float),
            old: t(&[-1.0, -1.0, -1.0]).to_kind(Kind::Float),
            rollout: t(&[-1.0, -2.0, -1.0 - 3f64.ln()]).to_kind(Kind::Float),
            reference: t(&[-1.5, -1.0, -1.0]).to_kind(Kind::Float),
            adv: t(&[1.0, 1.0, -1.0]).to_kind(Kind::Float),
            w: Tensor::from_slice(&sample_mean_weights(&[vec![1.0, 1.0], vec![1.0]], 2)),
            seg: Tensor::from_slice(&[0i64, 0, 1]),
            counts: Tensor::from_slice(&[2.0f32, 1.0]),
        }
    }

    fn objective(f: &Fixture, o: &LossOptions) -> BTreeMap<&'static str, f64> {
        let terms = policy_objective(
            &TokenBatch {
                logp: &f.logp,
                entropy: &f.entropy,
                old_logp: &f.old,
                train_logp: &f.old,
                rollout_logp: &f.rollout,
                ref_logp: Some(&f.reference),
                advantages: &f.adv,
                weights: &f.w,
                segment: &f.seg,
                counts: &f.counts,
                use_rollout_logprobs: false,
            },
            ClipRange {
                eps_clip: 0.2,
                eps_clip_high: 0.2,
            },
            o,
        );
        terms.metrics.into_iter().collect()
    }

    use std::collections::BTreeMap;

    #[test]
    fn plain_grpo_entropy_and_abs_diff_by_hand() {
        let f = fixture();
        let m = objective(
            &f,
            &LossOptions {
                entropy_coef: 0.1,
                ..Default::default()
            },
        );
        // on-policy: pg tokens -A = [-1, -1, 1], weights [.25, .25, .5] → 0
        close(
            &[m["pg_loss"], m["pg_clipfrac"], m["ppo_kl"]],
            &[0.0, 0.0, 0.0],
        );
        // entropy .25·1 + .25·2 + .5·3 = 2.25; loss = 0 - 0.1·2.25
        close(&[m["entropy_loss"], m["loss"]], &[2.25, -0.225]);
        // |old - rollout| = [0, 1, ln 3] → .25 + .5·ln 3
        close(
            &[m["train_rollout_logprob_abs_diff"]],
            &[0.25 + 0.5 * 3f64.ln()],
        );
        assert!(!m.contains_key("kl_loss") && !m.contains_key("tis"));
    }

    #[test]
    fn truncated_and_masked_importance_sampling_by_hand() {
        let f = fixture();
        let mut o = LossOptions {
            use_tis: true,
            tis_clip: 2.0,
            tis_clip_low: 0.5,
            ..Default::default()
        };
        // ratio exp(train - rollout) = [1, e, 3]; truncate → [1, 2, 2]
        // pg tokens [-1, -1, 1]·w = [-1, -2, 2] → -.25 - .5 + 1 = .25
        let m = objective(&f, &o);
        let e = 1f64.exp();
        close(
            &[m["pg_loss"], m["tis"], m["tis_clipfrac"]],
            &[0.25, 0.25 + 0.25 * e + 1.5, 0.75],
        );
        // masked: weights [1, 0, 0] → -.25
        o.tis_mode = TisMode::Mask;
        let m = objective(&f, &o);
        close(&[m["pg_loss"], m["tis_clipfrac"]], &[-0.25, 0.75]);
    }

    #[test]
    fn off_policy_sequence_masking_by_hand() {
        let mut f = fixture();
        // sample 1 (A < 0): old - new = 0.5 > delta → masked; sample 0 has A > 0.
        f.old = t(&[-1.0, -1.0, -0.5]).to_kind(Kind::Float);
        let o = LossOptions {
            use_opsm: true,
            opsm_delta: 0.1,
            ..Default::default()
        };
        let m = objective(&f, &o);
        close(&[m["pg_loss"], m["opsm_clipfrac"]], &[-0.5, 1.0]);
        // without OPSM the token costs max(0.6065, 0.8)·.5 = .4
        let m = objective(&f, &LossOptions::default());
        close(&[m["pg_loss"], m["pg_clipfrac"]], &[-0.1, 0.5]);
    }

    #[test]
    fn kl_loss_and_gspo_by_hand() {
        let mut f = fixture();
        let o = LossOptions {
            use_kl_loss: true,
            kl_loss_coef: 0.5,
            kl_loss_type: KlType::K3,
            ..Default::default()
        };
        let m = objective(&f, &o);
        let k3 = (-0.5f64).exp() - 1.0 + 0.5;
        close(&[m["kl_loss"], m["loss"]], &[0.25 * k3, 0.5 * 0.25 * k3]);
        // GSPO: sample 0's ratio is exp of its mean log-ratio: old - new = [0.4, 0] → mean .2,
        // ratio e^-0.2 = .8187 on both tokens (A=1, inside the clip): -.8187·.5
        f.old = t(&[-0.6, -1.0, -1.0]).to_kind(Kind::Float);
        let o = LossOptions {
            estimator: AdvantageEstimator::Gspo,
            ..Default::default()
        };
        let m = objective(&f, &o);
        close(
            &[m["pg_loss"], m["ppo_kl"]],
            &[-(-0.2f64).exp() * 0.5 + 0.5, 0.1],
        );
    }

    #[test]
    fn per_token_weights_and_names() {
        assert_eq!(
            token_mean_weights(&[vec![1.0, 1.0], vec![1.0]], 4),
            vec![0.25; 3]
        );
        let e = "ppo".parse::<AdvantageEstimator>().unwrap_err();
        assert!(
            e.contains("\"ppo\"") && e.contains("reinforce_plus_plus_baseline"),
            "{e}"
        );
        assert!("k4".parse::<KlType>().unwrap_err().contains("low_var_kl"));
    }
}
