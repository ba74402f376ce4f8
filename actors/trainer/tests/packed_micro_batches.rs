//! Packed micro-batches (`--max-tokens-per-gpu` counting real tokens, samples
//! concatenated in one row, positions restarting per sample, attention kept inside each
//! sample) give the loss, gradients and step metrics of training each sample
//! alone, and of the padded layout. If attention or positions leaked across samples,
//! the packed micro-batch would differ from the per-sample ones.

mod common;

use std::collections::BTreeMap;

use common::adam;
use manta_core::Sample;
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::loss::{ClipRange, KlType, LossOptions};
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{AlgoOptions, NamedTensors, TrainBatch, Trainer, TrainerOptions};

fn options(layout: MicroBatchLayout, max_tokens_per_gpu: usize, per_token: bool) -> TrainerOptions {
    TrainerOptions {
        seed: 11,
        adam: AdamWConfig {
            weight_decay: 0.01,
            ..adam(1e-2)
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        max_tokens_per_gpu,
        layout,
        logprob_chunk: 5,
        algo: AlgoOptions {
            loss: LossOptions {
                use_kl_loss: true,
                kl_loss_coef: 0.1,
                kl_loss_type: KlType::K3,
                entropy_coef: 0.01,
                calculate_per_token_loss: per_token,
                ..Default::default()
            },
            ..Default::default()
        },
        ..common::options()
    }
}

/// Rollout log-probs that differ per token and per sample.
fn sample(id: u64, tokens: Vec<u32>, mask: Vec<u8>) -> Sample {
    let lps = (0..mask.len())
        .map(|k| -4.0 - 0.3 * k as f32 - 0.1 * id as f32)
        .collect();
    common::sample(id, tokens, mask, lps)
}

/// Four samples of lengths 9, 6, 6 and 11 (two of equal length, which packed attention
/// runs as one batched call), with masked-out response tokens.
fn batch() -> TrainBatch {
    TrainBatch {
        samples: vec![
            sample(
                0,
                vec![3, 17, 42, 99, 100, 7, 8, 150, 33],
                vec![1, 1, 0, 1, 1],
            ),
            sample(1, vec![5, 6, 200, 201, 13, 14], vec![1, 1, 1]),
            sample(2, vec![9, 8, 7, 6, 5, 4], vec![1, 0, 1, 1]),
            sample(
                3,
                vec![250, 1, 2, 3, 4, 60, 61, 62, 63, 64, 65],
                vec![1, 1, 1, 0, 1, 1, 1],
            ),
        ],
        advantages: vec![1.0, -0.5, 0.25, -0.75],
        global_samples: 4,
    }
}

/// Each tensor within `rel` of the larger one's largest entry, or within `abs`.
fn assert_close(what: &str, a: &NamedTensors, b: &NamedTensors, rel: f64, abs: f64) {
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let d = (ta - tb).abs().max().double_value(&[]);
        let scale = tb.abs().max().double_value(&[]);
        assert!(
            d <= (rel * scale).max(abs),
            "{what}: {na} differs by {d} (scale {scale})"
        );
    }
}

/// The loss and gradient at the initial weights, and the metrics of one train step.
fn run(
    layout: MicroBatchLayout,
    budget: usize,
    per_token: bool,
) -> (f64, NamedTensors, BTreeMap<String, f64>) {
    let mut t = Trainer::new(options(layout, budget, per_token)).unwrap();
    let (m, g) = t.gradients(&batch()).unwrap();
    let step = t.train_step(&batch()).unwrap();
    (m["train/loss"], g, step)
}

#[test]
fn a_packed_micro_batch_equals_each_sample_alone_and_the_padded_layout() {
    for per_token in [false, true] {
        // 32 real tokens fit one packed micro-batch of 40; padded they would need 44.
        let (packed_loss, packed_g, packed_m) = run(MicroBatchLayout::Packed, 40, per_token);
        // A budget of 1 gives every sample its own micro-batch: nothing shares a row.
        let (alone_loss, alone_g, alone_m) = run(MicroBatchLayout::Packed, 1, per_token);
        let (padded_loss, padded_g, padded_m) = run(MicroBatchLayout::Padded, 44, per_token);
        assert!(
            (packed_loss - alone_loss).abs() < 1e-5 && (packed_loss - padded_loss).abs() < 1e-5,
            "per_token {per_token}: packed {packed_loss}, alone {alone_loss}, padded {padded_loss}"
        );
        assert_close("gradient, packed vs alone", &packed_g, &alone_g, 1e-4, 1e-9);
        assert_close(
            "gradient, packed vs padded",
            &packed_g,
            &padded_g,
            1e-4,
            1e-9,
        );
        // The step's metrics (gradient accumulated over micro-batches, norm before clipping).
        for (what, other) in [("alone", &alone_m), ("padded", &padded_m)] {
            for key in [
                "train/loss",
                "train/grad_norm",
                "train/pg_clipfrac",
                "train/kl_loss",
            ] {
                let (a, b) = (packed_m[key], other[key]);
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                    "{key}: packed {a}, {what} {b}"
                );
            }
        }
    }
}
