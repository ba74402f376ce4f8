//! A GRPO step with gradient checkpointing moves the weights exactly as without it, and
//! partial recompute (Megatron's `--recompute-method block|uniform --recompute-num-layers
//! N`) gives the loss and gradients of a plain backward pass; a layer count the model
//! does not have is an error naming the flag and the value.

mod common;

use std::path::PathBuf;

use common::{one_at_a_time, sample_at, tiny_model};
use manta_model::{Recompute, RecomputeMethod};
use manta_trainer::{TrainBatch, Trainer, TrainerError, TrainerOptions};

/// libtorch's RNG is process-global and the tests of this binary run in parallel: two
/// seeded inits must not interleave with another test's.
fn new_trainer(opts: TrainerOptions) -> Result<Trainer, TrainerError> {
    let _guard = one_at_a_time();
    Trainer::new(opts)
}

fn options(gradient_checkpointing: bool) -> TrainerOptions {
    options_for(
        tiny_model(),
        gradient_checkpointing.then_some(Recompute::EVERY_LAYER),
    )
}

fn options_for(model_dir: PathBuf, recompute: Option<Recompute>) -> TrainerOptions {
    TrainerOptions {
        model_dir,
        seed: 3,
        temperature: 0.8,
        max_tokens_per_gpu: 24,
        use_rollout_logprobs: false,
        logprob_chunk: 4,
        recompute,
        ..common::options()
    }
}

fn batch() -> TrainBatch {
    TrainBatch {
        samples: vec![
            sample_at(0, vec![258, 10, 20, 30, 40, 50, 60], vec![1, 1, 0, 1], -1.0),
            sample_at(1, vec![258, 11, 21, 31, 41], vec![1, 1], -1.0),
            sample_at(
                2,
                vec![258, 12, 22, 32, 42, 52, 62, 72, 82],
                vec![0, 1, 1, 1, 1],
                -1.0,
            ),
        ],
        advantages: vec![1.0, -0.5, 0.25],
        global_samples: 3,
    }
}

#[test]
fn checkpointed_step_equals_plain_step() {
    let batch = batch();
    let mut plain = new_trainer(options(false)).unwrap();
    let mut ckpt = new_trainer(options(true)).unwrap();
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

/// The tiny model with `layers` decoder layers (random weights), in a temporary folder.
fn deeper_model(layers: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(tiny_model().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["num_hidden_layers"] = layers.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

#[test]
fn partial_recompute_gives_the_loss_and_gradients_of_a_plain_backward_pass() {
    let dir = deeper_model(4);
    // One trainer, its recompute setting switched between runs: the weights stay the same
    // (`gradients` takes no optimizer step) and no second seeded init is needed.
    let mut t = new_trainer(options_for(dir.path().to_path_buf(), None)).unwrap();
    let (m_plain, g_plain) = t.gradients(&batch()).unwrap();
    assert!(m_plain["train/loss"].abs() > 0.0);
    let settings = [
        (RecomputeMethod::Block, 1),
        (RecomputeMethod::Block, 3),
        (RecomputeMethod::Block, 4),
        (RecomputeMethod::Uniform, 1),
        (RecomputeMethod::Uniform, 3),
    ];
    for (method, num_layers) in settings {
        let r = Recompute { method, num_layers };
        t.set_recompute(Some(r)).unwrap();
        let (m, g) = t.gradients(&batch()).unwrap();
        let (a, b) = (m_plain["train/loss"], m["train/loss"]);
        assert!((a - b).abs() < 1e-6, "{r:?}: loss {b} vs plain {a}");
        let mut nonzero = 0;
        for ((name, x), (_, y)) in g_plain.iter().zip(&g) {
            let diff = (x - y).abs().max().double_value(&[]);
            let scale = x.abs().max().double_value(&[]);
            assert!(
                diff <= 1e-6 + 1e-5 * scale,
                "{r:?}: gradient of {name} differs by {diff}"
            );
            if scale > 0.0 {
                nonzero += 1;
            }
        }
        // Every parameter (each layer's and the tied embedding) gets a gradient.
        assert_eq!(
            nonzero,
            g_plain.len(),
            "{r:?}: some parameter got no gradient"
        );
    }
}

#[test]
fn a_layer_count_the_model_lacks_is_rejected_naming_the_flag() {
    let too_many = Recompute {
        method: RecomputeMethod::Block,
        num_layers: 3,
    };
    // The tiny model has 2 layers.
    let err = match new_trainer(options_for(tiny_model(), Some(too_many))) {
        Err(e) => e,
        Ok(_) => panic!("3 recomputed layers of a 2-layer model were accepted"),
    };
    assert!(matches!(err, TrainerError::Recompute(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("--recompute-num-layers") && msg.contains("= 3") && msg.contains("2 layers"),
        "{msg}"
    );
    let mut t = new_trainer(options(false)).unwrap();
    let zero = Recompute {
        method: RecomputeMethod::Uniform,
        num_layers: 0,
    };
    let msg = t.set_recompute(Some(zero)).unwrap_err().to_string();
    assert!(
        msg.contains("--recompute-num-layers") && msg.contains("= 0"),
        "{msg}"
    );
}
