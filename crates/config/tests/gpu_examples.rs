//! The one-node GPU examples under configs/ parse and validate, and place the trainer
//! and the engine where their comments say (bench/run_e2e.sh runs them on a GPU).

use std::path::{Path, PathBuf};

use manta_config::{ClusterConfig, ClusterMode, EngineKind, TrainConfig};

fn config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs")
        .join(name)
}

fn load(name: &str) -> ClusterConfig {
    let c = ClusterConfig::from_file(&config(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(c.mode, ClusterMode::Local, "{name}");
    assert_eq!(c.rollout.engine, EngineKind::Native, "{name}");
    assert_eq!(c.rollout.engines, 1, "{name}");
    // The environments file it names exists and validates too.
    let train = c.train_config.clone().expect("train_config");
    TrainConfig::from_file(&train).unwrap_or_else(|e| panic!("{}: {e}", train.display()));
    // The acceptance shape: 32 prompts x 8 samples, 20 steps.
    let s = c.train.clone().resolve();
    assert_eq!(
        (s.rollout_batch_size, s.n_samples, s.num_rollout),
        (32, 8, 20),
        "{name}"
    );
    c
}

#[test]
fn disaggregated_example_puts_the_trainer_on_gpu0_and_the_engine_on_gpu1() {
    let c = load("gpu-disagg.toml");
    assert_eq!(c.trainer.gpus, vec![0]);
    assert_eq!(c.rollout.gpus_per_engine, 1);
    assert!(!c.rollout.colocate);
    // The engine's GPUs skip the trainer's: it gets GPU 1.
    let engine: Vec<u32> = (0u32..)
        .filter(|g| !c.trainer.gpus.contains(g))
        .take(c.rollout.gpus_per_engine)
        .collect();
    assert_eq!(engine, vec![1]);
}

#[test]
fn colocated_example_shares_gpu0() {
    let c = load("gpu-colocated.toml");
    assert_eq!(c.trainer.gpus, vec![0]);
    assert_eq!(c.rollout.gpus_per_engine, 1);
    assert!(c.rollout.colocate);
    let s = c.train.clone().resolve();
    assert_eq!(
        s.sampling.max_weight_staleness, 0,
        "colocated runs are synchronous"
    );
}
