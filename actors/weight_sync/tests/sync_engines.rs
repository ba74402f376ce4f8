//! The weight-sync actor against a real trainer actor and two real native engines on the
//! CPU (the tiny model; trainer and engines drawn from different seeds): every engine
//! takes each version bit for bit, and a broadcast route that cannot run here (CPU
//! tensors: NCCL moves device memory) gives way to copies instead of failing the sync.
//! The broadcast itself needs GPUs: the four-GPU runs check it bit for bit
//! (`MANTA_VERIFY_WEIGHT_SYNC=1 bench/run_e2e.sh dp2-disagg`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use manta_config::TrainConfig;
use manta_engine::{Engine, NamedTensors, NativeEngine, NativeEngineOptions};
use manta_hosting::rollout::spawn::start_rollout_actor;
use manta_rollout::RolloutMsg;
use manta_tokenizer::Tokenizer;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{TrainerActor, TrainerMsg, TrainerOptions};
use manta_weight_sync::{WeightSyncActor, WeightSyncArgs, WeightSyncMsg};
use ractor::{call, Actor, ActorRef};
use tch::Device;

fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

fn trainer_options(seed: u64) -> TrainerOptions {
    TrainerOptions {
        model_dir: tiny_model(),
        seed,
        device: Device::Cpu,
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
        max_tokens_per_gpu: 1000,
        use_rollout_logprobs: true,
        logprob_chunk: 8,
        recompute: None,
        layout: Default::default(),
        bf16: None,
        algo: Default::default(),
    }
}

async fn engine_actor(i: u64, tokenizer: &Arc<Tokenizer>) -> ActorRef<RolloutMsg> {
    let engine: Arc<dyn Engine> = NativeEngine::start(NativeEngineOptions {
        seed: 100 + i,
        ..NativeEngineOptions::new(tiny_model(), Device::Cpu)
    })
    .expect("the tiny model starts on the CPU");
    // An environment is named (the config requires one); no episode runs here.
    let yaml = "environments:\n  manta/Digits:\n    url: builtin\n    variant: digits\n";
    let train =
        TrainConfig::from_yaml_str(yaml, Path::new("inline.yaml")).expect("train config parses");
    start_rollout_actor(
        &format!("rollout-{i}"),
        engine,
        tokenizer,
        &train,
        BTreeMap::new(),
        None,
        4,
    )
    .await
    .expect("rollout actor starts")
}

fn identical(a: &NamedTensors, b: &NamedTensors) -> bool {
    let by_name: BTreeMap<_, _> = b.iter().map(|(n, t)| (n.clone(), t)).collect();
    a.len() == b.len()
        && a.iter()
            .all(|(n, t)| by_name.get(n).is_some_and(|u| t.equal(u)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_take_each_version_bit_for_bit_and_an_unusable_broadcast_falls_back() {
    let (trainer, _) = Actor::spawn(None, TrainerActor, trainer_options(5))
        .await
        .expect("trainer starts");
    let tokenizer = Arc::new(Tokenizer::from_dir(&tiny_model()).expect("tokenizer"));
    let engines = vec![
        engine_actor(0, &tokenizer).await,
        engine_actor(1, &tokenizer).await,
    ];
    let weights = call!(trainer, TrainerMsg::ExportWeights).unwrap();
    let before = call!(engines[0], RolloutMsg::ReadWeights).unwrap().unwrap();
    assert!(
        !identical(&weights, &before),
        "engines start from other weights than the trainer's (seeds differ)"
    );
    // Asking for a broadcast from GPU 0 with the trainer on the CPU: the route cannot run.
    let (sync, _) = Actor::spawn(
        None,
        WeightSyncActor,
        WeightSyncArgs {
            trainer: trainer.clone(),
            engines: engines.clone(),
            broadcast_from: Some(0),
        },
    )
    .await
    .unwrap();
    for version in 1..=2 {
        let report = call!(sync, WeightSyncMsg::Sync, version)
            .unwrap()
            .unwrap_or_else(|e| panic!("sync {version}: {e}"));
        assert_eq!((report.version, report.engines), (version, 2));
        for (i, engine) in engines.iter().enumerate() {
            let got = call!(engine, RolloutMsg::ReadWeights).unwrap().unwrap();
            assert!(
                identical(&weights, &got),
                "engine {i} after version {version}"
            );
            assert_eq!(call!(engine, RolloutMsg::WeightVersion).unwrap(), version);
        }
    }
    // An older version is refused by name unless the sync allows a rewind.
    let stale = call!(sync, WeightSyncMsg::Sync, 1).unwrap().unwrap_err();
    assert!(stale.to_string().contains("not newer"), "{stale}");
}
