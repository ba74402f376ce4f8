//! Micro-batches: consecutive samples whose padded size stays under a token budget.

/// Splits sample lengths into index ranges; each range's `count * max_len` stays within
/// `max_tokens` (a sample longer than the budget gets a micro-batch of its own).
pub fn micro_batches(lengths: &[usize], max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut longest = 0;
    for (i, &len) in lengths.iter().enumerate() {
        let candidate = longest.max(len);
        if i > start && candidate * (i - start + 1) > max_tokens {
            out.push(start..i);
            start = i;
            longest = len;
        } else {
            longest = candidate;
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
        assert_eq!(micro_batches(&[3, 3, 3, 3], 6), vec![0..2, 2..4]);
        assert_eq!(micro_batches(&[2, 5, 1], 10), vec![0..2, 2..3]);
        assert_eq!(micro_batches(&[20, 1], 10), vec![0..1, 1..2]);
        assert!(micro_batches(&[], 10).is_empty());
    }
}
