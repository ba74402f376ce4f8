//! Learning-rate schedule as Megatron's `OptimizerParamScheduler` computes it for slime:
//! linear warmup from 0 over `--lr-warmup-iters`, then constant, linear or cosine decay
//! to `--min-lr` at the last optimizer step (`num_rollout × num_steps_per_rollout`).

use std::f64::consts::PI;

pub use manta_core::algo::DecayStyle;

/// The learning rate as a function of the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Optimizer steps of the whole run; decay ends there.
    pub decay_steps: u64,
    pub style: DecayStyle,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> Self {
        Self {
            max_lr: lr,
            min_lr: 0.0,
            warmup_steps: 0,
            decay_steps: 1,
            style: DecayStyle::Constant,
        }
    }

    /// The learning rate of optimizer step `step` (0 for the first update). As in
    /// Megatron the first warmup step runs at lr 0 and warmup ends at `max_lr`.
    pub fn lr_at(&self, step: u64) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return self.max_lr * step as f64 / self.warmup_steps as f64;
        }
        if self.style == DecayStyle::Constant {
            return self.max_lr;
        }
        if step > self.decay_steps {
            return self.min_lr;
        }
        let span = self.decay_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let ratio = (step - self.warmup_steps) as f64 / span;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            DecayStyle::Cosine => 0.5 * ((PI * ratio).cos() + 1.0),
            DecayStyle::Constant => 1.0,
        };
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-15, "{a} vs {b}");
    }

    #[test]
    fn warmup_then_linear_decay_by_hand() {
        let s = LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 2,
            decay_steps: 6,
            style: DecayStyle::Linear,
        };
        // warmup: 0, 0.5e-3, 1e-3; then ratio (k-2)/4 → 1e-4 + (1-r)·9e-4
        let want = [0.0, 5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4];
        for (k, w) in want.iter().enumerate() {
            close(s.lr_at(k as u64), *w);
        }
    }

    #[test]
    fn cosine_and_constant_by_hand() {
        let s = LrSchedule {
            max_lr: 2.0,
            min_lr: 0.0,
            warmup_steps: 0,
            decay_steps: 4,
            style: DecayStyle::Cosine,
        };
        // 0.5·(cos(π k/4)+1)·2 = cos(πk/4)+1
        close(s.lr_at(0), 2.0);
        close(s.lr_at(1), (PI / 4.0).cos() + 1.0);
        close(s.lr_at(2), 1.0);
        close(s.lr_at(4), 0.0);
        let c = LrSchedule {
            style: DecayStyle::Constant,
            warmup_steps: 3,
            ..s
        };
        close(c.lr_at(0), 0.0);
        close(c.lr_at(1), 2.0 / 3.0);
        close(c.lr_at(100), 2.0);
    }

    #[test]
    fn unknown_style_is_named() {
        let e = "exp".parse::<DecayStyle>().unwrap_err();
        assert!(e.contains("\"exp\"") && e.contains("cosine"), "{e}");
    }
}
