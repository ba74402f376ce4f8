//! What the trainer tests share: the tiny model, a baseline of trainer options that each
//! test adjusts with struct-update syntax, sample builders and weight comparisons.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{NamedTensors, TrainerOptions};
use tch::Kind;

/// The tiny random Qwen3 in assets/ (2 layers, hidden 64, vocabulary 265).
pub fn tiny_model() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3");
    if built.exists() {
        built
    } else {
        // A test binary carried to the GPU machine runs from the repository root there.
        PathBuf::from("assets/tiny-qwen3")
    }
}

/// AdamW at learning rate `lr`, betas 0.9 / 0.999, eps 1e-8, no weight decay.
pub fn adam(lr: f64) -> AdamWConfig {
    AdamWConfig {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

/// The tiny model on the CPU in fp32 with the clipped GRPO loss (eps 0.2), rollout
/// log-probs as the old policy, grad-norm clip 1, AdamW lr 1e-2, every sample in one
/// micro-batch, no recompute.
pub fn options() -> TrainerOptions {
    TrainerOptions {
        model_dir: tiny_model(),
        seed: 0,
        device: tch::Device::Cpu,
        adam: adam(1e-2),
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: 1000,
        use_rollout_logprobs: true,
        logprob_chunk: 8,
        recompute: None,
        layout: Default::default(),
        bf16: None,
        algo: Default::default(),
    }
}

/// A completed sample: `tokens` whose last `loss_mask.len()` are the response, with the
/// engine's log-prob of each response token.
pub fn sample(
    id: u64,
    tokens: Vec<u32>,
    loss_mask: Vec<u8>,
    rollout_log_probs: Vec<f32>,
) -> Sample {
    assert_eq!(
        rollout_log_probs.len(),
        loss_mask.len(),
        "one log-prob per response token"
    );
    Sample {
        id,
        group_index: 0,
        index: id as u32,
        response_length: loss_mask.len(),
        rollout_log_probs,
        tokens,
        loss_mask,
        reward: 0.0,
        status: SampleStatus::Completed,
        weight_version: 0,
        metadata: EpisodeMetadata::default(),
        routed_experts: None,
    }
}

/// [`sample`] with the same rollout log-prob `log_prob` at every response token.
pub fn sample_at(id: u64, tokens: Vec<u32>, loss_mask: Vec<u8>, log_prob: f32) -> Sample {
    let n = loss_mask.len();
    sample(id, tokens, loss_mask, vec![log_prob; n])
}

/// Seven samples of different lengths and trained-token counts, and their advantages:
/// the global batch the data-parallel, ZeRO-3 and prefetch tests split over ranks.
pub fn global_samples() -> (Vec<Sample>, Vec<f64>) {
    let mk = sample_at;
    let samples = vec![
        mk(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1], -5.5),
        mk(1, vec![5, 6, 200, 201, 13], vec![1, 1, 1], -5.4),
        mk(2, vec![9, 8, 7, 6, 5, 4, 3], vec![1, 0, 1, 1, 1], -5.7),
        mk(3, vec![11, 12, 13, 14], vec![1, 1], -5.6),
        mk(
            4,
            vec![21, 22, 23, 24, 25, 26, 27, 28, 29],
            vec![1, 1, 1, 1, 1, 1, 0, 1],
            -5.5,
        ),
        mk(5, vec![30, 31, 32], vec![1], -5.3),
        mk(6, vec![40, 41, 42, 43, 44, 45], vec![0, 1, 1, 1], -5.6),
    ];
    let advantages = vec![1.0, 0.5, -0.25, -1.0, 0.75, 0.2, -0.6];
    (samples, advantages)
}

/// The largest element-wise difference between two same-named weight lists.
pub fn max_diff(a: &NamedTensors, b: &NamedTensors) -> f64 {
    assert_eq!(a.len(), b.len(), "weight lists differ in length");
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta.to_kind(Kind::Double) - tb.to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// Trainers draw their random init from libtorch's global seed: tests that compare two
/// trainers' weights must not build trainers at the same time.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
