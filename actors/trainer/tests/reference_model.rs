//! The KL reference: the initial weights by default, the `--ref-load` directory when given.

mod common;

use std::path::Path;

use common::sample_at;
use manta_core::Sample;
use manta_trainer::loss::LossOptions;
use manta_trainer::{AlgoOptions, TrainBatch, Trainer, TrainerOptions};

fn options(seed: u64, ref_load: Option<&Path>) -> TrainerOptions {
    TrainerOptions {
        seed,
        max_tokens_per_gpu: 100,
        use_rollout_logprobs: false,
        algo: AlgoOptions {
            loss: LossOptions {
                use_kl_loss: true,
                kl_loss_coef: 1.0,
                ..Default::default()
            },
            ref_load: ref_load.map(Path::to_path_buf),
            ..Default::default()
        },
        ..common::options()
    }
}

fn batch() -> TrainBatch {
    TrainBatch {
        samples: vec![Sample {
            reward: 1.0,
            ..sample_at(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1], -5.0)
        }],
        advantages: vec![1.0],
        global_samples: 1,
    }
}

#[test]
fn kl_reference_is_the_initial_model_unless_ref_load_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let other = Trainer::new(options(5, None)).unwrap();
    other.save_checkpoint(&dir.path().join("ref"), 0).unwrap();

    let mut initial_ref = Trainer::new(options(6, None)).unwrap();
    let (m, _) = initial_ref.gradients(&batch()).unwrap();
    assert_eq!(m["train/kl_loss"], 0.0, "{m:?}");

    let mut loaded_ref = Trainer::new(options(6, Some(&dir.path().join("ref")))).unwrap();
    let (m, _) = loaded_ref.gradients(&batch()).unwrap();
    assert!(m["train/kl_loss"].abs() > 1e-4, "{m:?}");

    let err = Trainer::new(options(6, Some(&dir.path().join("missing"))));
    assert!(
        err.is_err(),
        "a missing --ref-load directory must be an error"
    );
}
