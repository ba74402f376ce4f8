//! Micro-batches: consecutive samples whose laid-out size stays under a token budget
//! (`--max-tokens-per-gpu`).

use serde::{Deserialize, Serialize};

/// How the samples of a micro-batch are laid out for the forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MicroBatchLayout {
    /// Concatenated into one row, attention kept within each sample: a micro-batch
    /// costs the sum of its samples' lengths (slime's dynamic batch size, no padding).
    #[default]
    Packed,
    /// One row per sample, right-padded to the longest: a micro-batch costs
    /// samples × longest length.
    Padded,
}

impl MicroBatchLayout {
    /// Tokens the forward pass computes for samples of these lengths.
    pub fn cost(self, lengths: &[usize]) -> usize {
        match self {
            Self::Packed => lengths.iter().sum(),
            Self::Padded => lengths.len() * lengths.iter().copied().max().unwrap_or(0),
        }
    }
}

/// Splits sample lengths into index ranges of consecutive samples whose laid-out size
/// stays within `max_tokens` (a sample longer than the budget gets a micro-batch of its
/// own).
pub fn micro_batches(
    lengths: &[usize],
    max_tokens: usize,
    layout: MicroBatchLayout,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..lengths.len() {
        if i > start && layout.cost(&lengths[start..=i]) > max_tokens {
            out.push(start..i);
            start = i;
        }
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn respects_the_padded_budget() {
        let padded = |l: &[usize], m| micro_batches(l, m, MicroBatchLayout::Padded);
        assert_eq!(padded(&[3, 3, 3, 3], 6), vec![0..2, 2..4]);
        assert_eq!(padded(&[2, 5, 1], 10), vec![0..2, 2..3]);
        assert_eq!(padded(&[20, 1], 10), vec![0..1, 1..2]);
        assert!(padded(&[], 10).is_empty());
    }

    #[test]
    fn packing_fills_the_budget_without_padding() {
        let packed = |l: &[usize], m| micro_batches(l, m, MicroBatchLayout::Packed);
        // Padded, [2, 5, 1] under 10 needs two micro-batches (2 × 5 + 1); packed, 8 tokens fit in one.
        assert_eq!(packed(&[2, 5, 1], 10), vec![0..3]);
        assert_eq!(packed(&[6, 4, 1, 9], 10), vec![0..2, 2..4]);
        assert_eq!(packed(&[6, 4, 1, 10], 10), vec![0..2, 2..3, 3..4]);
        assert_eq!(packed(&[20, 1], 10), vec![0..1, 1..2]);
        assert!(packed(&[], 10).is_empty());
    }
}
