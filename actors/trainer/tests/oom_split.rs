//! Out-of-memory recovery: a micro-batch that fails with an OOM error (injected with
//! `MANTA_INJECT_OOM_TOKENS`) is split in halves and retried, giving the same gradient
//! as an unfailed step; a sample that does not fit even alone is skipped and counted in
//! `train/oom_skipped`. One test in this binary: the injection is process-wide.

mod common;

use common::sample_at;
use manta_trainer::{NamedTensors, TrainBatch, Trainer, TrainerOptions};

fn options() -> TrainerOptions {
    TrainerOptions {
        seed: 9,
        // One micro-batch holds the whole batch (6 + 5 + 7 = 18 packed tokens).
        max_tokens_per_gpu: 1000,
        ..common::options()
    }
}

fn batch(n: usize) -> TrainBatch {
    let all = [
        sample_at(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1], -5.0),
        sample_at(1, vec![5, 6, 200, 201, 13], vec![1, 1, 1], -5.0),
        sample_at(2, vec![9, 8, 7, 6, 5, 4, 3], vec![1, 0, 1, 1, 1], -5.0),
    ];
    TrainBatch {
        samples: all[..n].to_vec(),
        advantages: vec![1.0, -0.5, -0.5][..n].to_vec(),
        global_samples: 3,
    }
}

fn assert_same(a: &NamedTensors, b: &NamedTensors) {
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert!(ta.allclose(tb, 1e-5, 1e-7, false), "{na} differs");
    }
}

#[test]
fn oom_micro_batches_are_split_and_unfit_samples_skipped() {
    std::env::remove_var("MANTA_INJECT_OOM_TOKENS");
    let mut clean = Trainer::new(options()).unwrap();
    let (clean_m, clean_g) = clean.gradients(&batch(3)).unwrap();
    let (_, two_g) = clean.gradients(&batch(2)).unwrap();

    // 18 packed tokens fail; the halves (6 and 5 + 7 = 12) fit.
    std::env::set_var("MANTA_INJECT_OOM_TOKENS", "14");
    let mut split = Trainer::new(options()).unwrap();
    let (m, g) = split.gradients(&batch(3)).unwrap();
    assert_eq!(m["train/oom_skipped"], 0.0);
    assert!(
        (m["train/loss"] - clean_m["train/loss"]).abs() < 1e-6,
        "{m:?} vs {clean_m:?}"
    );
    assert_same(&g, &clean_g);

    // Only 6 tokens fit: 5 + 7 splits again, and sample 2 (7 tokens) fails alone and is skipped.
    std::env::set_var("MANTA_INJECT_OOM_TOKENS", "6");
    let mut tight = Trainer::new(options()).unwrap();
    let (m, g) = tight.gradients(&batch(3)).unwrap();
    assert_eq!(m["train/oom_skipped"], 1.0);
    assert_same(&g, &two_g);
    let step = tight.train_step(&batch(3)).unwrap();
    assert_eq!(step["train/oom_skipped"], 1.0);
    std::env::remove_var("MANTA_INJECT_OOM_TOKENS");
}
