//! `--bf16` (run here on the CPU, where the trainer's default stays fp32): the model
//! computes in bf16, AdamW keeps fp32 master weights and fp32 moments, and after each
//! step the bf16 weights are the rounded masters. Updates far below bf16's resolution
//! still move the masters; the bf16 step tracks the fp32 step; a bf16 checkpoint resumes
//! exactly (the masters are saved with the optimizer).

mod common;

use common::{adam, max_diff, one_at_a_time, sample_at};
use manta_trainer::{NamedTensors, TrainBatch, Trainer, TrainerOptions};
use tch::Kind;

fn options(bf16: Option<bool>, lr: f64) -> TrainerOptions {
    TrainerOptions {
        seed: 3,
        adam: adam(lr),
        max_tokens_per_gpu: 12,
        bf16,
        logprob_chunk: 4,
        recompute: Some(manta_model::Recompute::EVERY_LAYER),
        ..common::options()
    }
}

fn batch() -> TrainBatch {
    TrainBatch {
        samples: vec![
            sample_at(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1], -5.5),
            sample_at(1, vec![5, 6, 200, 201, 13], vec![1, 1, 1], -5.5),
            sample_at(2, vec![9, 8, 7, 6, 5, 4, 3], vec![1, 0, 1, 1, 1], -5.5),
        ],
        advantages: vec![1.0, 0.5, -0.25],
        global_samples: 3,
    }
}

/// The bf16 weights are exactly the masters rounded to bf16.
fn assert_weights_are_rounded_masters(t: &Trainer) {
    let weights = t.export_weights();
    let masters = t.master_weights();
    assert_eq!(weights.len(), masters.len());
    for ((nw, w), (nm, m)) in weights.iter().zip(&masters) {
        assert_eq!(nw, nm);
        assert_eq!(w.kind(), Kind::BFloat16, "{nw}");
        assert_eq!(m.kind(), Kind::Float, "{nm}");
        assert!(
            w.equal(&m.to_kind(Kind::BFloat16)),
            "{nw} is not its rounded master"
        );
    }
}

#[test]
fn the_cpu_default_stays_fp32() {
    let _serial = one_at_a_time();
    let t = Trainer::new(options(None, 1e-3)).unwrap();
    assert!(!t.is_bf16());
    assert!(t.master_weights().is_empty());
    assert!(t
        .export_weights()
        .iter()
        .all(|(_, w)| w.kind() == Kind::Float));
}

#[test]
fn bf16_steps_update_fp32_masters_and_refresh_the_bf16_weights() {
    let _serial = one_at_a_time();
    let mut fp32 = Trainer::new(options(Some(false), 1e-3)).unwrap();
    let mut bf16 = Trainer::new(options(Some(true), 1e-3)).unwrap();
    assert!(bf16.is_bf16());
    assert_weights_are_rounded_masters(&bf16);
    let fp32_init = copies(&fp32.export_weights());
    let bf16_init = bf16.master_weights();
    for step in 0..2 {
        let a = fp32.train_step(&batch()).unwrap();
        let b = bf16.train_step(&batch()).unwrap();
        assert_weights_are_rounded_masters(&bf16);
        let (la, lb) = (a["train/loss"], b["train/loss"]);
        assert!(
            (la - lb).abs() <= 0.02 * la.abs().max(1e-2),
            "step {step}: fp32 loss {la}, bf16 loss {lb}"
        );
    }
    // The two runs take the same step: their weight updates point the same way.
    let du_fp32 = flat_update(&fp32_init, &fp32.export_weights());
    let du_bf16 = flat_update(&bf16_init, &bf16.master_weights());
    let cos = (&du_fp32 * &du_bf16).sum(Kind::Double).double_value(&[])
        / (du_fp32.norm().double_value(&[]) * du_bf16.norm().double_value(&[]));
    assert!(cos > 0.95, "cosine of the fp32 and bf16 updates: {cos}");
}

fn copies(w: &NamedTensors) -> NamedTensors {
    w.iter().map(|(k, t)| (k.clone(), t.copy())).collect()
}

/// All weights' change from `before` to `after`, flattened into one fp64 vector.
fn flat_update(before: &NamedTensors, after: &NamedTensors) -> tch::Tensor {
    let parts: Vec<tch::Tensor> = before
        .iter()
        .zip(after)
        .map(|((_, b), (_, a))| (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).flatten(0, -1))
        .collect();
    tch::Tensor::cat(&parts, 0)
}

#[test]
fn updates_below_bf16_resolution_accumulate_in_the_masters() {
    let _serial = one_at_a_time();
    // lr 1e-6: each Adam step moves a weight by ~1e-6, far below the bf16 spacing of
    // weights around 0.02 (~1e-4), so the bf16 weights alone would never change.
    let mut t = Trainer::new(options(Some(true), 1e-6)).unwrap();
    let before = t.master_weights();
    for _ in 0..3 {
        t.train_step(&batch()).unwrap();
    }
    let moved = max_diff(&before, &t.master_weights());
    assert!(
        (1e-6..3.5e-6).contains(&moved),
        "masters moved by {moved}, expected up to 3 steps of 1e-6"
    );
    assert_weights_are_rounded_masters(&t);
}

#[test]
fn a_bf16_checkpoint_resumes_exactly() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let mut straight = Trainer::new(options(Some(true), 1e-3)).unwrap();
    straight.train_step(&batch()).unwrap();
    straight
        .save_checkpoint(&dir.path().join("step_1"), 1)
        .unwrap();
    let expected = straight.train_step(&batch()).unwrap();

    let mut resumed = Trainer::new(TrainerOptions {
        seed: 99,
        ..options(Some(true), 1e-3)
    })
    .unwrap();
    assert_eq!(
        resumed.load_checkpoint(&dir.path().join("step_1")).unwrap(),
        1
    );
    let got = resumed.train_step(&batch()).unwrap();
    assert_eq!(got["train/loss"], expected["train/loss"]);
    assert_eq!(
        max_diff(&resumed.master_weights(), &straight.master_weights()),
        0.0
    );
    assert_eq!(
        max_diff(&resumed.export_weights(), &straight.export_weights()),
        0.0
    );
}
