//! GRPO group advantages (REFERENCE.md §4).

/// How rewards turn into advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantageOptions {
    /// Divide by (std + eps) within the group. Forced off for groups of one.
    pub normalize_std: bool,
    pub eps: f64,
}

impl Default for AdvantageOptions {
    fn default() -> Self {
        Self {
            normalize_std: true,
            eps: 1e-6,
        }
    }
}

/// Advantage of each reward in one group: `r - mean`, divided by `std + eps` when
/// normalizing. `std` is the unbiased standard deviation, as slime's `torch.std` gives.
pub fn group_advantages(rewards: &[f64], opts: AdvantageOptions) -> Vec<f64> {
    let n = rewards.len();
    if n == 0 {
        return Vec::new();
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    let centered: Vec<f64> = rewards.iter().map(|r| r - mean).collect();
    if !opts.normalize_std || n == 1 {
        return centered;
    }
    let var = centered.iter().map(|c| c * c).sum::<f64>() / (n as f64 - 1.0);
    let std = var.sqrt();
    centered.iter().map(|c| c / (std + opts.eps)).collect()
}

/// Whether all rewards in a group agree (std ≤ 1e-6): such a group carries no
/// learning signal and dynamic sampling drops it.
pub fn is_zero_std(rewards: &[f64]) -> bool {
    let n = rewards.len();
    if n <= 1 {
        return true;
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n as f64;
    var.sqrt() <= 1e-6
}

/// Whitens per-sample advantages over the batch's trained tokens, as slime's
/// `--normalize-advantages` does (masked mean, Bessel-corrected variance, `rsqrt(var +
/// 1e-8)`): a sample counts once per trained token, so `tokens[i]` weights `adv[i]`.
pub fn whiten_over_tokens(adv: &mut [f64], tokens: &[usize]) {
    let n: f64 = tokens.iter().map(|&t| t as f64).sum();
    if n == 0.0 {
        return;
    }
    let sum: f64 = adv.iter().zip(tokens).map(|(a, &t)| a * t as f64).sum();
    let sum_sq: f64 = adv.iter().zip(tokens).map(|(a, &t)| a * a * t as f64).sum();
    let mean = sum / n;
    let mut var = sum_sq / n - mean * mean;
    if n >= 2.0 {
        var *= n / (n - 1.0);
    }
    let scale = 1.0 / (var + 1e-8).sqrt();
    for a in adv.iter_mut() {
        *a = (*a - mean) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn centered_and_normalized_by_hand() {
        // rewards 1, 0, 0, 1: mean 0.5, unbiased std = sqrt(1/3) = 0.57735
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], AdvantageOptions::default());
        let s = (1.0f64 / 3.0).sqrt();
        let expected = [
            0.5 / (s + 1e-6),
            -0.5 / (s + 1e-6),
            -0.5 / (s + 1e-6),
            0.5 / (s + 1e-6),
        ];
        for (got, want) in a.iter().zip(expected) {
            assert!((got - want).abs() < 1e-9, "{got} vs {want}");
        }
    }

    #[test]
    fn without_std_normalization_only_centers() {
        let a = group_advantages(
            &[3.0, 1.0],
            AdvantageOptions {
                normalize_std: false,
                eps: 1e-6,
            },
        );
        assert_eq!(a, vec![1.0, -1.0]);
    }

    #[test]
    fn equal_rewards_give_zero_advantage_and_count_as_zero_std() {
        let a = group_advantages(&[0.7; 4], AdvantageOptions::default());
        assert!(a.iter().all(|x| x.abs() < 1e-12));
        assert!(is_zero_std(&[0.7; 4]));
        assert!(!is_zero_std(&[0.7, 0.2]));
    }

    #[test]
    fn single_sample_group_is_only_centered() {
        assert_eq!(
            group_advantages(&[0.9], AdvantageOptions::default()),
            vec![0.0]
        );
    }

    #[test]
    fn whitening_weights_samples_by_their_tokens() {
        // adv [1, -1] over 3 and 1 tokens: tokens [1, 1, 1, -1], mean .5,
        // var (3·.25 + 2.25)/3 = 1 (Bessel) → [(1-.5)/1, (-1-.5)/1]
        let mut a = vec![1.0, -1.0];
        whiten_over_tokens(&mut a, &[3, 1]);
        let s = 1.0 / (1.0f64 + 1e-8).sqrt();
        assert!(
            (a[0] - 0.5 * s).abs() < 1e-12 && (a[1] + 1.5 * s).abs() < 1e-12,
            "{a:?}"
        );
    }
}
