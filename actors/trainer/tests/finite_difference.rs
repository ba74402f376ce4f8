//! The trainer's GRPO gradient (clipped surrogate against fixed rollout log-probs, KL to
//! the frozen reference, entropy bonus, sample-mean aggregation over micro-batches)
//! equals central finite differences of its own `train/loss` on a tiny model.

mod common;

use common::{adam, sample};
use manta_trainer::loss::{ClipRange, KlType, LossOptions};
use manta_trainer::{AlgoOptions, TrainBatch, Trainer, TrainerOptions};
use tch::{IndexOp, Kind};

fn options() -> TrainerOptions {
    TrainerOptions {
        seed: 5,
        adam: adam(3e-2),
        // Wide enough that no token sits on a clip boundary (the loss stays smooth).
        clip: ClipRange {
            eps_clip: 0.99,
            eps_clip_high: 10.0,
        },
        temperature: 0.9,
        max_tokens_per_gpu: 24,
        logprob_chunk: 4,
        recompute: Some(manta_model::Recompute::EVERY_LAYER),
        algo: AlgoOptions {
            loss: LossOptions {
                use_kl_loss: true,
                kl_loss_coef: 0.5,
                kl_loss_type: KlType::K3,
                entropy_coef: 0.5,
                ..Default::default()
            },
            ..Default::default()
        },
        ..common::options()
    }
}

fn batch() -> TrainBatch {
    // Rollout log-probs drift along each response; masked-out tokens carry none.
    let mk = |id: u64, tokens: Vec<u32>, mask: Vec<u8>, lp: f32| {
        let lps = mask
            .iter()
            .enumerate()
            .map(|(k, &m)| if m == 1 { lp - 0.1 * k as f32 } else { 0.0 })
            .collect();
        sample(id, tokens, mask, lps)
    };
    let samples = vec![
        mk(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1], -5.4),
        mk(1, vec![5, 6, 200, 201, 13], vec![1, 1, 1], -5.8),
        mk(2, vec![9, 8, 7, 6, 5, 4, 3], vec![1, 0, 1, 1, 1], -5.6),
    ];
    TrainBatch {
        samples,
        advantages: vec![1.2, -0.7, -0.5],
        global_samples: 3,
    }
}

#[test]
fn grpo_gradient_matches_finite_differences() {
    let mut trainer = Trainer::new(options()).unwrap();
    let batch = batch();
    // A few updates first: the policy moves away from the frozen reference (KL gradient
    // ≠ 0) and from the near-uniform init (entropy gradient ≠ 0).
    for _ in 0..5 {
        trainer.train_step(&batch).unwrap();
    }
    let (metrics, grads) = trainer.gradients(&batch).unwrap();
    assert!(metrics["train/kl_loss"] > 0.0, "{metrics:?}");
    let weights = trainer.export_weights();
    let eps = 2e-3;
    let mut checked = 0;
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        let g = &grads.iter().find(|(n, _)| n == name).unwrap().1;
        let w = &weights.iter().find(|(n, _)| n == name).unwrap().1;
        let flat_g = g.reshape([-1]).to_kind(Kind::Double);
        let (_, top) = flat_g.abs().topk(3, 0, true, true);
        for idx in Vec::<i64>::try_from(top).unwrap() {
            let analytic = flat_g.double_value(&[idx]);
            let flat_w = w.reshape([-1]);
            let mut probe = |delta: f64| {
                tch::no_grad(|| {
                    let _ = flat_w.i(idx..idx + 1).g_add_scalar_(delta);
                });
                trainer.gradients(&batch).unwrap().0["train/loss"]
            };
            let plus = probe(eps);
            let minus = probe(-2.0 * eps);
            probe(eps);
            let numeric = (plus - minus) / (2.0 * eps);
            assert!(
                (numeric - analytic).abs() <= 2e-2 * analytic.abs() + 2e-4,
                "{name}[{idx}]: autograd {analytic} vs finite differences {numeric}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}
