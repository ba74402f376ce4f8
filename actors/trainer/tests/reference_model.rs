//! The KL reference: the initial weights by default, the `--ref-load` directory when given.

use std::path::Path;

use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use manta_trainer::loss::{ClipRange, LossOptions};
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{AlgoOptions, TrainBatch, Trainer, TrainerOptions};

fn options(seed: u64, ref_load: Option<&Path>) -> TrainerOptions {
    TrainerOptions {
        model_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3"),
        seed,
        device: tch::Device::Cpu,
        adam: AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: 100,
        use_rollout_logprobs: false,
        logprob_chunk: 8,
        recompute: None,
        layout: Default::default(),
        bf16: None,
        algo: AlgoOptions {
            loss: LossOptions {
                use_kl_loss: true,
                kl_loss_coef: 1.0,
                ..Default::default()
            },
            ref_load: ref_load.map(Path::to_path_buf),
            ..Default::default()
        },
    }
}

fn batch() -> TrainBatch {
    TrainBatch {
        samples: vec![Sample {
            id: 0,
            group_index: 0,
            index: 0,
            tokens: vec![3, 17, 42, 99, 100, 7],
            response_length: 4,
            loss_mask: vec![1, 1, 0, 1],
            rollout_log_probs: vec![-5.0; 4],
            reward: 1.0,
            status: SampleStatus::Completed,
            weight_version: 0,
            metadata: EpisodeMetadata::default(),
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
