//! The weight-sync actor against a real trainer actor and two real native engines on the
//! CPU (the tiny model; trainer and engines drawn from different seeds): every engine
//! takes each version bit for bit, and a broadcast route that cannot run here (CPU
//! tensors: NCCL moves device memory) gives way to copies instead of failing the sync.
//! With two GPUs (`bench/run_gpu_tests.sh`), the same against an engine on the other GPU
//! through the NCCL broadcast group, bit for bit.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use manta_config::TrainConfig;
use manta_engine::{Engine, NamedTensors, NativeEngine, NativeEngineOptions};
use manta_hosting::rollout::spawn::start_rollout_actor;
use manta_rollout::RolloutMsg;
use manta_tokenizer::Tokenizer;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{TrainerActor, TrainerMsg, TrainerOptions};
use manta_weight_sync::{BroadcastRoot, WeightSyncActor, WeightSyncArgs, WeightSyncMsg};
use ractor::{call, Actor, ActorRef};
use tch::Device;

/// The tiny model's files (assets/tiny-qwen3, no weights), written to a directory of
/// their own: the test binary also runs on the GPU machine, away from this checkout.
fn tiny_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [
        (
            "config.json",
            include_str!("../../../assets/tiny-qwen3/config.json"),
        ),
        (
            "tokenizer.json",
            include_str!("../../../assets/tiny-qwen3/tokenizer.json"),
        ),
        (
            "tokenizer_config.json",
            include_str!("../../../assets/tiny-qwen3/tokenizer_config.json"),
        ),
    ] {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn trainer_options(model: &Path, seed: u64, device: Device) -> TrainerOptions {
    TrainerOptions {
        model_dir: model.to_path_buf(),
        seed,
        device,
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

fn native_engine(model: &Path, i: u64, device: Device) -> Arc<dyn Engine> {
    NativeEngine::start(NativeEngineOptions {
        seed: 100 + i,
        max_total_tokens: Some(4096),
        ..NativeEngineOptions::new(model, device)
    })
    .expect("the tiny model's engine starts")
}

async fn engine_actor(
    model: &Path,
    i: u64,
    device: Device,
    tokenizer: &Arc<Tokenizer>,
) -> ActorRef<RolloutMsg> {
    rollout_actor(
        native_engine(model, i, device),
        &format!("rollout-{i}"),
        tokenizer,
    )
    .await
}

/// `name` is global to the process (ractor's registry): tests running at once use
/// names of their own.
async fn rollout_actor(
    engine: Arc<dyn Engine>,
    name: &str,
    tokenizer: &Arc<Tokenizer>,
) -> ActorRef<RolloutMsg> {
    // An environment is named (the config requires one); no episode runs here.
    let yaml = "environments:\n  manta/Digits:\n    url: builtin\n    variant: digits\n";
    let train =
        TrainConfig::from_yaml_str(yaml, Path::new("inline.yaml")).expect("train config parses");
    start_rollout_actor(name, engine, tokenizer, &train, BTreeMap::new(), None, 4)
        .await
        .expect("rollout actor starts")
}

/// The trainer actor on `device` (seed 5: other weights than the engines').
async fn trainer_actor(model: &Path, device: Device) -> ActorRef<TrainerMsg> {
    let (trainer, _) = Actor::spawn(None, TrainerActor, trainer_options(model, 5, device))
        .await
        .expect("trainer starts");
    trainer
}

/// The weight-sync actor from `trainer` to `engines`, rooted as `broadcast_from` says.
async fn sync_actor(
    trainer: &ActorRef<TrainerMsg>,
    engines: &[ActorRef<RolloutMsg>],
    broadcast_from: Option<BroadcastRoot>,
) -> ActorRef<WeightSyncMsg> {
    let (sync, _) = Actor::spawn(
        None,
        WeightSyncActor,
        WeightSyncArgs {
            trainer: std::sync::Arc::new(trainer.clone()),
            engines: engines.to_vec(),
            broadcast_from,
        },
    )
    .await
    .expect("weight-sync actor starts");
    sync
}

/// Same names, and every tensor equal bit for bit (compared in host memory: the two
/// sides may sit on different GPUs).
fn identical(a: &NamedTensors, b: &NamedTensors) -> bool {
    let by_name: BTreeMap<_, _> = b.iter().map(|(n, t)| (n.clone(), t)).collect();
    a.len() == b.len()
        && a.iter().all(|(n, t)| {
            by_name
                .get(n)
                .is_some_and(|u| t.to_device(Device::Cpu).equal(&u.to_device(Device::Cpu)))
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_take_each_version_bit_for_bit_and_an_unusable_broadcast_falls_back() {
    let model = tiny_model();
    let trainer = trainer_actor(model.path(), Device::Cpu).await;
    let tokenizer = Arc::new(Tokenizer::from_dir(model.path()).expect("tokenizer"));
    let engines = vec![
        engine_actor(model.path(), 0, Device::Cpu, &tokenizer).await,
        engine_actor(model.path(), 1, Device::Cpu, &tokenizer).await,
    ];
    let weights = call!(trainer, TrainerMsg::ExportWeights).unwrap();
    let before = call!(engines[0], RolloutMsg::ReadWeights).unwrap().unwrap();
    assert!(
        !identical(&weights, &before),
        "engines start from other weights than the trainer's (seeds differ)"
    );
    // Asking for a broadcast from GPU 0 with the trainer on the CPU: the route cannot run.
    let sync = sync_actor(&trainer, &engines, Some(BroadcastRoot::Cuda(0))).await;
    for version in 1..=2 {
        let report = call!(sync, WeightSyncMsg::Sync, version)
            .unwrap()
            .unwrap_or_else(|e| panic!("sync {version}: {e}"));
        assert_eq!((report.version, report.engines), (version, 2));
        assert!(
            !report.broadcast,
            "CPU tensors cannot be broadcast over NCCL"
        );
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

/// The group protocol on the CPU: the weight-sync actor hosts a store-backed group as
/// rank 0, both engines join at their ranks and receive every tensor into their
/// parameters, bit for bit, version after version through the same group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_group_feeds_cpu_engines_through_the_store_backend() {
    let model = tiny_model();
    let trainer = trainer_actor(model.path(), Device::Cpu).await;
    let tokenizer = Arc::new(Tokenizer::from_dir(model.path()).expect("tokenizer"));
    let engines = vec![
        rollout_actor(
            native_engine(model.path(), 0, Device::Cpu),
            "store-0",
            &tokenizer,
        )
        .await,
        rollout_actor(
            native_engine(model.path(), 1, Device::Cpu),
            "store-1",
            &tokenizer,
        )
        .await,
    ];
    let sync = sync_actor(&trainer, &engines, Some(BroadcastRoot::Cpu)).await;
    let weights = call!(trainer, TrainerMsg::ExportWeights).unwrap();
    for version in 1..=3 {
        let report = call!(sync, WeightSyncMsg::Sync, version)
            .unwrap()
            .unwrap_or_else(|e| panic!("sync {version}: {e}"));
        assert!(report.broadcast, "version {version} went by copies");
        for (i, engine) in engines.iter().enumerate() {
            let got = call!(engine, RolloutMsg::ReadWeights).unwrap().unwrap();
            assert!(
                identical(&weights, &got),
                "engine {i} after version {version}"
            );
            assert_eq!(call!(engine, RolloutMsg::WeightVersion).unwrap(), version);
        }
    }
}

/// An engine that can lose its weights as a restarted SGLang server fed over NCCL does:
/// after [`Restarting::restart`] it holds other weights (its own model directory's,
/// here its first seed's) and reports version 0 until the next update.
struct Restarting {
    inner: Arc<dyn Engine>,
    /// The weights it started with: what a restarted server loads again.
    initial: std::sync::Mutex<NamedTensors>,
    lost: std::sync::atomic::AtomicBool,
}

impl Restarting {
    async fn restart(&self) {
        let initial: NamedTensors = self
            .initial
            .lock()
            .unwrap()
            .iter()
            .map(|(n, t)| (n.clone(), t.copy()))
            .collect();
        self.inner
            .update_weights(initial, 0)
            .await
            .expect("reload the initial weights");
        self.lost.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Engine for Restarting {
    async fn generate(
        &self,
        request: manta_engine::GenerateRequest,
    ) -> Result<manta_engine::GenerateOutput, manta_engine::EngineError> {
        self.inner.generate(request).await
    }
    async fn update_weights(
        &self,
        weights: NamedTensors,
        version: u64,
    ) -> Result<(), manta_engine::EngineError> {
        self.lost.store(false, std::sync::atomic::Ordering::SeqCst);
        self.inner.update_weights(weights, version).await
    }
    fn weight_version(&self) -> u64 {
        self.inner.weight_version()
    }
    async fn update_weights_from_disk(
        &self,
        dir: std::path::PathBuf,
        version: u64,
    ) -> Result<(), manta_engine::EngineError> {
        self.inner.update_weights_from_disk(dir, version).await
    }
    async fn read_weights(&self) -> Result<NamedTensors, manta_engine::EngineError> {
        self.inner.read_weights().await
    }
}

/// A restarted engine that lost the last sync's weights gets them again on `Refresh`,
/// bit for bit and at the last version, while engines that kept them are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_lost_its_weights_gets_the_last_version_again() {
    let model = tiny_model();
    let trainer = trainer_actor(model.path(), Device::Cpu).await;
    let tokenizer = Arc::new(Tokenizer::from_dir(model.path()).expect("tokenizer"));
    let inner = native_engine(model.path(), 0, Device::Cpu);
    let initial = inner
        .read_weights()
        .await
        .expect("read the initial weights");
    let restarting = Arc::new(Restarting {
        inner,
        initial: std::sync::Mutex::new(initial),
        lost: Default::default(),
    });
    let engines = vec![
        rollout_actor(restarting.clone(), "restarting-0", &tokenizer).await,
        rollout_actor(
            native_engine(model.path(), 1, Device::Cpu),
            "restarting-1",
            &tokenizer,
        )
        .await,
    ];
    let sync = sync_actor(&trainer, &engines, None).await;
    let fed = call!(sync, WeightSyncMsg::Refresh).unwrap().unwrap();
    assert!(fed.is_empty(), "nothing synced yet, nothing to re-send");
    call!(sync, WeightSyncMsg::Sync, 3).unwrap().unwrap();
    let fed = call!(sync, WeightSyncMsg::Refresh).unwrap().unwrap();
    assert!(fed.is_empty(), "every engine holds version 3: {fed:?}");

    restarting.restart().await;
    assert_eq!(call!(engines[0], RolloutMsg::WeightVersion).unwrap(), 0);
    let weights = call!(trainer, TrainerMsg::ExportWeights).unwrap();
    let lost = call!(engines[0], RolloutMsg::ReadWeights).unwrap().unwrap();
    assert!(!identical(&weights, &lost), "the restart lost the weights");

    let fed = call!(sync, WeightSyncMsg::Refresh).unwrap().unwrap();
    assert_eq!(fed, vec![0], "only the restarted engine is re-fed");
    for (i, engine) in engines.iter().enumerate() {
        let got = call!(engine, RolloutMsg::ReadWeights).unwrap().unwrap();
        assert!(identical(&weights, &got), "engine {i} after the refresh");
        assert_eq!(call!(engine, RolloutMsg::WeightVersion).unwrap(), 3);
    }
    assert!(!restarting.lost.load(std::sync::atomic::Ordering::SeqCst));
}

/// The trainer on GPU `MANTA_TEST_GPU` (0 or 1), an engine on the other: one NCCL group,
/// the trainer as rank 0, the engine receiving into its parameters, bit for bit.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_broadcast_group_feeds_an_engine_on_another_gpu_bit_for_bit() {
    if tch::Cuda::device_count() < 2 {
        eprintln!("skipped: fewer than two CUDA devices");
        return;
    }
    let trainer_gpu = manta_cuda::test_gpu().expect("a CUDA device");
    assert!(
        trainer_gpu < 2,
        "MANTA_TEST_GPU={trainer_gpu}: this test uses GPUs 0 and 1"
    );
    let engine_gpu = 1 - trainer_gpu;
    let model = tiny_model();
    let trainer = trainer_actor(model.path(), Device::Cuda(trainer_gpu)).await;
    let tokenizer = Arc::new(Tokenizer::from_dir(model.path()).expect("tokenizer"));
    let engine = engine_actor(model.path(), 0, Device::Cuda(engine_gpu), &tokenizer).await;
    let sync = sync_actor(
        &trainer,
        std::slice::from_ref(&engine),
        Some(BroadcastRoot::Cuda(trainer_gpu)),
    )
    .await;
    let weights = call!(trainer, TrainerMsg::ExportWeights).unwrap();
    for version in 1..=2 {
        let report = call!(sync, WeightSyncMsg::Sync, version)
            .unwrap()
            .unwrap_or_else(|e| panic!("sync {version}: {e}"));
        assert!(
            report.broadcast,
            "version {version} went by copies, not the group"
        );
        let got = call!(engine, RolloutMsg::ReadWeights).unwrap().unwrap();
        assert!(identical(&weights, &got), "engine after version {version}");
        assert_eq!(call!(engine, RolloutMsg::WeightVersion).unwrap(), version);
    }
}
