//! Rollout routing replay (R3) in the trainer, on the tiny random Qwen3-MoE
//! (assets/tiny-qwen3-moe: 2 sparse layers, 4 experts, top-2): with replay on, the
//! experts the forward uses are the rollout's (train/routing_mismatch 0 although the
//! recorded routing is not the trainer's own) and the routers still get a gradient;
//! with replay off the same samples measure the drift.

mod common;

use std::path::PathBuf;

use manta_core::{RoutedExperts, Sample};
use manta_trainer::{AlgoOptions, TrainBatch, Trainer, TrainerOptions};

fn tiny_moe() -> PathBuf {
    common::tiny_model().with_file_name("tiny-qwen3-moe")
}

fn options(replay: bool) -> TrainerOptions {
    TrainerOptions {
        model_dir: tiny_moe(),
        seed: 3,
        algo: AlgoOptions {
            use_rollout_routing_replay: replay,
            ..Default::default()
        },
        ..common::options()
    }
}

/// A routing no router would choose by itself for every token: experts (t, t+1) mod 4.
fn rollout_routing(tokens: &[u32]) -> RoutedExperts {
    let ids = tokens[..tokens.len() - 1]
        .iter()
        .flat_map(|&t| {
            let t = t as i32;
            // Two sparse layers, top-2 each.
            [t % 4, (t + 1) % 4, (t + 2) % 4, (t + 3) % 4]
        })
        .collect();
    RoutedExperts {
        layers: 2,
        top_k: 2,
        ids,
    }
}

fn batch() -> TrainBatch {
    let with_routing = |s: Sample| Sample {
        routed_experts: Some(rollout_routing(&s.tokens)),
        ..s
    };
    TrainBatch {
        samples: vec![
            with_routing(common::sample_at(
                0,
                vec![3, 17, 42, 99, 100, 7],
                vec![1, 1, 0, 1],
                -5.0,
            )),
            with_routing(common::sample_at(
                1,
                vec![5, 6, 200, 201, 13],
                vec![1, 1, 1],
                -4.0,
            )),
        ],
        advantages: vec![1.0, -0.5],
        global_samples: 2,
    }
}

fn router_grad_norms(grads: &manta_trainer::NamedTensors) -> Vec<(String, f64)> {
    grads
        .iter()
        .filter(|(n, _)| n.ends_with("mlp.gate.weight"))
        .map(|(n, g)| (n.clone(), g.norm().double_value(&[])))
        .collect()
}

#[test]
fn replay_routes_by_the_rollout_and_the_router_keeps_its_gradient() {
    let _one = common::one_at_a_time();
    let mut own = Trainer::new(options(false)).expect("trainer");
    let (m_off, g_off) = own.gradients(&batch()).expect("gradients without replay");
    let drift = m_off["train/routing_mismatch"];
    assert!(
        drift > 0.2,
        "the recorded routing should differ from the trainer's own: {drift}"
    );

    let mut replay = Trainer::new(options(true)).expect("trainer");
    for recompute in [false, true] {
        replay
            .set_recompute(recompute.then_some(manta_model::Recompute::EVERY_LAYER))
            .unwrap();
        let (m, g) = replay.gradients(&batch()).expect("gradients with replay");
        assert_eq!(
            m["train/routing_mismatch"], 0.0,
            "recompute {recompute}: the forward did not use the rollout's experts"
        );
        let norms = router_grad_norms(&g);
        assert_eq!(norms.len(), 2, "{norms:?}");
        for (name, norm) in norms {
            assert!(norm > 1e-7, "recompute {recompute}: {name} got no gradient");
        }
        // The replayed forward is the one trained: its gradient is not own routing's.
        assert!(
            common::max_diff(&g, &g_off) > 1e-6,
            "recompute {recompute}: replay changed nothing"
        );
    }
}

#[test]
fn replay_refuses_samples_without_routing_and_dense_models() {
    let _one = common::one_at_a_time();
    let mut t = Trainer::new(options(true)).expect("trainer");
    let mut b = batch();
    b.samples[1].routed_experts = None;
    let err = t.gradients(&b).unwrap_err().to_string();
    assert!(err.contains("sample 1: no routed experts"), "{err}");
    let mut b = batch();
    if let Some(r) = b.samples[0].routed_experts.as_mut() {
        r.ids[0] = 9;
    }
    let err = t.gradients(&b).unwrap_err().to_string();
    assert!(err.contains("routed expert id 9"), "{err}");
    let dense = Trainer::new(TrainerOptions {
        model_dir: common::tiny_model(),
        ..options(true)
    });
    assert!(
        dense.is_err(),
        "a dense model with replay on must be refused"
    );
}
