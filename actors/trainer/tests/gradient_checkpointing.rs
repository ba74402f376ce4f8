//! A GRPO step with gradient checkpointing moves the weights exactly as without it.

use std::path::Path;

use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{TrainBatch, Trainer, TrainerOptions};

fn options(gradient_checkpointing: bool) -> TrainerOptions {
    TrainerOptions {
        model_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3"),
        seed: 3,
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
        temperature: 0.8,
        max_tokens_per_gpu: 24,
        use_rollout_logprobs: false,
        logprob_chunk: 4,
        gradient_checkpointing,
        layout: Default::default(),
        bf16: None,
        algo: Default::default(),
    }
}

fn sample(id: u64, tokens: Vec<u32>, mask: Vec<u8>) -> Sample {
    let response_length = mask.len();
    Sample {
        id,
        group_index: 0,
        index: id as u32,
        rollout_log_probs: vec![-1.0; response_length],
        tokens,
        response_length,
        loss_mask: mask,
        reward: 0.0,
        status: SampleStatus::Completed,
        weight_version: 0,
        metadata: EpisodeMetadata::default(),
    }
}

#[test]
fn checkpointed_step_equals_plain_step() {
    let batch = TrainBatch {
        samples: vec![
            sample(0, vec![258, 10, 20, 30, 40, 50, 60], vec![1, 1, 0, 1]),
            sample(1, vec![258, 11, 21, 31, 41], vec![1, 1]),
            sample(
                2,
                vec![258, 12, 22, 32, 42, 52, 62, 72, 82],
                vec![0, 1, 1, 1, 1],
            ),
        ],
        advantages: vec![1.0, -0.5, 0.25],
        global_samples: 3,
    };
    let mut plain = Trainer::new(options(false)).unwrap();
    let mut ckpt = Trainer::new(options(true)).unwrap();
    let before: Vec<_> = plain
        .export_weights()
        .into_iter()
        .map(|(_, t)| t.copy())
        .collect();
    for ((_, a), (_, b)) in plain
        .export_weights()
        .iter()
        .zip(ckpt.export_weights().iter())
    {
        assert!(a.equal(b), "both trainers start from the same seed");
    }
    let m_plain = plain.train_step(&batch).unwrap();
    let m_ckpt = ckpt.train_step(&batch).unwrap();
    assert!((m_plain["train/grad_norm"] - m_ckpt["train/grad_norm"]).abs() < 1e-6);
    assert!(m_plain["train/grad_norm"] > 0.0);
    let mut moved = 0;
    for (((name, a), (_, b)), init) in plain
        .export_weights()
        .iter()
        .zip(ckpt.export_weights().iter())
        .zip(&before)
    {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} differs by {diff}");
        if !a.equal(init) {
            moved += 1;
        }
    }
    assert!(moved > 0, "the step changed no weight");
}
